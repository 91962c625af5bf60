"""torch.compile(backend="sched_lifetime") on CPU (in CI): outputs, every gradient and the
weights after several SGD steps bit-exact against plain eager and against aot_eager, for an
MLP, a transformer block and the embedded MoE model with EP over 2 gloo processes (functional
collectives); the order really moves launches early and waits late; contracts and options
are errors that name what is wrong."""

import copy
import gc
import os
import socket
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
import torch.multiprocessing as mp

import sched_lifetime as sl  # noqa: F401  (registers the backend)
from sched_lifetime import compile as slc

import _spawned  # noqa: E402
from _compile_parity import STEPS, assert_matches_eager, same as _same, steps as _steps  # noqa: E402


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 16))


def _block():
    return torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)


MODELS = {
    "mlp": (_mlp, lambda step: (torch.randn(8, 16, generator=torch.Generator().manual_seed(step)),)),
    "transformer_block": (_block, lambda step: (torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(step)),)),
}


def _against_eager_and_aot(name: str, options: dict) -> tuple:
    """MODELS[name] for STEPS SGD steps: plain eager, aot_eager and our backend with `options`."""
    torch.use_deterministic_algorithms(True)
    build, batch = MODELS[name]
    torch.manual_seed(0)
    base = build()
    eager = _steps(copy.deepcopy(base), batch, None)
    aot = _steps(copy.deepcopy(base), batch, "aot_eager")
    return eager, aot, _steps(copy.deepcopy(base), batch, "sched_lifetime", options)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("options", [{}, {"overlap": False}, {"explain": True, "ep_budget": 1}, {"partition": "default"}])
def test_bit_exact_against_eager_and_aot_eager(name, options, capsys):
    eager, aot, ours = _against_eager_and_aot(name, options)
    assert _same(eager, ours), "sched_lifetime differs from eager"
    assert _same(aot, ours), "sched_lifetime differs from aot_eager"
    phases = [h["phase"] for h in slc.history[-2:]]
    assert phases == ["fwd", "bwd"]
    if options.get("explain"):
        assert "[sched_lifetime] fwd graph" in capsys.readouterr().out


def test_options_are_checked():
    with pytest.raises(ValueError, match="unknown option 'overlpa'.*valid options.*overlap"):
        slc.check_options({"overlpa": True})
    with pytest.raises(ValueError, match="'explain' must be a bool"):
        slc.check_options({"explain": "yes"})
    with pytest.raises(ValueError, match="'lifetime' must be"):
        slc.check_options({"lifetime": "never"})
    with pytest.raises(ValueError, match="'partition' must be 'default' or 'min_cut'"):
        slc.check_options({"partition": "auto"})
    with pytest.raises(ValueError, match="paging=True with cudagraphs=True is not supported"):
        slc.check_options({"paging": True, "cudagraphs": True})
    for k, v in (("paging_budget", 1.5), ("paging_budget", "half"), ("paging_prefetch", -1), ("paging_buffers", 0), ("paging_min_bytes", 1.0), ("paging_timed", 1), ("paging_slack", 0.5), ("paging_two_way", 1), ("paging_count_host", 1), ("paging_group_out", 0), ("paging_group_out", True), ("paging_slack", True), ("paging_budget", True), ("paging_prefetch", True),
                 ("paging_budget", float("nan")), ("paging_slack", float("inf")), ("memory_slack", float("inf")), ("memory_slack", float("nan"))):
        with pytest.raises(ValueError, match=f"option '{k}' must be"):
            slc.check_options({"paging": True, k: v})
    with pytest.raises(ValueError, match="'cudagraphs' must be a bool"):
        slc.check_options({"cudagraphs": 1})
    assert "sched_lifetime" in torch._dynamo.list_backends()
    # The host-time rule reaches each run slot's Pager (on by default, off by the option).
    from sched_lifetime.compile.paging_pass import GraphPager

    for on in (True, False):
        gp = GraphPager(0.5, timed=True, count_host=on)
        assert gp.begin_forward().pager._calib.count_host is on
    assert GraphPager(0.5, timed=True, group_out=4).begin_forward().pager.group_out == 4  # and to the pool it makes
    assert slc.check_options({"paging": True})["paging_count_host"] is True
    # NumPy scalars (a config read with numpy) are the numbers they hold; a float budget stays a fraction.
    np = pytest.importorskip("numpy")
    got = slc.check_options({"paging": True, "paging_budget": np.float32(0.5), "paging_min_bytes": np.int64(1024), "paging_slack": np.float64(1.1)})
    assert (got["paging_budget"], got["paging_min_bytes"]) == (0.5, 1024) and type(got["paging_min_bytes"]) is int
    with pytest.raises(ValueError, match="option 'paging_budget' must be"):
        slc.check_options({"paging": True, "paging_budget": np.float32(1.5)})


PAGING = {"paging": True, "paging_budget": 1.0, "paging_min_bytes": 0}
STATIC = {**PAGING, "paging_timed": False}


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("options", [PAGING, STATIC, {**STATIC, "paging_prefetch": 0, "paging_budget": 0.5, "overlap": False}, {**STATIC, "partition": "default"}])
def test_paging_is_bit_exact_and_moves_the_saved_activations(name, options):
    eager, aot, ours = _against_eager_and_aot(name, options)
    assert _same(eager, ours) and _same(aot, ours)
    fw, bw = (h["module"] for h in slc.history[-2:])
    pager = fw.sched_lifetime["paging"]
    assert pager is bw.sched_lifetime["paging"] and pager.chosen and pager.paged
    targets = lambda gm: [n.target.__name__ for n in gm.graph.nodes if n.op == "call_function" and hasattr(n.target, "__name__")]
    st = pager.stats
    assert st["bytes_out"] == st["bytes_in"] > 0
    if options.get("paging_timed", True):
        # Every candidate has its nodes; the Pager (calibrated in the first step) chose.
        assert targets(fw).count("_page_save") == targets(bw).count("_page_use") == len(pager.chosen)
        assert st["steps"] == STEPS and set(pager.paged) <= set(pager.chosen)
    else:
        assert targets(fw).count("_page_out") == len(pager.chosen)
        assert targets(bw).count("_page_in_launch") == targets(bw).count("_page_wait") == len(pager.chosen)
        assert st["copies_out"] == st["copies_in"] == STEPS * len(pager.chosen)
    assert pager.host_pool.in_use() == 0  # every host buffer back on the freelist
    # Parameters and views of them (a matmul's saved weight transpose) are never candidates.
    params = {n.name for n in fw.graph.find_nodes(op="placeholder")}
    for n in fw.graph.nodes:
        if n.name in pager.chosen and n.op == "call_function" and n.target is torch.ops.aten.t.default:
            assert n.args[0].name not in params, n.name


@pytest.mark.parametrize("options", [PAGING, STATIC])
def test_paging_the_embedded_moe_model_is_bit_exact(options):
    """The embedded MoE model (EP local, fixed capacity) compiled with paging: every gradient
    equal to eager's over 3 steps, and something was paged."""
    from sched_lifetime.models.moe import CONFIGS, MoEModel, with_overrides

    torch.use_deterministic_algorithms(True)
    torch._dynamo.reset()
    cfg = with_overrides(CONFIGS["tiny"], capacity_factor=1.0)
    ref = MoEModel(cfg)
    model = copy.deepcopy(ref)
    run = torch.compile(model, backend="sched_lifetime", options=options)
    for step in range(3):
        for m in (ref, model):
            m.zero_grad(set_to_none=True)
        b = ref.batch(step, 0)
        ref(**b).backward()
        run(**b).backward()
        for (k, p), q in zip(ref.named_parameters(), model.parameters()):
            assert torch.equal(p.grad, q.grad), (step, k)
    pager = slc.history[-1]["module"].sched_lifetime["paging"]
    assert pager.paged and pager.stats["bytes_out"] == pager.stats["bytes_in"] > 0


def test_timed_paging_runs_a_second_forward_before_the_backward_in_a_run_slot_of_its_own():
    """Timed paging used to refuse a second forward before the last one's backward; each
    forward in flight now has its own run slot (its own Pager), and a dropped forward's slot
    comes back at the next forward (issue 27)."""
    torch._dynamo.reset()
    model = _mlp()
    run = torch.compile(model, backend="sched_lifetime", options=PAGING)
    x = torch.randn(8, 16)
    run(x).sum().backward()
    run(x)  # dropped: its backward never runs
    a, b = run(x).sum(), run(x).sum()
    (a + b).backward()
    pager = slc.history[-1]["module"].sched_lifetime["paging"]
    assert [r.open for r in pager.runs] == [False, False] and pager.dropped_runs == 1  # the dropped forward's slot reused


@pytest.mark.parametrize("options", [PAGING, STATIC])
def test_paging_inside_the_callers_saved_tensor_hooks_is_exact_and_the_hooks_still_apply(options):
    """The caller's saved-tensor hooks around the compiled model (save_on_cpu on a GPU, an
    sl.Pager, activation offloading: unpack returns another tensor; here a clone) still pack
    every value the graph saves but the pager's own, and the steps equal aot_eager's under the
    same hooks bit for bit. (The pager finds its values by address; the hooks' copy made the
    backward raise "a backward read saved value #1, which no forward of this graph saved".)"""
    build, batch = MODELS["mlp"]
    torch.manual_seed(0)
    base = build()
    results = []
    for backend, opts in (("aot_eager", None), ("sched_lifetime", options)):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        run = torch.compile(model, backend=backend, **({"options": opts} if opts else {}))
        packed, steps = [0], []

        def pack(t):
            packed[0] += 1
            return t.clone()

        for k in range(3):  # (timed: the first step calibrates, the later ones page)
            model.zero_grad(set_to_none=True)
            torch.manual_seed(5 + k)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t.clone()):
                loss = run(*batch(k)).sum()
                loss.backward()
            steps.append([loss.detach()] + [p.grad.clone() for p in model.parameters()])
        results.append((steps, packed[0]))
    (ref, n_ref), (ours, n_ours) = results
    assert [[torch.equal(a, b) for a, b in zip(sa, sb)] for sa, sb in zip(ref, ours)] == [[True] * len(ref[0])] * len(ref)
    pager = slc.history[-1]["module"].sched_lifetime["paging"]
    # The hooks packed every value the graph saved but the pager's own (timed: every candidate,
    # paged or kept; static: the chosen ones), each step: no more, no fewer.
    assert n_ours > 0 and n_ref == n_ours + 3 * len(pager.chosen)
    assert pager.stats["bytes_out"] > 0
    # Whatever else the hooks see is not the pager's: a sparse tensor, a subclass with no storage
    # (their addresses cannot be read: asking raised), a plain one at no page node's address.
    sparse = torch.eye(4).to_sparse()
    assert not pager.owns(sparse) and not pager.owns(torch.zeros(3))
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    assert not pager.owns(two_tensor.TwoTensor(torch.zeros(2), torch.ones(2)))


