"""Which saved tensors are worth paging and can be (`is_weight`, `restorable`), and what a page-out keeps of one (`Paged`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def is_weight(t: torch.Tensor) -> bool:
    """A saved tensor that is a weight: a parameter, a leaf that takes a gradient, or a view of
    one (a matmul saves its weight). It stays on the device: paging it saves nothing."""
    base = t._base if t._base is not None else t
    return isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad)


def restorable(t: torch.Tensor) -> bool:
    """Whether a fresh tensor can take `t`'s exact strides: no two of its elements share memory
    (an expanded tensor's do). Only those are paged: the page-in rebuilds the strides, since a
    backward kernel given another layout may round differently."""
    if t.is_contiguous():
        return True
    covered = 0  # the furthest offset the dims seen so far reach, strides ascending
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1):
        if stride <= covered:
            return False
        covered += stride * (size - 1)
    return True


def _check_restorable(t: torch.Tensor) -> None:
    """A page-out's check: `t` can come back with its strides (`restorable`)."""
    if not restorable(t):
        raise ValueError(f"page_out: a tensor of shape {tuple(t.shape)} and strides {t.stride()} has elements sharing memory; keep it on the device")


@dataclass(frozen=True)
class Paged:
    """A tensor paged out: its host buffer and what it was (strides included)."""

    slot: int
    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    nbytes: int
    offset: int = 0  # byte offset in the buffer of its element [0, ..., 0] (a group's tensors share one)
    packed: bool = False  # in a group: held contiguous (a view with gaps), scattered back on the device
