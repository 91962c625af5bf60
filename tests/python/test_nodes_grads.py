"""Gradients of a chunk's nodes (`nodes/grads.py`): the dI/dW split gives one full backward's
gradients bit for bit, and every weight of the embedded model splits at an intermediate."""

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