@pytest.mark.parametrize("options", [PAGING, STATIC])
def test_paging_backward_reads_the_host_copy(options):
    """Corrupt the host buffers between forward and backward: the gradients change (the
    backward really reads what was paged out, not a device tensor kept alive)."""
    build, batch = MODELS["mlp"]
    torch.manual_seed(0)
    base = build()
    torch._dynamo.reset()
    model = copy.deepcopy(base)
    run = torch.compile(model, backend="sched_lifetime", options=options)
    grads = []
    for poison in (False, True):  # (timed: the first step calibrates, the second pages)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        out = run(*batch(0))
        if poison:
            pool = slc.history[-1]["module"].sched_lifetime["paging"].host_pool
            assert pool._taken
            for slot in pool._taken:
                pool._bufs[slot].data.fill_(0x7F)  # .data: past autograd's version check
        out.sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert not all(torch.equal(a, b) for a, b in zip(*grads))


def test_static_paging_leaves_what_it_cannot_restore_and_keeps_what_runs_unlike_its_trace():
    """Static paging sizes its host buffers from the trace. A saved value whose elements share
    memory (a stride-0 expand: BERT's token-type embeddings) is no candidate, and `explain`
    says why (before, Rust chose it and the page-out refused it). A value that comes at run time
    unlike its trace (CPU bf16 autocast: BatchNorm's saved statistics traced as bf16, float32
    at run time) stays on the device with a warning (the pool was exhausted). Zero-element
    values are no candidates (two forwards in flight could not tell theirs apart). All
    bit-exact with aot_eager (found by a new-user trial)."""

    class Expanded(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(4, 8)
            self.lin = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
            self.register_buffer("tt", torch.zeros(1, 12, dtype=torch.long), persistent=False)
            self.register_buffer("pos", torch.arange(12).unsqueeze(0), persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            ids = torch.gather(self.tt, 1, self.pos).expand(x.shape[0], -1)  # an activation, expanded
            h = self.emb(ids) * x.unsqueeze(-1)
            e = torch.tanh(h[:, :0])  # an empty activation its backward saves
            for lin in self.lin:
                h = torch.tanh(lin(h))
            return h.sum() + e.sum()

    class Norms(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c1, self.b1 = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8)
            self.c2, self.b2 = torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b2(self.c2(torch.relu(self.b1(self.c1(x))))).float().square().mean()

    static = {"paging": True, "paging_timed": False, "paging_budget": 1.0, "paging_min_bytes": 0}
    timed = {"paging": True, "paging_budget": 1.0, "paging_min_bytes": 0, "paging_count_host": False}
    for build, x, autocast, options in (
        (Expanded, torch.randn(2, 12), False, static),
        (Expanded, torch.randn(2, 12), False, timed),
        (Expanded, torch.randn(2, 12), False, {**timed, "paging_group_out": 3}),
        (Norms, torch.randn(2, 3, 8, 8), True, {**static, "paging_group_out": 2}),
        (Norms, torch.randn(2, 3, 8, 8), True, static),
    ):
        got = {}
        for backend in ("aot_eager", "sched_lifetime"):
            torch._dynamo.reset()
            torch.manual_seed(0)
            model = build()
            run = torch.compile(model, backend=backend, options=options if backend == "sched_lifetime" else None)
            out = []
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for _ in range(3):  # two forwards in flight, then their backwards (timed: the first step calibrates)
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                        a, b = run(x), run(x * 2)
                    (a + b).backward()
                    out.append([a.detach(), *[p.grad.clone() for p in model.parameters()]])
                    model.zero_grad(set_to_none=True)
            got[backend] = out
        assert all(torch.equal(p, q) for u, v in zip(got["aot_eager"], got["sched_lifetime"]) for p, q in zip(u, v)), (build.__name__, options)
        pager = next(h["module"].sched_lifetime["paging"] for h in reversed(slc.history) if h["phase"] == "fwd")
        assert pager.paged and pager.stats["bytes_out"] == pager.stats["bytes_in"] > 0
        unlike = [str(w.message) for w in caught if "came at run time as" in str(w.message)]
        if build is Expanded:
            assert "its elements share memory (shape (2, 12), strides (0, 1))" in pager.explain(), pager.explain()
            assert not unlike
        else:
            assert unlike and "torch.float32" in unlike[0] and "traced as" in unlike[0] and "torch.bfloat16" in unlike[0], unlike
            assert pager.stats["kept_unlike_trace"] > 0


@pytest.mark.parametrize("timed", [False, True], ids=["static", "timed"])
def test_paging_explain_says_what_the_paging_pass_added(timed, capsys):
    """The order is planned before the paging pass adds its nodes, so its explain line ("nothing
    to overlap") is about the graph without them; the backend says what paging added after it,
    and `GraphPager.explain()` counts the candidates, not only what was chosen. An int budget
    under 1 KiB is bytes: a warning says so."""
    torch._dynamo.reset()
    build, batch = MODELS["mlp"]
    run = torch.compile(build(), backend="sched_lifetime", options={**PAGING, "paging_timed": timed, "explain": True})
    run(*batch(0)).sum().backward()
    out = capsys.readouterr().out
    pager = slc.history[-1]["module"].sched_lifetime["paging"]
    c, n = len(pager.candidates), len(pager.chosen)
    assert c >= 2 and (n == c if timed else 0 < n <= c)
    assert pager.explain().startswith(f"{c} candidate saved values")
    if timed:
        assert f"page-out/in nodes on {n} of {c} candidate saved values" in out
    else:
        assert f"paging (its nodes go in after the order above): {n} of {c} candidate saved values paged out" in out
        assert f"{n} page-ins, each launched 2 compute nodes before its first use" in out
    with pytest.warns(UserWarning, match="paging budget 1 is an int: 1 byte") as got:
        sl.page_plan([{"name": "a", "bytes": 4096, "saved_at": 0, "used_at": 3}], 1)
    with pytest.warns(UserWarning, match="paging budget 2 is an int") as got2:
        sl.Pager(2)
    # Each warning names the caller's line (here), not the library's check; for a compiled
    # model, the line that calls it (its pager is made inside torch.compile's first call).
    torch._dynamo.reset()
    run = torch.compile(build(), backend="sched_lifetime", options={**PAGING, "paging_timed": timed, "paging_budget": 3})
    with pytest.warns(UserWarning, match="paging budget 3 is an int") as got3:
        run(*batch(0)).sum().backward()
    names = [w.filename for w in (*got, *got2, *got3)]
    assert len(names) >= 3 and set(names) == {__file__}, names


@pytest.mark.parametrize("timed", [False, True])
def test_paging_steps_aside_inside_activation_checkpointing_and_keeps_nothing_alive(timed, monkeypatch):
    """Each block compiled with paging, run under torch.utils.checkpoint (non-reentrant, as HF's
    gradient_checkpointing_enable() with per-layer compile): checkpoint drops the forward's saved
    values and the backward reads the recompute's, so the graph pages nothing there and every
    value it would have handed over goes to checkpoint's hooks. Red before: the page nodes'
    values bypassed checkpoint and stayed alive until the backward (more memory than no
    checkpoint at all). Gradients bit-exact against aot_eager under the same checkpointing."""
    import weakref

    from torch.utils.checkpoint import checkpoint

    from sched_lifetime.compile import paging_pass as pp

    alive = []
    give = pp.GraphPager._give

    def recording_give(self, run, i, out):
        got = give(self, run, i, out)
        alive.append(weakref.ref(got))
        return got

    def train(backend, options, record=False):
        torch._dynamo.reset()
        torch.manual_seed(0)
        blocks = [
            torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 32))
            for _ in range(2)
        ]
        runs = [torch.compile(b, backend=backend, options=options) for b in blocks]
        grads = []
        for step in range(3):
            x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step))
            if record:
                monkeypatch.setattr(pp.GraphPager, "_give", recording_give)
                alive.clear()
            for r in runs:
                x = checkpoint(r, x, use_reentrant=False)
            loss = x.square().sum()
            if record:
                monkeypatch.setattr(pp.GraphPager, "_give", give)
                gc.collect()
                assert alive and not [w for w in alive if w() is not None], f"step {step}: values of the forward kept from checkpoint"
            loss.backward()
            grads.append([loss.detach()] + [p.grad.clone() for b in blocks for p in b.parameters()])
            for b in blocks:
                b.zero_grad(set_to_none=True)
        return grads, runs

    want, _ = train("aot_eager", None)
    slc.history.clear()
    got, runs = train("sched_lifetime", {"paging": True, "paging_min_bytes": 0, "paging_budget": 1.0, "paging_timed": timed}, record=True)
    assert all(torch.equal(a, b) for w, g in zip(want, got) for a, b in zip(w, g))
    pagers = list({id(p): p for h in slc.history if (p := h["module"].sched_lifetime.get("paging")) is not None}.values())
    assert pagers and all(gp.aside_runs > 0 and gp.stats["bytes_out"] == 0 and gp.dropped_runs == 0 for gp in pagers), [
        (gp.aside_runs, gp.dropped_runs, gp.stats) for gp in pagers
    ]  # (checkpoint dropping a forward's values is no dropped step)
    torch._dynamo.reset()  # a later compile of Sequential with other sizes would otherwise recompile it dynamic


