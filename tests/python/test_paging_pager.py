"""The eager pager (`paging/pager.py`) on CPU (in CI; CPU tensors stand in, no stream is needed): Rust's
choice from the calibrated live prefix, bit-exact gradients with paging on vs off, bytes out ==
bytes in every step, a step that saves other shapes keeping them on the device, a step cut short (in its forward or its backward)
giving its buffers back; a timed plan on the GPU."""

import re
import warnings
from dataclasses import replace

import pytest
import torch

import sched_lifetime as sl
from sched_lifetime.models import CONFIGS, MoEModel


# A made-up shape: dense first layers, no shared expert, 6 experts top-3, odd sizes, tokens
# dropped at capacity 0.75.
ODD = replace(
    CONFIGS["tiny"], vocab=97, hidden=48, heads=3, layers=4, dense_layers=2, experts=6, topk=3,
    expert_ffn=40, shared_ffn=0, dense_ffn=72, seq=12, batch=3, capacity_factor=0.75,
)


def grads(m: MoEModel) -> dict:
    return {k: p.grad.clone() for k, p in m.named_parameters()}


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda), pytest.param("cuda-one-stream", marks=pytest.mark.cuda)]
)
@pytest.mark.parametrize(
    "budget,prefetch,shape", [(0.5, 0, "tiny"), (1.0, 0, "tiny"), ({"bytes": 1 << 14}, 0, "tiny"), (1.0, 4, "tiny"), (1.0, 4, "odd")]
)
@pytest.mark.parametrize("group_out", [1, 3])
def test_paging_on_vs_off_is_bit_exact_over_steps(budget, prefetch, shape, device, group_out):
    two_way = device != "cuda-one-stream"  # page-ins on their own stream, or on the page stream
    device = device.removesuffix("-one-stream")
    cfg = ODD if shape == "odd" else replace(CONFIGS["tiny"], capacity_factor=1.0)
    ref, paged = MoEModel(cfg, device=device), MoEModel(cfg, device=device)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.05)
    opt_p = torch.optim.SGD(paged.parameters(), lr=0.05)
    # Untimed: the budget alone chooses (the tiny model's forward hides almost no copy; the
    # timed plan has its own test below).
    # group_out=3: page-outs queued three at a time (the last ones at the backward's first use).
    pager = sl.Pager(
        budget, min_distance=0, min_bytes=1024, prefetch=prefetch, timed=False, measure_waits=True, two_way=two_way, group_out=group_out
    )
    for step in range(3):
        for m, opt in ((ref, opt_r), (paged, opt_p)):
            opt.zero_grad()
        ref(**ref.batch(step, 0)).backward()
        with pager.step():
            paged(**paged.batch(step, 0)).backward()
        g_r, g_p = grads(ref), grads(paged)
        assert all(torch.equal(g_r[k], g_p[k]) for k in g_r), step
        opt_r.step()
        opt_p.step()
    s = pager.stats()
    assert s["steps"] == 3 and s["bytes_out"] == s["bytes_in"] > 0
    assert pager.plan["bytes_paged"] >= pager.plan["target"] or pager.plan["short"]
    assert s["bytes_out"] == 2 * pager.plan["bytes_paged"]  # two paged steps after calibration
    assert (s["max_prefetched"] > 0) == (prefetch > 0)
    assert pager.pool.in_use() == 0
    per = pager.per_step()
    assert [p["step"] for p in per] == [2, 3]  # the paged steps
    for p in per:
        assert p["bytes_out"] == p["bytes_in"] == pager.plan["bytes_paged"]
        # Every paged tensor's buffer is taken before the first one comes back (all saves
        # precede the backward), so the host peak is all of them.
        assert p["host_bytes_peak"] == pager.pool.bytes
        if device == "cpu":  # synchronous copies: nothing held, no events to time
            assert p["out_in_flight_peak"] == 0 and p["page_in_wait_us"] is None
        else:
            assert p["out_in_flight_peak"] >= 1 and p["page_in_wait_us"] >= 0.0
    assert pager.explain().startswith(f"paging {len(pager.plan['page'])} tensors")


