"""Expert-parallel transport (wiring only: which stream runs it is the schedule's decision).

`Transport` is the small interface the node API calls for dispatch and combine: one
all-to-all of a token buffer with split sizes. `AllToAll` (the default) is
`torch.distributed.all_to_all_single` in an EP process group (NCCL with high-priority streams
on GPU, gloo on CPU). A HybridEP/DeepEP buffer can be handed in instead by implementing
`all_to_all` with the same meaning; it runs on the caller's current stream, which the
executor sets to the EP stream. `HostLinkAllToAll` (in `ep_link.py`) is the emulated EP link:
one process on one GPU standing for rank 0 of an EP group of `k` ranks, all experts local, the
rows that would cross the network moved device -> pinned host -> device (bit-exact with the
local `AllToAll()`; full duplex by default: chunk i comes back while chunk i+1 goes out), so EP
overlap can be measured on one GPU; traced (torch.compile, GraphStep) it is a launch/wait op
pair, as `FunctionalAllToAll` is.

The output buffer is allocated on the stream that will consume it (the compute stream the
caller passes), before the side stream starts writing it: the value is then the compute
stream's own (graph outputs marked `"alloc": "consumer"`), so autograd may keep it for the
backward pass with no cross-stream lifetime hazard.

`check_rank_identical` all-gathers a digest of what decides the collective order (graph,
budgets, config) before the first step: ranks that differ raise on every rank, naming them,
instead of hanging in NCCL.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Optional, Protocol, Sequence

import torch
import torch.distributed as dist

from .ep_link import HostLinkAllToAll, LinkBytes, consumer_output

__all__ = ["AllToAll", "FunctionalAllToAll", "HostLinkAllToAll", "LinkBytes", "Transport", "check_rank_identical", "digest", "new_ep_group"]


class Transport(Protocol):
    """Moves tokens between EP ranks."""

    world: int
    rank: int

    def all_to_all(
        self,
        x: torch.Tensor,
        out_rows: int,
        out_splits: Optional[Sequence[int]],
        in_splits: Optional[Sequence[int]],
        alloc_stream: Optional[torch.Stream],
    ) -> torch.Tensor:
        """Send rows of `x` (split `in_splits` per rank, equal splits when None) and return
        the `out_rows` received (split `out_splits`), allocated on `alloc_stream`."""
        ...

    def exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """All-to-all of per-destination count vectors (the eager mode's split learning)."""
        ...


def new_ep_group(ranks: Optional[Sequence[int]] = None) -> Any:
    """The EP process group: NCCL with high-priority streams when the default backend is
    NCCL, the default backend otherwise (gloo on CPU)."""
    backend = dist.get_backend()
    ranks = list(range(dist.get_world_size())) if ranks is None else list(ranks)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = True
        return dist.new_group(ranks, backend="nccl", pg_options=opts)
    return dist.new_group(ranks, backend=backend)


class AllToAll:
    """`torch.distributed.all_to_all_single` over an EP group (or one rank, no group).
    `local=True`: EP of one rank (a copy) even when torch.distributed is initialized for
    something else (pipeline stages on other ranks)."""

    def __init__(self, group: Any = None, local: bool = False) -> None:
        if local and group is not None:
            raise ValueError("AllToAll(local=True) takes no group")
        self.group = group
        on = not local and dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size(group) if on else 1
        self.rank = dist.get_rank(group) if on else 0

    def all_to_all(
        self,
        x: torch.Tensor,
        out_rows: int,
        out_splits: Optional[Sequence[int]],
        in_splits: Optional[Sequence[int]],
        alloc_stream: Optional[torch.Stream] = None,
    ) -> torch.Tensor:
        out = consumer_output(x, out_rows, alloc_stream)
        if self.world == 1:
            out.copy_(x)
            return out
        dist.all_to_all_single(
            out,
            x.contiguous(),
            output_split_sizes=None if out_splits is None else list(out_splits),
            input_split_sizes=None if in_splits is None else list(in_splits),
            group=self.group,
        )
        return out

    def exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return counts.clone()
        out = torch.empty_like(counts)
        dist.all_to_all_single(out, counts.contiguous(), group=self.group)
        return out


class FunctionalAllToAll:
    """The same transport through `torch.distributed._functional_collectives` (autograd-aware
    `all_to_all_single` + `wait_tensor`): what torch.compile traces, so the compile backend
    sees each dispatch/combine as a launch and its wait. Eager use waits at once."""

    def __init__(self, group: Any = None) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)

    def all_to_all(
        self,
        x: torch.Tensor,
        out_rows: int,
        out_splits: Optional[Sequence[int]],
        in_splits: Optional[Sequence[int]],
        alloc_stream: Optional[torch.Stream] = None,
    ) -> torch.Tensor:
        import torch.distributed._functional_collectives as funcol

        out = funcol.all_to_all_single_autograd(
            x.contiguous(), None if out_splits is None else list(out_splits), None if in_splits is None else list(in_splits), self.group
        )
        return funcol.wait_tensor(out)

    def exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        import torch.distributed._functional_collectives as funcol

        return funcol.wait_tensor(funcol.all_to_all_single(counts.contiguous(), None, None, self.group))


