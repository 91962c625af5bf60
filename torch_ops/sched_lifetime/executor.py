"""Runs a schedule (wiring only: every decision comes from Rust's `sl.schedule`).

Given a graph table, per-node callables and the scheduler's result, `Executor.run` issues each
node on the stream the schedule names (compute = the caller's current stream; one
high-priority EP stream and two page streams per device, created once and reused: the page
role's page-outs on one and its page-ins on the other, so the link runs both ways), records and
waits the scheduled events (a pool made at construction, so nothing is created during CUDA
graph capture), and calls the lifetime manager where the schedule put each retire and drain,
one manager per plan (source), finalized at the end of the run. On CPU every role maps to the
one CPU stream and events are not needed (host order is stream order).

Node callables take the node's input tensors in table order and return its outputs (one
tensor, or a tuple in table order). A launch's callable runs on its side stream; its outputs
become usable at its wait, which needs no callable. A noop without a callable passes its
inputs through unchanged (rule 6: the same objects, their bindings kept).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Optional, Union

import torch

from ._ops import INFO
from .lifetime import LifetimeManager, current_stream

Graph = Union[dict, str]
NodeFn = Callable[..., Any]

_LIFETIME_MODES = ("scheduled", "record_stream", "none")


def add_note(e: BaseException, note: str) -> None:
    """`e.add_note(note)` (PEP 678, Python 3.11+). On 3.10 the note goes to `__notes__` all
    the same, and, when `e` has no cause yet, a RuntimeError with the note becomes its cause, so
    the printed traceback names it too."""
    if hasattr(e, "add_note"):
        e.add_note(note)
        return
    notes = getattr(e, "__notes__", None)
    e.__notes__ = (list(notes) if notes else []) + [note]  # type: ignore[attr-defined]
    if e.__cause__ is None:
        e.__cause__ = RuntimeError(note)


#: Two page streams under capture: refused, not silently wrong (see the GPU test).
TWO_WAY_CAPTURE = ('two-way paging (page-ins on their own stream) is not supported under CUDA graph capture: replays were not bit-exact on an H200 (2026-12-02, test_train_cuda two_way case); use two_way=False (the default) for captured steps')

#: Retire actions that empty the storage (names, from Rust).
_EMPTYING = frozenset(INFO["storage_emptying_actions"])

class SideStreams:
    """The high-priority EP and page streams of one device, created once and reused: `ep` for
    EP launches, `page` for page-outs (device -> host), `page_in` for page-ins (host -> device),
    at the same priority, so the link's two directions run at once (on CPU all are the one CPU
    stream). Make them before a CUDA graph capture (`SideStreams.of(device)`).

    Example:

        >>> import torch, sched_lifetime as sl
        >>> side = sl.SideStreams.of(torch.device("cpu"))
        >>> side is sl.SideStreams.of(torch.device("cpu")), side.ep is side.page is side.page_in
        (True, True)
    """

    _lock = threading.Lock()
    _by_device: dict[torch.device, "SideStreams"] = {}

    def __init__(self, device: torch.device) -> None:
        if device.type == "cuda":
            lo, hi = torch.cuda.Stream.priority_range()
            prio = min(lo, hi)  # the numerically lower value is the higher priority
            self.ep: torch.Stream = torch.cuda.Stream(device=device, priority=prio)
            self.page: torch.Stream = torch.cuda.Stream(device=device, priority=prio)
            self.page_in: torch.Stream = torch.cuda.Stream(device=device, priority=prio)
        else:
            self.ep = self.page = self.page_in = current_stream(device)

    @classmethod
    def of(cls, device: torch.device) -> "SideStreams":
        """The side streams of `device` (made on first use, outside any capture)."""
        device = _device(device)
        with cls._lock:
            s = cls._by_device.get(device)
            if s is None:
                s = cls._by_device[device] = SideStreams(device)
            return s


def _outputs(name: str, result: Any, want: int) -> tuple:
    out = result if isinstance(result, tuple) else (result,)
    if len(out) != want:
        raise ValueError(f"node '{name}' returned {len(out)} outputs, the graph declares {want}")
    return out


class Executor:
    """Issues one graph's schedule; `run` may be called many times (eagerly or under capture).

    `lifetime`: "scheduled" (the lifetime manager at the schedule's retires and drains),
    "record_stream" (`Tensor.record_stream` on the consumer stream, the baseline), or "none"
    (values dropped after their last use, no cross-stream protection: only for one stream).
    `single_stream`: every node on the compute stream (a serial baseline; no events).
    `keep`: consumed values to return as well (values no node consumes are always returned).
    `timing` (settable between runs): time every node on its stream (CUDA events recorded
    after the node's waits, so a node's time is its own work, not what it waited for; host
    time on CPU). No sync per node or per run: `take_times()` syncs once and returns every
    timed run's times since the last call (what cost calibration reads at a step's end,
    `sched_lifetime.calibrate`); `node_times_us()` the last run's. In a serial order each node
    runs alone on the GPU (the simulator's `durations`); in an overlapped one a node's time
    includes the contention it met.
    `two_way_paging`: the page role's page-in nodes run on `SideStreams.page_in` and its
    page-outs on `SideStreams.page` (False: both on the page stream). The schedule has one page
    role and relies on no order between a page-out and a page-in node (they share no value);
    what they share, host buffers, the pool keeps in order (`paging.SlotOrder`).
    Guide: docs/nodes.md (the executor under the node API) and docs/scheduler.md (graphs).

    Example (CPU; a launch's callable runs on the EP stream, its wait takes none):

        >>> import torch, sched_lifetime as sl
        >>> graph = {"sources": [{"name": "F", "phase": "F"}], "inputs": ["x"], "nodes": [
        ...     {"name": "attn", "source": "F", "kind": "compute", "inputs": ["x"], "outputs": ["a"]},
        ...     {"name": "a2a", "source": "F", "kind": "comm_launch", "inputs": ["a"], "outputs": ["d"]},
        ...     {"name": "a2a.wait", "source": "F", "kind": "comm_wait", "launch": "a2a"},
        ...     {"name": "mlp", "source": "F", "kind": "compute", "inputs": ["d"], "outputs": ["y"]}]}
        >>> fns = {"attn": torch.tanh, "a2a": lambda a: a * 2, "mlp": torch.relu}
        >>> ex = sl.Executor(graph, sl.schedule(graph), fns, device="cpu")
        >>> out = ex.run({"x": torch.ones(2)})
        >>> sorted(out), out["y"].tolist()
        (['y'], [1.5231883525848389, 1.5231883525848389])
    """

    def __init__(
        self,
        graph: Mapping[str, Any],
        schedule: Mapping[str, Any],
        callables: Mapping[str, NodeFn],
        device: Union[str, torch.device, None] = None,
        lifetime: str = "scheduled",
        single_stream: bool = False,
        keep: Iterable[str] = (),
        timing: bool = False,
        two_way_paging: bool = False,
    ) -> None:
        if lifetime not in _LIFETIME_MODES:
            raise ValueError(f"lifetime must be one of {_LIFETIME_MODES}, got {lifetime!r}")
        self.device = _device(device)
        self.lifetime = lifetime
        self.single_stream = single_stream
        nodes = {n["name"]: n for n in graph["nodes"]}
        self._nodes = nodes
        unknown = sorted(set(callables) - set(nodes))
        if unknown:
            raise ValueError(f"callables name nodes that are not in the graph: {unknown[:5]}")
        for name, n in nodes.items():
            needs = n["kind"] in ("compute", "comm_launch", "page_out", "page_in")
            if needs and name not in callables:
                raise ValueError(f"node '{name}' ({n['kind']}) has no callable")
            if n["kind"] in ("comm_wait", "page_wait") and name in callables:
                raise ValueError(f"node '{name}' is a wait: the executor issues it, it takes no callable")
        self._callables = dict(callables)
        self._order: list[str] = list(schedule["order"])
        if sorted(self._order) != sorted(nodes):
            raise ValueError("the schedule's order does not list exactly the graph's nodes")
        self.two_way_paging = bool(two_way_paging)
        # The schedule's role per node, with the page role's page-ins on the page-in stream.
        self._role = {name: self._stream_key(role, name) for name, role in schedule["streams"]}
        self._side_roles = ("ep", "page") + (("page_in",) if "page_in" in self._role.values() else ())
        self._source = {name: n["source"] for name, n in nodes.items()}
        self._ins = {name: [_value_name(v) for v in n.get("inputs", [])] for name, n in nodes.items()}
        self._outs = {name: [_value_name(o) for o in n.get("outputs", [])] for name, n in nodes.items()}
        self._producer = {v: name for name, outs in self._outs.items() for v in outs}
        # Last use of each value (in issue order) frees the executor's reference.
        consumed: dict[str, str] = {}
        for name in self._order:
            for v in self._ins[name]:
                consumed[v] = name
        self._keep = set(keep)
        self._last_use: dict[str, list[str]] = {}
        for v, last in consumed.items():
            if v not in self._keep:
                self._last_use.setdefault(last, []).append(v)
        # Events: one per producer of a sync edge, made now (never during capture).
        self._syncs_into: dict[str, list[str]] = {}
        self._events: dict[str, torch.Event] = {}
        if not single_stream and self.device.type == "cuda":
            for p, c, *_ in schedule["syncs"]:
                self._syncs_into.setdefault(c, []).append(p)
                if p not in self._events:
                    self._events[p] = torch.cuda.Event()
        # Lifetime points from the schedule. A retired value is bound to its producer's stream
        # in the retire call itself (`retire(..., owner_stream=)`), one call per (plan,
        # consumer stream, action, owner stream) after each node: no op call at the producer.
        self._retire_after: dict[str, dict[tuple[str, str, str, str], list[str]]] = {}
        self._drain_before: dict[str, list[tuple[str, str]]] = {}
        # For lifetime="record_stream": every stream other than the owner's that reads the value
        # (uses on two side streams need a record on each; the schedule names one).
        reader_roles: dict[str, set[str]] = {}
        for c, ins in self._ins.items():
            for v in ins:
                reader_roles.setdefault(v, set()).add(self._role[c])
        self._other_roles: dict[str, tuple[str, ...]] = {}
        for r in schedule["retires"]:
            v = r["value"]
            self._other_roles[v] = tuple(sorted(reader_roles.get(v, set()) - {self._stream_key(r["owner"], self._producer[v])}))
            if v in self._keep and r["action"] in INFO["storage_emptying_actions"]:
                raise ValueError(f"value '{v}' is kept, but the schedule empties its storage after '{r['last_consumer']}'")
            plan = self._source[self._producer[v]]
            consumer = self._stream_key(r["consumer_stream"], r["last_consumer"])
            key = (plan, consumer, r["action"], self._role[self._producer[v]])
            self._retire_after.setdefault(r["last_consumer"], {}).setdefault(key, []).append(v)
            if r["drain_before"] is not None:
                entry = (plan, self._stream_key(r["owner"], self._producer[v]))
                lst = self._drain_before.setdefault(r["drain_before"], [])
                if entry not in lst:
                    lst.append(entry)
        #: Forward values autograd saved for a backward (chunk names, without the source prefix:
        #: the node API fills it on each node's first forward). Their storage-emptying retire
        #: becomes `drop_reference` (the backward still reads them); `kept_for_autograd` counts.
        self.autograd_saved: set[str] = set()
        self.kept_for_autograd = 0
        #: Retires of a node output that shares the storage of a tensor the caller passed to
        #: `run` (a callable returning its input, or a view of it): made `drop_reference`, never
        #: emptied (the caller's tensor would lose its memory); counted here.
        self.kept_for_caller = 0
        self._caller_storages: set[int] = set()
        self._plans = sorted({self._source[self._producer[r["value"]]] for r in schedule["retires"]})
        #: Time every node of the next runs (see the class docs).
        self.timing = bool(timing)
        #: Bytes of every tensor value of the last run, when set to a dict (`sized_graph`).
        self.value_bytes: Optional[dict[str, int]] = None
        # Timed runs not yet read: per run, node -> (start, end) (CUDA events or host seconds).
        self._runs: list[dict[str, tuple]] = []
        # CUDA timing events, reused from one `take_times` to the next (none made in capture).
        self._timer_pool: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._timers_used = 0
        self.last_stats: dict[str, dict[str, int]] = {}

    def _stream_key(self, role: str, node: str) -> str:
        """The stream a node of the schedule's `role` runs on: its role, but "page_in" for the
        page role's page-in nodes (`two_way_paging`)."""
        if role == "page" and self.two_way_paging and self._nodes[node]["kind"] == "page_in":
            return "page_in"
        return role

    def _streams(self) -> dict[str, torch.Stream]:
        comp = current_stream(self.device)
        if self.single_stream or self.device.type != "cuda":
            return {"compute": comp, "ep": comp, "page": comp, "page_in": comp}
        side = SideStreams.of(self.device)
        return {"compute": comp, "ep": side.ep, "page": side.page, "page_in": side.page_in}

    def run(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """Issue every node once. Returns the values no node consumes, plus `keep`."""
        if self.two_way_paging and self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(TWO_WAY_CAPTURE)
        streams = self._streams()
        env: dict[str, Any] = dict(inputs)
        # The caller's tensors: a node's output that is one of them or a view of one (a callable
        # returning its input reshaped) is never emptied at its retire, only its reference dropped.
        self._caller_storages = {p for t in inputs.values() if isinstance(t, torch.Tensor) and (p := t.untyped_storage().data_ptr())}
        managers: dict[str, LifetimeManager] = {}
        if self.lifetime == "scheduled":
            managers = {p: LifetimeManager(p) for p in self._plans}
        comp = streams["compute"]
        # Side streams start after what the caller queued on compute.
        for role in self._side_roles:
            if streams[role] is not comp:
                streams[role].wait_stream(comp)
        # Under a profiler, each node is a labelled range (per-node GPU times for the simulator).
        labels = torch.autograd.profiler._is_profiler_enabled
        marks: Optional[dict[str, tuple]] = None
        if self.timing:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("Executor timing is not supported under CUDA graph capture: turn it off (executor.timing = False) before capturing")
            marks = {}
            self._runs.append(marks)
        try:
            for name in self._order:
                if labels:
                    with torch.profiler.record_function(name):
                        self._issue(name, streams, env, managers, marks)
                else:
                    self._issue(name, streams, env, managers, marks)
            # Side streams rejoin compute: the caller's later work sees everything.
            for role in self._side_roles:
                if streams[role] is not comp:
                    comp.wait_stream(streams[role])
            self.last_stats = {p: m.finalize() for p, m in managers.items()}
        finally:
            # Nothing left behind: after an error, parked tensors take the record_stream
            # fallback on close; after finalize, close only drops the handle.
            for m in managers.values():
                m.close()
        return env

    def _start_mark(self, s: torch.Stream) -> Any:
        if self.device.type != "cuda":
            return time.perf_counter()
        if self._timers_used == len(self._timer_pool):
            self._timer_pool.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
        pair = self._timer_pool[self._timers_used]
        self._timers_used += 1
        pair[0].record(s)
        return pair

    def _end_mark(self, start: Any, s: torch.Stream) -> tuple:
        if self.device.type != "cuda":
            return (start, time.perf_counter())
        start[1].record(s)
        return start

    def take_times(self, sync: bool = True) -> list[dict[str, float]]:
        """Every timed run's node times (us, by node name) since the last call, oldest first,
        and forget them. On CUDA one device sync for all of them (`sync=False`: the caller has
        synchronized already)."""
        runs, self._runs = self._runs, []
        if self.device.type == "cuda":
            if sync and runs:
                torch.cuda.synchronize(self.device)
            out = [{n: a.elapsed_time(b) * 1e3 for n, (a, b) in marks.items()} for marks in runs]
            self._timers_used = 0
            return out
        return [{n: (b - a) * 1e6 for n, (a, b) in marks.items()} for marks in runs]

    def node_times_us(self) -> dict[str, float]:
        """Each node's time in the last timed run, in microseconds (synchronizes the GPU)."""
        if not self.timing:
            raise RuntimeError("node times need Executor(..., timing=True)")
        runs = self.take_times()
        return runs[-1] if runs else {}

    def _issue(self, name: str, streams: dict, env: dict, managers: dict, marks: Optional[dict] = None) -> None:
        node = self._nodes[name]
        role = self._role[name]
        s = streams[role]
        if managers:
            for plan, owner in self._drain_before.get(name, ()):
                managers[plan].acquire(streams[owner])
        for p in self._syncs_into.get(name, ()):
            s.wait_event(self._events[p])
        kind = node["kind"]
        if marks is not None and kind == "comm_launch" and s is not streams["compute"] and self.device.type == "cuda":
            # The transports make their stream wait for everything queued on compute (they
            # allocate the output there: `ep_link.consumer_output`); waited here first, the
            # start mark below times the transfer alone, not that wait (the simulator's launch
            # waits model it: `sl.lower(..., launch_waits=True)`). The same wait: no new order.
            s.wait_stream(streams["compute"])
        # Timed from after its waits: the node's own work.
        start = self._start_mark(s) if marks is not None else None
        if kind in ("comm_wait", "page_wait"):
            pass  # the sync edge from the launch is the wait
        else:
            try:
                args = [env[v] for v in self._ins[name]]
            except KeyError as e:
                raise RuntimeError(f"node '{name}': input {e} is not available (freed or never produced)") from None
            fn = self._callables.get(name)
            if fn is None:  # a noop passes its inputs through
                out = tuple(args)
                if managers and out:
                    plan = self._source[name]
                    managers[plan].passthrough([t for t in out if isinstance(t, torch.Tensor)])
            else:
                with _stream_ctx(s):
                    try:
                        out = _outputs(name, fn(*args), len(self._outs[name]))
                    except Exception as e:
                        # The caller's own exception (type, message, traceback), with the node named.
                        add_note(e, f"in node '{name}' ({kind}) of the schedule")
                        if "leaf Variable that requires grad is being used in an in-place operation" in str(e):
                            add_note(
                                e,
                                "a node's inputs are leaves of its own autograd graph, so it may not modify an input in place "
                                "(e.g. nn.ReLU(inplace=True) as a node of its own): use inplace=False, or compute it in the node "
                                "before it (sl.pipelining.describe does that for layers with inplace=True)",
                            )
                        raise
            for v, t in zip(self._outs[name], out):
                env[v] = t
                if self.value_bytes is not None and isinstance(t, torch.Tensor):
                    self.value_bytes[v] = t.untyped_storage().nbytes()
        if marks is not None:
            marks[name] = self._end_mark(start, s)
        if name in self._events:
            self._events[name].record(s)
        for (plan, consumer_role, action, owner_role), values in self._retire_after.get(name, {}).items():
            live = [(v, t) for v, t in ((v, env.get(v)) for v in values) if isinstance(t, torch.Tensor)]
            if not live:
                continue
            if managers:
                if action in _EMPTYING and (self._caller_storages or self.autograd_saved):
                    # Never emptied, only their reference dropped: the caller's tensors (or views
                    # of them) and values autograd saved for a backward.
                    caller = [bool(self._caller_storages) and t.untyped_storage().data_ptr() in self._caller_storages for _, t in live]
                    saved = [not c and v.split(".", 1)[-1] in self.autograd_saved for (v, _), c in zip(live, caller)]
                    kept = [c or a for c, a in zip(caller, saved)]
                    if any(kept):
                        self.kept_for_caller += sum(caller)
                        self.kept_for_autograd += sum(saved)
                        held = [t for (_, t), k in zip(live, kept) if k]
                        live = [vt for vt, k in zip(live, kept) if not k]
                        managers[plan].retire(held, streams[consumer_role], "drop_reference", owner_stream=streams[owner_role])
                        if not live:
                            continue
                managers[plan].retire([t for _, t in live], streams[consumer_role], action, owner_stream=streams[owner_role])
            elif self.lifetime == "record_stream":
                for v, t in live:
                    for role in self._other_roles[v]:
                        if streams[role] is not streams[owner_role]:
                            t.record_stream(streams[role])
        for v in self._last_use.get(name, ()):
            env.pop(v, None)


def _stream_ctx(s: torch.Stream):
    """`torch.cuda.stream` for CUDA streams; nothing to switch on CPU."""
    return torch.cuda.stream(s) if isinstance(s, torch.cuda.Stream) else contextlib.nullcontext()


def sized_graph(graph: Mapping[str, Any], value_bytes: Mapping[str, int]) -> dict:
    """The graph table with each output's (and input's) bytes as measured in a run, for the
    simulator (`sl.lower` then `sl.simulate`)."""

    def sized(o: Any) -> Any:
        name = _value_name(o)
        if name not in value_bytes:
            return o
        d = dict(o) if isinstance(o, Mapping) else {"value": name}
        d["bytes"] = int(value_bytes[name])
        return d

    g = dict(graph)
    g["nodes"] = [dict(n, outputs=[sized(o) for o in n.get("outputs", [])]) for n in graph["nodes"]]
    g["inputs"] = [sized(v) for v in graph.get("inputs", [])]
    return g


def _device(device: Union[str, torch.device, None]) -> torch.device:
    """A device with its index ("cuda" means the current device)."""
    d = torch.device(device) if device is not None else torch.device("cpu")
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


def _value_name(v: Union[str, Mapping[str, Any]]) -> str:
    return v if isinstance(v, str) else v["value"]

