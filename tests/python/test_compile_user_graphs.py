"""The compile backend on graphs users produce (issue 27), on CPU: a compiled graph that runs
several times per step (a graph break inside each layer), paging with it timed and static (one
plan and host buffers per run, sized from what runs), dynamic shapes with paging, a memory
timeline that does not match the saves (explained, never an error), a functional collective
launched in one graph and waited in the next, and the order pass's memory guard. Each is
bit-exact against eager (and aot_eager) over several SGD steps."""

import copy
import gc
import socket

import pytest
import torch
import torch.distributed as dist

import sched_lifetime as sl
from sched_lifetime import compile as slc

from _compile_parity import STEPS, same as _same, steps as _parity_steps  # noqa: E402


class Layer(torch.nn.Module):
    """A layer with a graph break in its middle: every layer runs the same two compiled graphs."""

    def __init__(self, d=32):
        super().__init__()
        self.a, self.c, self.b = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.c(torch.nn.functional.gelu(self.a(x))))
        torch._dynamo.graph_break()
        return x + self.b(torch.tanh(h))


class Broken(torch.nn.Module):
    def __init__(self, layers=3, d=32):
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer(d) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def _steps(model, backend, options=None, steps=STEPS, shapes=None, dynamic=None):
    """`_compile_parity.steps` on 16 (or `shapes[step]`) rows of 32 features, seeded per step."""

    def batch(step):
        n = shapes[step] if shapes else 16
        return (torch.randn(n, 32, generator=torch.Generator().manual_seed(step)),)

    return _parity_steps(model, batch, backend, options, steps, dynamic)


def _pagers():
    seen = []
    for h in slc.history:
        p = h["module"].sched_lifetime.get("paging")
        if p is not None and p not in seen:
            seen.append(p)
    return seen


PAGING = {"paging": True, "paging_budget": 1.0, "paging_min_bytes": 0}


@pytest.mark.parametrize("timed", [True, False], ids=["timed", "static"])
def test_a_graph_that_runs_once_per_layer_is_paged_per_run_and_bit_exact(timed):
    """Issue 27: with a graph break in each layer, one compiled graph runs 3 times before the
    backwards; timed paging refused it ("a forward started before the last forward's backward
    finished") and static paging ran out of host buffers past `paging_buffers` (2) runs."""
    torch.manual_seed(0)
    base = Broken(layers=4)
    eager = _steps(copy.deepcopy(base), None)
    slc.history.clear()
    ours = _steps(copy.deepcopy(base), "sched_lifetime", {**PAGING, "paging_timed": timed})
    assert _same(eager, ours)
    pagers = [p for p in _pagers() if p.chosen]
    assert pagers, "nothing was a paging candidate"
    # Dynamo compiles layer 0 on its own and layers 1-3 share graphs: those run 3 times per
    # step (more than the 2 `paging_buffers`), each run in a slot of its own, reused every step.
    assert max(len(p.runs) for p in pagers) == 3, [len(p.runs) for p in pagers]
    for p in pagers:
        assert not any(r.open for r in p.runs) and not p._owner
        st = p.stats
        assert st["bytes_out"] == st["bytes_in"]
        assert all(pool.in_use() == 0 for pool in p.host_pools())
    assert sum(p.stats["bytes_out"] for p in pagers) > 0
    if timed:  # every run calibrated in step 0, paged in steps 1 and 2
        assert all(r.pager.plan is not None for p in pagers for r in p.runs)
        assert all(p.stats["steps"] == STEPS * len(p.runs) for p in pagers)


