"""Gradients of a chunk's nodes (`nodes/grads.py`): the dI/dW split gives one full backward's
gradients bit for bit, and every weight of the embedded model splits at an intermediate."""

import pytest
import torch

from sched_lifetime.models import CONFIGS, MoEModel
from sched_lifetime.nodes import MicrobatchState, _WeightSplit


def test_weight_split_matches_one_backward_and_covers_weights_off_the_input_graph():
    """dI then dW from the kept intermediate gradients gives the gradients of one full
    backward, bit for bit, also for a weight whose graph never meets the input's (w2)."""
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


@pytest.mark.parametrize("dw_nodes", [True, False], ids=["dI-then-dW", "fused"])
def test_a_gradient_passed_on_is_not_taken_as_a_parameters_grad(dw_nodes):
    """`x + p` hands `p` the very gradient it hands `x`, which the previous node then receives:
    taken as it is, `p.grad` and the previous node's parameter's `.grad` were one tensor (each
    later microbatch added twice: a silent wrong gradient, found in review). As autograd's
    AccumulateGrad, a gradient something else refers to (here the first `.grad` that took it:
    its use count) or that the node passes on (`keep`) is copied into `.grad`; the step is
    bit-exact with eager, with the dI/dW split and fused."""
    from sched_lifetime.nodes import Chunk, NodeDef, train_step

    torch.manual_seed(0)
    p1, p2 = torch.nn.Parameter(torch.randn(2, 4)), torch.nn.Parameter(torch.randn(2, 4))
    c = torch.randn(2, 4)
    nodes = [
        NodeDef("a", "compute", ["x"], ["h"], lambda x: x + p1, [p1], grad_outputs=["h"]),
        NodeDef("b", "compute", ["h"], ["y"], lambda h: h + p2, [p2], grad_inputs=["h"], grad_outputs=["y"]),
        NodeDef("l", "compute", ["y"], ["loss"], lambda y: (y * c).sum(), [], grad_inputs=["y"], grad_outputs=["loss"]),
    ]
    chunk = Chunk(nodes, ["x"], "loss", torch.device("cpu"), dw_nodes=dw_nodes)
    mbs = [{"x": torch.randn(2, 4)} for _ in range(3)]
    train_step(chunk, mbs, "sequential")
    assert p1.grad.data_ptr() != p2.grad.data_ptr()
    got = [p1.grad.clone(), p2.grad.clone()]
    p1.grad = p2.grad = None
    for mb in mbs:
        (((mb["x"] + p1 + p2) * c).sum() / len(mbs)).backward()
    assert torch.equal(got[0], p1.grad) and torch.equal(got[1], p2.grad)


def _eager_and_nodes(nodes_of, eager_loss, mbs, dw_nodes=True, order="ours"):
    """(node-path gradients, eager gradients) of one step over `mbs`, fresh weights for each."""
    from sched_lifetime.nodes import Chunk, train_step

    out = []
    for node_path in (True, False):
        torch.manual_seed(0)
        nodes, params = nodes_of()
        if node_path:
            train_step(Chunk(nodes, ["x"], "loss", torch.device("cpu"), dw_nodes=dw_nodes), mbs, order)
        else:
            for mb in mbs:
                (eager_loss(mb["x"]) / len(mbs)).backward()
        out.append([None if p.grad is None else p.grad.clone() for p in params])
    return out


@pytest.mark.parametrize("dw_nodes", [True, False], ids=["dI-then-dW", "fused"])
def test_a_value_read_by_three_nodes_sums_its_gradient_as_autograd_does(dw_nodes):
    """A value with three consumer nodes: its partial gradients are added last consumer first,
    the order in which autograd's backward reaches them (table order differed in the last bits,
    a new user's trial)."""
    from sched_lifetime.nodes import NodeDef

    lins = {}

    def nodes_of():
        lins.update({k: torch.nn.Linear(8, 8) for k in ("l0", "a", "b", "c")})
        l0, a, b, c = (lins[k] for k in ("l0", "a", "b", "c"))
        nodes = [
            NodeDef("l0", "compute", ["x"], ["h"], l0, list(l0.parameters()), grad_outputs=["h"]),
            NodeDef("a", "compute", ["h"], ["u"], lambda h: torch.tanh(a(h)), list(a.parameters()), grad_inputs=["h"], grad_outputs=["u"]),
            NodeDef("b", "compute", ["h", "u"], ["v"], lambda h, u: torch.tanh(b(h)) * u, list(b.parameters()), grad_inputs=["h", "u"], grad_outputs=["v"]),
            NodeDef("c", "compute", ["h", "v"], ["loss"], lambda h, v: (c(h) * v).square().mean(), list(c.parameters()), grad_inputs=["h", "v"], grad_outputs=["loss"]),
        ]
        return nodes, [p for k in ("l0", "a", "b", "c") for p in lins[k].parameters()]

    def eager(x):
        h = lins["l0"](x)
        u = torch.tanh(lins["a"](h))
        v = torch.tanh(lins["b"](h)) * u
        return (lins["c"](h) * v).square().mean()

    mbs = [{"x": torch.randn(5, 8, generator=torch.Generator().manual_seed(i))} for i in range(3)]
    got, want = _eager_and_nodes(nodes_of, eager, mbs, dw_nodes)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_a_node_that_reads_a_value_twice_before_another_node_reads_it_warns():
    """Autograd adds each use of a value; the node path adds a node's uses first (inside its own
    backward), then the nodes: the same only when every reader but the last reads it once. The
    first forward says so, naming the node, the value and the fix."""
    from sched_lifetime.nodes import Chunk, NodeDef, train_step

    torch.manual_seed(0)
    l0, l1, l2 = (torch.nn.Linear(8, 8) for _ in range(3))
    nodes = [
        NodeDef("l0", "compute", ["x"], ["h"], l0, list(l0.parameters()), grad_outputs=["h"]),
        NodeDef("a", "compute", ["h"], ["u"], lambda h: l1(h) * torch.sigmoid(h), list(l1.parameters()), grad_inputs=["h"], grad_outputs=["u"]),
        NodeDef("b", "compute", ["h", "u"], ["loss"], lambda h, u: (l2(u) + h).square().mean(), list(l2.parameters()), grad_inputs=["h", "u"], grad_outputs=["loss"]),
    ]
    with pytest.warns(UserWarning, match="node 'a' reads 'h' 2 times and node 'b' reads it after: .*read 'h' once in 'a' or put its uses in one node"):
        train_step(Chunk(nodes, ["x"], "loss", torch.device("cpu")), [{"x": torch.randn(4, 8)}], "sequential")


