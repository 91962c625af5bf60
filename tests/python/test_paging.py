"""The pager on CPU (in CI; CPU tensors stand in, no stream is needed): Rust's choice from
the calibrated live prefix, bit-exact gradients with paging on vs off, bytes out == bytes in
every step, a changed step refused, and the planner's errors."""

import re
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


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize(
    "budget,prefetch,shape", [(0.5, 0, "tiny"), (1.0, 0, "tiny"), ({"bytes": 1 << 14}, 0, "tiny"), (1.0, 4, "tiny"), (1.0, 4, "odd")]
)
def test_paging_on_vs_off_is_bit_exact_over_steps(budget, prefetch, shape, device):
    cfg = ODD if shape == "odd" else replace(CONFIGS["tiny"], capacity_factor=1.0)
    ref, paged = MoEModel(cfg, device=device), MoEModel(cfg, device=device)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.05)
    opt_p = torch.optim.SGD(paged.parameters(), lr=0.05)
    # Untimed: the budget alone chooses (the tiny model's forward hides almost no copy; the
    # timed plan has its own test below).
    pager = sl.Pager(budget, min_distance=0, min_bytes=1024, prefetch=prefetch, timed=False, measure_waits=True)
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
    timed = sl.Pager(1.0, min_distance=0, min_bytes=1, slack=1.5)
    untimed = sl.Pager(1.0, min_distance=0, min_bytes=1, timed=False, drain_distance=1000, prefetch=2)
    step(timed.step())  # calibrates: the memory timeline
    assert timed.plan is None
    step(timed.step())  # calibrates: the time line, then plans
    step(untimed.step())  # calibrates
    step(untimed.step())  # warm: a first paged step is slow on the host, the GPU catches up
    t = timed.plan["timing"]
    assert len(t["save_us"]) > 12 and t["d2h_bytes_per_us"] > 1e3  # > 1 GB/s: a real link
    assert len(timed.plan["release_at"]) == len(timed.plan["launch_at"]) == len(timed.plan["page"]) > 0
    assert timed.plan["bytes_paged"] >= 32 * 8192 * 2, timed.explain()  # at least one gelu input
    start, end = re.search(r"^peak (\d+) -> (\d+) bytes", timed.explain(), re.M).groups()
    assert int(end) < int(start), timed.explain()  # the plan lowers the peak it measured
    for _ in range(2):
        held_t, g_t = step(timed.step())
        held_u, g_u = step(untimed.step())
        assert all(torch.equal(a, b) for a, b in zip(ref, g_t)) and all(torch.equal(a, b) for a, b in zip(ref, g_u))
        assert held_t <= held_off - timed.plan["bytes_paged"], (held_off, held_t, timed.plan["bytes_paged"])
        assert held_u >= held_off  # the control: nothing released before the boundary
    s = timed.stats()
    assert s["steps"] == 4 and s["bytes_out"] == s["bytes_in"] == 2 * timed.plan["bytes_paged"]
    per = timed.per_step()
    assert len(per) == 2 and all(p["host_bytes_peak"] > 0 and p["out_in_flight_peak"] >= 1 for p in per)
    assert all(p["page_in_wait_us"] is None for p in per)  # not measured unless asked


def test_the_choice_is_reproducible_and_the_furthest_use_goes_first():
    prefix = [
        {"name": "#0", "bytes": 100, "saved_at": 0, "used_at": 5},
        {"name": "#1", "bytes": 300, "saved_at": 1, "used_at": 1},
        {"name": "#2", "bytes": 100, "saved_at": 2, "used_at": 3},
    ]
    a = sl.page_plan(prefix, {"bytes": 150}, min_distance=1)
    assert a["page"] == ["#0", "#2"] and a["bytes_paged"] == 200
    assert sl.page_plan(list(reversed(prefix)), {"bytes": 150}, 1)["page"] == a["page"]
    assert sl.page_plan(prefix, 0.5, 2)["page"] == ["#0", "#2"]  # #1 is read too soon
    with pytest.raises(ValueError, match="0..=1"):
        sl.page_plan(prefix, 1.5)
    with pytest.raises(ValueError, match="budget must be"):
        sl.Pager("half")
    with pytest.raises(ValueError, match="prefetch must be"):
        sl.Pager(0.5, prefetch=-1)
    with pytest.raises(ValueError, match="slack must be"):
        sl.Pager(0.5, slack=0.9)


