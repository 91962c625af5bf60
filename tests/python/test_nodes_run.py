"""Running a chunk (`nodes/run.py`) on CPU, one rank: per-node autograd gives the gradients of
plain `loss.backward()` bit for bit, in every order and lifetime mode, both dispatch modes,
with and without paired warm-up and cool-down."""

from dataclasses import replace

import pytest
import torch

from sched_lifetime.models import CONFIGS, MoEModel
from sched_lifetime.nodes import MicrobatchState, _two_graph, combined_step, run_two, train_step

#: A made-up shape beside the tiny config: odd sizes, 6 experts top-3, no shared expert, two
#: dense layers first, counted routing (no capacity; a test may set one: below 1, assignments
#: are dropped).
ODD = replace(
    CONFIGS["tiny"], vocab=97, hidden=48, heads=3, layers=4, dense_layers=2, experts=6, topk=3,
    expert_ffn=40, shared_ffn=0, dense_ffn=72, seq=12, batch=3, capacity_factor=None,
)


@pytest.mark.parametrize("config", ["tiny", "tiny_dense", "odd"])
@pytest.mark.parametrize("capacity", [None, 1.0, 0.75])
def test_node_path_equals_plain_backward(config, capacity):
    cfg = replace(ODD if config == "odd" else CONFIGS[config], capacity_factor=capacity)
    ref = MoEModel(cfg)
    n = 3
    for i in range(n):
        (ref(**ref.batch(0, i)) / n).backward()
    want = {k: p.grad for k, p in ref.named_parameters()}
    arms = [("sequential", "scheduled"), ("b_then_f", "scheduled"), ("ours", "scheduled"), ("ours", "record_stream"), ("ours:classic", "scheduled"), ("ours:ep_budget=1", "scheduled")]
    for order, lifetime, dw_nodes in [(o, lt, True) for o, lt in arms] + [("ours", "scheduled", False), ("sequential", "scheduled", False)]:
        m = MoEModel(cfg)
        train_step(m.chunk(dw_nodes=dw_nodes), [m.batch(0, i) for i in range(n)], order, lifetime)
        for k, p in m.named_parameters():
            assert torch.equal(p.grad, want[k]), (order, lifetime, dw_nodes, k)


def test_backward_without_a_forward_is_an_error():
    m = MoEModel(CONFIGS["tiny"])
    ch = m.chunk()
    with pytest.raises(ValueError, match="microbatch 5 has no saved forward"):
        combined_step(ch, (MicrobatchState(6), m.batch(0, 0)), MicrobatchState(5))


def test_train_step_rejects_bad_orders_and_empty_steps():
    m = MoEModel(CONFIGS["tiny"])
    with pytest.raises(ValueError, match="at least one microbatch"):
        train_step(m.chunk(), [], "ours")
    with pytest.raises(ValueError, match="order must be one of"):
        train_step(m.chunk(), [m.batch(0, 0)], "fastest")


def _steps(cfg, n, order, paired, steps=3, costs=None):
    m = MoEModel(cfg, seed=0, device="cpu")
    ch = m.chunk(torch.device("cpu"))
    if costs is not None:
        ch.costs = costs(ch)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    out = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        losses = train_step(ch, [m.batch(step, i) for i in range(n)], order, paired_ends=paired)
        out += list(losses) + [p.grad.clone() for p in m.parameters()]
        opt.step()
    return out + [p.detach().clone() for p in m.parameters()], ch


@pytest.mark.parametrize("cfg", [replace(CONFIGS["tiny"], capacity_factor=1.0), ODD], ids=["tiny", "odd"])
@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_paired_ends_are_bit_exact_against_sequential(n, cfg):
    """Warm-up F(0) with F(1) and cool-down B(n-2) with B(n-1) multiplexed: losses, every
    gradient and the weights after 3 SGD steps equal sequential F then B."""
    ref, _ = _steps(cfg, n, "sequential", False)
    got, _ = _steps(cfg, n, "ours", True)
    assert len(ref) == len(got) and all(torch.equal(a, b) for a, b in zip(ref, got))


