"""How a node's saved tensors share one host buffer: views of one storage packed once (`group_plan`).

A node often saves several views of one storage (the same tensor twice; q, k and v of one
projection). `group_plan` lays them out so each storage moves once and the page-in rebuilds
them as views of one block; the layout helpers (`_dense`, `_contiguous`, `compact`, `extent`) say how
a tensor's bytes sit in its storage.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import torch


def _dense(shape: tuple, stride: tuple) -> bool:
    """Whether a tensor of `shape` and `stride` covers its span exactly (a permutation of a
    contiguous layout): its bytes copy as one block into a host buffer of the same strides."""
    expected = 1
    for st, sz in sorted((st, sz) for st, sz in zip(stride, shape) if sz != 1):
        if st != expected:
            return False
        expected *= sz
    return True


#: Byte alignment of each segment of a group in its buffer (the device allocator's block
#: alignment: a tensor reloaded from the group's one device block is as aligned as one
#: allocated alone).
GROUP_ALIGN = 512


def _contiguous(shape: tuple) -> tuple:
    """The strides of a contiguous tensor of `shape`."""
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))


@functools.lru_cache(maxsize=4096)
def compact(shape: tuple, stride: tuple) -> tuple:
    """Dense strides for `shape` in the dimension order of `stride` (innermost = smallest
    stride; ties and size-1 dimensions in their place from the right): the layout a tensor with
    gaps has on the host when a pitched copy moves it (`pitched.py`), its gaps removed."""
    order = sorted(range(len(shape)), key=lambda d: (stride[d], -d))
    out = [0] * len(shape)
    step = 1
    for d in order:
        out[d] = step
        step *= max(shape[d], 1)
    return tuple(out)


def extent(shape: tuple, stride: tuple, itemsize: int) -> int:
    """Bytes from the first element of a tensor of `shape` and `stride` to just past its last
    (0 when empty)."""
    if 0 in shape:
        return 0
    return (1 + sum((n - 1) * st for n, st in zip(shape, stride))) * itemsize


def _extent(t: torch.Tensor) -> int:
    """Bytes from `t`'s first element to just past its last (0 when empty)."""
    return extent(tuple(t.shape), t.stride(), t.element_size())


@dataclass(frozen=True)
class GroupPlan:
    """How a node's saved tensors share one host buffer (`group_plan`)."""

    #: (kind, tensor index, device byte start, bytes, buffer offset): kind "span" copies the bytes
    #: [start, start + bytes) of that tensor's storage, "view" copies the tensor itself.
    segments: list
    #: Per tensor: (buffer offset of its element [0, ..., 0], packed).
    places: list
    #: The buffer's size.
    nbytes: int


def group_plan(ts: Sequence[torch.Tensor]) -> GroupPlan:
    """Lay a node's saved tensors out in one buffer by storage: the bytes a storage's saved views
    span are copied once when they hold no more than the distinct views do (the same tensor
    saved twice, or q, k and v of one projection, move once, and the page-in rebuilds them as
    views of one storage: they alias as before, strides and all); otherwise each distinct view
    on its own (one with gaps packed contiguous). Segments are `GROUP_ALIGN`-aligned. Depends
    only on the tensors' storages, offsets, shapes, strides and dtypes: the same every step of
    a fixed-shape model, so calibration sizes the pool with it."""
    by_storage: dict[int, list[int]] = {}
    for i, t in enumerate(ts):
        by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(i)
    segments: list = []
    places: list = [None] * len(ts)
    end = 0

    def segment(kind: str, i: int, start: int, n: int) -> int:
        nonlocal end
        off = end
        segments.append((kind, i, start, n, off))
        end += -(-n // GROUP_ALIGN) * GROUP_ALIGN
        return off

    start = [t.storage_offset() * t.element_size() for t in ts]  # byte offset in its storage
    for idx in by_storage.values():
        # The distinct views (the same one saved twice is one), each by its first tensor.
        key = {i: (start[i], tuple(ts[i].shape), ts[i].stride(), ts[i].dtype) for i in idx}
        distinct: dict[tuple, int] = {}
        for i in idx:
            distinct.setdefault(key[i], i)
        first = list(distinct.values())
        lo = min(start[i] for i in first) // 16 * 16  # every dtype's alignment
        hi = max(start[i] + _extent(ts[i]) for i in first)
        if hi - lo <= sum(ts[i].numel() * ts[i].element_size() for i in first) + 16:
            off = segment("span", idx[0], lo, hi - lo)
            for i in idx:
                places[i] = (off + start[i] - lo, False)
        else:
            place = {}
            for k, i in distinct.items():
                t = ts[i]
                place[k] = (segment("view", i, 0, t.numel() * t.element_size()), not _dense(tuple(t.shape), t.stride()))
            for i in idx:
                places[i] = place[key[i]]
    return GroupPlan(segments, places, end)
