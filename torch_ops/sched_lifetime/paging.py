"""Activation paging through `saved_tensors_hooks` (wiring only: what to page is Rust's choice).

`Pager` wraps a plain module's forward and backward:

    pager = sl.Pager(budget={"fraction": 0.5})
    for batch in data:
        with pager.step():
            loss = model(batch); loss.backward()

The first step calibrates: it records the live prefix (every tensor autograd saves, its bytes,
its save order and the backward order of its first use) and asks Rust (`page_plan`) what to
page. Host buffers are then allocated once (pinned on CUDA), never during a step. Later steps
copy the chosen tensors to their host buffer when autograd saves them and back when the
backward unpacks them; the rest stay on the device. On CUDA the copies run on the page stream
(`SideStreams`), the device storage of a paged-out tensor is released through the lifetime
manager (owner: the compute stream, retired on the page stream with `drop_reference`), and the
host buffers come from a `HostPool` whose freelist is updated in page-stream order: a buffer is
given back right after the page-in that reads it is queued, so the next page-out into it is
queued behind that read on the same stream (no host sync). On CPU the copies are plain.

A step whose saved tensors differ from the calibration (count, shape or dtype) raises: no
silent fallback. A saved tensor changed in place after its save raises at its unpack, as
autograd's version check does in eager (saved_tensors_hooks turn that check off): every kept
one, and a paged one while anything still holds it (else its host copy is the value saved). `stats()` gives bytes out and in (equal every step) and the host bytes held;
`per_step()` per step: bytes out and in, host bytes in use at once, page-outs in flight at once,
and (`measure_waits=True`) the time the compute stream waited on page-ins.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import json
import math
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence, Union

import torch

from ._ops import ops
from .executor import SideStreams
from .lifetime import LifetimeManager

Budget = Union[dict, float, int]


def _budget_text(budget: Budget) -> str:
    if isinstance(budget, dict):
        return json.dumps(budget)
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise ValueError(f"paging budget must be bytes (int), a fraction (float) or a dict, got {budget!r}")
    return json.dumps({"bytes": budget} if isinstance(budget, int) else {"fraction": budget})


def page_plan(prefix: list[dict], budget: Budget, min_distance: int = 1, timing: Optional[dict] = None) -> dict:
    """Rust's choice for a live prefix (`[{"name", "bytes", "saved_at", "used_at"}]`); with a
    measured `timing` (`{"save_us", "unpack_us", "d2h_bytes_per_us", "h2d_bytes_per_us",
    "slack"}`) only what hides, with release and page-in points (`release_at`, `launch_at`)."""
    return json.loads(ops.page_plan(json.dumps(prefix), _budget_text(budget), int(min_distance), "" if timing is None else json.dumps(timing)))


def explain_plan(plan: dict) -> str:
    """A plan from `page_plan` as text: a head line, then Rust's line per candidate."""
    head = f"paging {len(plan['page'])} tensors, {plan['bytes_paged']} of {plan['bytes_live']} bytes (target {plan['target']})"
    return "\n".join([head + (" SHORT of target" if plan["short"] else "")] + plan["explain"])


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


def link_rates(dev: torch.device, mib: int = 64, reps: int = 2) -> tuple[float, float]:
    """Measured device -> pinned host and pinned host -> device copy rates (bytes per us) of one
    `mib` MiB buffer, `reps` copies each after a warm-up, timed with CUDA events."""
    torch.cuda.synchronize(dev)
    n = mib << 20
    d, h = torch.empty(n, dtype=torch.uint8, device=dev), torch.empty(n, dtype=torch.uint8, pin_memory=True)
    rates = []
    for dst, src in ((h, d), (d, h)):
        dst.copy_(src, non_blocking=True)  # warm
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        rates.append(reps * n / (a.elapsed_time(b) * 1e3))
    return rates[0], rates[1]


def _dense(shape: tuple, stride: tuple) -> bool:
    """Whether a tensor of `shape` and `stride` covers its span exactly (a permutation of a
    contiguous layout): its bytes copy as one block into a host buffer of the same strides."""
    expected = 1
    for st, sz in sorted((st, sz) for st, sz in zip(stride, shape) if sz != 1):
        if st != expected:
            return False
        expected *= sz
    return True


def wait_us(marks: list[tuple]) -> float:
    """Compute-stream time (us) between each (before, after) event pair of `take_figures`'
    `page_in_waits`; synchronizes on the last one."""
    if marks:
        marks[-1][1].synchronize()
    return sum(b.elapsed_time(a) for b, a in marks) * 1e3


