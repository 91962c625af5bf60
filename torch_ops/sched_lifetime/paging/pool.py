"""The pinned host pool: page copies between device tensors and host buffers on the page streams (`HostPool`).

`HostPool` is built from four parts, each with its own state: `HostSlots` (the buffers and
their FIFO freelist), `PageStreams` (the page streams and the host-cost caches of a copy),
`Releases` (page-outs whose device storage is still held, built on `PageStreams`) and
`SlotOrder` (the freelist's rule across the two page streams: a buffer's copies in order). This
module queues the copies themselves: one tensor (`page_out`, `page_in_launch`), or a node's
saved tensors as one group laid out by `group_plan` (`page_out_group`, `page_in_group`), each
under `SlotOrder`'s rule (a group's copies between `before` and `after`; one tensor's through
`PageStreams._queue_copy`, which asks `wait_for` and records `event`), and the compute stream's wait on a page-in
(`page_wait`, timed with `measure_waits`).
"""

from __future__ import annotations

import weakref
from typing import Any, Sequence

import torch

from . import pitched
from .groups import _contiguous, compact, extent, group_plan
from .paged import Paged, _check_restorable
from .release import Releases
from .slot_order import SlotOrder
from .slots import HostSlots
from .streams import capturing, record, wait


def empty_unfilled(shape: tuple, stride: tuple, dtype: torch.dtype, device: Any) -> torch.Tensor:
    """`torch.empty_strided(shape, stride)` on the current stream without torch's fill under
    deterministic algorithms. There torch fills every new tensor (NaN, or the largest integer) so
    that a kernel reading memory it never wrote is deterministic: a kernel per page-in on the
    compute stream (58 fill kernels a step on the GPU-bound Qwen3-MoE, H100,
    `benches/data/2026-12-05_h100/s11a/kernels.log`). A page-in's tensor is written whole by its
    copy before anything reads it (its reader waits on the copy); the gaps of a tensor with gaps
    are not filled by torch either. A storage of the tensor's extent is allocated and viewed
    (no process-wide setting changed: other threads keep their fills)."""
    if (not torch.are_deterministic_algorithms_enabled() or torch.device(device).type == "meta"
            or torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None):  # traced: no memory, no fill
        return torch.empty_strided(shape, stride, dtype=dtype, device=device)
    storage = torch.UntypedStorage(extent(tuple(shape), tuple(stride), dtype.itemsize), device=device)
    return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, shape, stride)


#: Pinned buffers of pools that ended during a CUDA graph capture, with their device: released
#: by the next `_settle` or pool made outside a capture, after a device synchronize.
_parked: list = []


def _release_parked() -> None:
    if _parked and not capturing():
        for dev in {d for d, _ in _parked}:
            torch.cuda.synchronize(dev)
        _parked.clear()


def _settle(device: Any, used: list, bufs: list) -> None:
    """A pool's end (its finalizer). A pitched copy, unlike torch's, does not tell torch's
    pinned-memory cache that its buffer is in use, and the host may be ahead of the GPU: a pool
    that queued one (`used[0]`) waits for its device before its buffers go back to that cache
    (a device synchronize: it covers copies of graph replays too). During a capture no host wait
    is allowed: the buffers are parked until the next pool is made or ends outside one."""
    if not used[0]:
        return
    if capturing():
        _parked.append((device, list(bufs)))
        return
    torch.cuda.synchronize(device)
    _release_parked()


def check_group_out(group_out: Any) -> None:
    """`group_out` (`HostPool`, `Pager`; compile option `paging_group_out`): an int >= 1."""
    if isinstance(group_out, bool) or not isinstance(group_out, int) or group_out < 1:
        raise ValueError(f"group_out must be an int >= 1 (page-outs queued behind one wait; 1: each at once), got {group_out!r}")


def wait_us(marks: list[tuple]) -> float:
    """Compute-stream time (us) between each (before, after) event pair of `take_figures`'
    `page_in_waits`; synchronizes on the last one."""
    if marks:
        marks[-1][1].synchronize()
    return sum(b.elapsed_time(a) for b, a in marks) * 1e3