def test_backwards_in_any_order_find_their_own_run():
    """Two forwards of one compiled graph, their backwards in the order they were made (not
    reversed): each backward reads its own run's host copies."""
    torch.manual_seed(0)
    layer = Layer()
    ref = copy.deepcopy(layer)
    torch._dynamo.reset()
    run = torch.compile(layer, backend="sched_lifetime", options={**PAGING, "paging_timed": False})
    xs = [torch.randn(8, 32, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    for _ in range(2):
        outs = [run(x).square().sum() for x in xs]
        for o in outs:  # first-in, first-out
            o.backward()
    for _ in range(2):
        for o in [ref(x).square().sum() for x in xs]:
            o.backward()
    for p, q in zip(layer.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_too_many_forwards_without_backward_is_an_error_that_says_why(monkeypatch):
    from sched_lifetime.compile import paging_pass

    monkeypatch.setattr(paging_pass, "MAX_RUNS", 2)
    torch._dynamo.reset()
    run = torch.compile(Layer(), backend="sched_lifetime", options=PAGING)
    x = torch.randn(8, 32)
    keep = [run(x), run(x)]
    with pytest.raises(RuntimeError, match="forwards of this compiled graph are waiting for their backwards.*torch.no_grad"):
        run(x)
    del keep


@pytest.mark.parametrize("timed", [True, False], ids=["timed", "static"])
def test_dynamic_shapes_with_paging_run_and_say_what_was_left_out(timed):
    """Issue 27: `dynamic=True` + `paging=True` crashed in the paging pass (a symbolic size)."""
    torch.manual_seed(0)
    base = Broken(layers=2)
    shapes = [16, 24, 40]
    eager = _steps(copy.deepcopy(base), None, shapes=shapes)
    slc.history.clear()
    ours = _steps(copy.deepcopy(base), "sched_lifetime", {**PAGING, "paging_timed": timed}, shapes=shapes, dynamic=True)
    assert _same(eager, ours)
    pagers = _pagers()
    assert pagers and any(p.left_out for p in pagers)
    text = "\n".join(p.explain() for p in pagers)
    assert "not paged (its size is symbolic" in text, text


def test_a_memory_timeline_shorter_than_the_saves_is_explained_not_an_error():
    """Issue 27: "the memory timeline has 48 save and 52 unpack peaks for 52 saves and 52
    unpacks" was an error; now the partial memory line is left out and said, and a tensor the
    time line cannot place is kept, and said."""
    prefix = [{"name": f"#{i}", "bytes": 1 << 20, "saved_at": i, "used_at": 3 - i} for i in range(4)]
    timing = {
        "save_us": [0.0, 100.0, 200.0, 300.0], "unpack_us": [0.0, 100.0, 200.0, 300.0],
        "d2h_bytes_per_us": 1e5, "h2d_bytes_per_us": 1e5, "slack": 1.0,
        "save_peak": [10, 20, 30], "unpack_peak": [30, 20, 10, 5], "tail_peak": 1,
    }
    plan = sl.page_plan(prefix, 1.0, 1, timing)
    assert any("memory timeline not used" in l and "3 save and 4 unpack peaks for 4 saves and 4 unpacks" in l for l in plan["explain"]), plan["explain"]
    assert plan["page"]
    short = {**timing, "save_us": [0.0, 100.0], "save_peak": [], "unpack_peak": []}
    plan = sl.page_plan(prefix, 1.0, 1, short)
    assert "#3" not in plan["page"] and any(l.startswith("#3: kept (not placed") for l in plan["explain"]), plan["explain"]


def test_the_order_pass_keeps_aot_order_where_nothing_overlaps():
    """Issue 27: the order pass raised the estimated peak by 27.5% on a graph with nothing to
    overlap. With no collective and no page copy the graph keeps AOTAutograd's order, and the
    schedule says so with both peaks (the liveness estimate, from the values' bytes)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 32)) for _ in range(3)])
    slc.history.clear()
    torch._dynamo.reset()
    run = torch.compile(model, backend="sched_lifetime")
    run(torch.randn(16, 32)).square().mean().backward()
    for h in slc.history[-2:]:
        mem = h["schedule"]["memory"]
        assert mem["kept_table_order"] and "nothing to overlap" in mem["why"], mem
        assert mem["baseline_peak_bytes"] > 0 and mem["peak_bytes"] == mem["baseline_peak_bytes"]
        assert h["order"] == [n["name"] for n in h["ir"]["nodes"] if n["name"] in h["order"]]
    # memory_slack=None: the guard is off (the scheduler's order, no memory record).
    slc.history.clear()
    torch._dynamo.reset()
    torch.compile(model, backend="sched_lifetime", options={"memory_slack": None})(torch.randn(16, 32)).sum().backward()
    assert "memory" not in slc.history[-1]["schedule"]
    for bad in (-0.1, "2%", True):
        with pytest.raises(ValueError, match="'memory_slack' must be"):
            slc.check_options({"memory_slack": bad})


def test_calibrations_at_once_share_one_memory_line():
    """On CUDA each calibration mark reads the allocation peak since the last mark and resets it;
    two calibrations measuring at once (two runs of one graph) must not cut each other's
    intervals short: an interval's peak is the highest of every mark inside it."""
    from sched_lifetime.paging.calibrate import MemoryLine

    reads = iter([5, 90, 7, 3])
    line = MemoryLine(read=lambda dev: next(reads))
    a0 = line.mark(None)  # run A saves (peak 5 since the start)
    b0 = line.mark(None)  # run B saves in between (peak 90)
    a1 = line.mark(None)  # run A's next save: its interval holds B's 90
    assert line.peak(a0, a1) == 90 and line.peak(-1, a0) == 5 and line.peak(b0, a1) == 7
    line.join()
    line.leave()
    assert line.peaks == [] and line.users == 0


@pytest.fixture
def one_rank(monkeypatch):
    if dist.is_initialized():
        yield dist.group.WORLD
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Restored afterwards: later tests (the docs' examples) pick their own port.
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


class SplitA2A(torch.nn.Module):
    """An all-to-all launched in one graph and waited in the next (a graph break between them,
    as an EP layer's `.tolist()` of the split sizes makes without `capture_scalar_outputs`),
    with a shared expert between them and a second transfer inside the second graph."""

    def __init__(self, group, d=32):
        super().__init__()
        self.group = group.group_name
        self.pre, self.expert, self.shared, self.post = (torch.nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        h = self.pre(x)
        y = torch.ops._c10d_functional_autograd.all_to_all_single(h, [h.shape[0]], [h.shape[0]], self.group)
        torch._dynamo.graph_break()
        s = torch.relu(self.shared(h))  # independent of the transfer in flight
        e = torch.relu(self.expert(torch.ops._c10d_functional.wait_tensor(y)))
        z = torch.ops._c10d_functional_autograd.all_to_all_single(e, [e.shape[0]], [e.shape[0]], self.group)
        z = torch.ops._c10d_functional.wait_tensor(z)
        return (self.post(z) + s).square().mean()


def test_a_collective_launched_in_one_graph_and_waited_in_the_next_runs_bit_exact(one_rank):
    """Issue 27: "wait_tensor waits for 'arg0_1', which is not a functional collective". The wait
    of a transfer launched by an earlier graph gets a stand-in launch (a no-op) at the graph's
    start, so it still comes late: after the shared expert that does not need it; a launch
    returned unwaited gets a stand-in wait. Bit-exact against eager and aot_eager."""
    torch.manual_seed(0)
    base = SplitA2A(one_rank)
    runs = {}
    for backend in (None, "aot_eager", "sched_lifetime"):
        slc.history.clear()
        runs[backend] = _steps(copy.deepcopy(base), backend)
    assert _same(runs[None], runs["sched_lifetime"]) and _same(runs["aot_eager"], runs["sched_lifetime"])
    fwds = [h for h in slc.history if h["phase"] == "fwd"]
    second = next(h for h in fwds if any(n["name"].endswith(".in_flight") for n in h["ir"]["nodes"]))
    first = next(h for h in fwds if any(n["name"].endswith(".handed_on") for n in h["ir"]["nodes"]))
    assert any(n.endswith(".handed_on") for n in first["order"])  # Rust ordered the stand-ins; the graphs run without them
    # Within the second graph the policy still launches early and waits late: the wait for the
    # transfer in flight comes first only because the expert feeds the next launch (budget 1),
    # and the shared expert (`addmm`, independent of both) runs under that second transfer.
    names = [n.name for n in second["module"].graph.nodes if n.op == "call_function"]
    assert names.index("wait_tensor") < names.index("all_to_all_single") < names.index("addmm") < names.index("wait_tensor_1"), names


def test_the_memory_guard_through_the_schedule_op():
    """`sl.schedule(..., memory_slack=...)`: the result says what the guard found (peaks from the
    values' bytes, the order's within the slack of the table's), without it nothing changes, and
    a bad slack is an error. (Which order the guard picks is Rust's `sched::memory` tests.)"""
    def node(name, kind, ins=(), out=None, bytes_=0, **kw):
        n = {"name": name, "source": "f", "kind": kind, "inputs": list(ins), **kw}
        if out:
            n["outputs"] = [{"value": out, "bytes": bytes_, **({"alloc": "consumer"} if kind == "comm_launch" else {})}]
        return n

    graph = {
        "sources": [{"name": "f", "phase": "F"}], "inputs": ["x"], "outputs": ["a2", "b2"],
        "nodes": [
            node("a", "compute", ["x"], "a", 100), node("b", "compute", ["x"], "b", 100),
            node("l", "comm_launch", ["x"], "r", 10), node("w", "comm_wait", launch="l"),
            node("a2", "compute", ["a", "r"], "a2", 1), node("b2", "compute", ["b"], "b2", 1),
        ],
    }
    plain = sl.schedule(graph)
    assert "memory" not in plain
    guarded = sl.schedule(graph, memory_slack=0.02)
    mem = guarded["memory"]
    assert mem["peak_bytes"] <= mem["baseline_peak_bytes"] * 1.02, mem
    assert guarded["order"].index("l") < guarded["order"].index("w")
    with pytest.raises(ValueError, match="memory_slack must be a number"):
        sl.schedule(graph, memory_slack="2%")


@pytest.mark.parametrize("timed", [False] + ([True] if torch.cuda.is_available() else []), ids=lambda t: "timed" if t else "static")
def test_a_forward_whose_outputs_are_dropped_gives_its_run_slot_back(monkeypatch, timed):
    """A skipped step (`if not loss.isfinite(): continue`) drops the loss: its forward's run slot
    (and host buffers) come back at the next forward, so the MAX_RUNS error never comes; a
    forward whose outputs are kept still holds its slot, and parity holds after the skips."""
    from sched_lifetime.compile import paging_pass

    monkeypatch.setattr(paging_pass, "MAX_RUNS", 2)
    torch._dynamo.reset()
    dev = "cuda" if timed else "cpu"
    torch.manual_seed(0)
    layer = Layer().to(dev)
    ref = copy.deepcopy(layer)
    run = torch.compile(layer, backend="sched_lifetime", options={**PAGING, "paging_timed": timed})
    x = torch.randn(8, 32, device=dev)
    for _ in range(3):  # calibrate (timed: two steps), then page
        run(x).square().sum().backward()
        ref(x).square().sum().backward()
    for _ in range(6):  # skipped steps: the loss dropped before any backward
        loss = run(x).square().sum()
        del loss
        gc.collect()
    run(x).square().sum().backward()
    ref(x).square().sum().backward()
    gp = [h["module"].sched_lifetime["paging"] for h in slc.history if h["module"].sched_lifetime.get("paging")][-1]
    assert gp.dropped_runs >= 5 and len(gp.runs) <= 2
    for p, q in zip(layer.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)
    keep = [run(x), run(x)]  # outputs alive: their slots stay taken
    with pytest.raises(RuntimeError, match="waiting for their backwards"):
        run(x)
    del keep


def test_a_second_backward_through_a_paged_graph_is_refused_naming_retain_graph():
    """A gradient penalty's `autograd.grad(..., retain_graph=True)` then `backward()` reads the
    saved values twice: paging does not support it, and the error says so."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    run = torch.compile(Layer(), backend="sched_lifetime", options={**PAGING, "paging_timed": False})
    x = torch.randn(8, 32)
    loss = run(x).square().sum()
    w = next(run.parameters())
    torch.autograd.grad(loss, w, retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph=True .* is not supported with paging=True"):
        loss.backward()