@pytest.mark.parametrize(
    "timed, device", [(False, "cpu"), (True, "cpu"), pytest.param(False, "cuda", marks=pytest.mark.cuda)], ids=["static", "timed", "static-cuda"]
)
def test_paging_refuses_a_saved_value_changed_in_place_before_the_backward(timed, device):
    """The forward returns an activation its backward reads, and the user changes it in place
    before `backward()`: autograd raises (eager, aot_eager). Paged, the graph saves the host
    copy, whose version never moves; the page-in compares the device tensor's version counter
    and raises autograd's error instead of computing gradients from the old values."""

    class ReturnsSaved(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(64, 64)
            self.b = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(3))

        def forward(self, x: torch.Tensor) -> tuple:
            h = y = torch.sigmoid(self.a(x))
            for layer in self.b:
                y = torch.tanh(layer(y))
            return h, y.sum()

    torch._dynamo.reset()
    torch.manual_seed(0)
    run = torch.compile(ReturnsSaved().to(device), backend="sched_lifetime", options={**PAGING, "paging_timed": timed, "paging_count_host": False})
    x = torch.randn(8, 64, device=device)
    for _ in range(3):  # timed: the first step calibrates; a step not changed in place passes
        h, loss = run(x)
        loss.backward()
    pager = slc.history[-1]["module"].sched_lifetime["paging"]
    assert "sigmoid" in pager.paged, pager.explain()
    for _ in range(3):  # refused each time; the refused backward's run slot is given back
        h, loss = run(x)
        h.mul_(0)
        with pytest.raises(RuntimeError, match=r"modified by an inplace operation: saved value #0 of this compiled graph, paged to host memory \(\(8, 64\) torch.float32\) is at version 1; expected version 0"):
            loss.backward()
    run(x)[1].backward()
    assert len(pager.runs) <= 2 and not any(r.open for r in pager.runs) and not pager._held and not pager._owner  # (static: 2 made up front)
    assert pager.host_pool.in_use() == 0


@pytest.mark.parametrize("timed", [False, True], ids=["static", "timed"])
def test_paging_leaves_a_saved_value_with_no_elements_on_the_device(timed):
    """A branch fed an empty batch saves a 0-byte activation: with `paging_min_bytes=0` it is
    no candidate (paging it frees nothing; a host buffer of 0 bytes was an error), and the
    steps stay bit-exact with aot_eager."""

    class TwoBranch(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)

        def forward(self, empty: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.a(empty)).sum() + torch.tanh(self.b(x)).sum()

    torch.manual_seed(0)
    base = TwoBranch()
    inputs = (torch.randn(0, 64), torch.randn(8, 64))
    got = {}
    for backend, options in (("aot_eager", None), ("sched_lifetime", {"paging": True, "paging_min_bytes": 0, "paging_budget": 1.0, "paging_timed": timed})):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        run = torch.compile(model, backend=backend, options=options)
        out = []
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            loss = run(*inputs)
            loss.backward()
            out.append([loss.detach(), *[p.grad.clone() for p in model.parameters()]])
        got[backend] = out
    assert all(torch.equal(a, b) for x, y in zip(got["aot_eager"], got["sched_lifetime"]) for a, b in zip(x, y))


@pytest.mark.cuda
def test_paging_on_the_gpu_releases_saved_activations_and_stays_bit_exact():
    """paging=True on the H200: three SGD steps bit-exact against eager (timed and static plans,
    and timed on one page stream: `paging_two_way=False`) and against our backend without
    paging; after a forward (its page-outs done and released), the memory the static plan
    leaves for the backward is lower than without paging by at least 80% of the bytes paged
    out."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.use_deterministic_algorithms(True)
    dev = torch.device("cuda")

    def build():
        layers = []
        for _ in range(6):
            layers += [torch.nn.Linear(1024, 1024), torch.nn.GELU()]
        return torch.nn.Sequential(*layers)

    def batch(step):
        return (torch.randn(4096, 1024, generator=torch.Generator().manual_seed(step)).to(dev),)

    torch.manual_seed(0)
    base = build().to(dev)
    eager = _steps(copy.deepcopy(base), batch, None)
    plain = _steps(copy.deepcopy(base), batch, "sched_lifetime")
    static = {"paging": True, "paging_budget": 1.0, "paging_timed": False}
    timed = _steps(copy.deepcopy(base), batch, "sched_lifetime", {"paging": True, "paging_budget": 1.0})
    assert _same(eager, timed)
    one_stream = _steps(copy.deepcopy(base), batch, "sched_lifetime", {"paging": True, "paging_budget": 1.0, "paging_two_way": False})
    assert _same(eager, one_stream)
    grouped = _steps(copy.deepcopy(base), batch, "sched_lifetime", {"paging": True, "paging_budget": 1.0, "paging_group_out": 4})
    assert _same(eager, grouped)
    paged = _steps(copy.deepcopy(base), batch, "sched_lifetime", static)
    assert _same(eager, paged) and _same(plain, paged)
    pager = slc.history[-1]["module"].sched_lifetime["paging"]
    assert pager.stats["bytes_out"] == pager.stats["bytes_in"] > 0

    def boundary(options):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        run = torch.compile(model, backend="sched_lifetime", options=options)
        run(*batch(0)).sum().backward()  # compiles
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        out = run(*batch(1))
        torch.cuda.synchronize()
        pg = slc.history[-1]["module"].sched_lifetime.get("paging")
        if pg is not None:
            pg.pool.release_done()  # every copy is done after the sync
        held = torch.cuda.memory_allocated() - start
        out.sum().backward()
        return held, pg

    held_plain, _ = boundary({})
    held_paged, pg = boundary(static)
    per_step = pg.stats["bytes_out"] // 2
    torch._dynamo.reset()
    gc.collect()
    assert held_plain - held_paged >= 0.8 * per_step, (held_plain, held_paged, per_step)


def test_cudagraphs_on_cpu_graphs_is_an_error_saying_why():
    """Capture needs CUDA graphs: on CPU the option raises with the reason instead of running
    the graphs eagerly behind the user's back."""
    torch._dynamo.reset()
    model = _mlp()
    run = torch.compile(model, backend="sched_lifetime", options={"cudagraphs": True})
    with pytest.raises(Exception, match="cudagraphs=True cannot capture the fwd graph.*cpu.*needs the model and its inputs on a CUDA device"):
        run(torch.randn(8, 16))


def test_an_inductor_mode_is_an_error_that_names_the_option_to_use():
    """torch.compile hands `mode` to any backend; "reduce-overhead" is how Inductor users ask for
    CUDA graphs, so the error names `options={'cudagraphs': True}` instead of a TypeError about
    an unexpected keyword."""
    torch._dynamo.reset()
    run = torch.compile(_mlp(), backend="sched_lifetime", mode="reduce-overhead")
    with pytest.raises(Exception, match="mode='reduce-overhead' is an Inductor mode.*'cudagraphs': True"):
        run(torch.randn(8, 16))
    torch._dynamo.reset()


def test_paging_that_pages_nothing_under_its_min_bytes_warns_with_the_fix():
    """A graph whose saved activations are all under `paging_min_bytes` (a small model at the
    default 64 KiB) pages nothing: a warning says so and names the option, and `explain()`
    counts them; with `paging_min_bytes=0` the same graph pages and does not warn."""
    import warnings

    torch._dynamo.reset()
    model = _mlp()
    with pytest.warns(UserWarning, match="pages nothing in this graph.*paging_min_bytes=65536"):
        run = torch.compile(model, backend="sched_lifetime", options={"paging": True})
        run(torch.randn(8, 16)).sum().backward()
    pager = compiled_pager()
    assert "under paging_min_bytes=65536" in pager.explain() and not pager.candidates, pager.explain()
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*pages nothing")  # the warning would fail here
        run = torch.compile(_mlp(), backend="sched_lifetime", options={"paging": True, "paging_min_bytes": 0, "paging_timed": False})
        run(torch.randn(8, 16)).sum().backward()
    assert compiled_pager().candidates
    torch._dynamo.reset()


def test_paging_that_pages_nothing_under_dynamic_shapes_warns_with_the_fix():
    """Sizes that change between calls make torch.compile's automatic dynamic recompile the graph
    with symbolic sizes, which paging cannot plan for: a warning says the graph pages nothing and
    names dynamic=False (found by a new user's trial: HF sequence lengths 8, 11, 8 paged 0 bytes
    silently); with dynamic=False each size's graph pages, bit-exact against aot_eager."""
    import warnings

    torch._dynamo.reset()
    options = {"paging": True, "paging_min_bytes": 0, "paging_budget": 1.0, "paging_timed": False}
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 16))
    run = torch.compile(model, backend="sched_lifetime", options=options, dynamic=True)  # as automatic dynamic, sizes 8 then 11
    with pytest.warns(UserWarning, match=r"pages nothing in this graph: its \d+ saved activation\(s\) have symbolic sizes.*dynamic=False"):
        run(torch.randn(11, 16)).sum().backward()
    assert "its size is symbolic" in " ".join(compiled_pager().left_out.values())
    torch._dynamo.reset()
    model.zero_grad(set_to_none=True)
    ref_model = copy.deepcopy(model)
    ref = torch.compile(ref_model, backend="aot_eager", dynamic=False)
    run = torch.compile(model, backend="sched_lifetime", options=options, dynamic=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*pages nothing")
        for n in (8, 11, 8):
            x = torch.randn(n, 16, generator=torch.Generator().manual_seed(n))
            run(x).sum().backward()
            ref(x).sum().backward()
            assert compiled_pager().stats["bytes_out"] > 0
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), ref_model.parameters()))
    torch._dynamo.reset()


def compiled_pager():
    """The paging pass of the last graph our backend compiled."""
    return next(h["module"].sched_lifetime["paging"] for h in reversed(slc.history) if h["module"].sched_lifetime.get("paging") is not None)


