"""Page nodes on the node path (`Chunk.enable_paging`): scheduled on the page stream and bit-exact,
prefetch distance and release points, bad input and changed shapes refused, a step cut short giving
its buffers back, no microbatch state left alive."""

from dataclasses import replace

import pytest
import torch

import sched_lifetime as sl
from sched_lifetime.models import CONFIGS, MoEModel
from test_paging_pager import ODD, grads


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
    with pytest.raises(ValueError, match="two_way must be a bool"):
        c.enable_paging(m.batch(0, 0), budget=0.5, two_way="yes")
    plan = c.enable_paging(m.batch(0, 0), nodes=["L0.attn"], min_bytes=1)
    assert plan["page"] == ["L0.attn"] and plan["bytes_paged"] > 0


@pytest.mark.parametrize("two_way", [True, False])
def test_two_way_page_in_nodes_run_on_the_page_in_stream(two_way):
    """The schedule has one page role; the executor runs its page-in nodes on the page-in
    stream (`SideStreams.page_in`) and its page-outs on the page stream, or both on the page
    stream with `two_way=False`; the page-in stream joins and rejoins the compute stream as the
    others do, and only when a node runs on it."""
    cfg = replace(CONFIGS["tiny"], capacity_factor=1.0)
    m = MoEModel(cfg)
    c = m.chunk()
    plan = c.enable_paging(m.batch(0, 0), budget=0.5, min_bytes=1024, two_way=two_way)
    assert plan["page"] and c.pool.two_way == two_way and c.page_two_way == two_way
    ex = c.executor(True, True)
    kinds = {n["name"]: n["kind"] for n in c.graph(True, True)["nodes"]}
    on = {kinds[n]: set() for n in kinds}
    for n, r in ex._role.items():
        on[kinds[n]].add(r)
    assert on["page_out"] == {"page"} and on["page_in"] == ({"page_in"} if two_way else {"page"})
    assert on["compute"] == {"compute"}
    assert ("page_in" in ex._side_roles) == two_way
    assert "page_in" not in c.executor(True, False)._side_roles  # a forward alone has no page-in


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
