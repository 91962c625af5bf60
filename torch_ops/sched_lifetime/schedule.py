"""The scheduler from Python: multiplex annotated forward/backward graphs (a table: sources,
nodes, control/reuse edges; format in the README) into one issue order with the streams,
record/wait edges and lifetime actions. All policy runs in Rust."""

from __future__ import annotations

import json
from typing import Any, Optional, Sequence, Union

from ._ops import INFO, json_text, ops

Graph = Union[dict, str]


def _budget(value: Optional[int], name: str) -> str:
    """The budget as text for Rust, which checks the range ("" = env or default)."""
    if value is None:
        return ""
    if isinstance(value, bool) or not isinstance(value, int):
        b = INFO["budget"]
        raise ValueError(f"{name} must be an int in {b['min']}..={b['max']}, got {value!r}")
    return str(value)


def schedule(
    graph: Graph,
    ep_budget: Optional[int] = None,
    page_budget: Optional[int] = None,
    explain: bool = False,
    rules: Optional[str] = None,
    memory_slack: Optional[float] = None,
) -> dict[str, Any]:
    """Schedule `graph` (a dict or JSON text: sources, nodes, edges; docs/scheduler.md) into
    one issue order with each node's stream, the minimal record/wait edges and the lifetime
    actions. Budgets (launches in flight per stream, 1..=1024) default to
    SCHED_LIFETIME_EP_LAUNCH_BUDGET / SCHED_LIFETIME_PAGE_LAUNCH_BUDGET, else 1 (EP) and 2
    (page). With `explain`, the result lists, per launch, the compute it ran under. `rules`:
    scheduler rules, comma-separated, from `INFO["scheduler_rules"]` ("" or None: the default,
    which includes `ready_first`; `"classic"`: the policy before it; `"search"` needs node
    costs and runs through `simulate_schedule`'s cost model). Deterministic: the same graph and
    budgets give the same result on every rank. Returns `{"order", "streams", "syncs",
    "retires", "budgets", "explain"}`.

    Example (one MoE layer's forward with another microbatch's backward, built in Rust):

        >>> import sched_lifetime as sl
        >>> from sched_lifetime.schedule import format_explain
        >>> graph = sl.scenario_graph("moe_chunk:1:1.0")["graph"]
        >>> s = sl.schedule(graph, explain=True)
        >>> s["order"][:4]
        ['B.L0.combine', 'F.L0.attn', 'B.L0.combine.wait', 'F.L0.dispatch']
        >>> dict(s["streams"])["F.L0.dispatch"], s["budgets"]
        ('ep', {'ep': 1, 'page': 2})
        >>> print(format_explain(s))
        B.L0.combine [B0] ran under: F.L0.attn
        F.L0.dispatch [F1] ran under: B.L0.mlp, B.L0.mlp.dw
        B.L0.dispatch [B0] ran under: F.L0.mlp
        F.L0.combine [F1] ran under: B.L0.attn, B.L0.attn.dw
    """
    if memory_slack is not None and (isinstance(memory_slack, bool) or not isinstance(memory_slack, (int, float))):
        raise ValueError(f"memory_slack must be a number >= 0 or None, got {memory_slack!r}")
    slack = "" if memory_slack is None else repr(float(memory_slack))
    return json.loads(
        ops.schedule(
            json_text(graph, "graph"), _budget(ep_budget, "ep_budget"), _budget(page_budget, "page_budget"), explain, rules or "", slack
        )
    )


def validate(
    graph: Graph,
    order: Sequence[str],
    syncs: Optional[Sequence[Sequence[str]]] = None,
    ep_budget: Optional[int] = None,
    page_budget: Optional[int] = None,
) -> None:
    """Check any schedule (ours or yours): topological, every cross-stream use covered by the
    given record/wait pairs (`[producer, consumer]` each, or `schedule(...)["syncs"]` as it
    comes; derived minimal ones when `syncs` is None), budgets respected.
    Raises ValueError naming the node at fault; returns None when the schedule is valid.

    Example:

        >>> import sched_lifetime as sl
        >>> graph = sl.scenario_graph("moe_chunk:1:1.0")["graph"]
        >>> order = sl.schedule(graph)["order"]
        >>> sl.validate(graph, order)
        >>> try:
        ...     sl.validate(graph, order, syncs=[])
        ... except ValueError as e:
        ...     print("no wait covering it" in str(e))
        True
    """
    ops.validate(
        json_text(graph, "graph"),
        json.dumps(list(order)),
        # A pair per record/wait: [producer, consumer]; `schedule`'s own entries also name the two
        # streams' roles ([producer, consumer, role, role]): their first two items are the pair.
        json.dumps(None if syncs is None else [list(p)[:2] if len(p) == 4 else list(p) for p in syncs]),
        _budget(ep_budget, "ep_budget"),
        _budget(page_budget, "page_budget"),
    )


