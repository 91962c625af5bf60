"""Measured node costs for the scheduler (issue 31): the order `"calibrated"`.

The default policy is timing-free; rule `search` (`sl.schedule(graph, rules="search")`, Rust)
picks among orders by the simulator's makespan, but needs node costs. `Calibration` measures
them where the graph runs: during the first `steps` steps (a setting, default 1) every node of
the calibrated executors is timed (`Executor.timing`: CUDA events recorded after the node's
waits, host clock on CPU; no sync per node or run), and at the step's end (`end_step`):

1. one device sync, each node's median over the step's runs (a second microbatch's nodes,
   `F2.`/`B2.`, count as the first's);
2. the ranks agree on one cost table with one collective (`all_gather_object`; each node's
   cost is the maximum over the ranks, so every rank ends with the same numbers: a different
   order per rank would issue collectives in a different order, a hang);
3. the costs are smoothed with the earlier calibration steps' (`smoothing`: the weight of the
   new measurement, 1.0 = the latest only);
4. each calibrated graph is scheduled again under rule `search` with these costs (by default
   in a thread beside the next step, taking over at the first step after it that finds every
   rank's search done, the same step on every rank; `background=False`: at the calibration
   step's end), and its executor is rebuilt only when the order changed; the orders are then
   checked rank-identical (`ep.check_rank_identical`).

`GraphStep` (compiled graphs, `order="calibrated"` by default) does the same for its
multiplexed module: its nodes timed in a `torch.fx.Interpreter` run, then `apply_plans`.

Later steps time nothing and re-plan nothing. Before the first calibration step's end (step
0), `"calibrated"` runs the timing-free order `"ours"`; `order="ours"` stays timing-free
always. Reordering never changes numerics: every candidate order respects the graph's edges,
which fix where gradients accumulate (one dW node per parameter per microbatch; a second
microbatch's dW after the first's by a control edge), so parity with plain autograd stays
bit-exact.

What decides an order (the costs, which step they came from, how often it re-planned) is in
`summary()` and beside the order in `format_costs`.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Optional

import torch
import torch.distributed as dist

from .schedule import schedule

#: The order name that turns calibration on (`train_step(order=...)`, the main job's arm).
CALIBRATED = "calibrated"


def fold_name(name: str) -> str:
    """A node's cost key: a second microbatch's node (`F2.x`, `B2.x`, `run_two`) costs what
    the first's does (`F.x`, `B.x`)."""
    head, dot, rest = name.partition(".")
    if dot and head in ("F2", "B2"):
        return head[0] + "." + rest
    return name


def with_costs(graph: Mapping[str, Any], costs: Mapping[str, float]) -> dict:
    """`graph` with each node's `cost` (us) from `costs` (by folded name; nodes not in it keep
    theirs)."""
    if not costs:
        return dict(graph)
    nodes = []
    for n in graph["nodes"]:
        c = costs.get(fold_name(n["name"]))
        nodes.append(dict(n, cost=float(c)) if c is not None else n)
    return dict(graph, nodes=nodes)


