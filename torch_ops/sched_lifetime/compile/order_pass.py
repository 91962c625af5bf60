"""The ordering pass: GraphModule in, GraphModule out, its call nodes in the order Rust's
scheduler chose (placeholders first, output last). The pass decides nothing: the order is an
input."""

from __future__ import annotations

import torch.fx as fx

from .to_ir import is_stand_in


def rewrite(gm: fx.GraphModule, order: list[str]) -> fx.GraphModule:
    """A new GraphModule with the call nodes in `order` (placeholders first, output last)."""
    old = {n.name: n for n in gm.graph.nodes}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr"):
            env[n] = graph.node_copy(n, lambda x: env[x])
    for name in order:
        if name not in old and is_stand_in(name):
            continue  # the other half of a collective split across graphs: nothing to run here
        n = old[name]
        env[n] = graph.node_copy(n, lambda x: env[x])
    for n in gm.graph.nodes:
        if n.op == "output":
            graph.node_copy(n, lambda x: env[x])
    missing = [n.name for n in gm.graph.nodes if n not in env and n.op != "output"]
    if missing:
        raise ValueError(f"the schedule's order leaves out FX nodes {missing[:5]}")
    graph.lint()
    return fx.GraphModule(gm, graph)


def reorder(gm: fx.GraphModule, order: list[str]) -> fx.GraphModule:
    """`rewrite` in place: the same nodes moved into `order` (placeholders and `get_attr`s
    first, output last), so the module keeps its class, codegen and metadata (what a pass in
    someone else's pipeline must keep: torchtitan's graph_trainer runs its graph with boxed
    codegen)."""
    g = gm.graph
    calls = [n for n in g.nodes if n.op not in ("placeholder", "get_attr", "output")]
    by_name = {n.name: n for n in calls}
    if len(order) != len(calls) or set(order) != set(by_name):
        missing = sorted(set(by_name) - set(order))
        extra = sorted(set(order) - set(by_name))
        raise ValueError(f"the schedule's order does not match the FX graph: leaves out {missing[:5]}, names unknown {extra[:5]}")
    cursor: list = [None]

    def place(n: fx.Node) -> None:
        first = next(iter(g.nodes))
        if cursor[0] is not None:
            cursor[0].append(n)
        elif first is not n:
            first.prepend(n)
        cursor[0] = n

    for n in [n for n in g.nodes if n.op == "placeholder"]:
        place(n)
    for n in [n for n in g.nodes if n.op == "get_attr"]:
        place(n)
    for name in order:
        place(by_name[name])
    g.lint()
    gm.recompile()
    return gm