def test_cudagraphs_hands_the_trees_the_first_calls_inputs_and_the_parameters_as_static(monkeypatch):
    """The wiring of `cudagraphs=True`, on the CPU with cudagraph trees replaced by a recorder
    (the cuda tests below run the real trees): the trees are called at the graph's first call,
    with its real inputs (ints, not the compile time's symbols: under dynamic shapes the trees
    key their recordings on them), and the forward's static inputs are exactly the model's
    parameters (read in place). Red before either fix: a SymInt, and no static input. The graph
    `history` holds keeps its plain positional signature (torch's `boxed_nop` had switched it to
    the argument-list convention): called with the trees' inputs it gives what the trees run."""
    from torch._dynamo.backends import cudagraphs as cg
    from torch._inductor import cudagraph_trees

    calls = []

    def recorder(model, inputs, static_input_idxs, **kw):
        static = list(static_input_idxs)
        phase = "bwd" if kw["is_backward"] else "fwd"
        gm = next(h["module"] for h in reversed(slc.history) if h["phase"] == phase and h["module"].sched_lifetime.get("cudagraphs"))
        plain, ran = gm(*inputs), model(list(inputs))
        calls.append({
            "backward": kw["is_backward"],
            "ints": [type(v).__name__ for v in inputs if not isinstance(v, torch.Tensor)],
            "static": {id(inputs[i]) for i in static},
            "n_static": len(static),
            "plain_equals_run": len(plain) == len(ran) and all(
                torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(plain, ran)
            ),
        })
        return model

    monkeypatch.setattr(cg, "check_for_skip", lambda gm, fixed: None)
    monkeypatch.setattr(cg, "get_device_index", lambda gm: 0)
    monkeypatch.setattr(cudagraph_trees, "cudagraphify_impl", recorder)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    eager = copy.deepcopy(model)
    run = torch.compile(model, backend="sched_lifetime", options={"cudagraphs": True}, dynamic=True)
    for n in (5, 4, 5):
        x = torch.randn(n, 8, generator=torch.Generator().manual_seed(n))
        y = run(x)
        y.square().sum().backward()
        ye = eager(x)
        ye.square().sum().backward()
        assert torch.equal(y, ye)
    torch._dynamo.reset()
    fwd = [c for c in calls if not c["backward"]]
    bwd = [c for c in calls if c["backward"]]
    assert fwd and bwd, calls
    # Every call into the trees saw plain ints (the first call's sizes), none a SymInt.
    assert all(t == "int" for c in calls for t in c["ints"]), calls
    assert any(c["ints"] for c in fwd), "the dynamic forward takes its size as an int input"
    assert fwd[0]["static"] == {id(p) for p in model.parameters()}, "the forward's static inputs are its parameters"
    assert all(c["plain_equals_run"] for c in calls), "history's module, called plainly, gives what the trees run"


def _square_sum_steps(model, run, inputs, lr: float = 0.0) -> tuple[list, list]:
    """Per input: `run(x)`'s output and the trainable parameters' gradients of its
    `square().sum()`, then (with `lr`) an SGD step; before each call of a compiled `run` (not
    `model` itself) a new CUDA-graph step begins. Returns (per call [output, *grads], the final
    weights)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable, lr=lr) if lr else None
    calls = []
    for x in inputs:
        model.zero_grad(set_to_none=True)
        if run is not model:
            torch.compiler.cudagraph_mark_step_begin()
        y = run(x)
        y.square().sum().backward()
        calls.append([y.detach().clone()] + [p.grad.clone() for p in trainable])
        if opt is not None:
            opt.step()
    return calls, [p.detach().clone() for p in model.parameters()]


def _cudagraphs_cuda_setup() -> tuple:
    """The cudagraphs cuda tests' start: skipped without CUDA, strict determinism, seed 0;
    (torch's cudagraph_trees module, the CUDA device)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from torch._inductor import cudagraph_trees

    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    return cudagraph_trees, torch.device("cuda")


@pytest.mark.cuda
def test_cudagraphs_under_dynamic_shapes_record_one_graph_per_size():
    """cudagraphs=True with sizes that change between calls (dynamic=True; transformers' eager
    experts loop gives graphs whose token counts differ per call): each size gets its own
    recording, replays of every size bit-exact against eager. Capturing at compile time keyed
    the recordings on symbols: a graph recorded for 15 rows replayed for 14 and raised."""
    cudagraph_trees, dev = _cudagraphs_cuda_setup()
    base = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32)).to(dev)
    sizes = [15, 14, 15, 14, 13, 15, 13, 14, 13]  # every size recorded, then replayed with new inputs
    inputs = [torch.randn(n, 32, generator=torch.Generator().manual_seed(i)).to(dev) for i, n in enumerate(sizes)]

    eager, _ = _square_sum_steps(base, base, inputs)
    torch._dynamo.reset()
    cudagraph_trees.reset_cudagraph_trees()
    model = copy.deepcopy(base)
    ours, _ = _square_sum_steps(model, torch.compile(model, backend="sched_lifetime", options={"cudagraphs": True}, dynamic=True), inputs)
    for i, (e, o) in enumerate(zip(eager, ours)):
        assert all(torch.equal(a, b) for a, b in zip(e, o)), f"call {i} ({sizes[i]} rows) differs from eager"
    assert any(h["module"].sched_lifetime.get("cudagraphs") for h in slc.history[-2:])
    manager = cudagraph_trees.get_manager(dev.index or 0, create_if_none_exists=False)
    assert manager is not None and len(manager.ids_to_funcs) == 6, "one recording per size of the forward and the backward"
    cudagraph_trees.reset_cudagraph_trees()


@pytest.mark.cuda
def test_cudagraphs_read_parameters_in_place_not_copied_into_the_pool():
    """The forward's parameters are static inputs of the captured graph (AOTAutograd's
    static_input_indices, as Inductor passes them): replays read them where they are, bit-exact
    against eager after SGD updates the trainable ones in place; the graphs' private pool holds
    no copy of them. A frozen 128 MiB weight (no gradient of its size in the pool) against a few
    KiB of activations and the cuBLAS workspace: with only the count of Dynamo's fixed arguments
    (0 when modules are inlined) every replay copied the weight into the pool."""
    cudagraph_trees, dev = _cudagraphs_cuda_setup()
    base = torch.nn.Sequential(torch.nn.Linear(8192, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 8)).to(dev)
    base[0].weight.requires_grad_(False)
    frozen = base[0].weight.numel() * base[0].weight.element_size()

    inputs = [torch.randn(8, 8192, generator=torch.Generator().manual_seed(step)).to(dev) for step in range(5)]

    def flat(result):
        calls, weights = result
        return [t for c in calls for t in c] + weights

    eager = flat(_square_sum_steps(m := copy.deepcopy(base), m, inputs, lr=0.05))
    torch._dynamo.reset()
    cudagraph_trees.reset_cudagraph_trees()
    ours = flat(_square_sum_steps(m := copy.deepcopy(base), torch.compile(m, backend="sched_lifetime", options={"cudagraphs": True}), inputs, lr=0.05))
    assert len(eager) == len(ours) and all(torch.equal(a, b) for a, b in zip(eager, ours)), "captured replays differ from eager"
    pool = _graph_pool_bytes()
    assert pool < frozen * 3 // 4, f"the graph pool ({pool} bytes) holds a copy of the frozen weight ({frozen} bytes)"
    cudagraph_trees.reset_cudagraph_trees()


GPU_MODELS = {
    "mlp": (lambda: torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)), (64, 256)),
    "transformer_block": (lambda: torch.nn.TransformerEncoderLayer(256, 8, 1024, dropout=0.0, batch_first=True), (8, 32, 256)),
}


def _graph_pool_bytes() -> int:
    """Bytes of the segments in cudagraph trees' private pool (device 0)."""
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_manager(0, create_if_none_exists=False)
    assert manager is not None, "nothing was captured"
    pool = manager.cuda_graphs_thread_pool
    return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot() if tuple(seg.get("segment_pool_id", ())) == tuple(pool))


