"""When a page-out's device storage is released: after its copy, in page-stream order (`Releases`).

A page-out's device storage must outlive its copy to the host, which runs on the page stream.
Instead of `record_stream`, a `LifetimeManager` holds it (owner: the stream that produced it,
retired on the page stream with `drop_reference`) until a release point: a host-side check
that finds the copy done, a calibrated plan's release point, a page-in the compute stream
waited for that proves the copy done (`mark`), or too many copies in flight. There the owner
stream waits on the copy's event (free when it is done: no host sync) and the reference is
dropped (DESIGN.md §2, rule 1).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from ..lifetime import LifetimeManager
from .streams import PageStreams, capturing, query


class Releases(PageStreams):
    """Page-outs whose device storage is still held, oldest first, numbered in the order they
    were queued on the page stream (`page_outs`, `mark`), and the ways to release them; a
    released page-out's copy-done event becomes a spare (`PageStreams._event`)."""

    def __init__(self, device: Any = "cpu", drain_distance: int = 16, two_way: bool = False) -> None:
        PageStreams.__init__(self, device, two_way)
        # Page-outs whose device storage is still held: (manager, copy-done event, owner stream,
        # number of its first page-out, how many page-outs: a group queued behind one wait is
        # held and released as one, `HostPool.flush_out`), in page-stream order.
        self._retiring: list[tuple[LifetimeManager, Any, Any, int, int]] = []
        self._held = 0  # page-outs whose device storage is held (the counts in `_retiring`)
        self.page_outs = 0  # page-outs queued so far (numbers them; `mark` reads it)
        self._wrote: dict[int, int] = {}  # host slot -> the number of the last page-out into it
        self.drain_distance = drain_distance
        self.released = 0  # page-outs whose device storage was released, in all
        self.forced_drains = 0  # releases forced by `drain_distance` (the compute stream may stall)
        self.peak_out_in_flight = 0  # a per-step figure: page-outs holding device storage at once

    def flush_out(self) -> None:
        """Queue deferred page-outs (`HostPool`; none here)."""

    def _hold(self, ts: Sequence[torch.Tensor], done: Any, comp: Any, page: Any, count: int = 1) -> None:
        """A page-out queued (its copies end at `done` on `page`): a lifetime manager holds the
        device storage of `ts` (owner `comp`, each storage once: a node may save two views of
        one tensor) until its release. Then what the link has already copied is released (the
        compute stream's wait on a finished copy costs nothing), oldest first; only past
        `drain_distance` page-outs holding storage does the compute stream wait on one at once
        (the copies fall behind the forward). `count`: how many page-outs `ts` are (a group
        behind one wait, released together by one wait of the compute stream)."""
        held = list(ts) if len(ts) == 1 else list({t.untyped_storage().data_ptr(): t for t in ts}.values())
        m = LifetimeManager("page_out")
        m.retire(held, page, "drop_reference", owner_stream=comp)  # bound and retired in one call
        self._retiring.append((m, done, comp, self.page_outs, count))
        self.page_outs += count
        self._held += count
        self.peak_out_in_flight = max(self.peak_out_in_flight, self._held)
        while self._held > self.drain_distance and self._retiring:
            self.forced_drains += 1
            self._drain_one()
        self.release_done()

    def _drain_one(self) -> None:
        m, done, owner, _, count = self._retiring.pop(0)  # the owner stream waits on the copy, then releases
        m.acquire(owner)
        m.finalize()
        m.close()
        self._spare.append(done)  # the acquire's wait on the copy is queued
        self.released += count
        self._held -= count

    def release_until(self, n: int) -> None:
        """Release the oldest page-outs until `n` have been released in all (a calibrated
        plan's release points: there the copy is done by the measured timeline, so the compute
        stream's wait costs nothing). Deferred page-outs (`HostPool.group_out`) it reaches are
        queued first; a group held as one goes once all of it is due."""
        if self.released + self._held < n:
            self.flush_out()
        while self._retiring and self.released + self._retiring[0][4] <= n:
            self._drain_one()

    def release_done(self) -> None:
        """Release the device storage of every page-out whose copy has finished, oldest first
        (the compute stream's wait on a finished copy costs nothing). Cheap: call it often.
        Under CUDA graph capture it does nothing (an event query is not allowed there; the
        capture-safe release points are `release_queued_before` and `drain`)."""
        if self._retiring and capturing():
            return
        while self._retiring and query(self._retiring[0][1]):
            self._drain_one()

    def mark(self, slot: Optional[int] = None) -> int:
        """Taken when a page-in of host slot `slot` is queued: the page-outs numbered below it
        are done once that page-in is. On one page stream, every page-out queued so far (the
        stream runs them before the page-in); two-way, those up to the one that wrote `slot`
        (the page-in waited for it: `SlotOrder`; page-outs run in order on their stream)."""
        if self.two_way and slot is not None:
            return self._wrote.get(slot, -1) + 1
        return self.page_outs

    def release_queued_before(self, mark: int) -> None:
        """Release every page-out numbered below `mark` (a page-in's `mark`), once the compute
        stream has waited for that page-in: their copies are done by then, so the wait each
        release queues finds its copy done. No query, no host sync: capture-safe."""
        while self._retiring and self._retiring[0][3] + self._retiring[0][4] <= mark:
            self._drain_one()

    def drain(self) -> None:
        """Queue what is deferred, then release every page-out's device storage still held (the
        compute stream waits on the copies first)."""
        self.flush_out()
        while self._retiring:
            self._drain_one()