def test_paired_ends_errors():
    cfg = replace(CONFIGS["tiny"], capacity_factor=1.0)
    m = MoEModel(cfg, seed=0, device="cpu")
    ch = m.chunk(torch.device("cpu"))
    with pytest.raises(ValueError, match="paired_ends needs one of our orders"):
        train_step(ch, [m.batch(0, 0), m.batch(0, 1)], "b_then_f", paired_ends=True)
    with pytest.raises(ValueError, match="two microbatches"):
        run_two(ch, "F", [(MicrobatchState(0), m.batch(0, 0))])
    with pytest.raises(ValueError, match="phase must be"):
        run_two(ch, "X", [None, None])
    with pytest.raises(ValueError, match="no saved forward"):
        run_two(ch, "B", [MicrobatchState(0), MicrobatchState(1)])
    ch.deferred_dw = []
    with pytest.raises(ValueError, match="not with paging or deferred dW"):
        run_two(ch, "F", [(MicrobatchState(0), m.batch(0, 0)), (MicrobatchState(1), m.batch(0, 1))])


def test_paired_ends_carry_the_node_costs_to_the_search_rule():
    """With node costs (e.g. a previous run's durations), both microbatches' nodes carry them,
    so `ours:search` orders the pairs too, still bit-exact."""
    cfg = replace(CONFIGS["tiny"], capacity_factor=1.0)
    ref, _ = _steps(cfg, 3, "sequential", False)
    got, ch = _steps(cfg, 3, "ours:search", True, costs=lambda ch: {n["name"]: 10.0 + i for i, n in enumerate(ch.graph(True, True)["nodes"])})
    assert len(ref) == len(got) and all(torch.equal(a, b) for a, b in zip(ref, got))
    costs = {n["name"]: n.get("cost") for n in _two_graph(ch, "B")["nodes"]}
    assert all(c is not None for c in costs.values())
    assert all(costs["B2" + k[1:]] == v for k, v in costs.items() if k.startswith("B."))


@pytest.mark.parametrize("order", ["ours", "sequential"])
def test_a_value_autograd_saved_is_not_emptied_when_it_crosses_streams(order):
    """A compute node whose output its own backward reads (sigmoid saves its result) feeds a
    comm node: the executor retires that output after the comm with rule 3's empty_storage,
    which made the backward read freed memory (a segfault on CPU). The node API finds, on each
    node's first forward, which values autograd saved; their retire drops the reference
    instead. Gradients bit-exact with plain autograd; the embedded model keeps none (its
    cross-stream values are not saved, so its memory is unchanged)."""
    from sched_lifetime.nodes import Chunk, NodeDef

    torch.manual_seed(0)
    w, v = torch.nn.Parameter(torch.randn(16, 16)), torch.nn.Parameter(torch.randn(16, 16))

    def comm(y, alloc_stream=None):
        return (y * 1.0,), None

    nodes = [
        NodeDef("a", "compute", ["x"], ["y"], lambda x: torch.sigmoid(x @ w), params=[w], grad_inputs=[], grad_outputs=["y"]),
        NodeDef("d", "comm", ["y"], ["z"], comm, grad_inputs=["y"], grad_outputs=["z"], transpose=lambda ctx, g, alloc_stream=None: (g,), consumer_alloc=["z"]),
        NodeDef("b", "compute", ["z"], ["loss"], lambda z: (z @ v).sum(), params=[v], grad_inputs=["z"], grad_outputs=["loss"]),
    ]
    chunk = Chunk(nodes, ["x"], "loss", torch.device("cpu"))
    xs = [torch.randn(4, 16) for _ in range(3)]
    train_step(chunk, [{"x": x} for x in xs], order)
    got = [w.grad.clone(), v.grad.clone()]
    w.grad = v.grad = None
    for x in xs:  # train_step's accumulation: each backward seeded with 1/n
        (torch.sigmoid(x @ w) @ v).sum().backward(torch.full((), 1.0 / len(xs)))
    assert torch.equal(got[0], w.grad) and torch.equal(got[1], v.grad)
    assert chunk.autograd_saved >= {"y"}
    assert sum(ex.kept_for_autograd for ex in chunk._executors.values()) > 0

    m = MoEModel(CONFIGS["tiny"])
    c = m.chunk()
    train_step(c, [m.batch(0, i) for i in range(2)], "ours")
    assert sum(ex.kept_for_autograd for ex in c._executors.values()) == 0