@pytest.mark.cuda
@pytest.mark.parametrize("name", sorted(GPU_MODELS))
def test_cudagraphs_replays_bit_exact_and_pool_within_the_eager_step(name):
    """cudagraphs=True on the H200: six SGD steps (warm-up, record, then replays), outputs,
    gradients and weights bit-exact against eager; the graphs' private pool no larger than
    what the eager step allocates above its start (activations, gradients, temporaries, cuBLAS
    workspaces on both sides)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from torch._inductor import cudagraph_trees

    torch.use_deterministic_algorithms(True)
    dev = torch.device("cuda")
    build, shape = GPU_MODELS[name]

    def batch(step):
        return (torch.randn(*shape, generator=torch.Generator().manual_seed(step)).to(dev),)

    torch.manual_seed(0)
    base = build().to(dev)
    # What earlier tests left behind goes now, not during the measured steps (their first
    # dynamo reset would free it and hide part of the eager step's peak). Both sides count the
    # cuBLAS workspaces their own run allocates (the captured graphs allocate theirs in the
    # pool): cleared here, the eager step allocates its own, whatever ran before this test.
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    eager = _steps(copy.deepcopy(base), batch, None, steps=6)
    torch.cuda.synchronize()
    eager_step = torch.cuda.max_memory_allocated() - start - sum(p.numel() * p.element_size() for p in base.parameters())
    pools = {}
    for lifetime in ("scheduled", "record_stream"):
        cudagraph_trees.reset_cudagraph_trees()
        ours = _steps(copy.deepcopy(base), batch, "sched_lifetime", {"cudagraphs": True, "lifetime": lifetime}, steps=6)
        assert _same(eager, ours), f"{lifetime}: captured replays differ from eager"
        assert all(h["module"].sched_lifetime.get("cudagraphs") for h in slc.history[-2:])
        pools[lifetime] = _graph_pool_bytes()
    print(f"{name}: graph pool {pools} bytes, eager step {eager_step} bytes")
    assert pools["scheduled"] <= eager_step, (pools, eager_step)
    cudagraph_trees.reset_cudagraph_trees()


def _saved(outputs: tuple, n_user: int) -> list:
    """(shape, dtype) of what a forward graph returns for the backward, sorted."""
    return sorted((tuple(n.meta["val"].shape), str(n.meta["val"].dtype)) for n in outputs[n_user:] if isinstance(n, fx.Node))


def test_min_cut_partition_saves_what_aot_eager_saves():
    """`partition="min_cut"`: the forward saves exactly what aot_eager's forward saves (same
    partitioner); the default partition saves more bytes (what eager autograd saves), on the
    embedded MoE model."""
    from functools import partial

    from torch._dynamo.backends.debugging import aot_eager, boxed_nop

    from sched_lifetime.models.moe import CONFIGS, MoEModel, with_overrides

    cfg = with_overrides(CONFIGS["tiny"], capacity_factor=1.0)
    graphs = []

    def keep(g, inputs):
        graphs.append(g)
        return boxed_nop(g, inputs)

    saved = {}
    for arm, backend in (("aot_eager", partial(aot_eager, fw_compiler=keep)), ("min_cut", "sched_lifetime"), ("default", "sched_lifetime")):
        torch._dynamo.reset()
        m = MoEModel(cfg, seed=0, device="cpu")
        opts = {"partition": arm} if backend == "sched_lifetime" else None
        run = torch.compile(m, backend=backend, options=opts) if opts else torch.compile(m, backend=backend)
        run(**m.batch(0, 0)).backward()
        fw = graphs[-1] if arm == "aot_eager" else next(h["module"] for h in reversed(slc.history) if h["phase"] == "fwd")
        outs = next(iter(fw.graph.find_nodes(op="output"))).args[0]
        saved[arm] = _saved(outs, 1)  # the loss, then what the backward reads
    size = {k: sum(torch.Size(s).numel() for s, _ in v) for k, v in saved.items()}
    assert saved["min_cut"] == saved["aot_eager"], (size, len(saved["min_cut"]), len(saved["aot_eager"]))
    assert size["default"] > size["min_cut"], size


def test_entry_point_is_declared():
    text = open(os.path.join(os.path.dirname(__file__), "..", "..", "pyproject.toml")).read()
    assert '[project.entry-points.torch_dynamo_backends]' in text
    assert 'sched_lifetime = "sched_lifetime.compile:backend"' in text


def _graph_with(fn) -> fx.GraphModule:
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(fn(g, x))
    return fx.GraphModule(torch.nn.Module(), g)


def test_contract_errors_name_the_node():
    c10d = torch.ops._c10d_functional

    def unwaited(g, x):
        g.call_function(c10d.all_reduce.default, (x, "sum", "0"))
        return x

    with pytest.raises(ValueError, match="'all_reduce_default'.*never waited"):
        slc.to_ir(_graph_with(unwaited), "fwd")

    def wait_on_compute(g, x):
        y = g.call_function(torch.ops.aten.relu.default, (x,))
        return g.call_function(c10d.wait_tensor.default, (y,))

    with pytest.raises(ValueError, match="'wait_tensor_default' waits for 'relu_default', which is not a functional collective"):
        slc.to_ir(_graph_with(wait_on_compute), "fwd")

    def open_dispatch(g, x):
        y = g.call_function(torch.ops.aten.relu.default, (x,))
        y.meta["custom"] = {"ep": "dispatch", "layer": 3}
        return y

    with pytest.raises(ValueError, match="'relu_default' opens an EP dispatch region \\(layer 3\\) with no combine"):
        slc.to_ir(_graph_with(open_dispatch), "fwd")


def test_explain_says_what_each_launch_is_the_budget_and_the_rank(capsys, monkeypatch):
    """explain names each launch's collective and, where annotated, its EP role and layer; the
    header gives the EP launch budget; under several ranks every line says which rank printed it."""
    c10d = torch.ops._c10d_functional

    def ep_layer(g, x):
        h = g.call_function(torch.ops.aten.relu.default, (x,))
        d = g.call_function(c10d.all_to_all_single.default, (h, [2, 2], [2, 2], "0"))
        d.meta["custom"] = {"ep": "dispatch", "layer": "3.fwd"}
        dw = g.call_function(c10d.wait_tensor.default, (d,))
        e = g.call_function(torch.ops.aten.mul.Tensor, (dw, dw))
        c = g.call_function(c10d.all_to_all_single.default, (e, [2, 2], [2, 2], "0"))
        c.meta["custom"] = {"ep": "combine", "layer": "3.fwd"}
        cw = g.call_function(c10d.wait_tensor.default, (c,))
        r = g.call_function(c10d.all_reduce.default, (x, "sum", "0"))
        rw = g.call_function(c10d.wait_tensor.default, (r,))
        return g.call_function(torch.ops.aten.add.Tensor, (cw, rw))

    opts = slc.check_options({"explain": True, "ep_budget": 2})
    slc.compile_fx_graph(_graph_with(ep_layer), "fwd", opts)
    out = capsys.readouterr().out
    assert out.startswith("[sched_lifetime] fwd graph: ") and "3 comm launches, EP launch budget 2" in out, out
    assert "all_to_all_single_default (all_to_all_single, EP dispatch, layer 3.fwd) [" in out, out
    assert "(all_to_all_single, EP combine, layer 3.fwd) [" in out and "(all_reduce) [" in out, out
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    slc.compile_fx_graph(_graph_with(ep_layer), "fwd", opts)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) >= 4 and all(line.startswith("[sched_lifetime rank 1] ") for line in lines), lines


def test_views_are_noops_and_in_place_ops_mutate():
    def body(g, x):
        v = g.call_function(torch.ops.aten.view.default, (x, [-1]))
        r = g.call_function(torch.ops.aten.relu.default, (v,))
        g.call_function(torch.ops.aten.add_.Tensor, (x, r))
        return x

    t = slc.to_ir(_graph_with(body), "fwd")
    kinds = {n["name"]: (n["kind"], n.get("mutates")) for n in t["nodes"]}
    assert kinds == {"view_default": ("noop", None), "relu_default": ("compute", None), "add__tensor": ("compute", ["x"])}


def test_graph_breaks_fall_back_to_eager_for_that_region():
    torch.use_deterministic_algorithms(True)

    class Breaky(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x):
            h = self.a(x)
            if h.sum().item() > -1e9:  # data-dependent branch: a graph break
                h = h * 2
            return self.b(h).relu()

    torch.manual_seed(0)
    base = Breaky()
    batch = lambda step: (torch.randn(4, 8, generator=torch.Generator().manual_seed(step)),)  # noqa: E731
    slc.history.clear()  # it keeps the last 64 graphs: counted from empty
    assert _same(_steps(copy.deepcopy(base), batch, None), _steps(copy.deepcopy(base), batch, "sched_lifetime"))
    assert len(slc.history) >= 4  # two regions, each a forward and a backward graph


def _spawn_two(worker, tmp_path, *args) -> list:
    """Run `worker(rank, port, out, *args)` on 2 processes; each rank's saved result."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(port, str(tmp_path), *args), nprocs=2, join=True)
    return [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(2)]


def _join(rank: int, port: int, device: str = "cpu") -> None:
    """Join the 2-rank group (gloo on CPU, NCCL on this rank's GPU), deterministic kernels."""
    _spawned.start()
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    if device == "cuda":
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=2, device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.use_deterministic_algorithms(True)


def _moe_worker(rank: int, port: int, out: str, device: str = "cpu") -> None:
    _join(rank, port, device)
    try:
        from sched_lifetime.ep import FunctionalAllToAll
        from sched_lifetime.models.moe import CONFIGS, MoEModel, with_overrides

        cfg = with_overrides(CONFIGS["tiny"], capacity_factor=1.0, layers=3, dense_layers=1)
        arms = {}
        for backend, options in ((None, None), ("aot_eager", None), ("sched_lifetime", {}), ("sched_lifetime", {"overlap": False})):
            m = MoEModel(cfg, transport=FunctionalAllToAll(), seed=0, device=device)
            n0 = len(slc.history)
            arms[(backend, str(options))] = _steps(m, lambda step, m=m: tuple(m.batch(step, 0).values()), backend, options)
            if backend == "sched_lifetime" and options == {}:
                graphs = slc.history[n0:]
        ok = {k: _same(arms[(None, "None")], v) for k, v in arms.items()}
        # What the scheduler changed: compute nodes issued between each launch and its wait.
        moved = []
        for h in graphs[:2]:
            orig = [n["name"] for n in h["ir"]["nodes"]]
            kind = {n["name"]: n["kind"] for n in h["ir"]["nodes"]}
            waits = {n["launch"]: n["name"] for n in h["ir"]["nodes"] if n["kind"] == "comm_wait"}

            def under(order):
                pos = {n: i for i, n in enumerate(order)}
                return [sum(kind[x] == "compute" for x in order[pos[l] : pos[w]]) for l, w in sorted(waits.items())]

            moved.append((h["phase"], len(waits), under(orig), under(h["order"])))
        # A forward graph multiplexed with a backward graph: equal to running them apart,
        # and each source's transfers run under the other's compute.
        torch._dynamo.reset()
        m = MoEModel(cfg, transport=FunctionalAllToAll(), seed=0, device=device)
        run = torch.compile(m, backend="sched_lifetime")
        fwd, bwd, fargs, bargs = _capture_pair(run, m, [tuple(m.batch(s, 0).values()) for s in range(2)])
        mux = _check_multiplexed(fwd, bwd, fargs, bargs)
        kinds = {n["name"]: (n["kind"], n["source"]) for n in mux.sched_lifetime["ir"]["nodes"]}
        waits = {n["launch"]: n["name"] for n in mux.sched_lifetime["ir"]["nodes"] if n["kind"] == "comm_wait"}
        order = mux.sched_lifetime["order"]
        pos = {n: i for i, n in enumerate(order)}
        cross = sum(
            1
            for l, w in waits.items()
            if any(kinds[x] == ("compute", "B" if kinds[l][1] == "F" else "F") for x in order[pos[l] : pos[w]])
        )
        orders = [None, None]
        dist.all_gather_object(orders, [h["order"] for h in graphs] + [order])
        torch.save({"ok": ok, "moved": moved, "same_order": orders[0] == orders[1], "cross": (cross, len(waits))}, os.path.join(out, f"rank{rank}.pt"))
        _spawned.leave()
    finally:  # a rank that raised: its traceback goes to the test
        dist.destroy_process_group()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_moe_model_with_ep_over_two_ranks(tmp_path, device):
    """gloo on CPU (CI); NCCL on 2 GPUs under the cuda marker."""
    if device == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    for got in _spawn_two(_moe_worker, tmp_path, device):
        assert all(got["ok"].values()), got["ok"]
        assert got["same_order"]  # every rank issues the collectives in the same order
        cross, launches = got["cross"]
        assert launches == 8 and cross >= 4, got["cross"]  # transfers under the other source's compute
        for phase, launches, orig, ours in got["moved"]:
            assert launches == 4, (phase, launches)  # 2 MoE layers x dispatch + combine
            assert all(o >= a for o, a in zip(ours, orig)), (phase, orig, ours)
            assert sum(ours) > sum(orig), (phase, orig, ours)  # more compute under the transfers


def _moe_capture_worker(rank: int, port: int, out: str) -> None:
    """EP over NCCL inside captured graphs: the embedded MoE model (fixed capacity: no host
    sync) compiled with cudagraphs=True, six SGD steps (warm-up, record, replays) against eager."""
    _join(rank, port, "cuda")
    try:
        from torch._inductor import cudagraph_trees

        from sched_lifetime.ep import FunctionalAllToAll
        from sched_lifetime.models.moe import CONFIGS, MoEModel, with_overrides

        cfg = with_overrides(CONFIGS["tiny"], capacity_factor=1.0, layers=3, dense_layers=1)
        got = {}
        for backend, options in ((None, None), ("sched_lifetime", {"cudagraphs": True})):
            m = MoEModel(cfg, transport=FunctionalAllToAll(), seed=0, device="cuda")
            n0 = len(slc.history)
            got[backend] = _steps(m, lambda step, m=m: tuple(m.batch(step, 0).values()), backend, options, steps=6)
        hist = slc.history[n0:]
        comm = sum(n["kind"] == "comm_launch" for h in hist for n in h["ir"]["nodes"])
        captured = [bool(h["module"].sched_lifetime.get("cudagraphs")) for h in hist]
        cudagraph_trees.reset_cudagraph_trees()
        torch.save({"same": _same(got[None], got["sched_lifetime"]), "comm": comm, "captured": captured}, os.path.join(out, f"rank{rank}.pt"))
        _spawned.leave()
    finally:  # a rank that raised: its traceback goes to the test
        dist.destroy_process_group()