class Calibration:
    """The measured-cost state of one chunk (or graph owner) for order `"calibrated"`.

    `steps`: calibration steps (>= 1): the first `steps` steps are timed and each re-plans at
    its end. `smoothing`: in (0, 1], the weight of a step's measurement against the costs so
    far (exponential smoothing over the calibration steps). `background` (default True): the
    search runs in a thread (the op releases the GIL) while the next step runs in the old
    order, and the new orders apply from the step after it, on every rank at the same step
    (the calibration step's own extra is then the events, one sync and the agreement; False:
    the search runs at the calibration step's end and applies from the next step): from the second step
    after, each step's start asks every rank whether its search is done (one small collective
    while one is in flight) and the orders take over at the first step where all are, so a
    search longer than a step never makes a step wait; `wait_after=N`: the step start waits for
    it once N steps ran beside it (1: always the second step after). The thread is no daemon:
    a script that ends while it runs waits for it at exit (as a daemon it was still inside the
    native op at shutdown and aborted the process). `group`:
    the process group whose ranks must agree (None: the chunk's `rank_group`, itself None for
    the default group, when torch.distributed is initialized).

    Example (the costs agreed and smoothed, then the order under rule `search`):

        >>> import sched_lifetime as sl
        >>> from sched_lifetime.calibrate import Calibration
        >>> graph = sl.scenario_graph("moe_chunk:1:1.0")["graph"]
        >>> cal = Calibration(steps=1)
        >>> cal.schedule(graph)["order"] == sl.schedule(graph)["order"]     # no costs yet: "ours"
        True
        >>> costs = cal.end_step([{n["name"]: 100.0 for n in graph["nodes"]}])
        >>> cal.active, cal.steps_done, len(cal.costs) == len(graph["nodes"])
        (False, 1, True)
        >>> from sched_lifetime.calibrate import with_costs
        >>> cal.schedule(graph)["order"] == sl.schedule(with_costs(graph, cal.costs), rules="search")["order"]
        True
    """

    def __init__(
        self, steps: int = 1, smoothing: float = 0.5, group: Any = None, background: bool = True, wait_after: Optional[int] = None
    ) -> None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"calibration steps must be an int >= 1, got {steps!r} (to time nothing, use order='ours')")
        if isinstance(smoothing, bool) or not isinstance(smoothing, (int, float)) or not 0.0 < float(smoothing) <= 1.0:
            raise ValueError(f"calibration smoothing is the new measurement's weight, in (0, 1]; got {smoothing!r}")
        self.steps = steps
        self.smoothing = float(smoothing)
        self.group = group
        if wait_after is not None and (isinstance(wait_after, bool) or not isinstance(wait_after, int) or wait_after < 1):
            raise ValueError(f"calibration wait_after must be None or an int >= 1 (steps beside a background search), got {wait_after!r}")
        self.background = bool(background)
        self.wait_after = wait_after
        # The search in flight: (thread, its result holder, the step whose costs it uses, the
        # steps begun since it started).
        self._pending: Optional[list] = None
        self._measured_step: Optional[int] = None
        #: The agreed, smoothed costs (us, by folded node name); empty before the first step's end.
        self.costs: dict[str, float] = {}
        #: Calibration steps ended so far (the next step is timed while < `steps`).
        self.steps_done = 0
        #: The step (0-based, counted by `end_step`) whose costs the current orders come from.
        self.from_step: Optional[int] = None
        #: Graphs whose order changed at a calibration step (executors rebuilt).
        self.replans = 0
        #: Host milliseconds each calibration step's end took (sync, agreement, search).
        self.end_ms: list[float] = []

    @property
    def active(self) -> bool:
        """Whether the next step is timed."""
        return self.steps_done < self.steps

    def restart(self, steps: Optional[int] = None) -> None:
        """Time again from the next step (e.g. after the shapes changed); the costs so far stay
        as the smoothing's start."""
        if steps is not None:
            Calibration(steps)  # the same checks
            self.steps = self.steps_done + steps
        else:
            self.steps = self.steps_done + self.steps

    def schedule(self, graph: Mapping[str, Any], **kw: Any) -> dict:
        """The calibrated schedule of `graph`: the timing-free order before any costs, then
        rule `search` with the measured costs."""
        if not self.costs:
            return schedule(graph, **kw)
        return schedule(with_costs(graph, self.costs), rules="search", **kw)

    def _local_costs(self, runs: Iterable[Mapping[str, float]]) -> dict[str, float]:
        """This rank's cost per folded node name: the median over the runs that timed it."""
        samples: dict[str, list[float]] = {}
        for run in runs:
            for n, us in run.items():
                samples.setdefault(fold_name(n), []).append(float(us))
        return {n: statistics.median(v) for n, v in samples.items()}

    def _agree(self, local: dict[str, float]) -> dict[str, float]:
        """One collective: every rank's table; each node's cost is the maximum over the ranks.
        Ranks that timed different nodes are an error naming them (their graphs differ)."""
        if not (dist.is_available() and dist.is_initialized()):
            return local
        got: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(got, sorted(local.items()), group=self.group)
        names = [sorted(n for n, _ in g) for g in got]
        differ = [r for r, n in enumerate(names) if n != names[0]]
        if differ:
            extra = sorted(set(names[differ[0]]) ^ set(names[0]))[:5]
            raise RuntimeError(
                f"cost calibration: ranks {differ} timed other nodes than rank 0 (e.g. {extra}): their graphs differ, "
                "so no common order exists; give every rank the same model and microbatch count"
            )
        tables = [dict(g) for g in got]
        return {n: max(t[n] for t in tables) for n in names[0]}

    def end_step(self, runs: Iterable[Mapping[str, float]]) -> dict[str, float]:
        """End a calibration step: the runs' node times (us, by node name) become this rank's
        costs, agreed across the ranks and smoothed into `costs` (returned)."""
        measured = self._agree(self._local_costs(runs))
        a = self.smoothing
        for n, us in measured.items():
            old = self.costs.get(n)
            self.costs[n] = us if old is None else a * us + (1.0 - a) * old
        self._measured_step = self.steps_done
        self.steps_done += 1
        return dict(self.costs)

    def finish_step(self, runs: Callable[[], Iterable[Mapping[str, float]]], graphs: Mapping[str, Any], apply: Callable[[Optional[dict]], None], group: Any = None, **kw: Any) -> None:
        """A calibration step's end, as every owner of calibrated orders runs it (the node
        path's chunks, GraphStep): an earlier calibration step's background search applied
        first (`apply(plans)`), then `runs()` (the step's node times: one sync) agreed across
        the ranks of `group` (when none is set yet) and smoothed (`end_step`), and `graphs`
        scheduled again (`plan`) and applied, now or, in the background, at a later step's
        start; `end_ms` gets this end's host time, the wait for an earlier search included
        (`background=True` with `steps` > 1: a calibration step's end waits for the previous
        one's search when it is still running). `kw`: `schedule`'s other settings."""
        t0 = time.perf_counter()
        apply(self.take_plans(wait=True))
        if self.group is None:  # the ranks that agree on the step's facts agree on its costs
            self.group = group
        self.end_step(runs())
        apply(self.plan(graphs, **kw))  # None: searching in the background
        self.end_ms.append((time.perf_counter() - t0) * 1e3)

    def plan(self, graphs: Mapping[str, Any], **kw: Any) -> Optional[dict[str, dict]]:
        """The calibrated schedules of `graphs` (label -> graph table) with the costs as they are
        now: returned at once (`background=False`), or computed in a thread and returned
        by `take_plans` (None here). `kw`: `schedule`'s other settings (e.g. `ep_budget`)."""
        costs = dict(self.costs)

        def run(out: dict) -> None:
            try:
                out["plans"] = {k: schedule(with_costs(g, costs), rules="search", **kw) for k, g in graphs.items()}
            except BaseException as e:  # raised on the caller's thread by `take_plans`
                out["error"] = e

        if not self.background:
            out: dict = {}
            run(out)
            if "error" in out:
                raise out["error"]
            return out["plans"]
        holder: dict = {}
        # Not a daemon: the interpreter joins it before it finalizes. A daemon thread still inside
        # the scheduler op at exit aborted the process ("terminate called without an active
        # exception", seen in CI after a calibrated step that was the script's last).
        t = threading.Thread(target=run, args=(holder,), name="sched_lifetime-calibration-search", daemon=False)
        t.start()
        self._pending = [t, holder, self._measured_step, 0]
        return None

    def take_plans(self, wait: bool, at_end: bool = False) -> Optional[dict[str, dict]]:
        """At a step's start (`wait=False`): the background search's schedules once a whole
        step has run beside it, else None (one more step begun); every rank takes them at the
        same step. `at_end=True`: asked at a step's end instead (runs made with `Chunk.run`,
        which have no step start: the step just ended ran beside the search), for the next
        step. `wait=True`: now, whatever the steps (a calibration step's end applies an
        earlier search's first). The caller applies what it gets: called only to join the
        thread before the process ends, the orders are dropped."""
        if self._pending is None:
            return None
        if not wait:
            self._pending[3] += 1
            beside = self._pending[3] - (0 if at_end else 1)  # steps run beside the search so far
            if beside < 1:
                return None
            if not self._all_done() and (self.wait_after is None or beside < self.wait_after):
                return None  # one more step beside it, on every rank
        t, holder, _, _ = self._pending
        t.join()
        self._pending = None
        if "error" in holder:
            raise holder["error"]
        return holder["plans"]

    def _all_done(self) -> bool:
        """Whether the background search has finished on every rank of `group` (one small
        collective when torch.distributed is initialized: every rank asks at the same step)."""
        done = not self._pending[0].is_alive()
        if not (dist.is_available() and dist.is_initialized()):
            return done
        got: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(got, done, group=self.group)
        return all(got)

    @property
    def planning(self) -> bool:
        """Whether a background search is in flight (its orders not applied yet)."""
        return self._pending is not None

    def summary(self) -> dict[str, Any]:
        """What the calibrated orders come from: the costs' step, steps, re-plans, end times."""
        return {
            "from_step": self.from_step,
            "steps": self.steps,
            "steps_done": self.steps_done,
            "smoothing": self.smoothing,
            "replans": self.replans,
            "end_ms": [round(x, 3) for x in self.end_ms],
            "nodes": len(self.costs),
        }

    def describe(self) -> str:
        """One line for tables: 'calibrated order from step k's costs (r re-plans)'."""
        if self.from_step is None:
            return "calibrated order: not calibrated yet (timing-free order)"
        return f"calibrated order from step {self.from_step}'s costs ({self.replans} re-plan{'s' if self.replans != 1 else ''})"


