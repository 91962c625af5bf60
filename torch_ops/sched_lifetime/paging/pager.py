"""The eager pager: saved activations paged to host memory and back through `saved_tensors_hooks`.

Wiring only: what to page is Rust's choice (`page_plan`).

`Pager` wraps a plain module's forward and backward:

    pager = sl.Pager(budget={"fraction": 0.5})
    for batch in data:
        with pager.step():
            loss = model(batch); loss.backward()

The first step with a backward calibrates: it records the live prefix (every tensor autograd saves, its bytes,
its save order and the backward order of its first use) and asks Rust (`page_plan`) what to
page. Host buffers are then allocated once (pinned on CUDA), never during a step. Later steps
copy the chosen tensors to their host buffer when autograd saves them and back when the
backward unpacks them; the rest stay on the device. On CUDA page-outs run on the page stream
and page-ins on the page-in stream (`SideStreams`; `two_way=False`: both on the page stream), so
the backward's page-ins run beside page-outs still draining from the forward. The device
storage of a paged-out tensor is released through the lifetime manager (owner: the compute
stream, retired on the page stream with `drop_reference`), and the host buffers come from a
`HostPool`: a buffer is given back right after the page-in that reads it is queued, and the
next page-out into it waits for that read on the GPU (`SlotOrder`: an event per buffer, no host
sync). On CPU the copies are plain.

A step whose saved tensors differ from the calibration (count, shape or dtype) raises: no
silent fallback. A saved tensor changed in place after its save raises at its unpack, as
autograd's version check does in eager (saved_tensors_hooks turn that check off): every kept
one, and a paged one while anything still holds it (else its host copy is the value saved). A step that raises between page-outs and page-ins loses nothing: the compute
stream waits for the copies in flight, every page-out's storage is released and every host
buffer comes back (`HostPool.abandon`); the next step runs as usual (a calibration step that
raises, or runs no backward, is not counted: the next step calibrates). `stats()` gives bytes out and in (equal every step) and the host bytes held;
`per_step()` per step: bytes out and in, host bytes in use at once, page-outs in flight at once,
and (`measure_waits=True`) the time the compute stream waited on page-ins.
"""

from __future__ import annotations

import bisect
import contextlib
import warnings
from typing import Any, Iterator, Optional

import torch

from .calibrate import Calibration
from .paged import Paged, SavedVersion, pageable
from .plan import Budget, explain_plan, page_plan
from .pool import HostPool, check_group_out, wait_us


def _check_settings(
    budget: Budget, drain_distance: int, prefetch: int, slack: float, min_bytes: int = 0, min_distance: int = 1, flags: Optional[dict] = None,
    group_out: int = 1,
) -> None:
    """A `Pager`'s settings checked at construction: an error names the setting and its range
    (the budget by Rust's own parser, as the plan will read it)."""
    page_plan([], budget)  # validate now, not after the calibration step
    if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
        raise ValueError(f"min_bytes must be an int >= 0 (bytes; smaller saved tensors stay on the device), got {min_bytes!r}")
    if isinstance(min_distance, bool) or not isinstance(min_distance, int) or min_distance < 0:
        raise ValueError(f"min_distance must be an int >= 0 (backward steps, see Pager), got {min_distance!r}")
    if isinstance(drain_distance, bool) or not isinstance(drain_distance, int) or drain_distance < 0:
        raise ValueError(f"drain_distance must be an int >= 0 (page-outs in flight), got {drain_distance!r}")
    for name, v in (flags or {}).items():
        if not isinstance(v, bool):
            raise ValueError(f"{name} must be True or False, got {v!r}")
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be an int >= 0 (backward unpacks ahead), got {prefetch!r}")
    if isinstance(slack, bool) or not isinstance(slack, (int, float)) or not slack >= 1:
        raise ValueError(f"slack must be a number >= 1, got {slack!r}")
    check_group_out(group_out)