def _sources_in_issue_order(order: str) -> tuple[list[str], list[str]]:
    """F(1) + B(0) of the tiny model in `order`: the sources of the schedule's order and of the
    node callables as the executor really called them (waits have none)."""
    m = MoEModel(replace(CONFIGS["tiny"], capacity_factor=1.0))
    ch = m.chunk()
    g = ch.graph(True, True)
    source = {n["name"]: n["source"] for n in g["nodes"]}
    planned = [source[n] for n in ch.order_schedule(True, True, order)["order"]]
    ex = ch.executor(True, True, order)
    called: list[str] = []
    for name, fn in list(ex._callables.items()):
        ex._callables[name] = lambda *a, _fn=fn, _s=source[name]: (called.append(_s), _fn(*a))[1]
    st0, st1 = MicrobatchState(0), MicrobatchState(1)
    ch.run((st0, m.batch(0, 0)), None, order)
    ch.run((st1, m.batch(0, 1)), st0, order, grad_scale=0.5)
    return planned, called


def _b_before_f(sources: list[str]) -> bool:
    return "F" in sources and "B" in sources and max(i for i, s in enumerate(sources) if s == "B") < min(i for i, s in enumerate(sources) if s == "F")


def test_b_then_f_issues_every_backward_node_before_every_forward_node():
    """The `b_then_f` baseline of F(i+1) + B(i): in its schedule and in what the executor
    issues, every B node comes before every F node (the scheduler's `ours` does interleave
    them, so the check can tell the two apart)."""
    planned, called = _sources_in_issue_order("b_then_f")
    assert _b_before_f(planned), planned
    assert _b_before_f(called), called
    planned, called = _sources_in_issue_order("ours")
    assert not _b_before_f(planned) and not _b_before_f(called), planned


def test_timing_times_every_node_of_forward_only_and_backward_only_runs():
    """`chunk.timing` (the main job's durations.json): a sequential step runs a forward alone
    and a backward alone; every node of both graphs gets a time."""
    m = MoEModel(replace(CONFIGS["tiny"], capacity_factor=1.0))
    ch = m.chunk()
    ch.timing = True
    train_step(ch, [m.batch(0, i) for i in range(2)], "sequential")
    want = {n["name"] for g in (ch.graph(True, False), ch.graph(False, True)) for n in g["nodes"]}
    times = ch.node_times_us()
    assert set(times) == want and all(t >= 0 for t in times.values())


@pytest.mark.parametrize("order", ["ours", "sequential", "calibrated"])
def test_a_parameter_free_node_whose_inputs_take_no_gradient_trains(order):
    """`x * 0.5` of the chunk's input (no parameters, no `grad_inputs`) gets no backward node;
    its forward used to keep state for one anyway, and every step ended with "backward left
    state behind". Now it keeps none, and the gradients equal plain autograd's."""
    import sched_lifetime as sl

    torch.manual_seed(0)
    down = torch.nn.Linear(8, 1)
    nodes = [
        sl.NodeDef("scale", "compute", ["x"], ["h"], lambda x: x * 0.5, [], grad_outputs=["h"]),
        sl.NodeDef("down", "compute", ["h", "y"], ["loss"], lambda h, y: (down(h) - y).square().mean(),
                   list(down.parameters()), grad_inputs=["h"], grad_outputs=["loss"]),
    ]
    chunk = sl.Chunk(nodes, inputs=["x", "y"], loss_output="loss", device=torch.device("cpu"))
    mbs = [{"x": torch.randn(4, 8), "y": torch.randn(4, 1)} for _ in range(3)]
    for _ in range(2):
        sl.train_step(chunk, mbs, order=order)
    got = [p.grad.clone() for p in down.parameters()]
    for p in down.parameters():
        p.grad = None
    for _ in range(2):
        for m in mbs:
            ((down(m["x"] * 0.5) - m["y"]).square().mean() / len(mbs)).backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(got, down.parameters()))


def test_a_node_returning_no_tensor_for_a_gradient_output_is_named():
    """A callable returning None for an output a gradient flows back through: the error names
    that node and output (it used to surface as an AttributeError in the next node)."""
    import sched_lifetime as sl

    lin = torch.nn.Linear(4, 4)
    chunk = sl.Chunk(
        [sl.NodeDef("a", "compute", ["x"], ["h"], lambda x: None, list(lin.parameters()), grad_outputs=["h"]),
         sl.NodeDef("b", "compute", ["h", "y"], ["loss"], lambda h, y: (h - y).square().mean(), [], grad_inputs=["h"], grad_outputs=["loss"])],
        inputs=["x", "y"], loss_output="loss", device=torch.device("cpu"))
    with pytest.raises(TypeError, match="node 'a' returned NoneType for its output 'h', which takes a gradient"):
        sl.train_step(chunk, [{"x": torch.randn(3, 4), "y": torch.randn(3, 4)}], order="ours")
