"""The node API on CPU, one rank: per-node autograd gives the gradients of plain
`loss.backward()` bit for bit, in every order and lifetime mode, both dispatch modes."""

from dataclasses import replace

import pytest
import torch

from sched_lifetime.models import CONFIGS, MoEModel
from sched_lifetime.nodes import Chunk, MicrobatchState, NodeDef, _two_graph, combined_step, run_two, train_step, two_schedule


# A shape no example uses: odd sizes, 6 experts top-3 on one rank, no shared expert, two dense
# layers in front, and a capacity below 1 (assignments are dropped).
ODD = replace(
    CONFIGS["tiny"], vocab=97, hidden=48, heads=3, layers=4, dense_layers=2, experts=6, topk=3,
    expert_ffn=40, shared_ffn=0, dense_ffn=72, seq=12, batch=3,
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


def test_dw_nodes_are_wgrad_and_read_what_di_reads():
    ch = MoEModel(CONFIGS["tiny"]).chunk()
    b = {n["name"]: n for n in ch.graph(False, True)["nodes"]}
    assert b["B.L0.experts.dw"]["wgrad"] and b["B.L0.experts.dw"]["inputs"] == b["B.L0.experts"]["inputs"]
    assert b["B.L0.dispatch"]["kind"] == "comm_launch" and b["B.L0.dispatch"]["outputs"][0]["alloc"] == "consumer"
    assert "B.embed" not in b and b["B.embed.dw"]["wgrad"]  # tokens take no gradient


def test_fused_dw_nodes_leave_only_dw_without_di():
    ch = MoEModel(CONFIGS["tiny"]).chunk(dw_nodes=False)
    b = {n["name"] for n in ch.graph(False, True)["nodes"]}
    assert "B.L0.experts" in b and "B.L0.experts.dw" not in b
    assert not any(n.endswith(".dw") for n in b if n != "B.embed.dw")
    assert "B.embed.dw" in b  # tokens take no gradient: the embedding's whole backward is dW


def test_chunk_rejects_bad_descriptions_naming_the_node():
    f = lambda x: x  # noqa: E731
    with pytest.raises(ValueError, match="node 'b' reads 'y' before any node produces it"):
        Chunk([NodeDef("a", "compute", ["x"], ["z"], f), NodeDef("b", "compute", ["y"], ["w"], f)], ["x"], "w", torch.device("cpu"))
    with pytest.raises(ValueError, match="comm node 'c' needs a transpose"):
        Chunk([NodeDef("c", "comm", ["x"], ["y"], f)], ["x"], "y", torch.device("cpu"))
    with pytest.raises(ValueError, match="node 'a': grad input 'q' is not an input"):
        Chunk([NodeDef("a", "compute", ["x"], ["y"], f, grad_inputs=["q"])], ["x"], "y", torch.device("cpu"))


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


def test_weight_split_matches_one_backward_and_covers_weights_off_the_input_graph():
    """dI then dW from the kept intermediate gradients gives the gradients of one full
    backward, bit for bit, also for a weight whose graph never meets the input's (w2)."""
    from sched_lifetime.nodes import _WeightSplit

    torch.manual_seed(0)
    w1 = torch.nn.Parameter(torch.randn(8, 8))
    w2 = torch.nn.Parameter(torch.randn(8))
    x = torch.randn(4, 8, requires_grad=True)
    g = [torch.randn(4, 8), torch.randn(8)]

    def outs():
        return [torch.tanh(x @ w1), w2 * 3]

    ref = torch.autograd.grad(outs(), [x, w1, w2], g)
    split = _WeightSplit(outs(), [x], [w1, w2])
    assert split.rest == [1] and len(split.groups) == 1
    (dx,) = split.input_grads(g)
    dw1, dw2 = split.weight_grads()
    assert torch.equal(dx, ref[0]) and torch.equal(dw1, ref[1]) and torch.equal(dw2, ref[2])


def test_every_embedded_model_weight_splits_at_an_intermediate():
    """In the embedded model each node's weights join its inputs' graph: dW never redoes
    the input gradient work (no weight falls back to a backward from the outputs)."""
    from sched_lifetime.nodes import _WeightSplit

    m = MoEModel(CONFIGS["tiny"])
    ch = m.chunk()
    st = MicrobatchState(0)
    ch.run((st, m.batch(0, 0)), None)
    checked = 0
    for n in ch.nodes:
        if n.kind != "compute" or not n.params or not n.grad_inputs:
            continue
        leaves, outs = st.saved[n.name]
        assert _WeightSplit(outs, leaves, n.params).rest == [], n.name
        checked += 1
    assert checked >= 4


def test_order_settings_reach_the_scheduler_and_bad_ones_are_named():
    from sched_lifetime.nodes import _order_schedule

    g = MoEModel(CONFIGS["tiny"]).chunk().graph(True, True)
    assert _order_schedule(g, "ours:ep_budget=1")["budgets"]["ep"] == 1
    assert _order_schedule(g, "ours:classic,ep_budget=3,page_budget=1")["budgets"] == {"ep": 3, "page": 1}
    with pytest.raises(ValueError, match="ep_budget must be a positive integer, got 'x'"):
        _order_schedule(g, "ours:ep_budget=x")
    with pytest.raises(ValueError, match="unknown setting 'speed'"):
        _order_schedule(g, "ours:speed=2")
    with pytest.raises(ValueError, match="1..=1024"):
        _order_schedule(g, "ours:ep_budget=0")


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


#: A made-up shape beside the tiny config: odd sizes, 6 experts top-3, no shared expert, two
#: dense layers first, counted routing (no capacity).
ODD = replace(
    CONFIGS["tiny"], vocab=97, hidden=48, heads=3, layers=4, dense_layers=2, experts=6, topk=3,
    expert_ffn=40, shared_ffn=0, dense_ffn=72, seq=12, batch=3, capacity_factor=None,
)


@pytest.mark.parametrize("cfg", [replace(CONFIGS["tiny"], capacity_factor=1.0), ODD], ids=["tiny", "odd"])
@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_paired_ends_are_bit_exact_against_sequential(n, cfg):
    """Warm-up F(0) with F(1) and cool-down B(n-2) with B(n-1) multiplexed: losses, every
    gradient and the weights after 3 SGD steps equal sequential F then B."""
    ref, _ = _steps(cfg, n, "sequential", False)
    got, _ = _steps(cfg, n, "ours", True)
    assert len(ref) == len(got) and all(torch.equal(a, b) for a, b in zip(ref, got))


def test_paired_ends_hide_each_transfer_under_the_other_microbatch_and_keep_the_accumulation_order():
    cfg = replace(CONFIGS["tiny"], capacity_factor=1.0)
    ch = MoEModel(cfg, seed=0, device="cpu").chunk(torch.device("cpu"))
    for phase in ("F", "B"):
        s = two_schedule(ch, phase)
        graph = _two_graph(ch, phase)
        kinds = {n["name"]: (n["kind"], n["source"]) for n in graph["nodes"]}
        assert {src for _, src in kinds.values()} == {phase, phase + "2"}
        waits = {n["launch"]: n["name"] for n in graph["nodes"] if n["kind"] == "comm_wait"}
        order = s["order"]
        pos = {x: i for i, x in enumerate(order)}
        under = [any(kinds[x][0] == "compute" and kinds[x][1] != kinds[l][1] for x in order[pos[l] : pos[w]]) for l, w in waits.items()]
        assert len(under) == 8 and all(under), (phase, under)  # 2 MoE layers x 2 transfers x 2 microbatches
        if phase == "B":
            # Every node with weights: the second microbatch's gradient accumulation after the first's.
            acc = [n for n in ch.nodes if n.params]
            for n in acc:
                first = f"B.{n.name}.dw" if f"B.{n.name}.dw" in kinds else f"B.{n.name}"
                assert [first, "B2" + first[1:]] in graph["control"], first
                assert pos[first] < pos["B2" + first[1:]]


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
