"""Microbatch state: what a forward keeps for its backward, and which microbatches run now.

`MicrobatchState` is one microbatch's: the node callables write it in the forward and read it
in the backward. `_Ctx` is a chunk's: the microbatches its callables work on during one
executor run (set by the run functions, cleared after).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch


@dataclass
class MicrobatchState:
    """What one microbatch's forward keeps for its backward: per node, the detached leaf
    inputs and the outputs of its autograd graph (compute), or the comm's context. Make one
    per microbatch (`index` names it in errors) and hand it to `Chunk.run` / `combined_step`;
    `train_step` makes its own. `loss` is set by the forward.

    Example:

        >>> import sched_lifetime as sl
        >>> st = sl.MicrobatchState(0)
        >>> st.index, st.saved, st.loss
        (0, {}, None)
    """

    index: int
    saved: dict[str, Any] = field(default_factory=dict)
    loss: Optional[torch.Tensor] = None
    #: Paging: per paged node, the saved activations waiting for their page-out (device
    #: tensors), then their host handles; and after the page-in, the reloaded tensors.
    paged: dict[str, list] = field(default_factory=dict)
    paged_in: dict[str, list] = field(default_factory=dict)
    #: Per paged node, the host pool's `mark()` when its page-in was queued.
    page_marks: dict[str, int] = field(default_factory=dict)
    #: Per paged node, the host pool's `mark()` right after its page-out was queued.
    page_out_end: dict[str, int] = field(default_factory=dict)
    #: Tied weights (a parameter in several nodes' params): per parameter id, this microbatch's
    #: gradient summed over those nodes so far and how many are still to add; it goes into
    #: `.grad` once, as autograd sums a parameter's uses before its AccumulateGrad adds them.
    tied_grads: dict[int, tuple] = field(default_factory=dict)
    #: The step's last backward: each node's data-parallel gradients are final after its
    #: weight gradients here, and their all-reduce starts then (`Chunk.enable_grad_reduce`).
    last: bool = False


class _Ctx:
    """The microbatches the multiplexed callables work on now."""

    def __init__(self) -> None:
        self.fwd: Optional[MicrobatchState] = None
        self.bwd: Optional[MicrobatchState] = None
        self.compute: Optional[torch.Stream] = None
