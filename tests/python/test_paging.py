"""The pager on CPU (in CI; CPU tensors stand in, no stream is needed): Rust's choice from
the calibrated live prefix, bit-exact gradients with paging on vs off, bytes out == bytes in
every step, a changed step refused, and the planner's errors."""

from dataclasses import replace

import pytest
import torch

import sched_lifetime as sl
from sched_lifetime.models import CONFIGS, MoEModel


def grads(m: MoEModel) -> dict:
    return {k: p.grad.clone() for k, p in m.named_parameters()}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("budget", [0.5, 1.0, {"bytes": 1 << 14}])
def test_paging_on_vs_off_is_bit_exact_over_steps(budget, device):
    cfg = replace(CONFIGS["tiny"], capacity_factor=1.0)
    ref, paged = MoEModel(cfg, device=device), MoEModel(cfg, device=device)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.05)
    opt_p = torch.optim.SGD(paged.parameters(), lr=0.05)
    pager = sl.Pager(budget, min_distance=0, min_bytes=1024)
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
    assert pager.explain().startswith(f"paging {len(pager.plan['page'])} tensors")


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


def test_a_step_that_saves_different_tensors_is_refused():
    pager = sl.Pager(1.0, min_distance=0, min_bytes=1)
    w = torch.randn(8, 8, requires_grad=True)
    with pager.step():
        (torch.tanh(torch.randn(4, 8) @ w)).sum().backward()
    with pytest.raises(RuntimeError, match="saved tensor #"):
        with pager.step():
            (torch.tanh(torch.randn(5, 8) @ w)).sum().backward()