def test_a_timed_plan_through_the_op_places_releases_and_page_ins():
    """The measured timeline through the Python entry: #0's copy (100 bytes at 10 bytes/us)
    ends at 10 us, the save at 10 us releases it; #2's ends at 30 (save 3); #1 is read too soon.
    Page-ins as late as the link allows: #2 (used at unpack 3, 30 us) copies 20-30 (queued at
    unpack 2), #0 (unpack 5, 50 us) 40-50 (unpack 4). A bad timeline is a ValueError."""
    prefix = [
        {"name": "#0", "bytes": 100, "saved_at": 0, "used_at": 5},
        {"name": "#1", "bytes": 300, "saved_at": 1, "used_at": 0},
        {"name": "#2", "bytes": 100, "saved_at": 2, "used_at": 3},
    ]
    timing = {"save_us": [0, 10, 20, 30, 40], "unpack_us": [0, 10, 20, 30, 40, 50], "d2h_bytes_per_us": 10, "h2d_bytes_per_us": 10, "slack": 1}
    p = sl.page_plan(prefix, 1.0, 1, timing)
    assert (p["page"], p["release_at"], p["launch_at"]) == (["#0", "#2"], [1, 3], [4, 2])
    assert sl.page_plan(prefix, 1.0, 1)["release_at"] == []  # untimed: nothing placed
    with pytest.raises(ValueError, match="slack must be >= 1"):
        sl.page_plan(prefix, 1.0, 1, dict(timing, slack=0.5))
    with pytest.raises(ValueError, match="timing is not valid"):
        sl.page_plan(prefix, 1.0, 1, dict(timing, extra=1))


def test_a_step_that_saves_different_tensors_is_refused():
    pager = sl.Pager(1.0, min_distance=0, min_bytes=1)
    w = torch.randn(8, 8, requires_grad=True)
    with pager.step():
        (torch.tanh(torch.randn(4, 8) @ w)).sum().backward()
    with pytest.raises(RuntimeError, match="saved tensor #"):
        with pager.step():
            (torch.tanh(torch.randn(5, 8) @ w)).sum().backward()


def test_host_pool_freelist_is_fifo_per_size_and_never_allocates_in_a_step():
    pool = sl.HostPool([64, 64, 32])
    a, b = pool.take(64), pool.take(64)
    assert a != b and pool.in_use() == 2
    with pytest.raises(RuntimeError, match="exhausted: all 2 buffers of 64 bytes"):
        pool.take(64)
    with pytest.raises(RuntimeError, match="no buffer of 48 bytes"):
        pool.take(48)
    pool.give(b)
    pool.give(a)
    assert pool.take(64) == b  # given back first, taken first: the freelist keeps give order
    with pytest.raises(RuntimeError, match="given back but not taken"):
        pool.give(a)
    with pytest.raises(ValueError, match="positive byte counts"):
        sl.HostPool([0])
    # page_out/page_in round-trip through a buffer, and the buffer is free again after page_in
    pool = sl.HostPool([4 * 6])
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    p = pool.page_out(x)
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.page_out(x)
    assert torch.equal(pool.page_in(p), x) and pool.in_use() == 0


