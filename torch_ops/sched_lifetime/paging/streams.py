"""The page streams, reached cheaply: stream switches, stream-order waits and copy-done events (`PageStreams`).

Page-outs (device -> host) are queued on the page stream (`SideStreams.page`) and page-ins
(host -> device) on the page-in stream (`SideStreams.page_in`), so the link's two directions run
at once; `two_way=False` queues both on the page stream (one direction at a time, the baseline).
What a copy needs around it (the current stream, a switch onto a page stream and back, a wait
for the compute stream's work so far, an event recorded after it) is cached here: through
`torch.cuda`'s Python API a page copy costs tens of microseconds of host time. CUDA only; on
CPU the pool copies without any of it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from .._ops import direct
from . import pitched
from ..executor import TWO_WAY_CAPTURE, SideStreams



def _event_calls(base: Any) -> tuple:
    """A page copy's event calls, (event, stream) arguments: `base`'s C methods (torch's
    `_CudaEventBase`: `Event.record(stream)` and `Stream.wait_event(event)` without the Python
    frames torch.cuda's wrappers add, several per copy), or, where `base` has none (a CPU-only
    torch build puts a placeholder class there; the pool makes no event on CPU), the events'
    own methods."""
    if all(hasattr(base, m) for m in ("record", "wait", "query")):
        return base.record, base.wait, base.query
    return (lambda ev, stream: ev.record(stream)), (lambda ev, stream: ev.wait(stream)), (lambda ev: ev.query())


record, wait, query = _event_calls(getattr(torch._C, "_CudaEventBase", None))
# The one-call page copy (cpp/direct.cc): None where the library predates it.
_page_copy = getattr(direct, "page_copy", None)
capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False)


class PageStreams:
    """The page streams of `device` and the host-cost caches of the copies queued on them: the
    last current stream seen (by its raw id), one re-recorded event for stream-order waits
    (`_after`) and spare copy-done events (`_event`, `recycle`). `two_way`: page-ins on their
    own stream (else on the page stream, behind the page-outs)."""

    def __init__(self, device: Any = "cpu", two_way: bool = False) -> None:
        self.device = torch.device(device)
        self.two_way = bool(two_way)
        self._mark: Any = None  # the event `_after` re-records (made at its first use)
        self._page: Any = None
        self._page_in: Any = None
        self._cur: tuple = (None, None)
        self._spare: list = []
        #: Whether a pitched copy was queued (a list: a pool's finalizer holds it, not the pool).
        self._pitched_used = [False]

    @property
    def page_stream(self) -> Any:
        """The stream this pool's page-outs run on (None on CPU)."""
        if self._page is None and self.device.type == "cuda":
            self._page = SideStreams.of(self.device).page
        return self._page

    @property
    def page_in_stream(self) -> Any:
        """The stream this pool's page-ins run on: the page-in stream, or with `two_way` off the
        page stream (None on CPU). Two-way under CUDA graph capture is refused (`TWO_WAY_CAPTURE`)."""
        if self.two_way and self.device.type == "cuda" and capturing():
            raise RuntimeError(TWO_WAY_CAPTURE)
        if self._page_in is None and self.device.type == "cuda":
            self._page_in = SideStreams.of(self.device).page_in if self.two_way else self.page_stream
        return self._page_in

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

    #: Queue a copy and its waits and records in one native call (`_queue_copy`, the default);
    #: False: the same calls one by one from Python. On the H200 (2026-12-05, `bash
    #: benches/gpu_pass.sh s9a OUT`) the poison tests passed both ways and a page-out + page-in
    #: took 37.9 us of host against 44.6 (`benches/page_host_parts.py`).
    native_copy = True
    #: A tensor with one level of gaps (a slice of a wider one) copied by the copy engine alone
    #: (`pitched.py`: one `cudaMemcpy2DAsync`, no gather or scatter kernel, no device temporary);
    #: False: torch's copy_ (the A/B's other arm).
    pitched_copy = True

    def _queue_copy(self, page: Any, comp: Any, dst: torch.Tensor, src: torch.Tensor, order: Any, slot: int) -> Any:
        """`dst.copy_(src)` queued on `page` after the work queued on `comp` so far (None: the
        caller queued that wait, `HostPool.flush_out`) and after host slot `slot`'s last copy
        on another stream (`order`: the pool's `SlotOrder`), with the slot's event recorded
        behind it; returns the copy-done event. One native call
        (`page_copy`) once the events involved exist (each is created by its first record,
        which the calls from Python make); the same CUDA calls either way."""
        done = self._event()
        w = order.wait_for(slot, page)  # the slot rule, asked once for either way of queueing
        two_d = None if dst.is_contiguous() and src.is_contiguous() or not self.pitched_copy else pitched.plan(dst, src)
        mark = self._mark
        if two_d is None and self.native_copy and _page_copy is not None and (mark is not None or comp is None):
            h_mark, h_done, h_slot = 0 if comp is None else mark.cuda_event, done.cuda_event, order.event(slot).cuda_event
            h_wait = 0 if w is None else w.cuda_event
            if (h_mark or comp is None) and h_done and h_slot and (w is None or h_wait):
                if _page_copy(dst, src, page, comp, h_mark, h_wait, h_done, h_slot) is not NotImplemented:
                    order.recorded(slot, page)
                    return done
        # The calls from Python: a pitched copy, or not a plain tensor, or an event not created yet.
        if comp is not None:
            self._after(page, comp)
        order.queue_wait(w, page)
        if two_d is not None:
            self._pitched_used[0] = True
        if two_d is None or not pitched.queue(two_d, page):  # a pitched copy the runtime refused: torch's, on the same stream
            prev = self._on(page)
            try:
                dst.copy_(src, non_blocking=True)
            finally:
                self._back(prev)
        record(done, page)
        order.after(slot, page)
        return done

    def _event(self) -> Any:
        """A copy-done event: a spare one (its last record was waited on) or a new one."""
        return self._spare.pop() if self._spare else torch.cuda.Event()

    def recycle(self, ev: Any) -> None:
        """Give back a copy-done event once its wait is queued (a later record does not change
        what an earlier wait waits for)."""
        if ev is not None:
            self._spare.append(ev)

    def _after(self, page: Any, comp: Any) -> None:
        """`page` waits for the work queued on `comp` so far (`Stream.wait_stream` without its
        new event per call: one event, re-recorded; a wait takes the record it sees)."""
        ev = self._mark
        if ev is None:
            ev = self._mark = torch.cuda.Event()
        record(ev, comp)
        wait(ev, page)
