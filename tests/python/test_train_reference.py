"""The independent reference (`sched_lifetime.train.reference`), one process: `compare`'s rule
(bit-exact, or within the stated tolerance), its negative controls, and the plain-autograd
`Reference` equal to every default arm over two SGD steps. The 2-rank version (EP over gloo,
the in-step all-reduce) is in test_train_dist.py."""

import math

import pytest
import torch

from sched_lifetime.train.reference import EXACT, Reference, Verdict, compare, same_order_expected, tolerance


def _bump(t: torch.Tensor, ulps: int = 1) -> torch.Tensor:
    out = t.clone()
    x = out.view(-1)[:1]
    for _ in range(ulps):
        x.copy_(torch.nextafter(x, torch.tensor(float("inf"), dtype=t.dtype)))
    return out


def test_compare_is_exact_or_within_the_stated_tolerance_and_says_where():
    want = {"a": torch.linspace(-2, 2, 33), "b": torch.ones(3, dtype=torch.bfloat16)}
    assert compare({k: v.clone() for k, v in want.items()}, want, exact=True) == EXACT
    one = {"a": _bump(want["a"]), "b": want["b"]}
    # Exact mode: one ulp of one element is a difference, named.
    v = compare(one, want, exact=True)
    assert not v and not v.exact and v.where == "a" and v.label() == "DIFFER"
    # Tolerance mode: one ulp passes (its deviation printed), 17 ulp of the largest magnitude do not.
    v = compare(one, want, exact=False)
    assert v and not v.exact and 0 < v.worst <= tolerance(torch.float32) and v.label() == f"{v.worst:.0e}"
    far = {"a": want["a"].clone(), "b": want["b"]}
    far["a"][7] += 17 * tolerance(torch.float32) / 16 * 2  # 17 ulp of the tensor's max (2)
    assert not compare(far, want, exact=False)
    # The tolerance is per dtype: bf16's ulp is coarser.
    assert compare({"a": want["a"], "b": _bump(want["b"], 3)}, want, exact=False)
    assert tolerance(torch.bfloat16) == 16 * 2**-7 and tolerance(torch.float32) == 16 * 2**-23


@pytest.mark.parametrize(
    "got",
    [
        {"a": torch.zeros(4)},  # a gradient missing
        {"a": torch.zeros(4), "b": torch.zeros(4), "c": torch.zeros(1)},  # one too many
        {"a": torch.zeros(4), "b": torch.zeros(2, 2)},  # another shape
        {"a": torch.zeros(4), "b": torch.zeros(4, dtype=torch.float64)},  # another dtype
        {"a": torch.zeros(4), "b": torch.tensor([0.0, float("nan"), 0.0, 0.0])},  # NaN on one side
    ],
)
def test_compare_refuses_what_cannot_be_equal_in_either_mode(got):
    want = {"a": torch.zeros(4), "b": torch.zeros(4)}
    for exact in (True, False):
        v = compare(got, want, exact=exact)
        assert not v.within and not v.exact and math.isinf(v.worst), v


def test_verdicts_merge_to_the_worst():
    a, b = Verdict(False, True, 1e-7, "x"), Verdict(False, False, 3.0, "y")
    assert a.merge(EXACT) == a and EXACT.merge(a) == a
    assert a.merge(b) == Verdict(False, False, 3.0, "y") == b.merge(a)


def test_same_order_expected_up_to_two_ranks():
    assert same_order_expected(1) and same_order_expected(2) and not same_order_expected(4)


def test_every_default_arm_equals_plain_autograd_over_two_steps_and_a_perturbation_fails():
    """One process (EP=1, no all-reduce): each default arm's losses, gradients after every
    step and final weights are bit-exact against `Reference`; then one ulp on one weight of
    one arm, or one more step on the reference, and the check fails."""
    from sched_lifetime import ep
    from sched_lifetime.models import CONFIGS
    from sched_lifetime.train.arms import ARMS, Arm

    cfg = CONFIGS["tiny"]
    arms = {a: Arm(a, cfg, ep.AllToAll(None), torch.device("cpu"), lr=0.1) for a in ARMS}
    ref = Reference(cfg, None, torch.device("cpu"), lr=0.1)
    assert ref.world == 1 and ref.exact
    for step in range(2):
        for arm in arms.values():
            arm.step(step, 3)
        ref.step(step, 3)
        for a, arm in arms.items():
            assert ref.check_grads(arm.model).exact, (a, step, ref.check_grads(arm.model))
    for a, arm in arms.items():
        assert ref.check_end(arm.model, arm.losses).exact, a
    ours = arms["ours"]
    with torch.no_grad():
        w = next(ours.model.parameters())
        w.copy_(_bump(w))
    assert not ref.check_end(ours.model, ours.losses)
    assert ref.check_end(arms["sequential"].model, arms["sequential"].losses).exact
    ref.step(2, 3)  # the reference a step ahead: grads, weights and the loss count differ
    assert not ref.check_grads(arms["sequential"].model) and not ref.check_end(arms["sequential"].model, arms["sequential"].losses)