def test_page_in_restores_the_strides_and_elements_sharing_memory_are_not_paged():
    """A saved view (a chunk along the last dim) comes back with its strides: a backward kernel
    given another layout may round differently (it did on the made-up shape below). An expanded
    tensor cannot be rebuilt so: page_out refuses it, and both ways in keep it on the device."""
    x = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    view = x.chunk(2, dim=-1)[1]
    assert not view.is_contiguous() and sl.paging.restorable(view)
    pool = sl.HostPool([4 * 12])
    back = pool.page_in(pool.page_out(view))
    assert torch.equal(back, view) and back.stride() == view.stride()
    expanded = torch.ones(3, 1).expand(3, 4)
    assert not sl.paging.restorable(expanded) and sl.paging.restorable(torch.ones(3, 4).t())
    with pytest.raises(ValueError, match="elements sharing memory"):
        pool.page_out(expanded)
    pager = sl.Pager(1.0, min_distance=0, min_bytes=1)
    w = torch.randn(4, requires_grad=True)
    for _ in range(2):
        with pager.step():
            (torch.ones(3, 1).expand(3, 4) * w).sum().backward()  # mul saves the expanded tensor
    assert pager.plan["page"] == [] and pager.stats()["bytes_out"] == 0


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
    with pager.step():
        (torch.tanh(x @ w)).sum().backward()
    assert w.grad is not None


POISON_ITERS = 200
SLEEP = 20_000_000  # ~10 ms of GPU sleep on the page stream before the page-in


def _freelist_poison(ordered: bool) -> int:
    """A page-in delayed on the page stream, then at once a new page-out into the same (only)
    host buffer. `ordered`: the page-out goes through the pool (queued on the page stream);
    control: the same buffer is rewritten by a copy on another stream, skipping that order.
    Returns how many of the iterations reloaded a corrupt tensor."""
    n = 1 << 20
    pool = sl.HostPool([4 * n], "cuda")
    other = torch.cuda.Stream()
    bad = 0
    for it in range(POISON_ITERS):
        want = torch.full((n,), float(it), device="cuda")
        poison = torch.full((n,), -1.0, device="cuda")
        other.wait_stream(torch.cuda.current_stream())  # the control's copy may read `poison`
        p = pool.page_out(want)
        with torch.cuda.stream(pool.page_stream):
            torch.cuda._sleep(SLEEP)
        # A prefetched page-in: queued behind the sleep, the compute stream has not waited on it
        # yet, and the buffer is already back on the freelist.
        got, ev = pool.page_in_launch(p)
        if ordered:
            q = pool.page_out(poison)
            slot = q.slot
        else:
            slot = pool.take(4 * n)
            with torch.cuda.stream(other):
                pool.view(slot, (n,), torch.float32).copy_(poison, non_blocking=True)
        pool.page_wait(ev)
        torch.cuda.synchronize()
        bad += int(not torch.equal(got, want))
        pool.give(slot)
        pool.drain()
    return bad


@pytest.mark.cuda
def test_freelist_reuse_is_ordered_on_the_page_stream_and_the_control_corrupts():
    assert _freelist_poison(ordered=True) == 0
    corrupt = _freelist_poison(ordered=False)
    assert corrupt > POISON_ITERS // 2, f"control corrupted only {corrupt}/{POISON_ITERS}: the test has no teeth here"


@pytest.mark.parametrize("order,shape", [("ours", "tiny"), ("sequential", "tiny"), ("ours", "odd")])
def test_page_nodes_on_the_node_path_are_scheduled_and_bit_exact(order, shape):
    """Paging through the graph: page_out after each chosen node (forward source), page_in
    before its backward (backward source), on the page stream, in the scheduler's order; a
    whole train_step with paging equals one without, bit for bit, over several steps."""
    from sched_lifetime.nodes import train_step

    cfg = ODD if shape == "odd" else replace(CONFIGS["tiny"], capacity_factor=1.0, layers=3)
    ref, paged = MoEModel(cfg), MoEModel(cfg)
    cr, cp = ref.chunk(), paged.chunk()
    plan = cp.enable_paging(paged.batch(0, 0), budget=0.5, min_bytes=1024)
    assert plan["page"] and plan["bytes_paged"] >= plan["target"] and cp.pool is not None
    g = cp.graph(True, True)
    kinds = {n["name"]: n["kind"] for n in g["nodes"]}
    for x in plan["page"]:
        assert kinds[f"F.{x}.page_out"] == "page_out" and kinds[f"B.{x}.page_in"] == "page_in"
    s = cp.order_schedule(True, True, "ours")
    roles = dict(map(tuple, s["streams"]))
    assert {roles[n] for n in kinds if kinds[n] in ("page_out", "page_in")} == {"page"}
    for step in range(3):
        for m in (ref, paged):
            for p in m.parameters():
                p.grad = None
        lr = train_step(cr, [ref.batch(step, k) for k in range(3)], order=order)
        lp = train_step(cp, [paged.batch(step, k) for k in range(3)], order=order)
        assert all(torch.equal(a, b) for a, b in zip(lr, lp)), step
        g_r, g_p = grads(ref), grads(paged)
        assert all(torch.equal(g_r[k], g_p[k]) for k in g_r), step
        assert cp.pool.in_use() == 0
    moved = cp.page_stats
    assert moved["bytes_out"] == moved["bytes_in"] == 3 * 3 * plan["bytes_paged"]