def digest(*parts: Any) -> str:
    """A stable digest of JSON-able parts (graph tables, budgets, configs)."""
    h = hashlib.sha256()
    for p in parts:
        h.update(json.dumps(p, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def check_rank_identical(what: str, value: str, group: Any = None) -> None:
    """Raise on every rank when the ranks of `group` disagree on `value` (a digest),
    naming the ranks that differ from rank 0."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    world = dist.get_world_size(group)
    got: list = [None] * world
    dist.all_gather_object(got, value, group=group)
    differ = [r for r, v in enumerate(got) if v != got[0]]
    if differ:
        raise RuntimeError(
            f"{what} differs across EP ranks: ranks {differ} disagree with rank 0 "
            f"({got[0]} vs {[got[r] for r in differ]}); collectives would be issued in a different "
            "order (NCCL would hang), so no step is run"
        )


#: Modes of the cross-rank agreement check of a step (`agree_across_ranks`): "new_plan" (the
#: default: when this rank's facts change, the first step included), "every_step", "off".
RANK_CHECKS = ("new_plan", "every_step", "off")


def check_rank_agreement(what: str, facts: dict, group: Any = None) -> None:
    """Raise on every rank of `group`, with the same message, when its ranks disagree on
    `facts` (small JSON-able values: counts, digests), naming each fact that differs and every
    rank's value. One collective (`all_gather_object`); nothing without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    got: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(got, facts, group=group)
    keys = sorted({k for g in got for k in g})
    differ = {k: [g.get(k) for g in got] for k in keys if len({json.dumps(g.get(k), sort_keys=True, default=str) for g in got}) > 1}
    if differ:
        raise RuntimeError(
            f"{what}: the ranks disagree on "
            + "; ".join(f"{k} (by rank: {v})" for k, v in differ.items())
            + ". Their collectives would not match (a hang, or an abort inside the backend), so no step is run: "
            "give every rank the same microbatch count, model and paging settings"
        )


def agree_across_ranks(owner: Any, what: str, facts: dict) -> None:
    """A step's cross-rank check of the facts that decide its collectives (`facts`: microbatch
    count, schedule digest, paging plan digest, ...), per `owner.rank_check` (`RANK_CHECKS`)
    over `owner.rank_group` (None: the default group): "new_plan" checks when this rank's facts
    differ from those it last agreed on (the first step, and after any change); a rank whose
    facts change while its peers' do not meets their step's collectives instead, so when the
    microbatch count can change on one rank alone (an uneven last batch), use "every_step" (one
    small collective and a host sync a step). Skipped during CUDA graph capture (a captured
    step replays what an eager step agreed on)."""
    mode = owner.rank_check
    if mode not in RANK_CHECKS:
        raise ValueError(f"rank_check must be one of {RANK_CHECKS}, got {mode!r}")
    if mode == "off" or not (dist.is_available() and dist.is_initialized()):
        return
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return
    key = digest(facts)
    if mode == "new_plan" and owner._rank_agreed == key:
        return
    owner._rank_agreed = None
    check_rank_agreement(what, facts, owner.rank_group)
    owner._rank_agreed = key


def schedule_digest(ex: Any) -> str:
    """A digest of what an executor issues, in order (node, kind, stream role), made once."""
    d = getattr(ex, "_rank_digest", None)
    if d is None:
        d = ex._rank_digest = digest([[n, ex._nodes[n].get("kind"), ex._role.get(n)] for n in ex._order])
    return d
