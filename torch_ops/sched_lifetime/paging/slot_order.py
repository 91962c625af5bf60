"""A host buffer's copies kept in order across the two page streams (`SlotOrder`): the freelist's rule.

The rule: a host buffer (a slot of the pool) is rewritten or read only after the last copy that
touched it has finished. A page-in reading slot X finishes before a later page-out writes X; a
page-out writing X finishes before a page-in reads X. On one page stream this came free: the
freelist hands a buffer out again only after queueing the copy that last read it, and the stream
runs copies in the order they were queued. Page-outs and page-ins on two streams (one per
direction of the link, so both directions run at once) lose that order, and it is kept here:

- after every copy that touches slot X, X's event is recorded on that copy's stream;
- before the next copy that touches X, if it is queued on another stream than X's last copy,
  that stream waits on X's event (a stream-order wait: no host sync). On the same stream, the
  stream's own order suffices and no wait is queued.

One event per slot is enough: a wait takes the record the event has when the wait is queued,
and the event is recorded again only after the next copy, which already waits on the record
before. The events are made with the pool, never during a CUDA graph capture.

Captures: an event recorded outside a capture cannot be waited on inside it, nor one recorded in
a capture outside it (or in another capture). A slot's last copy is remembered with the epoch it
was queued in (a new epoch each time the copies see capturing start or stop); across epochs the
wait is left out, and the order comes from the step's edges instead: a step ends with the
compute stream after every copy it queued (each page-in is waited on, each page-out drained, and
a step cut short waits for both page streams: `HostPool.abandon`), and a captured step replays
behind the compute stream's earlier work, the eager work after it behind the whole replay.

`HostPool` (pool.py) calls `before` and `after` around a group's copies, and for one tensor's
copy `PageStreams._queue_copy` asks `wait_for` and, once its one native call queued the copy
with the wait and the records, says `recorded` (the same rule, queued by the caller); the stream and event
objects are whatever it passes (anything with `wait_event(event)` and `record(stream)`), so the
bookkeeping is tested on the CPU with stand-ins (tests/python/test_paging_slot_order.py).
"""

from __future__ import annotations

from typing import Any, Callable, Optional


class SlotOrder:
    """Per slot, the stream and capture epoch of its last copy and an event recorded after it;
    `before` queues the wait the rule needs, `after` records."""

    def __init__(self, slots: int, event: Optional[Callable[[], Any]] = None, capturing: Optional[Callable[[], bool]] = None) -> None:
        # CUDA events are recorded and waited on through the raw calls (streams.py); stand-ins
        # (the CPU tests) through their methods. `capturing`: whether a CUDA graph capture is
        # under way (default: on the current CUDA stream).
        self._record: Callable[[Any, Any], None] = lambda ev, stream: ev.record(stream)
        self._wait: Callable[[Any, Any], None] = lambda ev, stream: stream.wait_event(ev)
        if event is None:
            import torch

            from .streams import record, wait

            event, self._record, self._wait = torch.cuda.Event, record, wait
        if capturing is None:
            from .streams import capturing

        self._events = [event() for _ in range(slots)]  # made now: never during a capture
        self._last: list[Optional[tuple[Any, int]]] = [None] * slots  # (stream, epoch) of the slot's last copy
        self._capturing = capturing
        self._was_capturing = False
        self._epoch = 0
        #: Waits queued so far (a copy on another stream than its slot's last one).
        self.waits = 0

    def before(self, slot: int, stream: Any) -> None:
        """A copy touching `slot` is about to be queued on `stream`: if the slot's last copy ran
        on another stream (in this epoch), `stream` waits for it."""
        self.queue_wait(self.wait_for(slot, stream), stream)

    def queue_wait(self, ev: Any, stream: Any) -> None:
        """`stream` waits on `ev` (`wait_for`'s answer; None: nothing to wait for)."""
        if ev is not None:
            self._wait(ev, stream)

    def wait_for(self, slot: int, stream: Any) -> Any:
        """`before`'s rule without queueing the wait: the event `stream` must wait on before a
        copy touching `slot` (its last copy ran on another stream in this epoch), or None. The
        caller queues the wait (the pool's one-call copy, `PageStreams._queue_copy`)."""
        cap = bool(self._capturing())
        if cap != self._was_capturing:  # a capture starts or ends: earlier records are not waited on
            self._was_capturing = cap
            self._epoch += 1
        last = self._last[slot]
        if last is not None and last[1] == self._epoch and last[0] != stream:
            self.waits += 1
            return self._events[slot]
        return None

    def event(self, slot: int) -> Any:
        """The event recorded after `slot`'s copies (`after`; `recorded` when the caller records it)."""
        return self._events[slot]

    def after(self, slot: int, stream: Any) -> None:
        """A copy touching `slot` was queued on `stream` (after `before`): record the slot's event
        behind it."""
        self._record(self._events[slot], stream)
        self.recorded(slot, stream)

    def recorded(self, slot: int, stream: Any) -> None:
        """The caller recorded `event(slot)` on `stream` after a copy touching `slot`."""
        self._last[slot] = (stream, self._epoch)
