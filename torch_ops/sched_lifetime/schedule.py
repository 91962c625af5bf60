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
) -> dict[str, Any]:
    """Schedule `graph`. Budgets default to SCHED_LIFETIME_EP_LAUNCH_BUDGET /
    SCHED_LIFETIME_PAGE_LAUNCH_BUDGET, else 2. With `explain`, the result lists, per launch,
    the compute it ran under. `rules`: scheduler rules, comma-separated, from
    `INFO["scheduler_rules"]` ("" or None: the default, which includes `ready_first`;
    `"classic"`: the policy before it)."""
    return json.loads(
        ops.schedule(json_text(graph, "graph"), _budget(ep_budget, "ep_budget"), _budget(page_budget, "page_budget"), explain, rules or "")
    )


def validate(
    graph: Graph,
    order: Sequence[str],
    syncs: Optional[Sequence[Sequence[str]]] = None,
    ep_budget: Optional[int] = None,
    page_budget: Optional[int] = None,
) -> None:
    """Check any schedule (ours or yours): topological, every cross-stream use covered by the
    given record/wait pairs (derived minimal ones when `syncs` is None), budgets respected.
    Raises ValueError naming the node at fault."""
    ops.validate(
        json_text(graph, "graph"),
        json.dumps(list(order)),
        json.dumps(None if syncs is None else [list(p) for p in syncs]),
        _budget(ep_budget, "ep_budget"),
        _budget(page_budget, "page_budget"),
    )


def format_explain(result: dict[str, Any]) -> str:
    """One line per launch: what compute hid it."""
    lines = []
    for e in result.get("explain") or []:
        under = ", ".join(e["hidden_under"]) or "nothing (exposed)"
        lines.append(f"{e['launch']} [{e['source']}] ran under: {under}")
    return "\n".join(lines)


def schedule_order(
    graph: Graph, order: Sequence[str], ep_budget: Optional[int] = None, page_budget: Optional[int] = None
) -> dict[str, Any]:
    """A given order (a baseline's, or yours) in `schedule`'s output format: its streams,
    minimal record/wait edges, lifetime actions and what each launch ran under. The order is
    validated first (ValueError naming the node)."""
    return json.loads(
        ops.schedule_order(json_text(graph, "graph"), json.dumps(list(order)), _budget(ep_budget, "ep_budget"), _budget(page_budget, "page_budget"))
    )


def lower(graph: Graph, order: Sequence[str], serial: bool = False) -> dict[str, Any]:
    """The simulator program (see `sl.simulate`) that issues `order` on the graph's streams
    (`serial`: all on one stream), with the lifetime drains where the schedule puts them."""
    return json.loads(ops.lower(json_text(graph, "graph"), json.dumps(list(order)), serial))


def simulate_schedule(
    graph: Graph,
    order: Optional[Sequence[str]] = None,
    costs: Optional[dict[str, float]] = None,
    policy: str = "scheduled",
    trace: bool = False,
) -> dict[str, Any]:
    """SIMULATED: any graph through the simulator, under our order (`order=None`) or a given
    one, with per-node costs (us) from `costs`, else the graph's `cost`, else a per-kind
    default. Returns the simulator's report (makespan, exposed comm, memory) plus the order."""
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
