"""An independent reference for the main job's parity: the embedded model trained by plain
PyTorch autograd, and the check that compares an arm with it.

`Reference` trains the same `MoEModel` (same seed, so the same initial weights on every rank,
the same tokens from `model.batch`) with nothing of the node API: the model's own `forward`,
one `loss.backward()` per microbatch with the loss scaled by 1/n, torch's autograd-aware
functional all-to-all (`FunctionalAllToAll`: torch's own transpose, not the nodes'), each
data-parallel gradient all-reduced and divided by the EP world one parameter at a time (not
`GradReduce`'s buckets), and `torch.optim.SGD`. No executor, no schedule, no `train_step`, no
shared step code: a bug in the arms' common path makes them differ from it, where comparing
arms with the `sequential` arm cannot see it.

`compare` decides what "equal" means, one rule for every parity suite (main job, GraphStep,
benches): bit-exact (`torch.equal`) when the floating-point sums are done in the same order,
else within `tolerance(dtype)`. Where the order is the same: every gradient of one microbatch
is the same sum in the node path as in one autograd backward (the same ops on the same shapes,
partial gradients accumulated in autograd's order: tests/python/test_nodes_run.py holds that
bit for bit; on a GPU the main job makes the kernels deterministic), microbatches accumulate in
the same order, and an all-reduce over two ranks adds the same two numbers whatever its
buckets; so bit-exact in any dtype (bf16 too, as CONVENTIONS.md asks). Where it is not: an
all-reduce over more than two ranks, whose reduction tree depends on the bucket layout (the
arms' flattened buckets against the reference's one tensor at a time); there the arm must be
within the tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist


def tolerance(dtype: torch.dtype) -> float:
    """How far (in units of each tensor's largest magnitude) an arm may be from the reference
    where the order of floating-point sums differs: 16 units in the last place of `dtype`.
    Reordering a sum of k terms moves it by at most (k - 1) ulp of its largest partial sum, and
    a step's few reordered sums (an all-reduce tree, a gradient's two or three partials) stay
    well inside 16; a real bug (a gradient summed instead of averaged, a missed zeroing, a
    dropped microbatch) moves a tensor by a large fraction of its magnitude."""
    return 16 * torch.finfo(dtype).eps


@dataclass
class Verdict:
    """How a set of tensors compares with the reference's."""

    #: Every tensor `torch.equal` to the reference's (names and shapes alike).
    exact: bool
    #: Every tensor within `tolerance` (exact implies it).
    within: bool
    #: The largest deviation, in units of the reference tensor's largest magnitude.
    worst: float
    #: Where it was (a tensor's name), or why nothing compares (names or shapes differ).
    where: str

    def __bool__(self) -> bool:
        return self.within

    def merge(self, other: "Verdict") -> "Verdict":
        """Both sets together."""
        worst, where = (self.worst, self.where) if self.worst >= other.worst else (other.worst, other.where)
        return Verdict(self.exact and other.exact, self.within and other.within, worst, where)

    def label(self) -> str:
        """What the table prints: `exact`, the deviation within tolerance, or DIFFER."""
        if self.exact:
            return "exact"
        return f"{self.worst:.0e}" if self.within else "DIFFER"


EXACT = Verdict(True, True, 0.0, "")


def compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], exact: bool, tol: Optional[float] = None) -> Verdict:
    """`got` against `want`, tensor by tensor (the same names, shapes and dtypes required).
    `exact`: the sums are in the same order, so anything but `torch.equal` is a difference.
    Otherwise each tensor may deviate by `tol` (default `tolerance(dtype)`) times its reference's
    largest magnitude (norm-wise, so cancellation in one element does not count as error)."""
    if set(got) != set(want):
        return Verdict(False, False, float("inf"), f"names differ: {sorted(set(got) ^ set(want))[:4]}")
    verdict = EXACT
    for k in sorted(want):
        a, b = got[k], want[k]
        if a.shape != b.shape or a.dtype != b.dtype:
            return Verdict(False, False, float("inf"), f"{k}: {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}")
        if torch.equal(a, b):
            continue
        a64, b64 = a.detach().double(), b.detach().double()
        scale = b64.abs().max().item() if b64.numel() else 0.0
        diff = (a64 - b64).abs().max().item() if b64.numel() else 0.0
        worst = diff / scale if scale > 0 else float("inf")
        if worst != worst:  # NaN on one side only
            worst = float("inf")
        t = tolerance(b.dtype) if tol is None else tol
        verdict = verdict.merge(Verdict(False, not exact and worst <= t, worst, k))
    return verdict