def _check_version(packed: tuple) -> None:
    """Raise as autograd does when a saved tensor was changed in place since its save. A kept
    one is held; a paged one is checked while anything still holds it (its view family's base):
    once nothing does, nothing can change it, and the backward reads its host copy."""
    t = packed[2] if packed[0] == "keep" else packed[2]()
    if t is not None and t._version != packed[3]:
        raise RuntimeError(
            f"one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"saved tensor #{packed[1]} of this step ({tuple(t.shape)} {t.dtype}) is at version {t._version}; expected "
            f"version {packed[3]} instead (autograd's check, kept under sl.Pager). Hint: clone the tensor before changing it in place."
        )


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


def _extent(t: torch.Tensor) -> int:
    """Bytes from `t`'s first element to just past its last (0 when empty)."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) * t.element_size()


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

class HostPool:
    """Host buffers allocated once (pinned when they serve a GPU), handed out from a freelist per
    byte size. Page copies take a buffer for a page-out and give it back right after queueing the
    page-in that reads it; both copies run on the page stream, and the freelist is FIFO, so a
    buffer is rewritten only by a copy queued on the page stream after the copy that last read
    it: the stream's order is the freelist's order, with no host synchronisation. A step never
    allocates host memory: an empty freelist is an error (the pool was sized at calibration).
    """

    def __init__(self, sizes: list[int], device: Any = "cpu", drain_distance: int = 16) -> None:
        if drain_distance < 0:
            raise ValueError(f"drain_distance must be >= 0, got {drain_distance}")
        self.device = torch.device(device)
        pin = self.device.type == "cuda"
        self._free: dict[int, collections.deque] = {}
        self._bufs: list[torch.Tensor] = []
        for n in sizes:
            if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
                raise ValueError(f"host pool sizes must be positive byte counts, got {n!r}")
            self._free.setdefault(n, collections.deque()).append(len(self._bufs))
            self._bufs.append(torch.empty(n, dtype=torch.uint8, device="cpu", pin_memory=pin))
        self.bytes = sum(sizes)
        self._taken: set[int] = set()
        self._views: dict[tuple, torch.Tensor] = {}
        self._mark: Any = None  # the event `_after` re-records (made at its first use)
        # Page-outs whose device storage is still held: (manager, copy-done event, owner stream,
        # page-out number), in page-stream order.
        self._retiring: list[tuple[LifetimeManager, Any, Any, int]] = []
        self.page_outs = 0  # page-outs queued so far (numbers them; `mark` reads it)
        self.drain_distance = drain_distance
        self.released = 0  # page-outs whose device storage was released, in all
        self.forced_drains = 0  # releases forced by `drain_distance` (the compute stream may stall)
        # Host-cost caches (a page copy is tens of microseconds of Python otherwise): the page
        # stream, the last current stream seen (by its raw id), spare copy-done events.
        self._page: Any = None
        self._cur: tuple = (None, None)
        self._spare: list = []
        # Per-step figures (`take_figures`): host bytes taken at once, page-outs holding device
        # storage at once, and, when `measure_waits`, (before, after) timing events around each
        # compute-stream wait on a page-in.
        self._taken_bytes = 0
        self.peak_taken_bytes = 0
        self.peak_out_in_flight = 0
        self.measure_waits = False
        self._wait_marks: list[tuple] = []

    @property
    def page_stream(self) -> Any:
        """The stream every page copy of this pool runs on (None on CPU)."""
        if self._page is None and self.device.type == "cuda":
            self._page = SideStreams.of(self.device).page
        return self._page

    def current_stream(self) -> Any:
        """`torch.cuda.current_stream(device)`, without building a new Stream when it has not
        changed since the last call."""
        raw = torch._C._cuda_getCurrentStream(self.device.index if self.device.index is not None else torch.cuda.current_device())
        if self._cur[0] != raw:
            self._cur = (raw, torch.cuda.Stream(stream_id=raw[0], device_index=raw[1], device_type=raw[2]))
        return self._cur[1]

    def _on(self, stream: Any) -> tuple:
        """Make `stream` current (the stream context's switch without its lookups); returns
        the raw id of the stream it replaces, for `_back`."""
        prev = torch._C._cuda_getCurrentStream(stream.device_index)
        torch._C._cuda_setStream(stream_id=stream.stream_id, device_index=stream.device_index, device_type=stream.device_type)
        return prev

    @contextlib.contextmanager
    def _switched(self, stream: Any) -> Iterator[None]:
        """`stream` current inside (`_on` / `_back`); nothing to switch when None (CPU)."""
        if stream is None:
            yield
            return
        prev = self._on(stream)
        try:
            yield
        finally:
            self._back(prev)

    @staticmethod
    def _back(prev: tuple) -> None:
        torch._C._cuda_setStream(stream_id=prev[0], device_index=prev[1], device_type=prev[2])

    def _copy_on(self, page: Any, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """`dst.copy_(src)` queued on `page`; returns the event recorded after it."""
        prev = self._on(page)
        try:
            dst.copy_(src, non_blocking=True)
        finally:
            self._back(prev)
        ev = self._event()
        ev.record(page)
        return ev

    def _event(self) -> Any:
        """A copy-done event: a spare one (its last record was waited on) or a new one."""
        return self._spare.pop() if self._spare else torch.cuda.Event()

    def recycle(self, ev: Any) -> None:
        """Give back a copy-done event once its wait is queued (a later record does not change
        what an earlier wait waits for)."""
        if ev is not None:
            self._spare.append(ev)

    def take(self, nbytes: int) -> int:
        """A free buffer of exactly `nbytes` (the one given back longest ago)."""
        free = self._free.get(nbytes)
        if free is None:
            raise RuntimeError(f"host pool has no buffer of {nbytes} bytes (sizes: {sorted(self._free)}); it is sized at calibration")
        if not free:
            raise RuntimeError(f"host pool exhausted: all {sum(1 for b in self._bufs if b.numel() == nbytes)} buffers of {nbytes} bytes are in use")
        slot = free.popleft()
        self._taken.add(slot)
        self._taken_bytes += nbytes
        self.peak_taken_bytes = max(self.peak_taken_bytes, self._taken_bytes)
        return slot

    def give(self, slot: int) -> None:
        """Back to the freelist; call it after queueing the copy that last reads the buffer."""
        if slot not in self._taken:
            raise RuntimeError(f"host buffer {slot} given back but not taken")
        self._taken.remove(slot)
        self._taken_bytes -= self._bufs[slot].numel()
        self._free[self._bufs[slot].numel()].append(slot)

    def _after(self, page: Any, comp: Any) -> None:
        """`page` waits for the work queued on `comp` so far (`Stream.wait_stream` without its
        new event per call: one event, re-recorded; a wait takes the record it sees)."""
        ev = self._mark
        if ev is None:
            ev = self._mark = torch.cuda.Event()
        ev.record(comp)
        page.wait_event(ev)

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
        """The host buffer `p` was paged into, seen as the tensor it holds."""
        return self.view(p.slot, p.shape, p.dtype, p.stride, p.offset)

    def in_use(self) -> int:
        """Buffers taken and not given back."""
        return len(self._taken)

    def reclaim(self) -> None:
        """Give back every buffer still taken (a page-out never paged in, e.g. a step cut
        short). Safe without a sync: whatever copy comes next into it is queued on the page
        stream behind the page-out that wrote it."""
        for slot in sorted(self._taken):
            self.give(slot)

    def page_out(self, t: torch.Tensor, owner: Any = None) -> Paged:
        """Copy `t` into a free host buffer (on the page stream after the compute stream's work
        so far). On CUDA the device storage is kept alive by a lifetime manager until the copy
        is done: at a later save, unpack or page-out whose host-side check finds the copy
        finished (`release_done`), or, with more than `drain_distance` copies in flight, at
        once, the compute stream waits on the copy's event and the reference is dropped (rule
        1, no record_stream, no host sync; the event query makes this path eager-only, as
        saved_tensors_hooks are). `owner`: the stream `t` was produced on (default: the current
        stream; a page node running on the page stream passes the compute stream)."""
        _check_restorable(t)
        nbytes = t.numel() * t.element_size()
        slot = self.take(nbytes)
        buf = self.view(slot, tuple(t.shape), t.dtype, t.stride())
        if t.is_cuda:
            comp, page = owner if owner is not None else self.current_stream(), self.page_stream
            self._after(page, comp)
            self._hold([t], self._copy_on(page, buf, t.detach()), comp, page)
        else:
            buf.copy_(t.detach())
            self.page_outs += 1
        return Paged(slot, tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad, nbytes)

    def _hold(self, ts: Sequence[torch.Tensor], done: Any, comp: Any, page: Any) -> None:
        """A page-out queued (its copies end at `done` on `page`): a lifetime manager holds the
        device storage of `ts` (owner `comp`, each storage once: a node may save two views of
        one tensor) until its release. Then what the link has already copied is released (the
        compute stream's wait on a finished copy costs nothing), oldest first; only past
        `drain_distance` page-outs holding storage does the compute stream wait on one at once
        (the copies fall behind the forward)."""
        held = list({t.untyped_storage().data_ptr(): t for t in ts}.values())
        m = LifetimeManager("page_out")
        m.bind(held, comp)
        m.retire(held, page, "drop_reference")
        self._retiring.append((m, done, comp, self.page_outs))
        self.page_outs += 1
        self.peak_out_in_flight = max(self.peak_out_in_flight, len(self._retiring))
        while len(self._retiring) > self.drain_distance:
            self.forced_drains += 1
            self._drain_one()
        self.release_done()

    def page_in(self, p: Paged) -> torch.Tensor:
        """The tensor back on its device, allocated on the compute (consumer) stream; the
        compute stream waits for the copy (`page_in_launch` + `page_wait`)."""
        out, ev = self.page_in_launch(p)
        self.page_wait(ev)
        return out

    def page_in_launch(self, p: Paged, alloc_stream: Any = None) -> tuple:
        """Queue the copy back (on the page stream after the compute stream's work so far) into
        a tensor with the paged-out one's shape and strides, allocated on the compute stream;
        returns it with the event to wait on before
        reading it (None on CPU). The buffer goes back to the freelist at once: the next
        page-out that takes it is queued behind this copy on the page stream. `alloc_stream`:
        the consumer's stream (default: the current stream)."""
        buf = self.view_of(p)
        ev = None
        if p.device.type == "cuda":
            comp, page = alloc_stream if alloc_stream is not None else self.current_stream(), self.page_stream
            prev = self._on(comp)
            try:
                out = torch.empty_strided(p.shape, p.stride, dtype=p.dtype, device=p.device)
            finally:
                self._back(prev)
            self._after(page, comp)
            ev = self._copy_on(page, out, buf)
        else:
            out = torch.empty_strided(p.shape, p.stride, dtype=p.dtype).copy_(buf)
        self.give(p.slot)
        if p.requires_grad and out.is_leaf:
            out.requires_grad_(True)
        return out, ev

    def page_out_group(self, ts: Sequence[torch.Tensor], owner: Any = None, ordered: bool = False) -> list[Paged]:
        """`page_out` of a node's saved tensors into one buffer laid out by `group_plan` (the
        pool was sized with it), with one copy-done event and one lifetime manager for them
        all (the host cost of one page-out, not one per tensor). `ordered`: the caller has
        already made the page stream wait for the work that produced `ts` (the executor's sync
        edge from the producing node), so the page stream does not also wait for everything
        queued on `owner` since."""
        for t in ts:
            _check_restorable(t)
        plan = group_plan(ts)
        slot = self.take(plan.nbytes)
        buf = self._bufs[slot]
        cuda = bool(ts) and ts[0].is_cuda
        comp = page = None
        if cuda:
            comp, page = owner if owner is not None else self.current_stream(), self.page_stream
            if not ordered:
                self._after(page, comp)
        with self._switched(page):
            for kind, i, start, n, off in plan.segments:
                t = ts[i].detach()
                if kind == "span":
                    src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage(), start, (n,), (1,))
                    buf[off : off + n].copy_(src, non_blocking=cuda)
                else:
                    self.view(slot, tuple(t.shape), t.dtype, t.stride(), off).copy_(t, non_blocking=cuda)
        if cuda:
            done = self._event()
            done.record(page)
            self._hold(ts, done, comp, page)
        else:
            self.page_outs += 1
        return [
            Paged(slot, tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad, t.numel() * t.element_size(), off, packed)
            for t, (off, packed) in zip(ts, plan.places)
        ]

    def page_in_group(self, ps: Sequence[Paged], alloc_stream: Any = None) -> tuple:
        """`page_in_launch` of a `page_out_group`'s tensors: one device block allocated on the
        compute stream (the consumer's), one host->device copy of the whole buffer; each tensor
        comes back on the block's storage with its strides (views of one storage alias again),
        a packed one scattered into its own tensor on the page stream. Returns the tensors and
        the event to wait on (None on CPU). The buffer goes back to the freelist at once (the
        next page-out into it queues behind this copy)."""
        if not ps:
            return [], None
        slot = ps[0].slot
        if any(p.slot != slot for p in ps):
            raise ValueError("page_in_group: the tensors were not paged out as one group")
        dev = ps[0].device
        cuda = dev.type == "cuda"
        host = self._bufs[slot]
        comp = page = None
        if cuda:
            comp, page = alloc_stream if alloc_stream is not None else self.current_stream(), self.page_stream
        with self._switched(comp):
            block = torch.empty(host.numel(), dtype=torch.uint8, device=dev)
            storage = block.untyped_storage()

            def on_block(p: Paged, stride: tuple) -> torch.Tensor:
                return torch.empty(0, dtype=p.dtype, device=dev).set_(storage, p.offset // p.dtype.itemsize, p.shape, stride)

            outs = [torch.empty_strided(p.shape, p.stride, dtype=p.dtype, device=dev) if p.packed else on_block(p, p.stride) for p in ps]
        ev = None
        if cuda:
            self._after(page, comp)
        with self._switched(page):
            block.copy_(host, non_blocking=cuda)
            for o, p in zip(outs, ps):
                if p.packed:
                    o.copy_(on_block(p, _contiguous(p.shape)))
        if cuda:
            ev = self._event()
            ev.record(page)
        self.give(slot)
        outs = [o.detach().requires_grad_(True) if p.requires_grad else o for o, p in zip(outs, ps)]
        return outs, ev

    def page_wait(self, ev: Any) -> None:
        """The compute stream waits for a page-in (no host sync). With `measure_waits`, timing
        events recorded on the compute stream just before and just after the wait measure how
        long it stalled there (`take_figures` reads them)."""
        if ev is not None:
            comp = self.current_stream()
            if self.measure_waits:
                before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                before.record(comp)
                comp.wait_event(ev)
                after.record(comp)
                self._wait_marks.append((before, after))
            else:
                comp.wait_event(ev)

    def take_figures(self) -> dict[str, Any]:
        """The figures since the last call, and reset them: `host_bytes_peak` (host bytes taken
        at once), `out_in_flight_peak` (page-outs holding device storage at once) and
        `page_in_waits`: with `measure_waits`, the (before, after) event pairs around each
        compute-stream wait on a page-in, unread (no host sync here; `wait_us` reads them),
        else None."""
        out = {
            "host_bytes_peak": self.peak_taken_bytes,
            "out_in_flight_peak": self.peak_out_in_flight,
            "page_in_waits": self._wait_marks if self.measure_waits else None,
        }
        self._wait_marks = []
        self.peak_taken_bytes, self.peak_out_in_flight = self._taken_bytes, len(self._retiring)
        return out

    def _drain_one(self) -> None:
        m, done, owner, _ = self._retiring.pop(0)  # the owner stream waits on the copy, then releases
        m.acquire(owner)
        m.finalize()
        m.close()
        self._spare.append(done)  # the acquire's wait on the copy is queued
        self.released += 1

    def release_until(self, n: int) -> None:
        """Release the oldest page-outs until `n` have been released in all (a calibrated
        plan's release points: there the copy is done by the measured timeline, so the compute
        stream's wait costs nothing)."""
        while self.released < n and self._retiring:
            self._drain_one()

    def release_done(self) -> None:
        """Release the device storage of every page-out whose copy has finished, oldest first
        (the compute stream's wait on a finished copy costs nothing). Cheap: call it often.
        Under CUDA graph capture it does nothing (an event query is not allowed there; the
        capture-safe release points are `release_queued_before` and `drain`)."""
        if self._retiring and torch.cuda.is_current_stream_capturing():
            return
        while self._retiring and self._retiring[0][1].query():
            self._drain_one()

    def mark(self) -> int:
        """The page-outs queued on the page stream so far: taken when a page-in is queued, every
        page-out numbered below it runs before that page-in on the page stream."""
        return self.page_outs

    def release_queued_before(self, mark: int) -> None:
        """Release every page-out numbered below `mark` (a page-in's `mark`), once the compute
        stream has waited for that page-in: the page stream ran them before it, so the wait
        each release queues finds its copy done. No query, no host sync: capture-safe."""
        while self._retiring and self._retiring[0][3] < mark:
            self._drain_one()

    def drain(self) -> None:
        """Release every page-out's device storage still held (the compute stream waits on the
        copies first)."""
        while self._retiring:
            self._drain_one()


class Pager:
    """Pages saved activations out to host memory and back (see the module docstring)."""

    def __init__(
        self,
        budget: Budget,
        min_distance: int = 1,
        min_bytes: int = 1 << 16,
        drain_distance: int = 16,
        prefetch: int = 64,
        timed: bool = True,
        slack: float = 1.25,
        measure_waits: bool = False,
    ) -> None:
        """`timed` (CUDA): calibration takes two steps, the first measuring the memory timeline
        (the most memory allocated between saves and unpacks: it resets the peak memory
        statistic at each), the second the time line (an event at every save and unpack; the
        hooks do nothing else there, so the host keeps its usual lead) and the link's rates;
        then Rust pages only what hides under the
        forward and lowers the step's peak, releasing each page-out where its copy is done and
        queueing each page-in as late as the link allows (`slack`: copies planned that many
        times slower than measured); the budget caps it. `measure_waits` (CUDA): time the
        compute stream's waits on page-ins with events (`per_step()`). Untimed (and
        on CPU): the budget alone chooses, a page-out is released when found done or once more
        than `drain_distance` copies are in flight, and page-ins are queued `prefetch` unpacks
        ahead."""
        _budget_text(budget)  # validate now
        if drain_distance < 0:
            raise ValueError(f"drain_distance must be >= 0, got {drain_distance}")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0 (backward unpacks ahead), got {prefetch!r}")
        if isinstance(slack, bool) or not isinstance(slack, (int, float)) or not slack >= 1:
            raise ValueError(f"slack must be a number >= 1, got {slack!r}")
        self.prefetch = prefetch
        self.timed = bool(timed)
        self.slack = float(slack)
        self._events: dict[str, list] = {"save": [], "unpack": []}  # calibration's timeline
        self._peaks: dict[str, list] = {"save": [], "unpack": []}
        self._timing_pass = False
        self._tail = 0
        self._launch_at: dict[int, int] = {}
        self._release_at: list[int] = []  # save index of each release, ascending
        self._released0 = 0
        self._next_release = 0
        self._handles: dict[int, Paged] = {}
        self._ready: dict[int, tuple] = {}
        self._in_order: list[int] = []
        self._next_in = 0
        self.budget = budget
        self.drain_distance = drain_distance
        self.pool: Optional[HostPool] = None
        self.min_distance = min_distance
        self.min_bytes = min_bytes
        self.plan: Optional[dict] = None
        self.calibration: Optional[dict] = None
        self._calib: list[dict] = []
        self._first_use: dict[int, int] = {}
        self._page: set[int] = set()
        self._index = 0
        self._unpacks = 0
        self._stats = {"steps": 0, "bytes_out": 0, "bytes_in": 0, "host_bytes": 0, "max_prefetched": 0}
        self._shapes: list = []
        self._step_start = (0, 0)
        self._paging_step = False
        self.measure_waits = bool(measure_waits)
        self._per_step: list[dict] = []

    # -- hooks -------------------------------------------------------------------------

    def _pack(self, t: torch.Tensor) -> Any:
        i = self._index
        self._index += 1
        pool = self.pool
        if pool is not None and not self._release_at:
            pool.release_done()  # untimed: every save is a chance to free what the link has copied
        if self.plan is None:  # calibrating: record, keep
            if self._timing_pass:  # second calibration step: the timeline only
                c = self._calib[i] if i < len(self._calib) else None
                if c is None or c["shape"] != tuple(t.shape) or c["dtype"] != t.dtype:
                    raise RuntimeError(f"paging: saved tensor #{i} is {tuple(t.shape)} {t.dtype}, the first calibration step saw {c and (c['shape'], c['dtype'])}")
                self._events["save"].append(self._event_now())
                return ("keep", i, t, t._version)
            if self.timed and t.is_cuda:
                self._peak("save", t.device)
            # Metadata only: a reference here would keep every activation alive through the
            # backward and distort the memory timeline.
            self._calib.append({"device": t.device, "bytes": t.numel() * t.element_size(), "shape": tuple(t.shape), "dtype": t.dtype, "weight": is_weight(t), "restorable": restorable(t)})
            return ("keep", i, t, t._version)
        shapes = self._shapes
        if i >= len(shapes) or t.shape != shapes[i][0] or t.dtype != shapes[i][1]:
            raise RuntimeError(
                f"paging: saved tensor #{i} is {tuple(t.shape)} {t.dtype}, calibration saw "
                f"{shapes[i] if i < len(shapes) else 'nothing'}; make a new Pager for a new shape"
            )
        if i not in self._page or not restorable(t):
            packed: Any = ("keep", i, t, t._version)
        else:
            p = pool.page_out(t)
            self._handles[i] = p
            self._stats["bytes_out"] += p.nbytes
            packed = ("paged", i, weakref.ref(t if t._base is None else t._base), t._version)
        if self._release_at and i >= self._next_release:  # the plan's release points up to this save
            rel = self._release_at
            k = bisect.bisect_right(rel, i)
            pool.release_until(self._released0 + k)
            self._next_release = rel[k] if k < len(rel) else 1 << 62
        return packed

    def _unpack(self, packed: Any) -> torch.Tensor:
        kind, i = packed[0], packed[1]
        if len(packed) > 3:  # autograd's version check, which saved_tensors_hooks turn off
            _check_version(packed)
        if self.plan is None:
            if self._timing_pass:
                self._events["unpack"].append(self._event_now())
            elif self._peaks["save"]:  # a timed calibration on CUDA
                self._peak("unpack", self._calib[0]["device"])
            self._first_use.setdefault(i, self._unpacks)
            self._unpacks += 1
            return packed[2]
        u = self._unpacks
        self._unpacks += 1
        pool = self.pool
        if pool is not None:
            pool.release_done()
        # Prefetch: page-ins of the tensors read within `prefetch` unpacks from now are queued
        # now, so the copy runs under the backward's compute; the wait stays at the use.
        order = self._in_order
        while self._next_in < len(order) and self._launch_at[order[self._next_in]] <= u:
            self._launch_in(order[self._next_in])
            self._next_in += 1
        if kind == "keep":
            return packed[2]
        if i not in self._ready:
            if i not in self._handles:
                raise RuntimeError(f"paging: saved tensor #{i} unpacked twice (retain_graph is not supported with paging)")
            self._launch_in(i)
        out, ev = self._ready.pop(i)
        pool.page_wait(ev)
        pool.recycle(ev)
        return out

    def _launch_in(self, i: int) -> None:
        p = self._handles.pop(i, None)
        if p is None:  # not paged out this step (yet): the use pages it in
            return
        self._ready[i] = self.pool.page_in_launch(p)
        self._stats["bytes_in"] += p.nbytes
        self._stats["max_prefetched"] = max(self._stats["max_prefetched"], len(self._ready) - 1)

    # -- steps -------------------------------------------------------------------------

    @contextlib.contextmanager
    def step(self) -> Iterator["Pager"]:
        """One forward + backward with the hooks on; the first one calibrates (the first two
        when timed on CUDA)."""
        self.begin()
        ok = False
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self
            ok = True
        finally:
            self.end(ok)

    def begin(self) -> None:
        """Start a step (what `step()` does before the forward; the compile path's paging calls
        it at a forward's first save)."""
        self._index = 0
        self._unpacks = 0
        self._next_in = 0
        self._handles.clear()
        self._ready.clear()
        self._released0 = self.pool.released if self.pool is not None else 0
        if self.plan is None and self.timed and not self._timing_pass and torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()  # the first interval starts with the step
        self._next_release = self._release_at[0] if self._release_at else 0
        self._step_start = (self._stats["bytes_out"], self._stats["bytes_in"])
        self._paging_step = self.plan is not None  # calibrated: this step pages

    def end(self, ok: bool = True) -> None:
        """End a step after its backward (`ok`: it ran to the end): calibration moves on,
        bytes out must equal bytes in; every page-out's storage released, every buffer back."""
        try:
            if not ok:
                return
            if self.plan is None:
                if self.timed and self._peaks["save"] and not self._timing_pass:
                    self._tail = torch.cuda.max_memory_allocated(self._calib[0]["device"])
                    self._timing_pass = True  # the next step measures the timeline, then plans
                else:
                    self._calibrate()
            out0, in0 = self._step_start
            moved_out, moved_in = self._stats["bytes_out"] - out0, self._stats["bytes_in"] - in0
            if moved_out != moved_in:
                raise RuntimeError(f"paging: {moved_out} bytes paged out but {moved_in} paged in this step (a saved tensor never unpacked?)")
            self._stats["steps"] += 1
            if self._paging_step and self.pool is not None:
                self._per_step.append({"step": self._stats["steps"], "bytes_out": moved_out, "bytes_in": moved_in, **self.pool.take_figures()})
        finally:
            if self.pool is not None:
                self.pool.drain()
                self.pool.reclaim()  # a step cut short (an exception) leaves nothing taken

    @staticmethod
    def _event_now() -> Any:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def _peak(self, kind: str, dev: torch.device) -> None:
        """First calibration step: the most bytes allocated since the last save or unpack (the
        peak statistic is reset at each; slow on the host, so the timeline is measured in a
        second step)."""
        self._peaks[kind].append(torch._C._cuda_memoryStats(dev.index)["allocated_bytes"]["all"]["peak"])
        torch._C._cuda_resetPeakMemoryStats(dev.index)

    def _timing(self) -> Optional[dict]:
        """The calibration step's timeline (us from its first save / first unpack) and the
        link's measured rates, or None when untimed or nothing ran on CUDA."""
        saves, unpacks = self._events["save"], self._events["unpack"]
        peaks = self._peaks
        self._events, self._peaks = {"save": [], "unpack": []}, {"save": [], "unpack": []}
        if not saves:
            return None
        if len(saves) != len(self._calib) or len(unpacks) != len(peaks["unpack"]):
            raise RuntimeError(
                f"paging: the second calibration step saved {len(saves)} and unpacked {len(unpacks)} tensors, "
                f"the first {len(self._calib)} and {len(peaks['unpack'])}; make a new Pager for a new shape"
            )
        rates = link_rates(self._calib[0]["device"])
        return {
            "save_us": [saves[0].elapsed_time(e) * 1e3 for e in saves],
            "unpack_us": [unpacks[0].elapsed_time(e) * 1e3 for e in unpacks],
            "d2h_bytes_per_us": rates[0],
            "h2d_bytes_per_us": rates[1],
            "slack": self.slack,
            "save_peak": peaks["save"],
            "unpack_peak": peaks["unpack"],
            "tail_peak": self._tail,
        }

    def _calibrate(self) -> None:
        timing = self._timing() if self.timed else None
        prefix = []
        for i, c in enumerate(self._calib):
            if c["bytes"] < self.min_bytes or c["weight"] or not c["restorable"] or i not in self._first_use:
                continue
            prefix.append({"name": f"#{i}", "bytes": c["bytes"], "saved_at": i, "used_at": self._first_use[i]})
        small = [c["bytes"] for c in self._calib if c["bytes"] < self.min_bytes and not c["weight"]]
        if not prefix and small:  # a setting that selects nothing: say so once, with the fix
            warnings.warn(f"Pager: nothing to page: every saved activation is under min_bytes={self.min_bytes} bytes (the largest is {max(small)}); pass a smaller min_bytes")
        # used_at counts backward steps from the boundary: the first unpack is step 0.
        #: What the plan was made from (Rust's inputs), to print or to plan again with.
        self.calibration = {"prefix": prefix, "budget": self.budget, "min_distance": self.min_distance, "timing": timing}
        self.plan = page_plan(prefix, self.budget, self.min_distance, timing)
        self.plan["timing"] = timing
        paged = [int(n[1:]) for n in self.plan["page"]]
        self._page = set(paged)
        if timing is not None:
            self._launch_at = dict(zip(paged, self.plan["launch_at"]))
            self._release_at = list(self.plan["release_at"])
        else:
            self._launch_at = {i: max(0, self._first_use[i] - self.prefetch) for i in paged}
            self._release_at = []
        self._in_order = sorted(self._page, key=lambda i: (self._launch_at[i], self._first_use[i], i))
        self._shapes = [(c["shape"], c["dtype"]) for c in self._calib]
        page = sorted(self._page)
        if page:
            devs = {self._calib[i]["device"] for i in page}
            if len(devs) > 1:
                raise RuntimeError(f"paging: saved tensors on several devices {sorted(map(str, devs))}; use one Pager per device")
            dev = devs.pop()
            # A timed plan places every release; the count-based drain is only a backstop.
            drain = len(page) if timing is not None else self.drain_distance
            self.pool = HostPool([self._calib[i]["bytes"] for i in page], dev, drain)
            self.pool.measure_waits = self.measure_waits and dev.type == "cuda"
            self.pool.take_figures()  # figures start with the first paged step
            self._stats["host_bytes"] = self.pool.bytes
        self._calib = []

    def per_step(self) -> list[dict]:
        """One entry per step since calibration: bytes out and in (equal), `host_bytes_peak`
        (host bytes in use at once), `out_in_flight_peak` (page-outs holding device storage at
        once) and, with `measure_waits` on CUDA, `page_in_wait_us` (compute-stream time
        stalled on page-ins; reading it synchronizes on that step's last wait, so call this
        outside the training loop), else None."""
        out = []
        for st in self._per_step:
            st = dict(st)
            waits = st.pop("page_in_waits")
            st["page_in_wait_us"] = None if waits is None else wait_us(waits)
            out.append(st)
        return out

    def stats(self) -> dict[str, int]:
        """Bytes paged out and in (equal after every step), host bytes held, steps, and the most
        page-ins queued ahead of their use at once (prefetch)."""
        return dict(self._stats)

    def explain(self) -> str:
        """What calibration chose, one line per saved tensor."""
        return "not calibrated yet" if self.plan is None else explain_plan(self.plan)
