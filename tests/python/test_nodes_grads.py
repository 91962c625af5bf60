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