class HostPool(HostSlots, Releases):
    """Host buffers allocated once (pinned when they serve a GPU), handed out from a freelist per
    byte size. Page copies take a buffer for a page-out and give it back right after queueing the
    page-in that reads it. Page-outs run on the page stream and page-ins on the page-in stream
    (`two_way`; else both on the page stream), and a buffer is rewritten or read only after its
    last copy has finished: `SlotOrder`'s per-buffer events, stream-order waits with no host
    synchronisation (on one stream, the stream's order). The freelist is FIFO, so the buffer
    handed out is the one whose last copy is most likely done. A step never allocates host
    memory: an empty freelist is an error (the pool was sized at calibration).
    `sizes`: one entry per buffer, in bytes; `device`: the device whose tensors it pages
    (pinned buffers for CUDA); `drain_distance`: page-outs that may hold device storage at once
    before the oldest is waited on and released; `two_way`: page-ins on their own stream.
    `Pager` and `Chunk.enable_paging` make their own; use one directly to page tensors by hand.

    Example:

        >>> import torch, sched_lifetime as sl
        >>> pool = sl.HostPool([4096, 4096], "cpu")
        >>> x = torch.arange(1024, dtype=torch.float32)
        >>> handle = pool.page_out(x)             # a buffer taken, the copy queued
        >>> pool.in_use()
        1
        >>> y = pool.page_in(handle)              # back, and the buffer free again
        >>> torch.equal(x, y), pool.in_use()
        (True, 0)
    """

    def __init__(self, sizes: list[int], device: Any = "cpu", drain_distance: int = 16, two_way: bool = False, group_out: int = 1) -> None:
        if drain_distance < 0:
            raise ValueError(f"drain_distance must be >= 0, got {drain_distance}")
        check_group_out(group_out)
        device = torch.device(device)
        HostSlots.__init__(self, sizes, pin=device.type == "cuda")
        Releases.__init__(self, device, drain_distance, two_way)
        #: The freelist's rule across the page streams (CUDA; a CPU copy is done when queued).
        self.slot_order: Any = SlotOrder(len(self._bufs)) if device.type == "cuda" else None
        if self.slot_order is not None:
            _release_parked()
            weakref.finalize(self, _settle, device, self._pitched_used, list(self._bufs)).atexit = False
        # Per-step figures (`take_figures`; the others are `HostSlots`' and `Releases`'): when
        # `measure_waits`, (before, after) timing events around each compute-stream wait on a
        # page-in.
        self.measure_waits = False
        self._wait_marks: list[tuple] = []
        #: Page-outs queued behind one wait (`flush_out`): on CUDA the page stream's wait for the
        #: compute stream makes the copy queued behind it cost the host 65-100 us while the
        #: compute stream still runs (the host ahead of the GPU), 11-14 us for the next copy
        #: behind the same wait (H200, `benches/copy_enqueue_cost.py`). `page_out` defers its
        #: copy until this many wait (1: each queued at once); a group is held and released as
        #: one (`Releases._hold`'s count).
        self.group_out = group_out
        self._deferred: list[tuple] = []  # (slot, source tensor, handle), save order
        self._deferred_owner: Any = None  # the stream they were produced on

    def page_out(self, t: torch.Tensor, owner: Any = None) -> Paged:
        """Copy `t` into a free host buffer (on the page stream after the compute stream's work
        so far, and after the buffer's last copy). On CUDA the device storage is kept alive by a
        lifetime manager until the copy is done: at a later save, unpack or page-out whose
        host-side check finds the copy finished (`release_done`), or, with more than
        `drain_distance` copies in flight, at once, the compute stream waits on the copy's
        event and the reference is dropped (rule 1, no record_stream, no host sync; the event
        query makes this path eager-only, as saved_tensors_hooks are). `owner`: the stream `t`
        was produced on (default: the current stream; a page node running on the page stream
        passes the compute stream). With `group_out` > 1 the copy is queued later, with the
        next page-outs, behind one wait (`flush_out`); the handle is good at once (a page-in
        queues what is deferred first)."""
        _check_restorable(t)
        nbytes = t.numel() * t.element_size()
        slot = self.take(nbytes)
        shape = tuple(t.shape)
        host = compact(shape, t.stride()) if self.pitched_copy and pitched.usable(t) else None  # one pitched copy each way
        p = Paged(slot, shape, t.stride(), t.dtype, t.device, t.requires_grad, nbytes, gen=self._gen[slot], host_stride=host)
        comp = (owner if owner is not None else self.current_stream()) if t.is_cuda else None
        if self._deferred and comp != self._deferred_owner:  # one wait covers one producing stream
            self.flush_out()
        self._deferred.append((slot, t.detach(), p))
        self._deferred_owner = comp
        if len(self._deferred) >= self.group_out:
            self.flush_out()
        return p

    def flush_out(self) -> None:
        """Queue the deferred page-outs' copies (`group_out`), in save order: on CUDA the page
        stream waits once for the work queued on their stream so far (which made them all), then
        each copy follows under the buffer rule (`SlotOrder`); one lifetime manager holds the
        group's device storage until its last copy is done (`_hold` with its count). Called by
        `page_out` when the group is full and by whatever needs the copies queued: a page-in,
        a release point past them, `drain`."""
        pend, self._deferred = self._deferred, []
        if not pend:
            return
        comp = self._deferred_owner
        if comp is None:  # CPU: plain copies
            for slot, src, p in pend:
                self.view_of(p).copy_(src)
                self._wrote[slot] = self.page_outs
                self.page_outs += 1
            return
        page = self.page_stream
        after = comp  # the group's one wait, queued with its first copy
        done = None
        for k, (slot, src, p) in enumerate(pend):
            self._wrote[slot] = self.page_outs + k
            if done is not None:
                self._spare.append(done)  # only the group's last copy-done event is waited on
            done = self._queue_copy(page, after, self.view_of(p), src, self.slot_order, slot)
            after = None
        # Held and released as one: one lifetime manager, one wait of the compute stream.
        self._hold([src for _, src, _ in pend], done, comp, page, count=len(pend))

    def page_in(self, p: Paged) -> torch.Tensor:
        """The tensor back on its device, allocated on the compute (consumer) stream; the
        compute stream waits for the copy (`page_in_launch` + `page_wait`)."""
        out, ev = self.page_in_launch(p)
        self.page_wait(ev)
        return out

    def page_in_launch(self, p: Paged, alloc_stream: Any = None) -> tuple:
        """Queue the copy back (on the page-in stream after the compute stream's work so far, and
        after the page-out that wrote the buffer) into a tensor with the paged-out one's shape
        and strides, allocated on the compute stream; returns it with the event to wait on
        before reading it (None on CPU). The buffer goes back to the freelist at once: the next
        page-out that takes it waits for this copy (`SlotOrder`). `alloc_stream`: the
        consumer's stream (default: the current stream)."""
        return self.page_in_launch_many([p], alloc_stream)[0]

    def page_in_launch_many(self, ps: Sequence[Paged], alloc_stream: Any = None) -> list[tuple]:
        """`page_in_launch` of several handles at one point of the compute stream, their copies
        behind one wait for it (the first copy queued behind such a wait costs the host 65-100
        us while the compute stream still runs, the next ones about 11-14: H200,
        `benches/copy_enqueue_cost.py`): every tensor is allocated first, then the page-in
        stream waits once and the copies follow, each under its buffer's rule (`SlotOrder`)
        with its own event. Returns (tensor, event) per handle, in order."""
        for p in ps:
            if not isinstance(p, Paged):
                raise ValueError(f"page_in: expected the handle page_out returned (a Paged), got {type(p).__name__}")
            self.check_handle(p.slot, p.gen, "page_in")
        self.flush_out()  # their copies out may still be deferred (`group_out`)
        cuda = bool(ps) and ps[0].device.type == "cuda"
        comp = page = None
        if cuda:
            comp, page = alloc_stream if alloc_stream is not None else self.current_stream(), self.page_in_stream
        with self._switched(comp if alloc_stream is not None else None):  # allocated on the current stream: no switch
            outs = [empty_unfilled(p.shape, p.stride, p.dtype, p.device) for p in ps]
        got = []
        after = comp  # the one wait, queued with the first copy
        for p, out in zip(ps, outs):
            ev = None
            if cuda:
                ev = self._queue_copy(page, after, out, self.view_of(p), self.slot_order, p.slot)
                after = None
            else:
                out.copy_(self.view_of(p))
            self.give(p.slot)
            if p.requires_grad and out.is_leaf:
                out.requires_grad_(True)
            got.append((out, ev))
        return got

    def page_out_group(self, ts: Sequence[torch.Tensor], owner: Any = None, ordered: bool = False, stream: Any = None) -> list[Paged]:
        """`page_out` of a node's saved tensors into one buffer laid out by `group_plan` (the
        pool was sized with it), with one copy-done event and one lifetime manager for them
        all (the host cost of one page-out, not one per tensor). `ordered`: the caller has
        already made the page stream wait for the work that produced `ts` (the executor's sync
        edge from the producing node), so the page stream does not also wait for everything
        queued on `owner` since. `stream`: the stream to copy on (default: the page stream;
        a page node passes the one the executor runs it on). Every page-out of a pool runs on
        one stream (`mark` counts on their order)."""
        for t in ts:
            _check_restorable(t)
        self.flush_out()  # page-out numbers follow the page stream's order
        plan = group_plan(ts)
        slot = self.take(plan.nbytes)
        buf = self._bufs[slot]
        self._wrote[slot] = self.page_outs
        cuda = bool(ts) and ts[0].is_cuda
        comp = page = None
        if cuda:
            comp, page = owner if owner is not None else self.current_stream(), stream if stream is not None else self.page_stream
            if not ordered:
                self._after(page, comp)
            self.slot_order.before(slot, page)
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
            record(done, page)
            self.slot_order.after(slot, page)
            self._hold(ts, done, comp, page)
        else:
            self.page_outs += 1
        return [
            Paged(slot, tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad, t.numel() * t.element_size(), off, packed, self._gen[slot])
            for t, (off, packed) in zip(ts, plan.places)
        ]

    def page_in_group(self, ps: Sequence[Paged], alloc_stream: Any = None, stream: Any = None) -> tuple:
        """`page_in_launch` of a `page_out_group`'s tensors: one device block allocated on the
        compute stream (the consumer's), one host->device copy of the whole buffer; each tensor
        comes back on the block's storage with its strides (views of one storage alias again),
        a packed one scattered into its own tensor on the page-in stream (`stream`: the stream
        to copy on instead; a page node passes the one the executor runs it on). Returns the
        tensors and the event to wait on (None on CPU). The buffer goes back to the freelist at
        once (the next page-out into it waits for this copy: `SlotOrder`)."""
        if not ps:
            return [], None
        if not all(isinstance(p, Paged) for p in ps):
            raise ValueError("page_in_group: expected the handles page_out_group returned (Paged)")
        slot = ps[0].slot
        if any(p.slot != slot for p in ps):
            raise ValueError("page_in_group: the tensors were not paged out as one group")
        self.check_handle(slot, ps[0].gen, "page_in_group")
        dev = ps[0].device
        cuda = dev.type == "cuda"
        host = self._bufs[slot]
        comp = page = None
        if cuda:
            comp = alloc_stream if alloc_stream is not None else self.current_stream()
            page = stream if stream is not None else self.page_in_stream
        # When every tensor comes back packed, no output keeps the block alive: it is freed when
        # this call returns, while the page stream may still copy into and out of it. Allocated
        # on the page stream, it goes back to the page stream's pool, where later work queues
        # behind these copies; otherwise the outputs are views of it and keep it until consumed.
        scratch = all(p.packed for p in ps)
        with self._switched(page if scratch else comp):
            block = empty_unfilled((host.numel(),), (1,), torch.uint8, dev)
        storage = block.untyped_storage()

        def on_block(p: Paged, stride: tuple) -> torch.Tensor:
            return torch.empty(0, dtype=p.dtype, device=dev).set_(storage, p.offset // p.dtype.itemsize, p.shape, stride)

        with self._switched(comp):
            outs = [empty_unfilled(p.shape, p.stride, p.dtype, dev) if p.packed else on_block(p, p.stride) for p in ps]
        ev = None
        if cuda:
            self._after(page, comp)
            self.slot_order.before(slot, page)
        with self._switched(page):
            block.copy_(host, non_blocking=cuda)
            if cuda:
                self.slot_order.after(slot, page)  # the scatters below read the device block only
            for o, p in zip(outs, ps):
                if p.packed:
                    o.copy_(on_block(p, _contiguous(p.shape)))
        if cuda:
            ev = self._event()
            record(ev, page)
        self.give(slot)
        outs = [o.detach().requires_grad_(True) if p.requires_grad else o for o, p in zip(outs, ps)]
        return outs, ev

    def abandon(self) -> None:
        """A step cut short between page-outs and page-ins: the current (compute) stream waits
        for every copy queued on the page streams (a page-in launched but never waited on still
        writes a block the allocator may hand out again once its tensor is dropped), then every
        page-out's device storage is released and every buffer given back. Stream-order waits,
        no host sync; the next step finds the pool whole."""
        self._deferred = []  # never queued: their buffers come back below, their tensors go
        try:
            if self.device.type == "cuda":
                comp, out, inn = self.current_stream(), self.page_stream, self.page_in_stream
                self._after(comp, out)
                if inn != out:
                    self._after(comp, inn)
            self.drain()
        finally:
            self.reclaim()

    def page_wait(self, ev: Any) -> None:
        """The compute stream waits for a page-in (no host sync). With `measure_waits`, timing
        events recorded on the compute stream just before and just after the wait measure how
        long it stalled there (`take_figures` reads them)."""
        if ev is not None:
            comp = self.current_stream()
            if self.measure_waits:
                before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                record(before, comp)
                wait(ev, comp)
                record(after, comp)
                self._wait_marks.append((before, after))
            else:
                wait(ev, comp)

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
        self.peak_taken_bytes, self.peak_out_in_flight = self._taken_bytes, self._held
        return out