@pytest.mark.cuda
def test_moe_model_with_ep_over_nccl_captured_replays_bit_exact(tmp_path):
    """2 GPUs: the EP all-to-alls (functional collectives on our EP stream) captured with the
    compute in CUDA graphs; replays bit-exact against eager on both ranks."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    for rank, got in enumerate(_spawn_two(_moe_capture_worker, tmp_path)):
        print(rank, got)
        assert got["captured"] and all(got["captured"]), got
        assert got["comm"] >= 8, got  # 2 MoE layers x dispatch + combine, forward and backward
        assert got["same"], got


def _capture_pair(run, model, batches):
    """Compile on the first batch; on the second, record the real arguments of the forward
    and backward graphs; return (fwd module, bwd module, fwd args, bwd args)."""
    out = run(*batches[0])
    (out.sum() if out.dim() else out).backward()
    fwd, bwd = slc.history[-2]["module"], slc.history[-1]["module"]
    assert (slc.history[-2]["phase"], slc.history[-1]["phase"]) == ("fwd", "bwd")
    rec: dict = {}

    def keep(key):
        def hook(mod, args):
            # The runner takes one argument list (AOT's boxed convention) and clears it.
            rec.setdefault(key, [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args[0]])

        return hook

    runners = [m.sched_lifetime["runner"] for m in (fwd, bwd)]
    hooks = [runners[0].register_forward_pre_hook(keep("f")), runners[1].register_forward_pre_hook(keep("b"))]
    out = run(*batches[1])
    (out.sum() if out.dim() else out).backward()
    for h in hooks:
        h.remove()
    return fwd, bwd, rec["f"], rec["b"]


def _mlp_pair(*layers, batch: int = 8) -> tuple:
    """`_capture_pair` for a Sequential of `layers` (seeded) on batches of 16 features."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*layers)
    torch._dynamo.reset()
    run = torch.compile(model, backend="sched_lifetime")
    batches = [(torch.randn(batch, 16, generator=torch.Generator().manual_seed(s)),) for s in range(2)]
    return _capture_pair(run, model, batches)


def _check_multiplexed(fwd, bwd, fargs, bargs):
    ref = list(fwd(*fargs)) + list(bwd(*bargs))
    m = slc.multiplex(fwd, bwd)
    got = m(*fargs, *bargs)
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert (a is None and b is None) or torch.equal(a, b), f"output {i} differs"
    return m


def test_multiplexed_forward_and_backward_graphs_equal_separate_runs():
    torch.use_deterministic_algorithms(True)
    m = _check_multiplexed(*_mlp_pair(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16)))
    assert {n["source"] for n in m.sched_lifetime["ir"]["nodes"]} == {"F", "B"}


def test_backward_frees_each_saved_activation_at_its_last_use():
    """The graphs run under AOT's boxed convention (as aot_eager's do): the runner clears the
    argument list AOT hands it, so the backward's saved activations die at their last use in
    the graph, not when it returns (with the list kept, the backward held every saved
    activation to its end: +23% peak on the H200 bench)."""
    import weakref

    _, bwd, _, bargs = _mlp_pair(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    ref = bwd(*bargs)
    runner = slc.boxed(bwd)  # what the backend hands AOTAutograd
    args = [a.clone() if isinstance(a, torch.Tensor) else a for a in bargs]
    alive = [weakref.ref(a) for a in args if isinstance(a, torch.Tensor)]
    assert alive
    got = runner(args)
    assert args == []  # cleared once the graph bound its inputs
    outs = {id(o) for o in got if isinstance(o, torch.Tensor)}
    # Every input the graph does not hand back is gone as soon as the call returns.
    assert all(r() is None or id(r()) in outs for r in alive), [r() is not None for r in alive]
    assert all(torch.equal(a, b) for a, b in zip(got, ref) if isinstance(a, torch.Tensor))


def test_rewritten_graphs_trace_again_with_fake_tensors():
    from torch.fx.experimental.proxy_tensor import make_fx

    fwd, bwd, fargs, bargs = _mlp_pair(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8), batch=4)
    mux = slc.multiplex(fwd, bwd)
    for gm, args in ((fwd, fargs), (bwd, bargs), (mux, fargs + bargs)):
        traced = make_fx(gm, tracing_mode="fake")(*args)
        calls = [n for n in traced.graph.nodes if n.op == "call_function"]
        assert len(calls) >= len([n for n in gm.graph.nodes if n.op == "call_function"]) - 2  # views may fold


def _graph_step_worker(rank: int, port: int, out: str) -> None:
    _join(rank, port)
    try:
        from sched_lifetime.ep import FunctionalAllToAll
        from sched_lifetime.models.moe import CONFIGS, MoEModel, with_overrides
        from sched_lifetime.train.reference import all_ranks, compare

        cfg = with_overrides(CONFIGS["tiny"], capacity_factor=1.0)
        # The reference: the same model by plain autograd, one loss.backward() per microbatch.
        ref = MoEModel(cfg, transport=FunctionalAllToAll(), seed=0)
        m = MoEModel(cfg, transport=FunctionalAllToAll(), seed=0)
        gs = slc.GraphStep(m, tuple(m.batch(0, 0).values()))
        opts = [torch.optim.SGD(x.parameters(), lr=0.05) for x in (m, ref)]
        grads = lambda model: {k: p.grad for k, p in model.named_parameters()}  # noqa: E731
        ok = []
        for step in range(4):
            for o in opts:
                o.zero_grad(set_to_none=True)
            mbs = [tuple(m.batch(step, k).values()) for k in range(3)]
            # Steps: multiplexed, sequential, then twice with the warm-up and cool-down paired.
            losses = gs.step(mbs, multiplexed=step != 1, paired_ends=step >= 2)
            want = []
            for mb in mbs:
                loss = ref(*mb)
                loss.backward()
                want.append(loss.detach())
            # Bit-exact (same sums in the same order: CPU, float32, 2 ranks), every step.
            ok.append(compare(dict(enumerate(losses)), dict(enumerate(want)), exact=True).exact)
            ok.append(compare(grads(m), grads(ref), exact=True).exact)
            for o in opts:
                o.step()
        ok.append(compare(dict(m.named_parameters()), dict(ref.named_parameters()), exact=True).exact)
        # Negative control: one gradient element one ulp off on rank 1 fails on both ranks.
        g = next(iter(grads(m).values())).view(-1)
        if rank == 1:
            g[:1] = torch.nextafter(g[:1], torch.tensor(float("inf")))
        control = all_ranks({"gs": compare(grads(m), grads(ref), exact=True)})["gs"]
        launches, sources = [], []
        for mod in (gs.mux, *(r.module for r in gs._paired())):
            nodes = mod.sched_lifetime["ir"]["nodes"]
            launches.append(sum(n["kind"] == "comm_launch" for n in nodes))
            sources.append(sorted({n["source"] for n in nodes}))
        torch.save({"ok": ok, "control": [control.exact, control.within], "launches": launches, "sources": sources}, os.path.join(out, f"rank{rank}.pt"))
        _spawned.leave()
    finally:  # a rank that raised: its traceback goes to the test
        dist.destroy_process_group()


def test_graph_step_steady_state_on_compiled_graphs_with_ep_over_two_gloo_ranks(tmp_path):
    """F(0), then F(i+1) multiplexed with B(i) in one compiled module, then B(n-1); the
    sequential baseline; and with paired ends (F(0) with F(1), B(n-2) with B(n-1)): losses and
    accumulated gradients bit-exact against plain autograd after every one of 4 SGD steps, and
    the weights after them; a gradient one ulp off on one rank fails the check on both."""
    for got in _spawn_two(_graph_step_worker, tmp_path):
        assert len(got["ok"]) == 9 and all(got["ok"]), got["ok"]
        assert got["control"] == [False, False], got
        assert got["launches"] == [8, 8, 8], got
        assert got["sources"] == [["B", "F"], ["F", "F2"], ["B", "B2"]], got


def test_multiplexed_graphs_of_one_phase_equal_separate_runs():
    """Two forwards (or two backwards) of different microbatches in one module: the warm-up
    and cool-down of a paired-ends step; bad phase pairs are an error."""
    fwd, bwd, fargs, bargs = _mlp_pair(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    fargs2 = [a * 0.5 if isinstance(a, torch.Tensor) and not isinstance(a, torch.nn.Parameter) else a for a in fargs]
    for gm, a, b, phases in ((fwd, fargs, fargs2, ("fwd", "fwd")), (bwd, bargs, [x.flip(0) if x.dim() else x for x in bargs], ("bwd", "bwd"))):
        m = slc.multiplex(gm, gm, phases=phases)
        got = m(*a, *b)
        ref = list(gm(*a)) + list(gm(*b))
        assert len(got) == len(ref) and all((x is None and y is None) or torch.equal(x, y) for x, y in zip(got, ref))
        assert {n["source"] for n in m.sched_lifetime["ir"]["nodes"]} == {phases[0][0].upper(), phases[0][0].upper() + "2"}
    with pytest.raises(ValueError, match="phases must be one of"):
        slc.multiplex(bwd, fwd, phases=("bwd", "fwd"))


def test_graph_step_refuses_a_non_scalar_loss():
    with pytest.raises(ValueError, match="scalar loss"):
        slc.GraphStep(torch.nn.Linear(3, 2), (torch.randn(4, 3),))


def test_graph_step_refuses_a_submodule_registered_twice_and_takes_a_tied_parameter():
    """A Linear registered under two names (`a.1` and `b.0`) would leave a traced tensor in its
    weight and lose its gradient (torch's functional_call): a clear error, the model untouched;
    a parameter tied by assignment (as transformers ties embeddings) trains bit-exact."""

    class Shared(torch.nn.Module):
        def __init__(self, tie: bool) -> None:
            super().__init__()
            shared = torch.nn.Linear(8, 8)
            self.a = torch.nn.Sequential(torch.nn.Linear(8, 8), shared)
            self.b = torch.nn.Sequential(torch.nn.Linear(8, 8) if tie else shared, torch.nn.Linear(8, 8))
            if tie:
                self.b[0].weight = shared.weight

        def forward(self, x, y):
            return torch.nn.functional.mse_loss(self.b(torch.relu(self.a(x))), y)

    torch.manual_seed(0)
    mbs = [(torch.randn(4, 8), torch.randn(4, 8)) for _ in range(2)]
    net = Shared(tie=False)
    with pytest.raises(ValueError, match="registered as both 'a.1' and 'b.0'"):
        sl.GraphStep(net, mbs[0], order="ours")
    assert all(type(p) is torch.nn.Parameter for p in net.parameters())
    net = Shared(tie=True)
    ref = copy.deepcopy(net)
    sl.GraphStep(net, mbs[0], order="ours").step(mbs)
    for x, y in mbs:
        ref(x, y).backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(net.parameters(), ref.parameters()))