def format_costs(result: Mapping[str, Any], costs: Mapping[str, float]) -> str:
    """A schedule's order, one node a line, with each node's stream and measured cost (us):
    what the calibrated order was chosen from."""
    streams = dict(result.get("streams") or [])
    lines = []
    for i, n in enumerate(result["order"]):
        c = costs.get(fold_name(n))
        lines.append(f"{i:>4} {n:<32} {streams.get(n, ''):<8} {'-' if c is None else f'{c:.1f} us'}")
    return "\n".join(lines)


def apply_plans(cal: Calibration, plans: Mapping[str, dict], current: Mapping[str, Optional[list]], rebuild: Any, what: str = "calibrated order") -> None:
    """The calibrated schedules `plans` (label -> schedule; labels spelled the same on every
    rank) take over: `rebuild(label, schedule)` for each whose order differs from `current`
    (label -> the running order, None: no executor). Then the ranks check that their orders
    are identical (one collective)."""
    from .ep import check_rank_identical, digest

    step = cal._measured_step if cal._measured_step is not None else cal.steps_done - 1
    for label, s in plans.items():
        if current.get(label) is None or list(s["order"]) != list(current[label]):
            rebuild(label, s)
            cal.replans += 1
    cal.from_step = step
    orders = sorted((k, list(s["order"])) for k, s in plans.items())
    check_rank_identical(f"{what} (from calibration step {step}'s costs)", digest(orders), cal.group)


def timed_end(cal: Calibration, executors: Iterable[Any], device: torch.device) -> list[dict[str, float]]:
    """The timed runs of `executors` since the last read, after one device sync."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    runs: list[dict[str, float]] = []
    for ex in executors:
        runs += ex.take_times(sync=False)
    return runs


__all__ = ["CALIBRATED", "Calibration", "apply_plans", "fold_name", "format_costs", "timed_end", "with_costs"]