def format_explain(result: dict[str, Any], costs: Optional[dict[str, float]] = None, labels: Optional[dict[str, str]] = None) -> str:
    """One line per launch: what compute hid it. With `costs` (us by node name, e.g. a
    calibration's measured `Calibration.costs`), each node's cost beside it; with `labels`
    (text by launch name, e.g. "all_to_all_single, EP dispatch, layer 1.fwd"), what each launch is."""

    def name(n: str) -> str:
        if costs is None:
            return n
        from .calibrate import fold_name

        c = costs.get(fold_name(n))
        return n if c is None else f"{n} ({c:.0f} us)"

    lines = []
    for e in result.get("explain") or []:
        under = ", ".join(name(n) for n in e["hidden_under"]) or "nothing (exposed)"
        what = f" ({labels[e['launch']]})" if labels and e["launch"] in labels else ""
        lines.append(f"{name(e['launch'])}{what} [{e['source']}] ran under: {under}")
    return "\n".join(lines)


def schedule_order(
    graph: Graph, order: Sequence[str], ep_budget: Optional[int] = None, page_budget: Optional[int] = None
) -> dict[str, Any]:
    """A given order (a baseline's, or yours) in `schedule`'s output format: its streams,
    minimal record/wait edges, lifetime actions and what each launch ran under. The order is
    validated first (ValueError naming the node).

    Example (backward-then-forward, torchtitan's multiplexed order, as a schedule):

        >>> import sched_lifetime as sl
        >>> graph = sl.scenario_graph("moe_chunk:1:1.0")["graph"]
        >>> b_then_f = [n["name"] for n in graph["nodes"] if n["source"] == "B0"]
        >>> b_then_f += [n["name"] for n in graph["nodes"] if n["source"] == "F1"]
        >>> s = sl.schedule_order(graph, b_then_f)
        >>> s["order"] == b_then_f, len(s["syncs"]) > 0
        (True, True)
    """
    return json.loads(
        ops.schedule_order(json_text(graph, "graph"), json.dumps(list(order)), _budget(ep_budget, "ep_budget"), _budget(page_budget, "page_budget"))
    )


def lower(graph: Graph, order: Sequence[str], serial: bool = False, launch_waits: bool = False) -> dict[str, Any]:
    """The simulator program (see `sl.simulate`) that issues `order` on the graph's streams
    (`serial`: all on one stream), with the lifetime drains where the schedule puts them.
    `launch_waits`: each EP launch also waits for every compute node issued before it, as on
    the GPU (the transports allocate the output on the compute stream and make the EP stream
    wait for it); rule `search` rates orders with this model.

    Example:

        >>> import sched_lifetime as sl
        >>> graph = sl.scenario_graph("moe_chunk:1:1.0")["graph"]
        >>> program = sl.lower(graph, sl.schedule(graph)["order"])
        >>> [s["name"] for s in program["streams"]]
        ['compute', 'ep', 'page']
        >>> sl.simulate(program)["makespan_us"]
        2603.0
    """
    return json.loads(ops.lower(json_text(graph, "graph"), json.dumps(list(order)), serial, launch_waits))


def simulate_schedule(
    graph: Graph,
    order: Optional[Sequence[str]] = None,
    costs: Optional[dict[str, float]] = None,
    policy: str = "scheduled",
    trace: bool = False,
) -> dict[str, Any]:
    """SIMULATED: any graph through the simulator, under our order (`order=None`) or a given
    one, with per-node costs (us) from `costs`, else the graph's `cost`, else a per-kind
    default (100 us for compute and launches). `policy`: "scheduled" (the lifetime manager) or
    "record_stream". Returns the simulator's report (makespan, exposed comm, memory peaks,
    hazards) plus the order, with `"simulated": True`.

    Example (ours against backward-then-forward on one layer, comm/compute 1.0):

        >>> import sched_lifetime as sl
        >>> sc = sl.scenario_graph("moe_chunk:1:1.0")
        >>> ours = sl.simulate_schedule(sc["graph"])
        >>> btf = sl.simulate_schedule(sc["graph"], sc["orders"]["b_then_f"]["order"])
        >>> ours["makespan_us"], btf["makespan_us"], ours["simulated"]
        (2603.0, 4203.0, True)
    """
    rep = json.loads(
        ops.simulate_schedule(
            json_text(graph, "graph"),
            "" if order is None else json.dumps(list(order)),
            "" if costs is None else json.dumps(costs),
            policy,
            trace,
        )
    )
    rep["simulated"] = True
    return rep