def test_graph_step_takes_a_model_with_buffers_and_refuses_one_that_updates_them():
    """Buffers (a rotary cache, a scale; HF and torchtitan models have them) are graph inputs
    beside the parameters: bit-exact with eager over two steps, a buffer change between steps
    seen (not a constant baked in). A forward that updates a buffer (BatchNorm in training
    mode) is refused: the graphs would drop the update."""

    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(6, 6)
            self.register_buffer("scale", torch.linspace(0.5, 1.5, 6), persistent=False)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.mse_loss(self.lin(x) * self.scale, y)

    torch.manual_seed(0)
    m, ref = Scaled(), Scaled()
    ref.load_state_dict(m.state_dict())
    gs = slc.GraphStep(m, (torch.randn(4, 6), torch.randn(4, 6)), order="ours")
    for step in range(2):
        mbs = [(torch.randn(4, 6), torch.randn(4, 6)) for _ in range(3)]
        assert_matches_eager(gs.step(mbs), m, ref, mbs, f"step {step}")
        assert m.scale.grad is None
        for x in (m, ref):
            x.scale.mul_(2.0)  # the next step reads the new value
    bn = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.BatchNorm1d(6))

    class Loss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = bn

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x).sum()

    with pytest.raises(ValueError, match=r"updates its buffers \['net.1.running_mean'"):
        slc.GraphStep(Loss(), (torch.randn(4, 6),))
    slc.GraphStep(Loss().eval(), (torch.randn(4, 6),))  # frozen statistics: fine


def test_graph_step_refuses_parameters_replaced_after_it_was_built():
    """Its graphs read the tensors they were captured with: a parameter or buffer replaced since
    (a checkpoint loaded with assign=True) is an error naming it, not a step on the old tensors
    (a new user's trial: the losses used the old weights, the new ones got no gradient). In-place
    changes are seen."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    mbs = [(torch.randn(4, 8),) for _ in range(2)]

    class Loss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, x):
            return self.m(x).square().mean()

    wrapped = Loss()
    step = sl.GraphStep(wrapped, mbs[0], order="ours")
    with torch.no_grad():
        model[0].weight.mul_(0.5)  # in place: seen
    ref = copy.deepcopy(wrapped)
    got = step.step(mbs)
    want = [ref(*mb) / 1 for mb in mbs]
    assert all(torch.equal(g, w.detach()) for g, w in zip(got, want))
    wrapped.load_state_dict({k: v.clone() for k, v in wrapped.state_dict().items()}, assign=True)
    with pytest.raises(RuntimeError, match=r"GraphStep: the model's parameters or buffers were replaced since it was built \(\['m.0.weight'"):
        step.step(mbs)


def test_graph_step_takes_tensor_constants_and_checks_each_microbatchs_shapes():
    """A tensor literal in forward (HF's empty cache, a scale) is a constant of the captured
    graphs: the multiplexed module carries it, bit-exact with eager. A microbatch whose shape or
    dtype differs from the capture's is a clear error, not one from inside a graph; a forward
    that cannot be captured (data-dependent control flow) says what GraphStep can capture."""

    class Const(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            empty = torch.tensor([])
            return (torch.cat([empty.view(0, 4), self.a(x)], 0) * torch.tensor(2.0)).sum()

    torch.manual_seed(0)
    m = Const()
    ref = Const()
    ref.load_state_dict(m.state_dict())
    gs = slc.GraphStep(m, (torch.randn(2, 4),), order="ours")
    assert any(n.op == "get_attr" for n in gs.mux.graph.nodes)
    mbs = [(torch.randn(2, 4),) for _ in range(3)]
    assert_matches_eager(gs.step(mbs, paired_ends=True), m, ref, mbs, "paired ends")
    with pytest.raises(ValueError, match=r"microbatch 1 input 0 is shape \[4, 2\] float32, the graphs were captured for shape \[2, 4\] float32"):
        gs.step([(torch.randn(2, 4),), (torch.randn(4, 2),)])
    with pytest.raises(ValueError, match=r"microbatch 0 input 0 is shape \[2, 4\] float64"):
        gs.step([(torch.randn(2, 4, dtype=torch.float64),)])
    with pytest.raises(ValueError, match=r"microbatch 0 has 2 inputs, the graphs were captured with 1"):
        gs.step([(torch.randn(2, 4), torch.randn(2, 4))])
    with pytest.raises(TypeError, match=r"microbatch 0 is a Tensor; each microbatch is a tuple of the model's inputs"):
        gs.step([torch.randn(2, 4)])

    class Scaled(torch.nn.Module):  # a non-tensor input is a constant of the graphs
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
            return (self.a(x) * scale).square().mean()

    scaled = slc.GraphStep(Scaled(), (torch.randn(2, 4), 1.0))
    scaled.step([(torch.randn(2, 4), 1.0)] * 2)
    with pytest.raises(ValueError, match=r"microbatch 1 input 1 is 2.0, the graphs were captured with 1.0: a non-tensor input is a constant"):
        scaled.step([(torch.randn(2, 4), 1.0), (torch.randn(2, 4), 2.0)])

    class Branchy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            return h.sum() if (x > -10).all() else h.mean()

    with pytest.raises(Exception) as info:
        slc.GraphStep(Branchy(), (torch.randn(2, 4),))
    assert any("cannot be captured" in n for n in getattr(info.value, "__notes__", [])), info.value


def test_graph_step_accumulates_shared_and_broadcast_gradients_as_autograd_does():
    """The backward graph returns one tensor as two parameters' gradients (`x @ (w1 + w2)`) and
    a broadcast one (`offset.sum()`: a stride-0 expand). Taken as they were, w1.grad aliased
    w2.grad (each later microbatch added twice: a silent wrong gradient) and adding into the
    expanded one raised; as autograd's AccumulateGrad, the first gradient is copied in the
    parameter's layout when it cannot be taken. Bit-exact with eager in every mode, and no
    `.grad` aliases another or has a stride of 0 (found by a new-user trial)."""

    class SharedAndBroadcast(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1, self.w2 = torch.nn.Parameter(torch.randn(8, 8)), torch.nn.Parameter(torch.randn(8, 8))
            self.offset = torch.nn.Parameter(torch.zeros(8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x @ (self.w1 + self.w2) + self.offset).square().mean() + self.offset.sum()

    torch.manual_seed(0)
    m = SharedAndBroadcast()
    ref = copy.deepcopy(m)
    gs = slc.GraphStep(m, (torch.randn(4, 8),), order="ours")
    mbs = [(torch.randn(4, 8),) for _ in range(3)]
    for mode in ({"multiplexed": False}, {}, {"paired_ends": True}):
        losses = gs.step(mbs, **mode)
        grads = [p.grad for p in m.parameters()]
        assert len({g.data_ptr() for g in grads}) == 3 and all(0 not in g.stride() for g in grads), mode
        assert_matches_eager(losses, m, ref, mbs, str(mode))


def test_graph_step_paired_ends_needs_multiplexing():
    class Loss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x).sum()

    gs = slc.GraphStep(Loss(), (torch.randn(4, 3),))
    with pytest.raises(ValueError, match="paired_ends needs multiplexed=True"):
        gs.step([(torch.randn(4, 3),)] * 2, multiplexed=False, paired_ends=True)


def test_graph_step_with_dropout_draws_the_masks_eager_draws():
    """A model with dropout after LayerNorm + ReLU: AOTAutograd's partitioner copies the
    forward's dropout into the backward graph, unused (the backward reads the saved mask); run,
    it would draw from the generator at every backward and every later forward would get
    another mask than eager. GraphStep removes the forward ops nothing in the backward reads:
    losses and gradients bit-exact with eager microbatch by microbatch under one seed, in every
    mode. Its other arguments are checked: `example_inputs` a tuple, `order` one it knows."""

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.ln, self.b = torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 8)
            self.drop = torch.nn.Dropout(0.3)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.mse_loss(self.b(self.drop(torch.relu(self.ln(self.a(x))))), y)

    torch.manual_seed(0)
    m = Net()
    ref = copy.deepcopy(m)
    mbs = [(torch.randn(4, 8), torch.randn(4, 8)) for _ in range(5)]
    gs = slc.GraphStep(m, mbs[0], order="ours")
    assert not any(n.target == torch.ops.aten.native_dropout.default for n in gs.graphs["bwd"].graph.nodes)
    for kw in ({"multiplexed": False}, {}, {"paired_ends": True}):
        for p in [*m.parameters(), *ref.parameters()]:
            p.grad = None
        torch.manual_seed(1)
        ours = gs.step(mbs, **kw)
        torch.manual_seed(1)
        want = []
        for mb in mbs:
            loss = ref(*mb)
            loss.backward()
            want.append(loss.detach())
        assert all(torch.equal(a, b) for a, b in zip(ours, want)), kw
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(m.parameters(), ref.parameters())), kw
    with pytest.raises(TypeError, match=r"example_inputs must be a tuple of the model's positional inputs, got Tensor \(one input: `\(x,\)`\)"):
        slc.GraphStep(m, mbs[0][0])
    with pytest.raises(ValueError, match=r"order must be one of \('calibrated', 'ours'\), got 'search'"):
        gs.order = "search"
    gs.order = "calibrated"


def _comm_graph(k: int = 3) -> fx.GraphModule:
    """An AOT-like graph with `k` independent chains, each mm -> all-to-all launch -> wait ->
    relu (functional collectives by target only: it is scheduled and rewritten, never run)."""
    c10d = torch.ops._c10d_functional
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    outs = []
    for _ in range(k):
        a = g.call_function(torch.ops.aten.mm.default, (x, w))
        launch = g.call_function(c10d.all_to_all_single.default, (a, [4, 4], [4, 4], "0"))
        outs.append(g.call_function(torch.ops.aten.relu.default, (g.call_function(c10d.wait_tensor.default, (launch,)),)))
    g.output(tuple(outs))
    return fx.GraphModule(torch.nn.Module(), g)


def _most_in_flight(gm: fx.GraphModule) -> int:
    """The most all-to-all launches issued and not yet waited at any point of `gm`'s order."""
    live, most = set(), 0
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is torch.ops._c10d_functional.all_to_all_single.default:
            live.add(n)
        elif n.target is torch.ops._c10d_functional.wait_tensor.default:
            live.discard(n.args[0])
        most = max(most, len(live))
    return most


@pytest.mark.parametrize("budget", [1, 2, 3])
def test_ep_budget_bounds_the_launches_in_flight_in_every_compile_path(budget, monkeypatch):
    """The backend's graph pass (`compile_fx_graph`), the multiplexing pass, `compile_graphs`
    and GraphStep's paired ends each schedule under the `ep_budget` they are given: exactly
    that many all-to-alls in flight at most (three independent ones: the early-launch policy
    fills the budget), whatever the environment's default says."""
    monkeypatch.setenv("SCHED_LIFETIME_EP_LAUNCH_BUDGET", "1" if budget > 1 else "3")
    opts = slc.check_options({"ep_budget": budget})
    assert _most_in_flight(slc.compile_fx_graph(_comm_graph(), "fwd", opts)) == budget
    fwd, bwd, _ = slc.compile_graphs({"fwd": _comm_graph(), "bwd": _comm_graph()}, budget)
    assert _most_in_flight(fwd) == _most_in_flight(bwd) == budget
    # Two graphs multiplexed: six launches, `budget` of them in flight at most.
    assert _most_in_flight(slc.multiplex(_comm_graph(), _comm_graph(), ep_budget=budget)) == budget
    assert _most_in_flight(slc.multiplex(_comm_graph(), _comm_graph(), ep_budget=budget, phases=("bwd", "bwd"))) == budget


def test_graph_step_hands_its_ep_budget_to_every_pass(monkeypatch):
    """GraphStep's budget reaches the separate graphs, the F+B module and the paired ends'
    F+F and B+B modules (a model without collectives: the budget is only passed through)."""
    from sched_lifetime.compile import graph_step

    seen = []
    real_mux, real_compile = graph_step.multiplex, graph_step.compile_graphs
    monkeypatch.setattr(graph_step, "multiplex", lambda *a, **kw: (seen.append(("mux", kw.get("phases", ("fwd", "bwd")), kw.get("ep_budget"))), real_mux(*a, **kw))[1])
    monkeypatch.setattr(graph_step, "compile_graphs", lambda graphs, b=None: (seen.append(("graphs", None, b)), real_compile(graphs, b))[1])

    class Loss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x).sum()

    gs = slc.GraphStep(Loss(), (torch.randn(4, 3),), ep_budget=3)
    gs.step([(torch.randn(4, 3),)] * 3, paired_ends=True)
    assert sorted(seen) == [("graphs", None, 3), ("mux", ("bwd", "bwd"), 3), ("mux", ("fwd", "bwd"), 3), ("mux", ("fwd", "fwd"), 3)], seen