def test_enable_paging_refuses_bad_input():
    cfg = replace(CONFIGS["tiny"], capacity_factor=1.0)
    m = MoEModel(cfg)
    c = m.chunk()
    with pytest.raises(ValueError, match="a budget or a list of nodes"):
        c.enable_paging(m.batch(0, 0))
    with pytest.raises(ValueError, match="not compute nodes of this chunk with a backward: \\['L0.dispatch'\\]"):
        c.enable_paging(m.batch(0, 0), nodes=["L0.dispatch"])
    with pytest.raises(ValueError, match="in_flight must be"):
        c.enable_paging(m.batch(0, 0), budget=0.5, in_flight=0)
    plan = c.enable_paging(m.batch(0, 0), nodes=["L0.attn"], min_bytes=1)
    assert plan["page"] == ["L0.attn"] and plan["bytes_paged"] > 0


def test_page_in_prefetch_distance_holds_page_ins_back():
    """With `prefetch=k` a page-in is issued only after the backward compute node k dI nodes
    before its consumer; with None it may go at once (and the first page-ins then hold the page
    budget while the forward's page-outs wait)."""
    cfg = replace(CONFIGS["tiny"], capacity_factor=1.0, layers=3)
    m = MoEModel(cfg)
    leads = {}
    for pf in (None, 2):
        c = m.chunk()
        plan = c.enable_paging(m.batch(0, 0), budget=0.5, min_bytes=1024, prefetch=pf)
        o = c.order_schedule(True, True, "ours")["order"]
        pos = {n: i for i, n in enumerate(o)}
        if pf is not None:
            control = c.graph(True, True)["control"]
            for x in plan["page"]:
                held = [a for a, b in control if b == f"B.{x}.page_in"]
                assert all(pos[a] < pos[f"B.{x}.page_in"] for a in held)
        leads[pf] = max(pos.get(f"B.{x}", pos.get(f"B.{x}.dw")) - pos[f"B.{x}.page_in"] for x in plan["page"])
        first_out = min(pos[f"F.{x}.page_out"] - pos[f"F.{x}"] for x in plan["page"])
        leads[(pf, "out")] = first_out
    assert leads[2] < leads[None]  # no page-in sits in the budget from the start
    assert leads[(2, "out")] < leads[(None, "out")]  # so the first page-out goes sooner
    with pytest.raises(ValueError, match="prefetch must be"):
        m.chunk().enable_paging(m.batch(0, 0), budget=0.5, prefetch=0)


def test_a_page_in_releases_exactly_the_page_outs_queued_before_it():
    """`release_queued_before(mark)`: the page-outs numbered below a page-in's mark ran before
    it on the page stream, so they (and no later one) give their device storage back, oldest
    first, each by its owner's acquire and finalize (no event query: capture-safe)."""
    pool = sl.HostPool([16], "cpu")
    calls = []

    class Manager:
        def __init__(self, k):
            self.k = k

        def acquire(self, owner):
            calls.append(("acquire", self.k, owner))

        def finalize(self):
            calls.append(("finalize", self.k))

        def close(self):
            pass

    for k in range(4):
        pool._retiring.append((Manager(k), f"ev{k}", f"owner{k}", k))
    pool.page_outs = 4
    pool.release_queued_before(2)
    assert calls == [("acquire", 0, "owner0"), ("finalize", 0), ("acquire", 1, "owner1"), ("finalize", 1)]
    assert [e[3] for e in pool._retiring] == [2, 3] and pool.released == 2
    assert pool._spare == ["ev0", "ev1"]  # their copy-done events are recycled
    pool.release_queued_before(2)  # nothing below the mark is left
    assert len(calls) == 4
    assert pool.mark() == 4
    pool.release_queued_before(pool.mark())
    assert not pool._retiring and pool.released == 4