@pytest.mark.parametrize("dw_nodes", [True, False], ids=["dI-then-dW", "fused"])
def test_tied_weights_frozen_weights_and_a_loss_beside_other_outputs_are_as_autograd_has_them(dw_nodes):
    """A parameter in two nodes' params (tied weights) gets each microbatch's two uses added
    before they go into `.grad`, as autograd does (added one node at a time, 2+ microbatches
    differed in the last bits); a frozen parameter in `params` gets no gradient (autograd.grad
    raised); the loss may be one of its node's outputs (it had to be the only one). A parameter
    listed twice in one node counts once (it took two gradients and used up the tied count:
    found in review)."""
    from sched_lifetime.nodes import NodeDef

    mods = {}

    def nodes_of():
        mods.update(emb=torch.nn.Linear(8, 8), mid=torch.nn.Linear(8, 8), frozen=torch.nn.Linear(8, 8))
        emb, mid, frozen = mods["emb"], mods["mid"], mods["frozen"]
        frozen.weight.requires_grad_(False)
        nodes = [
            NodeDef("in", "compute", ["x"], ["h"], lambda x: emb(x), list(emb.parameters()), grad_outputs=["h"]),
            NodeDef("mid", "compute", ["h"], ["u"], lambda h: torch.tanh(frozen(mid(h))), [*mid.parameters(), *frozen.parameters()], grad_inputs=["h"], grad_outputs=["u"]),
            NodeDef("out", "compute", ["u"], ["logits", "loss"],
                    lambda u: (lo := u @ emb.weight, lo.square().mean()), [emb.weight, emb.weight], grad_inputs=["u"], grad_outputs=["loss"]),
        ]
        return nodes, [*emb.parameters(), *mid.parameters(), *frozen.parameters()]

    def eager(x):
        return (torch.tanh(mods["frozen"](mods["mid"](mods["emb"](x)))) @ mods["emb"].weight).square().mean()

    mbs = [{"x": torch.randn(5, 8, generator=torch.Generator().manual_seed(i))} for i in range(3)]
    got, want = _eager_and_nodes(nodes_of, eager, mbs, dw_nodes)
    assert got[4] is None and want[4] is None  # the frozen weight
    assert all((g is None and w is None) or torch.equal(g, w) for g, w in zip(got, want))


def test_a_parameter_missing_from_params_and_a_non_scalar_loss_are_errors_naming_the_node():
    from sched_lifetime.nodes import Chunk, NodeDef, train_step

    lin = torch.nn.Linear(8, 8)
    unlisted = [NodeDef("a", "compute", ["x"], ["loss"], lambda x: lin(x).sum(), [lin.weight], grad_outputs=["loss"])]
    with pytest.raises(ValueError, match=r"node 'a': its function used a tensor that requires grad \(\(8,\) torch.float32, a Parameter\) that is not in its params"):
        train_step(Chunk(unlisted, ["x"], "loss", torch.device("cpu")), [{"x": torch.randn(2, 8)}], "sequential")
    # A leaf made inside the function (a helper's tensor that requires grad) is no parameter: it runs.
    scratch = [NodeDef("a", "compute", ["x"], ["loss"], lambda x: (lin(x) * torch.ones(8, requires_grad=True)).sum(), list(lin.parameters()), grad_outputs=["loss"])]
    train_step(Chunk(scratch, ["x"], "loss", torch.device("cpu")), [{"x": torch.randn(2, 8)}], "sequential")
    vector = [NodeDef("a", "compute", ["x"], ["loss"], lambda x: lin(x).sum(1), list(lin.parameters()), grad_outputs=["loss"])]
    with pytest.raises(ValueError, match=r"the loss output 'loss' of microbatch 0 is a \(2,\) tensor: the loss must be a scalar tensor"):
        train_step(Chunk(vector, ["x"], "loss", torch.device("cpu")), [{"x": torch.randn(2, 8)}], "sequential")