@pytest.mark.parametrize("bad", [0, -1, 1025, "2", 1.5, True])
def test_a_bad_ep_budget_is_refused_naming_the_option(bad):
    with pytest.raises(ValueError, match=r"option 'ep_budget' must be an int in 1..=1024"):
        slc.check_options({"ep_budget": bad})
    with pytest.raises(ValueError, match=r"ep_budget must be an int in 1..=1024|ep_budget"):
        slc.compile_graphs({"fwd": _comm_graph(), "bwd": _comm_graph()}, bad)


def _writes_through_views() -> fx.GraphModule:
    """A non-functional graph (as torchtitan's traced step is): a buffer written through a view
    (`copy_` into a slice, no user of its result), read whole, then written again."""
    g = fx.Graph()
    x = g.placeholder("x")
    buf = g.call_function(torch.ops.aten.zeros.default, ([4],), {"dtype": torch.float32, "device": torch.device("cpu")})
    lo = g.call_function(torch.ops.aten.slice.Tensor, (buf, 0, 0, 2))
    g.call_function(torch.ops.aten.copy_.default, (lo, x))  # copy__default
    r = g.call_function(torch.ops.aten.relu.default, (buf,))  # reads buf after the write through lo
    hi = g.call_function(torch.ops.aten.slice.Tensor, (buf, 0, 2, 4))
    g.call_function(torch.ops.aten.copy_.default, (hi, x))  # copy__default_1: after relu's read
    s = g.call_function(torch.ops.aten.mul.Tensor, (buf, 2.0))
    g.output((r, s))
    return fx.GraphModule(torch.nn.Module(), g)


def test_to_ir_orders_reads_and_writes_of_one_storage_through_its_views():
    table = slc.to_ir(_writes_through_views(), "step")
    control = [tuple(e) for e in table.get("control", [])]
    assert ("copy__default", "relu_default") in control  # a read after the write through a view
    assert ("relu_default", "copy__default_1") in control  # a write after an earlier read
    assert ("copy__default_1", "mul_tensor") in control
    gm = _writes_through_views()
    x = torch.tensor([-1.0, 3.0])
    want = gm(x)
    got = slc.compile_fx_graph(_writes_through_views(), "step", slc.check_options({}), in_place=True)(x)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    with pytest.raises(ValueError, match="to_ir: phase must be 'fwd', 'bwd' or 'step'"):
        slc.to_ir(gm, "both")


def test_reorder_moves_the_modules_own_nodes_and_keeps_its_codegen():
    gm = _comm_graph()
    gm.graph.set_codegen(fx.graph._BoxedCodeGen())
    gm.recompile()
    table = slc.to_ir(gm, "fwd")
    order = list(sl.schedule(table)["order"])
    out = slc.reorder(gm, order)
    assert out is gm and isinstance(gm.graph._codegen, fx.graph._BoxedCodeGen)
    assert [n.name for n in gm.graph.nodes if n.op == "call_function"] == order
    with pytest.raises(ValueError, match="the schedule's order does not match the FX graph: leaves out"):
        slc.reorder(gm, order[1:])


def _joint_step():
    """A whole training step traced into one FX graph (forward, loss, gradients), its backward
    nodes marked as torch's autograd engine marks them for graph_trainer (`autograd_backward`)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(x, w1, w2):
        h = torch.tanh(x @ w1)
        g = torch.tanh(h @ w2)
        loss = g.sum()
        return (loss, *torch.autograd.grad(loss, [w1, w2]))

    torch.manual_seed(0)
    args = (torch.randn(64, 64), torch.randn(64, 64, requires_grad=True), torch.randn(64, 64, requires_grad=True))
    gm = make_fx(step, tracing_mode="fake")(*args)
    after_loss = False
    for n in gm.graph.nodes:
        if after_loss and n.op == "call_function":
            n.meta["autograd_backward"] = True
        after_loss = after_loss or (n.op == "call_function" and n.target is torch.ops.aten.sum.default)
    return gm, args


def test_joint_step_paging_explain_counts_its_candidates_and_says_when_min_bytes_leaves_none():
    """The joint pager's explain counts the values it could page (it said 0 before); a
    `min_bytes` above every saved value is a warning naming the option, not a silent no-op."""
    from sched_lifetime.compile import joint_paging_pass as jpp

    gm, _ = _joint_step()
    jp = jpp.page_step(gm, 1.0, min_bytes=0)
    assert len(jp.candidates) >= len(jp.chosen) > 0, (jp.candidates, jp.chosen)
    assert jp.explain().startswith(f"{len(jp.candidates)} candidate saved values (static: {len(jp.chosen)} paged)"), jp.explain()
    gm, _ = _joint_step()
    with pytest.warns(UserWarning, match="the step pages nothing: every forward value the backward reads is under paging_min_bytes=1048576"):
        assert jpp.page_step(gm, 1.0, min_bytes=1 << 20) is None


def test_joint_step_paging_is_exact_pages_each_storage_once_and_survives_a_failed_step(monkeypatch):
    """The joint-graph paging pass (torchtitan's traced step): outputs bit-exact with the
    unpaged step; aliases of one storage (`detach`) paged once; a step that raises between its
    page-outs and its end leaves nothing held, and the next step reuses the one run slot;
    `_page_finish` survives dead-code elimination; a graph with no backward is left as it is."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from sched_lifetime.compile import joint_paging_pass as jpp
    from sched_lifetime.compile import paging_pass as pp

    gm, args = _joint_step()
    want = gm(*args)
    vals = {n.name: n.meta["val"] for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)}
    jp = jpp.page_step(gm, 1.0, min_bytes=0)
    assert jp is not None and jp.chosen
    storages = [StorageWeakRef(vals[c].untyped_storage()) for c in jp.chosen]
    assert len(set(storages)) == len(storages), jp.chosen  # one copy per storage
    got = gm(*args)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert jp.stats["bytes_out"] == jp.stats["bytes_in"] > 0 and len(jp.runs) == 1 and not jp.runs[0].open
    # A step that raises after its page-outs: nothing stays held; the next step is whole.
    boom = RuntimeError("boom")

    def fail(key, t):
        raise boom

    g = gm.forward.__globals__
    names = [k for k, v in g.items() if v is pp._page_wait]
    for k in names:
        monkeypatch.setitem(g, k, fail)
    for _ in range(3):
        with pytest.raises(RuntimeError, match="boom"):
            gm(*args)
    for k in names:
        monkeypatch.setitem(g, k, pp._page_wait)
    got = gm(*args)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert len(jp.runs) == 1 and not jp.runs[0].open and not jp._held and not jp._owner
    gm.graph.eliminate_dead_code()
    assert any(getattr(n.target, "__name__", "") == "_page_finish" for n in gm.graph.nodes)
    # No backward marks: nothing to page, the graph unchanged.
    plain, _ = _joint_step()
    for n in plain.graph.nodes:
        n.meta.pop("autograd_backward", None)
    code = plain.code
    assert jpp.page_step(plain, 1.0, min_bytes=0) is None and plain.code == code