def test_calibration_and_paged_steps_leave_no_microbatch_state_alive():
    """What the page hooks pack refers back to no graph (kept tensors detached, the microbatch
    state weakly): the calibration forward (whose backward never runs) and a paged step leave no
    state, graph or activation behind. Before, the calibration's graph leaked (the hooks sit in
    C++, out of the collector's sight), and with it its parameters' gradient accumulators, made
    on the eager stream: a later CUDA graph capture failed on them."""
    import subprocess
    import sys

    # A fresh interpreter: what other tests in this process leave (and free) is not counted.
    script = """
import gc
from dataclasses import replace
import torch
import sched_lifetime as sl
from sched_lifetime.models import CONFIGS, MoEModel
from sched_lifetime.nodes import MicrobatchState, train_step

def alive():
    gc.collect()
    objs = gc.get_objects()
    return sum(isinstance(o, MicrobatchState) for o in objs), sum(isinstance(o, torch.Tensor) and o.grad_fn is not None for o in objs)

cfg = replace(CONFIGS["tiny"], capacity_factor=1.0)  # fixed shapes: the host pool's sizes hold every step
m = MoEModel(cfg, sl.ep.AllToAll(None), seed=0, device=torch.device("cpu"))
chunk = m.chunk(torch.device("cpu"))
out = [alive()]
assert chunk.enable_paging(m.batch(0, 0), budget=0.5, min_bytes=1)["page"]
out.append(alive())
train_step(chunk, [m.batch(0, i) for i in range(3)])
out.append(alive())
print(out)
"""
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "[(0, 0), (0, 0), (0, 0)]", res.stdout


@pytest.mark.parametrize("shape", ["tiny", "odd"])
def test_a_node_path_step_cut_short_gives_its_buffers_back_and_the_next_step_is_exact(shape):
    """A page-node step that fails midway (a microbatch without its labels, after two forwards
    paged out) gives every host buffer back, and the next step runs and equals the same step on
    a chunk that never failed (every gradient, bit for bit). Before, the buffers stayed taken and
    the next step failed with 'host pool exhausted'."""
    from sched_lifetime.nodes import train_step

    cfg = ODD if shape == "odd" else replace(CONFIGS["tiny"], capacity_factor=1.0)
    models = [MoEModel(cfg, sl.ep.AllToAll(None), seed=0, device=torch.device("cpu")) for _ in range(2)]
    chunks = [m.chunk(torch.device("cpu")) for m in models]
    for m, c in zip(models, chunks):
        assert c.enable_paging(m.batch(0, 0), budget=0.5, min_bytes=1)["page"]
    m, c = models[0], chunks[0]
    with pytest.raises(ValueError, match="chunk inputs missing"):
        train_step(c, [m.batch(0, 0), m.batch(0, 1), {"tokens": m.batch(0, 2)["tokens"]}])
    assert c.pool.in_use() == 0
    for mm, cc in zip(models, chunks):
        mm.zero_grad(set_to_none=True)
        train_step(cc, [mm.batch(1, i) for i in range(3)])
        assert cc.pool.in_use() == 0
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(models[0].parameters(), models[1].parameters()))


