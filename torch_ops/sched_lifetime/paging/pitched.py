"""The pitched page copy: a tensor with gaps moved by the copy engine alone (`pitch_of`, `copy_pitched`).

A saved value is often a slice of a wider tensor: transformers' experts compute gate and up in
one grouped matmul and save its two halves, each rows of `n` elements `2n` apart. Torch's
`copy_` between such a tensor and host memory gathers it into a device temporary with a kernel
first (page-out; page-in: a temporary and a scatter kernel after the copy): SM time and device
memory beside the compute, on every page copy of it. Its bytes are rows of one dense block at a
constant pitch, which is what `cudaMemcpy2DAsync` moves: the copy engine reads the rows and
packs them on the host (and back), no kernel, no temporary.

The host side holds such a tensor in its own dimension order with the gaps removed (`compact`,
the page-out's `Paged.host_stride`), so the rows land back to back and the page-in puts them back
at the pitch, into a tensor with the paged-out one's strides. Layouts with more than one level
of gaps, rows under `MIN_ROW_BYTES`, a pitch over `MAX_PITCH` or a conjugate/negative view keep
torch's copy and a contiguous host layout (`usable` decides at the page-out).

The CUDA runtime's entry is found in the process (the library torch loaded); where it is not
found, every copy takes torch's path (same bytes, the kernels above): `available()` says which.
A copy the runtime refuses is made by torch instead (`queue` answers False).
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import re
import warnings
from typing import Any, Optional

import torch

from .groups import compact

#: Narrower rows keep torch's copy: a copy engine moving rows of a few bytes is slower than the
#: gather kernel (a guess: only 2048-byte rows were measured).
MIN_ROW_BYTES = 512
#: The widest pitch a 2D copy takes (the devices' `memPitch`, 2^31 - 1 bytes).
MAX_PITCH = (1 << 31) - 1

_H2D, _D2H = 1, 2  # cudaMemcpyKind


@functools.lru_cache(maxsize=4096)
def pitch_of(shape: tuple, stride: tuple, itemsize: int) -> Optional[tuple]:
    """(row bytes, rows, pitch bytes) when a tensor of `shape` and `stride` is rows of one
    dense block at a constant pitch wider than the row (one level of gaps), its rows at least
    `MIN_ROW_BYTES` and its pitch at most `MAX_PITCH`; None otherwise (dense, or another
    layout)."""
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
    if row * itemsize < MIN_ROW_BYTES or pitch * itemsize > MAX_PITCH:
        return None
    return row * itemsize, rows, pitch * itemsize


_lib: Any = None
_looked = False


def _runtime() -> Any:
    """The CUDA runtime this process loaded (torch's: the mapped `libcudart` whose version is
    torch's CUDA major, else any mapped one, else one by name), with `cudaMemcpy2DAsync`; or None."""
    global _lib, _looked
    if _looked:
        return _lib
    _looked = True
    if not torch.cuda.is_available():
        return None
    torch.cuda.init()
    paths: list = []
    try:  # the runtime torch loaded (a pip wheel's, by its path)
        with open("/proc/self/maps") as f:
            paths = sorted({w for w in (line.split()[-1] for line in f if "libcudart.so" in line) if w.startswith("/")})
    except OSError:
        pass
    major = (torch.version.cuda or "").split(".")[0]
    ours = re.compile(rf"libcudart\.so\.{re.escape(major)}(\.|$)")
    paths.sort(key=lambda p: not ours.match(os.path.basename(p)))
    for name in paths + [f"libcudart.so.{major}", "libcudart.so"]:
        try:
            lib = ctypes.CDLL(name)
            fn = lib.cudaMemcpy2DAsync
            lib.cudaGetLastError.restype = ctypes.c_int
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t,
                       ctypes.c_int, ctypes.c_void_p]
        _lib = lib
        break
    return _lib


_refused: list = []  # the first error a 2D copy met (then no more are tried)


def available() -> bool:
    """Whether pitched copies run (CUDA, the runtime's `cudaMemcpy2DAsync` found, and none
    refused so far)."""
    return not _refused and _runtime() is not None


def usable(t: torch.Tensor) -> bool:
    """Whether a page copy of `t` goes as one pitched copy: a CUDA tensor with one level of gaps
    (`pitch_of`), no conjugate or negative bit (a raw copy would drop it), the runtime found.
    The host buffer then holds it as `compact` lays it out; otherwise contiguous (torch's copy
    from a host tensor that is not would go through pageable temporaries)."""
    return (t.is_cuda and not t.is_contiguous() and not t.is_conj() and not t.is_neg()  # contiguous: dense, no pitch
            and pitch_of(tuple(t.shape), t.stride(), t.element_size()) is not None and available())


def args(kind: int, dev_ptr: int, host_ptr: int, row: int, rows: int, pitch: int) -> tuple:
    """`cudaMemcpy2DAsync`'s arguments but the stream, (dst, dpitch, src, spitch, width, height,
    kind): the host side packed (its pitch the row), the device side at `pitch`."""
    if kind == _D2H:
        return (host_ptr, row, dev_ptr, pitch, row, rows, kind)
    return (dev_ptr, pitch, host_ptr, row, row, rows, kind)


def plan(dst: torch.Tensor, src: torch.Tensor) -> Optional[tuple]:
    """What `queue` needs to do `dst.copy_(src)` as one pitched copy (`args` and the device)
    when one side is a tensor `usable` takes and the other a pinned host tensor of its shape and
    dtype laid out as `compact` gives; None otherwise (torch's copy applies). Checks only:
    nothing is queued."""
    if dst.dtype != src.dtype or dst.shape != src.shape:
        return None
    if dst.is_cuda and not src.is_cuda:
        dev, host, kind = dst, src, _H2D
    elif src.is_cuda and not dst.is_cuda:
        dev, host, kind = src, dst, _D2H
    else:
        return None
    if not usable(dev) or host.is_conj() or host.is_neg():
        return None
    shape, stride = tuple(dev.shape), dev.stride()
    if host.stride() != compact(shape, stride) or not host.is_pinned():
        return None
    row, rows, pitch = pitch_of(shape, stride, dev.element_size())
    return args(kind, dev.data_ptr(), host.data_ptr(), row, rows, pitch) + (dev.device.index,)


def queue(planned: tuple, stream: Any) -> bool:
    """Queue `plan`'s copy on `stream` (a CUDA stream of the tensor's device); False when the
    runtime refused it: the error cleared, nothing queued (the caller copies with torch), a
    warning, and no pitched copy is tried again (`available`: later page-outs take the
    contiguous host layout)."""
    *call, device = planned
    lib = _runtime()
    with torch.cuda.device(device):
        err = lib.cudaMemcpy2DAsync(*call, stream.cuda_stream)
        if err != 0:
            lib.cudaGetLastError()  # else the next kernel launch's check would report it
    if err != 0:
        _refused.append(err)
        warnings.warn(f"sched_lifetime paging: cudaMemcpy2DAsync refused a pitched page copy (CUDA error {err}, "
                      f"{call[4]}-byte rows x {call[5]}); this copy and every later one go through torch's copy", stacklevel=3)
    return err == 0
