"""Which saved tensors are worth paging and can be (`is_weight`, `restorable`), what a page-out keeps of one (`Paged`), and the version it had (`SavedVersion`)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .._ops import direct as _direct


def is_weight(t: torch.Tensor) -> bool:
    """A saved tensor that is a weight: a parameter, a leaf that takes a gradient, or a view of
    one (a matmul saves its weight). It stays on the device: paging it saves nothing."""
    base = t._base if t._base is not None else t
    return isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad)


def restorable(t: torch.Tensor) -> bool:
    """Whether a fresh tensor can take `t`'s exact strides: no two of its elements share memory
    (an expanded tensor's do). Only those are paged: the page-in rebuilds the strides, since a
    backward kernel given another layout may round differently. A sparse or nested tensor
    (not strided) is never one."""
    if t.layout != torch.strided or t.is_nested:
        return False
    if t.is_contiguous():
        return True
    covered = 0  # the furthest offset the dims seen so far reach, strides ascending
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1):
        if stride <= covered:
            return False
        covered += stride * (size - 1)
    return True


def plain(t: torch.Tensor) -> bool:
    """A tensor of torch's own (a `torch.Tensor` or a parameter), not a subclass whose data lives
    elsewhere (DTensor's local shard, a wrapper's inner tensor): the eager hooks page only
    those; a subclass is kept on the device as it is saved."""
    return type(t) is torch.Tensor or type(t) is torch.nn.Parameter


def pageable(t: torch.Tensor) -> bool:
    """What the eager hooks (the Pager, page nodes, calibration) may page: a plain tensor that
    can come back with its strides (`plain` and `restorable`)."""
    return plain(t) and restorable(t)


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
    packed: bool = False  # in a group: a view with gaps held contiguous, scattered back on the device
    gen: int = -1  # which take of the buffer it came from (`HostSlots.check_handle`; -1: not checked)
    host_stride: Optional[tuple] = None  # its strides in the buffer when not `HostSlots.view`'s (a pitched copy's `compact`)


class SavedVersion:
    """The version a saved tensor had when it was saved, and its version counter (a capsule from
    the library, `cpp/direct.cc`: the counter, not the storage, so a paged tensor's device memory
    still goes), to check at the backward that it was not changed in place. Paging saves a host
    copy or a hook's packed form instead of the tensor, where autograd's own check cannot see
    the tensor (`saved_tensors_hooks` turn it off; a host copy's counter never moves): every
    paging path makes the check here, with autograd's message. One rule for the eager `Pager`,
    page nodes and the compile paging pass. `held`: the caller keeps `t` itself (a saved tensor
    left on the device) until the check: its counter is read from it, with no library call."""

    __slots__ = ("probe", "ref", "held", "saved", "shape", "dtype")

    def __init__(self, t: torch.Tensor, held: bool = False) -> None:
        self.probe: Any = None if held else _direct.version_probe(t)
        self.ref: Optional[weakref.ref] = None
        self.held: Optional[torch.Tensor] = t if held else None
        if self.probe is NotImplemented:  # a tensor subclass: its Python object's counter
            self.probe, self.ref = None, weakref.ref(t)
        self.saved = t._version if held or self.probe is not None or self.ref is not None else 0
        self.shape, self.dtype = t.shape, t.dtype

    def now(self) -> Optional[int]:
        """The counter now (None: an inference tensor, or a subclass whose object is gone)."""
        if self.held is not None:
            return self.held._version
        if self.probe is not None:
            return _direct.version_of(self.probe)
        t = self.ref() if self.ref is not None else None
        return None if t is None else t._version

    def check(self, what: str) -> None:
        """Raise autograd's error if the tensor (`what`, for the message) changed since its save."""
        now = self.now()
        if now is not None and now != self.saved:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"{what} ({tuple(self.shape)} {self.dtype}) is at version {now}; expected version {self.saved} instead "
                "(autograd's check, kept under paging). Hint: clone the tensor before changing it in place."
            )