def test_page_nodes_refuse_shapes_that_differ_from_calibration_naming_the_node():
    """Counted EP dispatch changes what a node saves from one microbatch to the next; the host
    pool is sized for the calibrated shapes, so the page-out says so, naming the node and the
    fix (a fixed capacity), before taking any buffer; the pool stays whole."""
    from sched_lifetime.nodes import train_step

    cfg = replace(CONFIGS["tiny"], capacity_factor=None)
    m = MoEModel(cfg, sl.ep.AllToAll(None), seed=0, device=torch.device("cpu"))
    c = m.chunk(torch.device("cpu"))
    plan = c.enable_paging(m.batch(0, 0), budget=1.0, min_bytes=1)
    assert plan["page"]
    with pytest.raises(ValueError, match=r"(?s)saved .* calibration saw .*capacity_factor.*in node 'F\.[^']+\.page_out'"):
        train_step(c, [m.batch(0, i) for i in range(3)])
    assert c.pool.in_use() == 0


def test_a_group_pages_each_storage_once_and_comes_back_with_its_strides_and_aliasing():
    """`page_out_group` / `page_in_group` (a page node's saved activations together), laid out
    by `group_plan`: one tensor saved twice and q, k, v of one projection move once (the bytes
    their storage spans), a lone chunk with gaps on its own (packed), a transposed tensor as
    its bytes; every segment 512-byte aligned; every tensor back equal with its dtype and
    strides, and tensors that shared memory share it again; the buffer free again; tensors
    of different groups are not one group; an expanded tensor is refused."""
    x = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    qkv = torch.randn(5, 3 * 8)
    q, k, v = qkv.split(8, dim=-1)
    dup = torch.randn(3, 5)
    ts = [dup, q, torch.arange(12, dtype=torch.int64).reshape(3, 4).t(), k, x.chunk(2, dim=-1)[1], dup, v, torch.randn(7).to(torch.bfloat16)]
    plan = sl.paging.group_plan(ts)
    kinds = [(kind, i) for kind, i, *_ in plan.segments]
    assert kinds == [("span", 0), ("span", 1), ("span", 2), ("view", 4), ("span", 7)], kinds
    assert [n for *_, n, _ in plan.segments] == [60, 4 * 5 * 24, 96, 48, 14]
    assert all(off % sl.paging.GROUP_ALIGN == 0 for *_, off in plan.segments)
    assert plan.places[0][0] == plan.places[5][0] and [p[1] for p in plan.places] == [False] * 4 + [True] + [False] * 3
    pool = sl.HostPool([plan.nbytes] * 2, "cpu")
    ps = pool.page_out_group(ts)
    assert pool.in_use() == 1 and pool.mark() == 1 and len({p.slot for p in ps}) == 1
    other = pool.page_out_group(ts)
    with pytest.raises(ValueError, match="not paged out as one group"):
        pool.page_in_group([ps[0], other[1]])
    back, ev = pool.page_in_group(ps)
    assert ev is None and pool.in_use() == 1
    for b, t in zip(back, ts):
        assert b.dtype == t.dtype and b.stride() == t.stride() and torch.equal(b, t)
    # One device block holds them all but the packed one; the same tensor twice is one tensor's
    # memory again, and k sits 8 floats after q, as in qkv.
    blocks = [b.untyped_storage().data_ptr() for b in back]
    assert len(set(blocks[:4] + blocks[5:])) == 1 and blocks[4] != blocks[0]
    assert back[0].data_ptr() == back[5].data_ptr() and back[3].data_ptr() - back[1].data_ptr() == 8 * 4
    assert [torch.equal(b, t) for b, t in zip(pool.page_in_group(other)[0], ts)] == [True] * len(ts)
    assert pool.in_use() == 0
    lone = sl.paging.group_plan([q, k[:, :4], q])  # a view with gaps saved twice, beside another
    assert [kind for kind, *_ in lone.segments] == ["view", "view"] and lone.places == [(0, True), (512, True), (0, True)]
    with pytest.raises(ValueError, match="elements sharing memory"):
        pool.page_out_group([torch.ones(3, 1).expand(3, 4)])