def same_order_expected(world: int) -> bool:
    """Whether the arms and the reference sum in the same order (see the module doc): an
    all-reduce over at most two ranks."""
    return world <= 2


class Reference:
    """The main job's model trained by plain autograd over the same steps as the arms.

    `step(step, microbatches)`: zero the gradients, for each microbatch `loss = model(batch)`
    and `(loss / n).backward()`, then (EP world > 1) every dense parameter's gradient summed over
    the EP group and divided by its size, as the arms' data-parallel reduce does (the experts
    are sharded, not replicated: their gradients are not reduced), then one SGD step.

    What it mirrors, on purpose, is the arms' objective, which is not quite the mean loss over
    ranks: the dense gradients are averaged (the gradient of the mean of the ranks' losses),
    while each expert's gradient is the sum of every rank's loss's gradient (its tokens come
    back through the all-to-all), i.e. world times the gradient of that mean. Megatron-LM scales
    expert gradients to match; here a change of that convention changes the arms and this
    reference together."""

    def __init__(self, cfg: Any, group: Any, device: torch.device, lr: float) -> None:
        from ..ep import AllToAll, FunctionalAllToAll
        from ..models import MoEModel

        on = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size(group) if on else 1
        self.group = group
        transport = FunctionalAllToAll(group) if self.world > 1 else AllToAll(local=True)
        self.model = MoEModel(cfg, transport, seed=0, device=device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=lr)
        self.dense = [p for n, p in self.model.named_parameters() if ".experts." not in n]
        self.losses: list[torch.Tensor] = []
        self.exact = same_order_expected(self.world)

    def step(self, step: int, microbatches: int) -> None:
        """One optimizer step over `microbatches` microbatches (see the class doc)."""
        m = self.model
        self.opt.zero_grad(set_to_none=True)
        losses = []
        for i in range(microbatches):
            loss = m(**m.batch(step, i))
            (loss / microbatches).backward()
            losses.append(loss.detach())
        if self.world > 1:
            for p in self.dense:
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=self.group)
                    p.grad.div_(self.world)
        self.opt.step()
        self.losses.append(torch.stack([x.float() for x in losses]).cpu())

    def grads(self) -> dict[str, torch.Tensor]:
        return _grads(self.model)

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: p.detach() for k, p in self.model.named_parameters()}

    def check_grads(self, model: torch.nn.Module) -> Verdict:
        """`model`'s gradients now against the reference's (after the same step)."""
        return compare(_grads(model), self.grads(), self.exact)

    def check_end(self, model: torch.nn.Module, losses: list[torch.Tensor]) -> Verdict:
        """`model`'s weights and every step's losses against the reference's."""
        got = {k: p.detach() for k, p in model.named_parameters()}
        v = compare(got, self.weights(), self.exact)
        if len(losses) != len(self.losses):
            return Verdict(False, False, float("inf"), f"{len(losses)} steps of losses against the reference's {len(self.losses)}")
        return v.merge(compare({f"loss[{i}]": x for i, x in enumerate(losses)}, {f"loss[{i}]": x for i, x in enumerate(self.losses)}, self.exact))


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.grad for k, p in model.named_parameters() if p.grad is not None}


def all_ranks(verdicts: dict[str, Verdict], group: Any = None, device: Optional[torch.device] = None) -> dict[str, Verdict]:
    """Each verdict as the worst over every rank (a difference on one rank fails all): exact and
    within are AND-ed, the worst deviation is the maximum."""
    if not (dist.is_available() and dist.is_initialized()):
        return verdicts
    names = list(verdicts)
    flags = torch.tensor([[int(verdicts[a].exact), int(verdicts[a].within)] for a in names], dtype=torch.int64, device=device)
    worst = torch.tensor([min(verdicts[a].worst, 1e300) for a in names], dtype=torch.float64, device=device)
    if names:
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
    out = {}
    for i, a in enumerate(names):
        w = worst[i].item()
        where = verdicts[a].where if w == min(verdicts[a].worst, 1e300) else "on another rank"
        out[a] = Verdict(bool(flags[i, 0]), bool(flags[i, 1]), float("inf") if w >= 1e300 else w, where)
    return out


def steps_equal(got: Iterable[torch.Tensor], want: Iterable[torch.Tensor]) -> bool:
    """Every tensor of `got` `torch.equal` to `want`'s, and as many (a bench's per-step check)."""
    got, want = list(got), list(want)
    return len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
