"""Host buffers allocated once and handed out from a FIFO freelist per byte size (`HostSlots`).

The bookkeeping half of `HostPool`: which buffer is free, taken or given back, and the tensor
views of a buffer; no stream and no copy here. A buffer given back may still be read by the
page-in queued just before: the copies into and out of a buffer are kept in order by the pool
(`SlotOrder`, slot_order.py), not by the freelist (DESIGN.md §4).
"""

from __future__ import annotations

import collections
import math
from typing import Optional

import torch

from .groups import _dense
from .paged import Paged


class HostSlots:
    """Host buffers allocated once (pinned when they serve a GPU), handed out from a freelist per
    byte size, FIFO: a buffer given back is taken again after every buffer of its size given
    back before it. A step never allocates host memory: an empty freelist is an error (the pool
    was sized at calibration)."""

    def __init__(self, sizes: list[int], pin: bool = False) -> None:
        self._free: dict[int, collections.deque] = {}
        self._bufs: list[torch.Tensor] = []
        for n in sizes:
            if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
                raise ValueError(f"host pool sizes must be positive byte counts, got {n!r}")
            self._free.setdefault(n, collections.deque()).append(len(self._bufs))
            self._bufs.append(torch.empty(n, dtype=torch.uint8, device="cpu", pin_memory=pin))
        self.bytes = sum(sizes)
        self._taken: set[int] = set()
        #: How many times each buffer was taken: a handle names the take it came from.
        self._gen: list[int] = [0] * len(self._bufs)
        self._views: dict[tuple, torch.Tensor] = {}
        # A per-step figure (`HostPool.take_figures`): host bytes taken now, and at most at once.
        self._taken_bytes = 0
        self.peak_taken_bytes = 0

    def take(self, nbytes: int) -> int:
        """A free buffer of exactly `nbytes` (the one given back longest ago)."""
        free = self._free.get(nbytes)
        if free is None:
            raise RuntimeError(f"host pool has no buffer of {nbytes} bytes (sizes: {sorted(self._free)}); it is sized at calibration")
        if not free:
            raise RuntimeError(f"host pool exhausted: all {sum(1 for b in self._bufs if b.numel() == nbytes)} buffers of {nbytes} bytes are in use")
        slot = free.popleft()
        self._taken.add(slot)
        self._gen[slot] += 1
        self._taken_bytes += nbytes
        self.peak_taken_bytes = max(self.peak_taken_bytes, self._taken_bytes)
        return slot

    def check_handle(self, slot: int, gen: int, verb: str) -> None:
        """A handle (`Paged`) is current: its buffer is still taken by the page-out that made it
        (`gen`, -1: not checked), else reading it would return another tensor's bytes."""
        if slot not in self._taken or (gen >= 0 and gen != self._gen[slot]):
            again = " and taken by another page-out since" if slot in self._taken else ""
            raise RuntimeError(
                f"{verb}: a stale handle: host buffer {slot} was given back (this handle was paged in already){again}; "
                "page each handle in once"
            )

    def give(self, slot: int) -> None:
        """Back to the freelist; call it after queueing the copy that last reads the buffer."""
        if slot not in self._taken:
            raise RuntimeError(f"host buffer {slot} given back but not taken")
        self._taken.remove(slot)
        self._taken_bytes -= self._bufs[slot].numel()
        self._free[self._bufs[slot].numel()].append(slot)

    def view(self, slot: int, shape: tuple, dtype: torch.dtype, stride: Optional[tuple] = None, offset: int = 0) -> torch.Tensor:
        """Buffer `slot` seen as a tensor of `shape` and `dtype`, contiguous or with `stride`
        when that layout is dense (then a page copy is one block, with no gather kernel and no
        device temporary); made once per key: a step pages the same shapes every time."""
        key = (slot, tuple(shape), dtype, stride, offset)
        v = self._views.get(key)
        if v is None:
            if stride is not None and not _dense(shape, stride):
                stride = None
            flat = self._bufs[slot][offset : offset + math.prod(shape) * dtype.itemsize].view(dtype)
            v = self._views[key] = flat.view(shape) if stride is None else flat.as_strided(shape, stride)
        return v

    def view_of(self, p: Paged) -> torch.Tensor:
        """The host buffer `p` was paged into, seen as the tensor it holds (with the strides it was
        written with: `p.host_stride`, a pitched copy's, else `view`'s)."""
        return self.view(p.slot, p.shape, p.dtype, p.host_stride or p.stride, p.offset)

    def in_use(self) -> int:
        """Buffers taken and not given back."""
        return len(self._taken)

    def reclaim(self) -> None:
        """Give back every buffer still taken (a page-out never paged in, e.g. a step cut
        short). Safe without a sync: whatever copy comes next into it waits for the page-out
        that wrote it (`SlotOrder`; on the same stream, the stream's order)."""
        for slot in sorted(self._taken):
            self.give(slot)
