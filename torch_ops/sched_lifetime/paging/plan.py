"""Rust's paging plan: the budget, the measured timing it is made with, and its explanation.

`page_plan` hands Rust a live prefix (every saved tensor's bytes, save order and first backward
use), a budget and, when measured, the step's timeline and the link's rates (`link_rates`: each
direction alone and, for a two-way pager, both at once); Rust answers with the tensors to page
and, timed, where each page-out is released and each page-in launched. `explain_plan` prints
the answer. `page_host_us` measures what one page-out and its page-in cost the host: the timed
plan keeps a tensor whose copy is shorter than that.
"""

from __future__ import annotations

import json
import math
import os
import sys
import warnings
import time
from typing import NamedTuple, Optional, Union

import torch

from .._ops import ops

Budget = Union[dict, float, int]


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


#: Where a frame is not the user's: this package, torch (a compiled model's pager is made inside
#: torch.compile's first call) and code torch generates (`<eval_with_key>.N`).
_LIBRARY = (_PACKAGE + os.sep, os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)


def _outside_level() -> int:
    """The `stacklevel` of the first frame outside this package and torch, for a warning about
    the caller's argument made in the function that calls this (the user's `Pager(...)`,
    `page_plan(...)` or call of a model compiled with paging options, not the library line
    that checked it)."""
    f, level = sys._getframe(2), 2  # the caller of the function that warns: stacklevel 2
    while f is not None and (f.f_code.co_filename.startswith("<") or os.path.abspath(f.f_code.co_filename).startswith(_LIBRARY)):
        f, level = f.f_back, level + 1
    return level


def _budget_text(budget: Budget) -> str:
    if isinstance(budget, dict):
        return json.dumps(budget)
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise ValueError(f"paging budget must be bytes (int), a fraction (float) or a dict, got {budget!r}")
    if isinstance(budget, int) and budget < 0:
        raise ValueError(f"paging budget in bytes must be >= 0, got {budget!r}")
    if isinstance(budget, float) and not math.isfinite(budget):  # JSON has no NaN or infinity
        raise ValueError(f"paging budget fraction must be in 0..=1, got {budget!r}")
    if isinstance(budget, int) and 0 < budget < 1024:
        warnings.warn(
            f"paging budget {budget} is an int: {budget} byte(s), which pages almost nothing; for a fraction of the "
            f"saved bytes write a float ({float(budget)!r} is all of them)",
            stacklevel=_outside_level(),
        )
    return json.dumps({"bytes": budget} if isinstance(budget, int) else {"fraction": budget})


def page_plan(prefix: list[dict], budget: Budget, min_distance: int = 1, timing: Optional[dict] = None) -> dict:
    """Rust's choice for a live prefix (`[{"name", "bytes", "saved_at", "used_at"}]`: every
    saved tensor, its bytes, its save order in the forward and its first use in the backward)
    under `budget` (fraction of the live bytes, bytes, or a dict), furthest backward use first,
    never within `min_distance` backward steps of its use. With a measured `timing`
    (`{"save_us", "unpack_us", "d2h_bytes_per_us", "h2d_bytes_per_us", "slack"}`, and for
    page-outs and page-ins on two streams `"both_bytes_per_us"`; `"page_host_us"`: the host
    time of a page-out and its page-in, a tensor whose copy is shorter stays) only what hides
    under the forward and lowers the planned peak, with release and page-in points (`release_at`: a save
    index, or the number of saves plus an unpack index for a two-way page-out released in the
    backward; `launch_at`). What `Pager` and `Chunk.enable_paging` call.

    Example:

        >>> import sched_lifetime as sl
        >>> prefix = [{"name": f"t{i}", "bytes": 1 << 20, "saved_at": i, "used_at": 2 - i} for i in range(3)]
        >>> plan = sl.page_plan(prefix, budget=0.5)
        >>> plan["page"], plan["bytes_paged"], plan["short"]
        (['t0', 't1'], 2097152, False)
        >>> plan["explain"][2]
        't2: kept (target of 1572864 bytes met)'
    """
    return json.loads(ops.page_plan(json.dumps(prefix), _budget_text(budget), int(min_distance), "" if timing is None else json.dumps(timing)))


def explain_plan(plan: dict) -> str:
    """A plan from `page_plan` as text: a head line, then Rust's line per candidate."""
    head = f"paging {len(plan['page'])} tensors, {plan['bytes_paged']} of {plan['bytes_live']} bytes (target {plan['target']})"
    short = f" SHORT of target by {plan['target'] - plan['bytes_paged']} bytes (each kept tensor's line says why)" if plan["short"] else ""
    return "\n".join([head + short] + plan["explain"])