def outside_dynamo(*hooks: Any) -> list:
    """Saved-tensor hooks that torch.compile never traces. Autograd calls them from whatever
    frame saves a tensor; in a compiled model a graph break (transformers' eager experts loop)
    runs that frame eagerly with Dynamo's frame callback on, and Dynamo then compiled the hook
    itself as user code (a new user's trial: `BackendCompilerFailed: 'NoneType' object has no
    attribute 'is_leaf'` in `is_weight`, under aot_eager as under our backend)."""
    return [torch._dynamo.disable(h, recursive=True) for h in hooks]


class Pager:
    """Pages saved activations out to pinned host memory during the forward and back before
    their backward use, through `saved_tensors_hooks` around an ordinary forward + backward;
    Rust chooses what to page (see the module docstring; guide: docs/paging.md). The first
    step calibrates (two when timed on CUDA); later steps page. `budget`: a fraction of the
    calibrated live prefix (float in [0, 1]), bytes (int), or `{"fraction": f}` /
    `{"bytes": n}`.

    Example (CPU: plain copies, the same arithmetic):

        >>> import torch, sched_lifetime as sl
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
        >>> pager = sl.Pager(budget=0.5, timed=False, min_bytes=1024)
        >>> for step in range(3):                 # step 0 calibrates, steps 1-2 page
        ...     with pager.step():
        ...         model(torch.randn(32, 64)).square().mean().backward()
        >>> st = pager.stats()
        >>> st["steps"], st["bytes_out"] == st["bytes_in"] > 0
        (3, True)
        >>> print(pager.explain().splitlines()[0])
        paging 2 tensors, 40960 of 81920 bytes (target 40960)
    """

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
        two_way: bool = False,
        count_host: bool = True,
        group_out: int = 1,
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
        ahead. `two_way` (CUDA): page-ins on their own stream, beside the page-outs (the
        link's two directions at once; a timed plan is made with the two-way rate and may let
        page-outs end in the backward); False: one page stream for both (the baseline).
        `count_host` (timed): calibration also measures the host time one page-out and its
        page-in take, and a tensor whose copy is shorter stays on the device (its host calls
        would cost the step more than the link does); False: any tensor that hides may be paged.
        `group_out` (CUDA): page-outs whose copies are queued together behind one wait for the
        compute stream (`HostPool.group_out`): on a step whose host runs ahead of the GPU the
        first copy behind such a wait costs the host 65-100 us, the next ones 11-14 (H200,
        `benches/copy_enqueue_cost.py`); the copies start when the group's last tensor is
        made, not each when its own is, and the group's device storage is held and released
        as one (one wait of the compute stream) once all of it is due. A page-in, a release
        point or the backward's first use queues what waits. 1: each page-out queued at its
        save. (Page-ins due at one point of the backward always go behind one wait.)"""
        _check_settings(
            budget, drain_distance, prefetch, slack, min_bytes, min_distance,
            {"timed": timed, "measure_waits": measure_waits, "two_way": two_way, "count_host": count_host}, group_out,
        )
        self.group_out = group_out
        self.prefetch = prefetch
        self.two_way = bool(two_way)
        self._calib = Calibration(bool(timed), float(slack), self.two_way, bool(count_host))
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
        self._page: set[int] = set()
        self._index = 0
        self._unpacks = 0
        self._stats = {"steps": 0, "bytes_out": 0, "bytes_in": 0, "bytes_abandoned": 0, "host_bytes": 0, "max_prefetched": 0, "kept_unlike_calibration": 0}
        self._warned_unlike = False
        self._shapes: list = []
        self._step_start = (0, 0)
        self._paging_step = False
        self.measure_waits = bool(measure_waits)
        self._per_step: list[dict] = []

    @property
    def timed(self) -> bool:
        """Whether calibration measures the memory and time lines on CUDA (set at construction)."""
        return self._calib.timed

    @property
    def slack(self) -> float:
        """How many times slower than measured a timed plan takes the copies (set at construction)."""
        return self._calib.slack

    # -- hooks -------------------------------------------------------------------------

    def _pack(self, t: torch.Tensor) -> Any:
        i = self._index
        self._index += 1
        pool = self.pool
        if pool is not None and not self._release_at:
            pool.release_done()  # untimed: every save is a chance to free what the link has copied
        if self.plan is None:  # calibrating: record, keep
            self._calib.save(i, t)
            return ("keep", i, t, SavedVersion(t, held=True))
        shapes = self._shapes
        unlike = i >= len(shapes) or t.shape != shapes[i][0] or t.dtype != shapes[i][1]
        if unlike and i in self._page:  # its host buffer was sized at calibration: it stays on the device
            self._stats["kept_unlike_calibration"] += 1
            if not self._warned_unlike:
                self._warned_unlike = True
                warnings.warn(
                    f"Pager: saved tensor #{i} is {tuple(t.shape)} {t.dtype}, calibration saw "
                    f"{shapes[i] if i < len(shapes) else 'nothing'}: kept on the device (its host buffer was sized at "
                    "calibration; said once, counted in stats()['kept_unlike_calibration']). The plan matches saved "
                    "tensors by save index: for a new input shape make a new Pager; where shapes follow the data (an "
                    "MoE's eager experts loop) it pages what still matches",
                    stacklevel=2,
                )
        if unlike or i not in self._page or not pageable(t):
            packed: Any = ("keep", i, t, SavedVersion(t, held=True))
        else:
            p = pool.page_out(t)
            self._handles[i] = p
            self._stats["bytes_out"] += p.nbytes
            packed = ("paged", i, None, SavedVersion(t))
        if self._release_at and i >= self._next_release:  # the plan's release points up to this save
            rel = self._release_at
            k = bisect.bisect_right(rel, i)
            pool.release_until(self._released0 + k)
            self._next_release = rel[k] if k < len(rel) else 1 << 62
        return packed

    def _unpack(self, packed: Any) -> torch.Tensor:
        kind, i = packed[0], packed[1]
        if len(packed) > 3:  # autograd's version check, which saved_tensors_hooks turn off
            packed[3].check(f"saved tensor #{i} of this step")
        if self.plan is None:
            self._calib.unpack(i, self._unpacks)
            self._unpacks += 1
            return packed[2]
        u = self._unpacks
        self._unpacks += 1
        pool = self.pool
        if pool is not None:
            pool.flush_out()  # the backward started: the forward's last page-outs go now (if any wait)
            pool.release_done()
        # Prefetch: page-ins of the tensors read within `prefetch` unpacks from now are queued
        # now, so the copy runs under the backward's compute; the wait stays at the use.
        order = self._in_order
        due = self._next_in
        while self._next_in < len(order) and self._launch_at[order[self._next_in]] <= u:
            self._next_in += 1
        if self._next_in > due:  # the page-ins due here, behind one wait (`page_in_launch_many`)
            self._launch_in(order[due : self._next_in])
        if kind == "keep":
            return packed[2]
        if i not in self._ready:
            if i not in self._handles:
                raise RuntimeError(f"paging: saved tensor #{i} unpacked twice (retain_graph is not supported with paging)")
            self._launch_in([i])
        out, ev = self._ready.pop(i)
        pool.page_wait(ev)
        pool.recycle(ev)
        return out

    def _launch_in(self, idx: list[int]) -> None:
        """Queue the page-ins of save indices `idx` (one point of the backward: one wait)."""
        idx = [i for i in idx if i in self._handles]  # one not paged out this step (yet): its use pages it in
        if not idx:
            return
        ps = [self._handles.pop(i) for i in idx]
        for i, p, got in zip(idx, ps, self.pool.page_in_launch_many(ps)):
            self._ready[i] = got
            self._stats["bytes_in"] += p.nbytes
        self._stats["max_prefetched"] = max(self._stats["max_prefetched"], len(self._ready) - 1)

    # -- steps -------------------------------------------------------------------------

    @contextlib.contextmanager
    def step(self) -> Iterator["Pager"]:
        """One forward + backward with the hooks on; the first one calibrates (the first two
        when timed on CUDA)."""
        hooks = outside_dynamo(self._pack, self._unpack)  # before the step starts (the first call imports torch._dynamo)
        self.begin()
        ok = False
        try:
            with torch.autograd.graph.saved_tensors_hooks(*hooks):
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
        if self.plan is None:
            self._calib.start()  # timed: the first memory interval starts with the step
        self._next_release = self._release_at[0] if self._release_at else 0
        self._step_start = (self._stats["bytes_out"], self._stats["bytes_in"])
        self._paging_step = self.plan is not None  # calibrated: this step pages

    def end(self, ok: bool = True) -> None:
        """End a step after its backward (`ok`: it ran to the end): calibration moves on,
        bytes out must equal bytes in; every page-out's storage released, every buffer back."""
        try:
            if not ok:  # what this step paged out and never in: given back with the pool, counted
                out0, in0 = self._step_start
                self._stats["bytes_abandoned"] += (self._stats["bytes_out"] - out0) - (self._stats["bytes_in"] - in0)
                if self.plan is None:  # a calibration step cut short: the next step calibrates afresh
                    self._calib.abort()
                return
            if self.plan is None:
                if not self._calib.had_backward():  # a forward alone: the next step calibrates
                    self._calib.abort()
                elif self._calib.finish_step():  # else the next step measures the timeline
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
                if ok:
                    self.pool.drain()
                    self.pool.reclaim()
                else:  # cut short: copies in flight are waited for, nothing stays taken
                    try:
                        self.pool.abandon()  # before the unwaited page-ins' tensors are dropped
                    finally:
                        for _, ev in self._ready.values():
                            self.pool.recycle(ev)
                        self._ready.clear()
                        self._handles.clear()

    def _calibrate(self) -> None:
        cal = self._calib
        timing = cal.timing() if self.timed else None
        prefix = cal.prefix(self.min_bytes)
        #: What the plan was made from (Rust's inputs), to print or to plan again with.
        self.calibration = {"prefix": prefix, "budget": self.budget, "min_distance": self.min_distance, "timing": timing}
        self.plan = page_plan(prefix, self.budget, self.min_distance, timing)
        self.plan["timing"] = timing
        paged = [int(n[1:]) for n in self.plan["page"]]
        self._page = set(paged)
        self._launch_at, self._in_order = cal.launches(paged, None if timing is None else self.plan["launch_at"], self.prefetch)
        self._release_at = list(self.plan["release_at"]) if timing is not None else []
        self._shapes = [(c["shape"], c["dtype"]) for c in cal.saved]
        page = sorted(self._page)
        if page:
            sizes, dev = cal.host_buffers(page)
            # A timed plan places every release; the count-based drain is only a backstop.
            drain = len(page) if timing is not None else self.drain_distance
            self.pool = HostPool(sizes, dev, drain, two_way=self.two_way, group_out=self.group_out)
            self.pool.measure_waits = self.measure_waits and dev.type == "cuda"
            self.pool.take_figures()  # figures start with the first paged step
            self._stats["host_bytes"] = self.pool.bytes
        cal.saved = []

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
        """Bytes paged out and in, host bytes held, steps, and the most page-ins queued ahead of
        their use at once (prefetch). `bytes_out == bytes_in + bytes_abandoned`: a step cut short
        by an exception counts what it paged out and never back in as abandoned (its buffers
        are given back all the same)."""
        return dict(self._stats)

    def explain(self) -> str:
        """What calibration chose, one line per saved tensor."""
        return "not calibrated yet" if self.plan is None else explain_plan(self.plan)
