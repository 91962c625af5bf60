"""The pitched page copy: a tensor with gaps moved by the copy engine alone (`pitch_of`, `copy_pitched`).

A saved value is often a slice of a wider tensor: transformers' experts compute gate and up in
one grouped matmul and save its two halves, each rows of `n` elements `2n` apart. Torch's
`copy_` between such a tensor and host memory gathers it into a device temporary with a kernel
first (page-out; page-in: a temporary and a scatter kernel after the copy): SM time and device
memory beside the compute, on every page copy of it. Its bytes are rows of one dense block at a
constant pitch, which is what `cudaMemcpy2DAsync` moves: the copy engine reads the rows and
packs them on the host (and back), no kernel, no temporary.

The host side holds the tensor in its own dimension order with the gaps removed (`compact`:
what `HostSlots.view` gives a tensor with gaps), so the rows land back to back and the page-in
puts them back at the pitch, into a tensor with the paged-out one's strides. Layouts with more
than one level of gaps, or rows under `MIN_ROW_BYTES`, keep torch's copy.

The CUDA runtime's entry is found in the process (the library torch loaded); where it is not
found, every copy takes torch's path (same bytes, the kernels above): `available()` says which.
"""

from __future__ import annotations

import ctypes
import functools
import math
from typing import Any, Optional

import torch

from .groups import compact

#: Narrower rows keep torch's copy: a copy engine moving rows of a few bytes is slower than the
#: gather kernel.
MIN_ROW_BYTES = 512

_H2D, _D2H = 1, 2  # cudaMemcpyKind


@functools.lru_cache(maxsize=4096)
def pitch_of(shape: tuple, stride: tuple, itemsize: int) -> Optional[tuple]:
    """(row bytes, rows, pitch bytes) when a tensor of `shape` and `stride` is rows of one
    dense block at a constant pitch wider than the row (one level of gaps) and its rows are at
    least `MIN_ROW_BYTES`; None otherwise (dense, or another layout)."""
    dims = sorted((st, n) for st, n in zip(stride, shape) if n != 1)
    if not dims or math.prod(shape) == 0:
        return None
    row, i = 1, 0
    while i < len(dims) and dims[i][0] == row:
        row *= dims[i][1]
        i += 1
    if i == len(dims):
        return None  # dense
    pitch = dims[i][0]
    if pitch <= row:
        return None  # elements share memory: not a page-able layout
    rows = 1
    for st, n in dims[i:]:
        if st != pitch * rows:
            return None  # a second level of gaps
        rows *= n
    if row * itemsize < MIN_ROW_BYTES:
        return None
    return row * itemsize, rows, pitch * itemsize


_fn: Any = None
_looked = False


def _memcpy2d() -> Any:
    """`cudaMemcpy2DAsync` of the CUDA runtime this process loaded (torch's), or None."""
    global _fn, _looked
    if _looked:
        return _fn
    _looked = True
    if not torch.cuda.is_available():
        return None
    torch.cuda.init()
    paths = []
    try:  # the runtime torch loaded (a pip wheel's, by its path)
        with open("/proc/self/maps") as f:
            paths = sorted({w for w in (line.split()[-1] for line in f if "libcudart.so" in line) if w.startswith("/")})
    except OSError:
        pass
    for name in paths + ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]:
        try:
            lib = ctypes.CDLL(name)
            fn = lib.cudaMemcpy2DAsync
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t,
                       ctypes.c_int, ctypes.c_void_p]
        _fn = fn
        break
    return _fn


def available() -> bool:
    """Whether pitched copies run (CUDA, and the runtime's `cudaMemcpy2DAsync` found)."""
    return _memcpy2d() is not None


def plan(dst: torch.Tensor, src: torch.Tensor) -> Optional[tuple]:
    """The `cudaMemcpy2DAsync` arguments (all but the stream) that do `dst.copy_(src)` when one
    side is a CUDA tensor with one level of gaps (`pitch_of`) and the other a pinned host tensor
    of the same shape and dtype laid out as `compact` gives; None otherwise (torch's copy
    applies). Checks only: nothing is queued."""
    if dst.dtype != src.dtype or dst.shape != src.shape:
        return None
    if dst.is_cuda and not src.is_cuda:
        dev, host, kind = dst, src, _H2D
    elif src.is_cuda and not dst.is_cuda:
        dev, host, kind = src, dst, _D2H
    else:
        return None
    shape, stride = tuple(dev.shape), dev.stride()
    got = pitch_of(shape, stride, dev.element_size())
    if got is None or host.stride() != compact(shape, stride) or not host.is_pinned() or _memcpy2d() is None:
        return None
    row, rows, pitch = got
    if kind == _D2H:
        return (host.data_ptr(), row, dev.data_ptr(), pitch, row, rows, kind, dev.device.index)
    return (dev.data_ptr(), pitch, host.data_ptr(), row, row, rows, kind, dev.device.index)


def queue(args: tuple, stream: Any) -> None:
    """Queue `plan`'s copy on `stream` (a CUDA stream of the tensor's device)."""
    *call, device = args
    with torch.cuda.device(device):
        err = _memcpy2d()(*call, stream.cuda_stream)
    if err != 0:
        raise RuntimeError(f"cudaMemcpy2DAsync failed with CUDA error {err} (a pitched page copy: {call[4]}-byte rows x {call[5]})")