@pytest.mark.cuda
def test_a_timed_plan_releases_paged_storage_under_the_forward_and_stays_bit_exact():
    """A forward long enough to hide its copies (weight-bound matmuls of a few rows, each
    saving a small input, and a sleep per layer), with the host well ahead of the GPU: the
    calibration's timeline lets the plan release every page-out during the forward at a
    planned save, so the memory held at the forward -> backward boundary drops by the paged
    bytes; an untimed plan (release when the host finds a copy done, or past a drain distance
    above the count of copies) finds none done and holds them all to the boundary: the
    control. Gradients bit-exact against no paging."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    # Frozen weights: the step's peak is the forward's end (with weight gradients it would be
    # the backward's, which no page-out lowers, and the plan would rightly page nothing).
    layers = [torch.nn.Linear(8192, 8192, bias=False, device=dev, dtype=torch.bfloat16).requires_grad_(False) for _ in range(12)]
    x0 = torch.randn(32, 8192, device=dev, dtype=torch.bfloat16)

    def step(ctx):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        with ctx:
            torch.cuda._sleep(10_000_000)  # ~5 ms: the host runs ahead, no copy is found done
            x = x0g = x0.clone().requires_grad_(True)
            for l in layers:
                torch.cuda._sleep(200_000)  # ~0.1 ms of compute per layer to hide a copy under
                x = torch.nn.functional.gelu(l(x))
            held = torch.cuda.memory_allocated() - base
            x.float().square().sum().backward()
        torch.cuda.synchronize()
        return held, [x0g.grad.clone()]

    import contextlib

    step(contextlib.nullcontext())  # warm (the first matmul allocates its workspace)
    held_off, ref = step(contextlib.nullcontext())
    # count_host=False: these 512 KiB inputs copy in ~10 us, less than a page-out's host time;
    # the rule that keeps them has its own test (test_paging_plan.py).
    timed = sl.Pager(1.0, min_distance=0, min_bytes=1, slack=1.5, count_host=False)
    untimed = sl.Pager(1.0, min_distance=0, min_bytes=1, timed=False, drain_distance=1000, prefetch=2)
    step(timed.step())  # calibrates: the memory timeline
    assert timed.plan is None
    step(timed.step())  # calibrates: the time line, then plans
    step(untimed.step())  # calibrates
    step(untimed.step())  # warm: a first paged step is slow on the host, the GPU catches up
    t = timed.plan["timing"]
    assert len(t["save_us"]) > 12 and t["d2h_bytes_per_us"] > 1e3  # > 1 GB/s: a real link
    assert "both_bytes_per_us" not in t and t["page_host_us"] == 0.0  # one page stream (the default); host time not counted
    assert len(timed.plan["release_at"]) == len(timed.plan["launch_at"]) == len(timed.plan["page"]) > 0
    # Released under the forward (a two-way plan may also release a page-out in the backward,
    # at point len(save_us) + unpack, where it lowers a backward peak: not counted here).
    size = {c["name"]: c["bytes"] for c in timed.calibration["prefix"]}
    under_fwd = sum(size[n] for n, r in zip(timed.plan["page"], timed.plan["release_at"]) if r < len(t["save_us"]))
    assert under_fwd >= 32 * 8192 * 2, timed.explain()  # at least one gelu input
    start, end = re.search(r"^peak (\d+) -> (\d+) bytes", timed.explain(), re.M).groups()
    assert int(end) < int(start), timed.explain()  # the plan lowers the peak it measured
    for _ in range(2):
        held_t, g_t = step(timed.step())
        held_u, g_u = step(untimed.step())
        assert all(torch.equal(a, b) for a, b in zip(ref, g_t)) and all(torch.equal(a, b) for a, b in zip(ref, g_u))
        assert held_t <= held_off - under_fwd, (held_off, held_t, under_fwd)
        assert held_u >= held_off  # the control: nothing released before the boundary
    s = timed.stats()
    assert s["steps"] == 4 and s["bytes_out"] == s["bytes_in"] == 2 * timed.plan["bytes_paged"]
    per = timed.per_step()
    assert len(per) == 2 and all(p["host_bytes_peak"] > 0 and p["out_in_flight_peak"] >= 1 for p in per)
    assert all(p["page_in_wait_us"] is None for p in per)  # not measured unless asked


def test_a_step_that_saves_other_shapes_keeps_them_on_the_device_and_says_so_once():
    """The plan matches saved tensors by save index. One that comes unlike calibration (a new
    input shape; an MoE's eager experts loop, whose saves follow the routing) stays on the
    device when the plan pages its index (its host buffer was sized at calibration), with one
    warning and a count; an index the plan keeps is not checked at all (it crashed the second
    step of a Pager that paged nothing: a new user's trial, HF Mixtral with eager experts).
    Gradients stay exact."""
    torch.manual_seed(0)
    w = torch.randn(8, 8, requires_grad=True)

    def step(n, seed):
        x = torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))
        (torch.tanh(torch.tanh(x @ w) @ w)).sum().backward()
        g, w.grad = w.grad.clone(), None
        return g

    pager = sl.Pager(1.0, min_distance=0, min_bytes=1)
    with pager.step():
        want4 = step(4, 0)
    with pager.step():
        got4 = step(4, 1)  # a matching step pages
    assert torch.equal(got4, step(4, 1))
    paged = pager.stats()["bytes_out"]
    assert paged > 0 and pager.stats()["kept_unlike_calibration"] == 0
    with pytest.warns(UserWarning, match=r"Pager: saved tensor #\d+ is \(5, 8\) torch.float32, calibration saw \(\(4, 8\), torch.float32\): kept on the device"):
        with pager.step():
            got5 = step(5, 2)
    assert torch.equal(got5, step(5, 2)) and pager.stats()["kept_unlike_calibration"] > 0
    assert pager.stats()["bytes_out"] == paged  # nothing of the other shape was paged
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        with pager.step():
            step(5, 3)
    with pager.step():
        assert torch.equal(step(4, 0), want4)
    assert pager.stats()["bytes_out"] > paged and pager.stats()["bytes_out"] == pager.stats()["bytes_in"]
    # A Pager that pages nothing checks nothing: shapes may change freely.
    idle = sl.Pager(1.0, min_bytes=1 << 30)
    with pytest.warns(UserWarning, match="nothing to page"):
        with idle.step():
            step(4, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for n in (5, 3, 7):
            with idle.step():
                step(n, n)


class _FailsInBackward(torch.autograd.Function):
    """Identity whose backward raises (once `armed`): a step cut short in its backward."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if _FailsInBackward.armed:
            raise RuntimeError("boom in the backward")
        return g


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("two_way", [True, False])
def test_a_step_that_raises_in_its_backward_loses_nothing_and_the_next_step_is_exact(device, two_way):
    """Page-outs done, page-ins launched (prefetch: all at the first unpack) and not all waited
    on when the backward raises: every host buffer comes back, no page-out keeps its device
    storage, no page-in is left pending, and the next step's gradients equal a pager's that
    never failed, bit for bit (and bytes out == bytes in again)."""
    torch.manual_seed(0)
    ws = [torch.randn(64, 64, device=device, requires_grad=True) for _ in range(4)]
    x = torch.randn(32, 64, device=device)

    def loss() -> torch.Tensor:
        h = x
        for k, w in enumerate(ws):
            h = torch.tanh(h @ w)
            if k == 1:
                h = _FailsInBackward.apply(h)  # between the layers: later ones unpack first
        return h.sum()

    def pager() -> sl.Pager:
        return sl.Pager(1.0, min_distance=0, min_bytes=1, prefetch=64, timed=False, two_way=two_way)

    ok, failing = pager(), pager()
    for p in (ok, failing):
        with p.step():  # calibrates
            loss().backward()
    _FailsInBackward.armed = True
    try:
        with pytest.raises(RuntimeError, match="boom in the backward"):
            with failing.step():
                loss().backward()
    finally:
        _FailsInBackward.armed = False
    pool = failing.pool
    assert pool.page_outs > 0 and failing.stats()["bytes_in"] > 0  # paged out, some paged in
    st = failing.stats()  # every page-in was launched (prefetch) before the error: nothing abandoned
    assert st["bytes_out"] == st["bytes_in"] + st["bytes_abandoned"], st
    assert pool.in_use() == 0 and not pool._retiring and not failing._ready and not failing._handles
    for w in ws:
        w.grad = None
    with ok.step():
        loss().backward()
    ref = [w.grad.clone() for w in ws]
    for w in ws:
        w.grad = None
    with failing.step():
        loss().backward()
    assert all(torch.equal(a, w.grad) for a, w in zip(ref, ws))
    assert pool.in_use() == 0 and not pool._retiring
    st = failing.stats()
    assert st["bytes_out"] == st["bytes_in"] + st["bytes_abandoned"] and ok.stats()["bytes_abandoned"] == 0, st


def test_a_step_cut_short_gives_its_buffers_back():
    pager = sl.Pager(1.0, min_distance=0, min_bytes=1)
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)
    with pager.step():
        (torch.tanh(x @ w)).sum().backward()
    with pytest.raises(RuntimeError, match="boom"):
        with pager.step():
            torch.tanh(x @ w).sum()  # paged out, never paged in
            raise RuntimeError("boom")
    assert pager.pool.in_use() == 0
    st = pager.stats()  # paged out, never in: counted as abandoned
    assert st["bytes_abandoned"] > 0 and st["bytes_out"] == st["bytes_in"] + st["bytes_abandoned"], st
    with pager.step():
        (torch.tanh(x @ w)).sum().backward()
    assert w.grad is not None


@pytest.mark.parametrize("value", [-1, "x", 1.5, True])
def test_min_bytes_must_be_a_byte_count(value):
    with pytest.raises(ValueError, match="min_bytes must be an int >= 0"):
        sl.Pager(0.5, min_bytes=value)


def _mlp_loss(ws: list, x: torch.Tensor) -> torch.Tensor:
    h = x
    for w in ws:
        h = torch.tanh(h @ w)
    return h.square().sum()


def test_a_calibration_step_that_raises_or_has_no_backward_is_not_the_calibration():
    """The first step raises in its forward (a bad batch), or runs a forward alone (a warm-up,
    a skipped step): the next step with a backward calibrates, and later steps page, bit-exact
    with plain autograd. (The partial record was kept: the next step failed as a changed step,
    or a forward alone made a plan that paged nothing, for good.)"""
    torch.manual_seed(0)
    ws = [torch.randn(64, 64, requires_grad=True) for _ in range(3)]
    xs = [torch.randn(32, 64) for _ in range(4)]
    ref = []
    for x in xs:
        for w in ws:
            w.grad = None
        _mlp_loss(ws, x).backward()
        ref.append([w.grad.clone() for w in ws])
    for first in ("raises", "forward only"):
        pager = sl.Pager(0.5, min_distance=0, min_bytes=1, timed=False)
        if first == "raises":
            with pytest.raises(RuntimeError, match="bad batch"):
                with pager.step():
                    torch.tanh(xs[0] @ ws[0])  # saved, then the step stops
                    raise RuntimeError("bad batch")
        else:
            with pager.step():
                _mlp_loss(ws, xs[0]).detach()
        assert pager.plan is None, first
        for k, x in enumerate(xs):
            for w in ws:
                w.grad = None
            with pager.step():
                _mlp_loss(ws, x).backward()
            assert all(torch.equal(a, w.grad) for a, w in zip(ref[k], ws)), (first, k)
        assert pager.plan is not None and pager.plan["page"] and pager.stats()["bytes_out"] > 0, first


class _Tagged(torch.Tensor):
    """A tensor subclass (as DTensor is one): its data may live elsewhere."""


def test_sparse_and_subclass_tensors_autograd_saves_stay_on_the_device():
    """A sparse CSR adjacency (`torch.sparse.mm` saves it) and a tensor subclass are kept as
    saved, the plain tensors beside them paged; gradients bit-exact. (CSR raised inside the
    pack hook: it has no strides; a DTensor broke the first paged step's copy.)"""
    torch.manual_seed(0)
    adj = torch.sparse_coo_tensor(torch.randint(0, 64, (2, 256)), torch.rand(256), (64, 64)).coalesce().to_sparse_csr()
    w0, w1 = torch.randn(16, 16, requires_grad=True), torch.randn(16, 4, requires_grad=True)
    x = torch.randn(64, 16)

    def loss() -> torch.Tensor:
        h = torch.tanh(x @ w0)
        h = torch.sparse.mm(adj, h)
        t = torch.tanh(h @ w1).as_subclass(_Tagged)
        return (t * t).sum().as_subclass(torch.Tensor)

    loss().backward()
    ref = [w0.grad.clone(), w1.grad.clone()]
    pager = sl.Pager(1.0, min_distance=0, min_bytes=1, timed=False)
    for _ in range(3):
        w0.grad = w1.grad = None
        with pager.step():
            loss().backward()
        assert torch.equal(ref[0], w0.grad) and torch.equal(ref[1], w1.grad)
    saved = pager.calibration["prefix"]
    assert pager.stats()["bytes_out"] > 0 and pager.stats()["bytes_out"] == pager.stats()["bytes_in"]
    kept = [int(n["name"][1:]) for n in saved]
    shapes = [s for i, s in enumerate(pager._shapes) if i in kept]
    assert all(s[0] != (64, 64) for s in shapes)  # the adjacency is no candidate


def _dtensor_rank(rank: int, port: int, out: str) -> None:
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)

        def forward(self, x):
            return self.down(torch.nn.functional.gelu(self.up(x)))

    torch.manual_seed(0)
    ref, m = MLP(), MLP()
    m.load_state_dict(ref.state_dict())
    parallelize_module(m, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    pager = sl.Pager(1.0, min_distance=0, min_bytes=0, timed=False)
    same = []
    for s in range(3):
        x = torch.randn(8, 16)
        ref.zero_grad()
        m.zero_grad()
        ref(x).square().mean().backward()
        with pager.step():
            m(x).square().mean().backward()
        same.append(torch.equal(m.up.weight.grad.full_tensor(), ref.up.weight.grad) and torch.equal(m.down.weight.grad.full_tensor(), ref.down.weight.grad))
    with open(out, "w") as f:
        f.write(repr((same, pager.stats()["bytes_out"] > 0)))
    dist.destroy_process_group()


def test_tensor_parallel_activations_stay_on_the_device_and_stay_exact(tmp_path):
    """torch's tensor parallelism (DTensor activations, one gloo rank): the Pager keeps the
    DTensors as saved and pages the plain tensors; gradients bit-exact over 3 steps."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "res")
    mp.spawn(_dtensor_rank, args=(port, out), nprocs=1, join=True)
    same, paged = eval(open(out).read())
    assert same == [True, True, True] and paged, (same, paged)


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"budget": -1}, "paging budget in bytes must be >= 0, got -1"),
        ({"budget": -0.5}, "paging budget fraction must be in 0..=1"),
        ({"budget": {"frac": 0.5}}, 'paging budget must be {"bytes": n} or {"fraction": f}: unknown variant `frac`'),
        ({"budget": {}}, 'paging budget must be {"bytes": n} or {"fraction": f}'),
        ({"budget": 0.5, "min_distance": -1}, "min_distance must be an int >= 0"),
        ({"budget": 0.5, "min_distance": 1.5}, "min_distance must be an int >= 0"),
        ({"budget": 0.5, "drain_distance": 2.5}, "drain_distance must be an int >= 0"),
        ({"budget": 0.5, "two_way": "yes"}, "two_way must be True or False, got 'yes'"),
        ({"budget": 0.5, "timed": 1}, "timed must be True or False"),
        ({"budget": 0.5, "group_out": 0}, "group_out must be an int >= 1 (page-outs queued behind one wait; 1: each at once), got 0"),
        ({"budget": 0.5, "group_out": True}, "group_out must be an int >= 1"),
    ],
)
def test_bad_pager_settings_are_refused_when_it_is_made(kw, message):
    """Checked at construction (the budget by the plan's own parser), not after a whole
    calibration step, and none silently taken (`two_way="yes"` was True)."""
    with pytest.raises(ValueError, match=re.escape(message)):
        sl.Pager(**kw)
