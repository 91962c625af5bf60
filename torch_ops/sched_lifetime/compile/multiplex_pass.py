"""The multiplexing pass: a forward graph of one microbatch and a backward graph of another in,
one GraphModule out, both scheduled together by Rust as two sources."""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
import torch.fx as fx

from ..schedule import format_explain, schedule
from .to_ir import is_stand_in, to_ir


#: Per pair of phases: each side's source name and value prefix.
_SIDES = {("fwd", "bwd"): (("F", "f:"), ("B", "b:")), ("fwd", "fwd"): (("F", "f:"), ("F2", "g:")), ("bwd", "bwd"): (("B", "b:"), ("B2", "c:"))}


def multiplex(
    fwd: fx.GraphModule, bwd: fx.GraphModule, ep_budget: Optional[int] = None, explain: bool = False, phases: tuple[str, str] = ("fwd", "bwd")
) -> fx.GraphModule:
    """One GraphModule running a forward graph (of microbatch i) and a backward graph (of
    microbatch j) as two sources scheduled together by Rust, so each one's transfers run
    under the other's compute: `module(*fwd_args, *bwd_args) -> (*fwd_outputs,
    *bwd_outputs)`. Both are AOT graphs (e.g. the `module`s in `history`), compiled once and
    reused for every pair; the result is a plain GraphModule (`.sched_lifetime` holds the IR
    and the schedule). `phases=("fwd", "fwd")` or `("bwd", "bwd")`: two graphs of one phase
    (two microbatches' forwards, or backwards: a step's warm-up and cool-down), the same way."""
    table = multiplex_table(fwd, bwd, phases)
    result = schedule(table, ep_budget=ep_budget, explain=explain)
    if explain:
        print(format_explain(result) or "  (no launches)")
    return build(fwd, bwd, table, result, phases)


def multiplex_table(fwd: fx.GraphModule, bwd: fx.GraphModule, phases: tuple[str, str] = ("fwd", "bwd")) -> dict:
    """The IR table `multiplex` schedules: both graphs' tables, names prefixed per side
    (`f:`/`b:`, `g:`/`c:` for a second graph of one phase), one source each."""
    sides = _SIDES.get(tuple(phases))
    if sides is None:
        raise ValueError(f"multiplex: phases must be one of {sorted(_SIDES)}, got {phases!r}")
    tables = [_prefixed(to_ir(gm, ph), src, p) for gm, ph, (src, p) in zip((fwd, bwd), phases, sides)]
    table = {
        "sources": [s for t in tables for s in t["sources"]],
        "inputs": [v for t in tables for v in t["inputs"]],
        "nodes": [n for t in tables for n in t["nodes"]],
    }
    control = [c for t in tables for c in t.get("control", [])]
    if control:
        table["control"] = control
    return table


def build(fwd: fx.GraphModule, bwd: fx.GraphModule, table: dict, result: dict, phases: tuple[str, str] = ("fwd", "bwd")) -> fx.GraphModule:
    """The multiplexed GraphModule of `fwd` and `bwd` in `result`'s order (a schedule of
    `multiplex_table(fwd, bwd, phases)`). `.sched_lifetime` holds the IR, the schedule, the
    order and `ir_names` (each call node's IR name, by its name in the module)."""
    sides = _SIDES[tuple(phases)]
    graph = fx.Graph()
    root = torch.nn.Module()  # holds each side's constants (get_attr targets), prefixed per side
    envs: list[dict[fx.Node, fx.Node]] = [{}, {}]
    parts = [(fwd, sides[0][1]), (bwd, sides[1][1])]
    for k, (gm, p) in enumerate(parts):
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                envs[k][n] = graph.placeholder(f"{p[0]}_{n.name}")
            elif n.op == "get_attr":  # a tensor constant of the traced code (`torch.tensor(2.0)` in a forward)
                attr = f"{p[0]}_{str(n.target).replace('.', '_')}"
                setattr(root, attr, functools.reduce(getattr, str(n.target).split("."), gm))
                envs[k][n] = graph.get_attr(attr)
    by_name = {p + n.name: (k, n) for k, (gm, p) in enumerate(parts) for n in gm.graph.nodes}
    ir_names: dict[str, str] = {}
    for name in result["order"]:
        if name not in by_name and is_stand_in(name):
            continue  # the other half of a collective split across graphs
        k, n = by_name[name]
        envs[k][n] = graph.node_copy(n, lambda x, env=envs[k]: env[x])
        ir_names[envs[k][n].name] = name
    outs: list[Any] = []
    for k, (gm, _) in enumerate(parts):
        (ret,) = [n.args[0] for n in gm.graph.nodes if n.op == "output"]
        outs += list(fx.map_arg(ret if isinstance(ret, (list, tuple)) else (ret,), lambda x, env=envs[k]: env[x]))
    graph.output(tuple(outs))
    graph.lint()
    out = fx.GraphModule(root, graph)
    out.sched_lifetime = {"ir": table, "schedule": result, "order": list(result["order"]), "ir_names": ir_names}
    return out


def _prefixed(table: dict, source: str, p: str) -> dict:
    """A graph's table with its node and value names prefixed and one source."""
    def v(x: Any) -> Any:
        return p + x if isinstance(x, str) else {**x, "value": p + x["value"]}

    nodes = []
    for n in table["nodes"]:
        m = {**n, "name": p + n["name"], "source": source}
        for key in ("inputs", "mutates"):
            if key in m:
                m[key] = [p + x for x in m[key]]
        if "outputs" in m:
            m["outputs"] = [v(x) for x in m["outputs"]]
        if "launch" in m:
            m["launch"] = p + m["launch"]
        nodes.append(m)
    phase = table["sources"][0]["phase"]
    out = {"sources": [{"name": source, "phase": phase}], "inputs": [p + x for x in table["inputs"]], "nodes": nodes}
    if table.get("control"):
        out["control"] = [[p + a, p + b] for a, b in table["control"]]
    return out
