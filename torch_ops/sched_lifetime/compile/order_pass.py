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