class LinkRates(NamedTuple):
    """The link's measured copy rates between the device and pinned host memory, bytes per us."""

    #: Device -> host, alone.
    d2h: float
    #: Host -> device, alone.
    h2d: float
    #: A device -> host and a host -> device copy at once, on two streams: both directions'
    #: bytes together (what a two-way pager's copies get while both run).
    both: float


def link_rates(dev: torch.device, mib: int = 64, reps: int = 4) -> LinkRates:
    """Measured device -> pinned host and pinned host -> device copy rates (bytes per us) of one
    `mib` MiB buffer: after two warm-up copies, `reps` copies each timed alone with CUDA events,
    the fastest kept; then both directions at once (one copy each way on two streams, two
    buffers per side: no copy reads what the other writes), timed from a common start to the
    later end, the fastest of `reps` rounds queued back to back behind a warm-up round (no host
    sync between rounds: none includes the time to issue it). The fastest, not the total: a
    pager measures once per process and plans every step with it, and the first copies of a
    process can run slow (an H100's calibration measured 28 GB/s each way where the same run's
    1 GiB copies moved 55, and paged half as much)."""
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise ValueError(f"link_rates: reps must be an int >= 1, got {reps!r}")
    with torch.cuda.device(dev):
        torch.cuda.synchronize(dev)
        n = mib << 20
        d, h = torch.empty(n, dtype=torch.uint8, device=dev), torch.empty(n, dtype=torch.uint8, pin_memory=True)
        main = torch.cuda.current_stream(dev)
        rates = []
        for dst, src in ((h, d), (d, h)):
            for _ in range(2):  # warm
                dst.copy_(src, non_blocking=True)
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
            for a, b in events:
                a.record(main)
                dst.copy_(src, non_blocking=True)
                b.record(main)
            events[-1][1].synchronize()  # one stream: every earlier event is done too
            rates.append(n / (min(a.elapsed_time(b) for a, b in events) * 1e3))
        d2, h2 = torch.empty_like(d), torch.empty(n, dtype=torch.uint8, pin_memory=True)
        streams = (torch.cuda.Stream(dev), torch.cuda.Stream(dev))
        rounds = []
        for _ in range(reps + 1):  # a warm-up round, then the timed ones, each starting when the last ends
            start = torch.cuda.Event(enable_timing=True)
            ends = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for e in rounds[-1][1] if rounds else ():
                main.wait_event(e)
            start.record(main)
            for s, (dst, src), end in zip(streams, ((h, d), (d2, h2)), ends):
                s.wait_event(start)
                with torch.cuda.stream(s):
                    dst.copy_(src, non_blocking=True)
                end.record(s)
            rounds.append((start, ends))
        for end in rounds[-1][1]:
            end.synchronize()  # each round starts after the one before ends: all are done
        best = min(max(start.elapsed_time(e) for e in ends) for start, ends in rounds[1:])
        main.wait_stream(streams[0])
        main.wait_stream(streams[1])
    return LinkRates(rates[0], rates[1], 2 * n / (best * 1e3))  # the copies are done: the buffers may go


def page_host_us(dev: torch.device, two_way: bool = False, nbytes: int = 1 << 16, reps: int = 32) -> float:
    """Host time, us, of one page-out and its page-in through a `HostPool` on `dev` (the pool's
    calls a pager makes per paged tensor: page-out, release, page-in launch, the compute
    stream's wait): the fastest of `reps` rounds of an `nbytes` tensor after a warm-up, timed
    with the host clock (the copies themselves run on the GPU meanwhile; the fastest, since a
    busy host only adds to it). A lower bound of what a paged tensor costs a step's host
    thread: the hooks around these calls add to it."""
    from .pool import HostPool  # pool -> release -> lifetime: loaded when first measured

    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise ValueError(f"page_host_us: reps must be an int >= 1, got {reps!r}")
    t = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    pool = HostPool([nbytes], dev, drain_distance=1, two_way=two_way)
    best = float("inf")
    try:
        for i in range(reps + 4):  # four warm-up rounds
            t0 = time.perf_counter()
            p = pool.page_out(t)
            pool.drain()
            out, ev = pool.page_in_launch(p)
            pool.page_wait(ev)
            pool.recycle(ev)
            if i >= 4:
                best = min(best, (time.perf_counter() - t0) * 1e6)
            del out
    finally:
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()  # the buffers go with the pool: copies done first
    return best