def test_page_out_release_points_wait_and_release_under_the_forward():
    """`enable_paging(release=k)`: the forward compute node k compute nodes after a paged one
    depends on that node's page-out wait (the scheduler issues the wait first) and releases the
    page-outs queued up to and including it, with the pool's mark taken right after it; with
    release=None there is no such edge and no such release. Bit-exact either way."""
    from sched_lifetime.nodes import train_step

    cfg = replace(CONFIGS["tiny"], capacity_factor=1.0, layers=3)
    ref = MoEModel(cfg)
    cr = ref.chunk()
    for release in (2, None):
        m = MoEModel(cfg)
        c = m.chunk()
        plan = c.enable_paging(m.batch(0, 0), budget=0.5, min_bytes=1024, release=release)
        computes = [n.name for n in c.nodes if n.kind == "compute"]
        control = c.graph(True, True).get("control", [])
        waits = {a.split(".page_out")[0][2:]: b[2:] for a, b in control if a.endswith(".page_out.wait")}
        # A forward alone (the warm-up) has no release points.
        assert not [a for a, _ in c.graph(True, False).get("control", []) if a.endswith(".page_out.wait")]
        if release is None:
            assert waits == {}
        else:
            want = {x: computes[computes.index(x) + release] for x in plan["page"] if computes.index(x) + release < len(computes)}
            assert want and waits == want
            order = c.order_schedule(True, True, "ours")["order"]
            for x, target in want.items():
                assert order.index(f"F.{x}.page_out.wait") < order.index(f"F.{target}")
        seen = []
        real = c.pool.release_queued_before
        c.pool.release_queued_before = lambda mark: (seen.append(mark), real(mark))
        for mm in (ref, m):
            for p in mm.parameters():
                p.grad = None
        lr = train_step(cr, [ref.batch(0, k) for k in range(3)])
        lp = train_step(c, [m.batch(0, k) for k in range(3)])
        assert all(torch.equal(a, b) for a, b in zip(lr, lp))
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(ref.parameters(), m.parameters()))
        # One release per paged node at its page-in's consumer, every microbatch; one per node
        # with a target (its mark: the page-outs up to and including its own) in the forwards
        # beside a backward: microbatches 1 and 2 (0's is the warm-up, alone).
        n_paged = len(plan["page"])
        n_targets = 0 if release is None else len(want)
        assert len(seen) == 3 * n_paged + 2 * n_targets, seen
        if release is not None:
            ends = [k * n_paged + i + 1 for k in (1, 2) for i, x in enumerate(plan["page"]) if x in want]
            assert set(ends) <= set(seen), (ends, seen)
    with pytest.raises(ValueError, match="release must be"):
        MoEModel(cfg).chunk().enable_paging(ref.batch(0, 0), budget=0.5, release=0)


@pytest.mark.cuda
def test_a_group_on_the_gpu_holds_each_storage_once_and_comes_back_as_one_block():
    """On the GPU: two saved views of one storage (q and k of one projection) are one storage
    to the lifetime manager (held and released once, not refused as aliases), a group of dense
    tensors comes back as views of one device block (one copy) with their strides, one with
    gaps as its own tensor; bit-exact; the device storage is released after its copy."""
    dev = torch.device("cuda")
    qkv = torch.randn(64, 3 * 256, device=dev)
    q, k, _ = qkv.split(256, dim=-1)
    dense = [torch.randn(128, 64, device=dev).t(), torch.arange(1000, device=dev), torch.randn(33, device=dev).to(torch.bfloat16)]
    for ts in (dense, [q, k, *dense]):
        want = [t.clone() for t in ts]
        pool = sl.HostPool([sl.paging.group_plan(ts).nbytes], dev)
        ps = pool.page_out_group(ts)
        assert pool.page_outs == 1  # one page-out (its storage released once its copy is done)
        back, ev = pool.page_in_group(ps)
        pool.page_wait(ev)
        bases = {b.untyped_storage().data_ptr() for b in back}
        assert (len(bases) == 1) == (ts is dense)  # one block only when every layout is dense
        for b, t, w in zip(back, ts, want):
            assert b.stride() == t.stride() and torch.equal(b, w)
        pool.drain()
        assert pool.released == 1 and not pool._retiring
