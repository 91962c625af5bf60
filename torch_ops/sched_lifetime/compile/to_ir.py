"""FX -> IR: the analysis every pass reads. Call nodes become IR nodes; functional collectives
(`_c10d_functional.*` and `_c10d_functional_autograd.*`, and the emulated EP link's
`sched_lifetime_link.*`, see `ep_link.py`) comm launches and their `wait_tensor` the matching wait; views and
`getitem` noops; ops that write an input mutation edges; RNG and side-effecting ops keep their
relative order (control edges); `node.meta["custom"]` (as `torch.fx.traceback.annotate` writes
it) can set a node's source (`"sched_lifetime_source"`) and mark EP regions (`"ep": "dispatch" |
"combine"` with a `"layer"`)."""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx as fx

#: Suffixes of the IR's stand-in nodes for a collective split across graphs (a graph break
#: between a launch and its wait): `<wait>.in_flight` (a launch made by an earlier graph) and
#: `<launch>.handed_on` (a wait made by a later one). Dotted names are never FX node names, so
#: the passes that rebuild a graph from Rust's order skip them (`is_stand_in`).
STAND_IN_SUFFIXES = (".in_flight", ".handed_on")


def is_stand_in(name: str) -> bool:
    """Whether an IR node name is a stand-in for the other half of a split collective."""
    return name.endswith(STAND_IN_SUFFIXES)


#: Namespaces of launch/wait op pairs: functional collectives, the emulated EP link's ops.
#: `_c10d_functional_autograd.*` launches are waited by `_c10d_functional.wait_tensor`. In
#: torch 2.11 their Autograd kernel ran `_c10d_functional.*`, which is what AOTAutograd traced;
#: torch 2.15 makes them CompositeExplicitAutograd aliases with a registered autograd formula,
#: so the forward graph keeps the `_c10d_functional_autograd` op itself.
_COLLECTIVES = ("_c10d_functional", "_c10d_functional_autograd", "sched_lifetime_link")
_SOURCE_KEY = "sched_lifetime_source"


def _is_collective(t: Any) -> bool:
    return isinstance(t, torch._ops.OpOverload) and t.namespace in _COLLECTIVES


def _is_wait(t: Any) -> bool:
    return _is_collective(t) and t.__name__.startswith("wait_tensor")


def _is_view(t: Any) -> bool:
    if t is operator.getitem:
        return True
    if not isinstance(t, torch._ops.OpOverload):
        return False
    return any(r.alias_info is not None and not r.alias_info.is_write for r in t._schema.returns)


def _is_seeded(t: Any) -> bool:
    """Ops that draw from the RNG: reordering them would change the random numbers."""
    return isinstance(t, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in t.tags


def _written_args(n: fx.Node) -> list[fx.Node]:
    t = n.target
    if not isinstance(t, torch._ops.OpOverload):
        return []
    out = []
    for i, a in enumerate(t._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = n.args[i] if i < len(n.args) else n.kwargs.get(a.name)
            for x in v if isinstance(v, (list, tuple)) else [v]:
                if isinstance(x, fx.Node):
                    out.append(x)
    return out


def _nbytes(val: Any) -> int:
    """Bytes of a node's value (a tensor, or a tuple of them) from its fake value; a symbolic
    size counts at its hint (0 when it has none): for memory estimates only."""
    if isinstance(val, (list, tuple)):
        return sum(_nbytes(v) for v in val)
    if not isinstance(val, torch.Tensor):
        return 0
    try:
        n = val.numel()
        return int(n if isinstance(n, int) else n.node.hint) * val.element_size()
    except Exception:  # no hint: unknown, counted as 0
        return 0


def _out(n: fx.Node, **extra: Any) -> dict:
    return {"value": n.name, "bytes": _nbytes(n.meta.get("val")), **extra}


def _inputs(n: fx.Node) -> list[fx.Node]:
    seen: list[fx.Node] = []
    for x in n.all_input_nodes:
        if x not in seen:
            seen.append(x)
    return seen


def _aliased_arg(n: fx.Node) -> Optional[fx.Node]:
    """The input whose storage `n`'s result shares: a view's or in-place op's `self`, an `out=`
    op's `out`, a `getitem`'s container; None for a fresh result."""
    t = n.target
    if t is operator.getitem:
        a = n.args[0] if n.args else None
        return a if isinstance(a, fx.Node) else None
    if not isinstance(t, torch._ops.OpOverload):
        return None
    sets = set()
    for r in t._schema.returns:
        if r.alias_info is not None:
            sets |= set(r.alias_info.before_set)
    if not sets:
        return None
    for i, a in enumerate(t._schema.arguments):
        if a.alias_info is not None and sets & set(a.alias_info.before_set):
            v = n.args[i] if i < len(n.args) else n.kwargs.get(a.name)
            if isinstance(v, (list, tuple)):
                v = v[0] if v else None
            return v if isinstance(v, fx.Node) else None
    return None


def _storage_order(g: fx.Graph, kinds: dict[str, str]) -> list[list[str]]:
    """Control edges that keep reads and writes of one storage in graph order when the graph
    is not functional (torchtitan's traced step writes into buffers through views: `copy_` into
    a slice, `split_with_sizes_copy` into aliases, `all_gather_into_tensor_out`): a write after
    every earlier read and write of any alias of its storage, a read after the last write. A
    collective's wait counts as its launch's reads and writes (c10d reads and fills the buffers
    until then). Views and waits of waits read nothing (they move no data)."""
    root: dict[fx.Node, fx.Node] = {}

    def root_of(x: fx.Node) -> fx.Node:
        return root.get(x, x)

    last_write: dict[fx.Node, str] = {}
    readers: dict[fx.Node, list[str]] = {}
    edges: list[list[str]] = []
    touched_by: dict[fx.Node, tuple[list[fx.Node], list[fx.Node]]] = {}
    for n in g.nodes:
        if n.op != "call_function":
            continue
        a = _aliased_arg(n)
        if a is not None:
            root[n] = root_of(a)
        if _is_wait(n.target) and n.args and isinstance(n.args[0], fx.Node):
            root[n] = root_of(n.args[0])
        if kinds.get(n.name) == "noop":
            continue
        if _is_wait(n.target):
            launch = n.args[0] if n.args else None
            reads, writes = touched_by.get(launch, ([], []))
        else:
            writes = list(dict.fromkeys(root_of(x) for x in _written_args(n)))
            reads = [r for r in dict.fromkeys(root_of(x) for x in _inputs(n)) if r not in writes]
            touched_by[n] = (reads, writes)
        for r in reads:
            w = last_write.get(r)
            if w is not None and w != n.name:
                edges.append([w, n.name])
            readers.setdefault(r, []).append(n.name)
        for r in writes:
            earlier = ([last_write[r]] if r in last_write else []) + readers.pop(r, [])
            edges.extend([e, n.name] for e in dict.fromkeys(earlier) if e != n.name)
            last_write[r] = n.name
    return edges


def to_ir(gm: fx.GraphModule, phase: str) -> dict:
    """The IR table of an AOT graph (see the module docstring). Raises ValueError naming the
    FX node when the graph breaks a contract: a collective whose result is never waited, a
    wait of something that is not a collective, an EP dispatch region without its combine."""
    g = gm.graph
    if phase not in ("fwd", "bwd", "step"):
        raise ValueError(f"to_ir: phase must be 'fwd', 'bwd' or 'step' (a whole traced step), got {phase!r}")
    src_phase = "B" if phase == "bwd" else "F"
    default_source = phase
    sources: dict[str, str] = {default_source: src_phase}
    inputs: list[str] = []
    nodes: list[dict] = []
    value_of: dict[fx.Node, str] = {}  # FX node -> the IR value it reads as
    waited: set[fx.Node] = set()
    regions: dict[Any, dict[str, str]] = {}
    control: list[list[str]] = []
    last_ordered: Optional[str] = None  # RNG and side-effecting ops keep their order
    nodes_source: dict[str, str] = {}
    for n in g.nodes:
        if n.op in ("placeholder", "get_attr"):
            inputs.append(n.name)
            value_of[n] = n.name
            continue
        if n.op == "output":
            continue
        if n.op != "call_function":
            raise ValueError(f"FX node '{n.name}': op {n.op!r} is not supported by the sched_lifetime backend")
        custom = n.meta.get("custom") or {}
        source = str(custom.get(_SOURCE_KEY, default_source))
        nodes_source[n.name] = source
        sources.setdefault(source, src_phase)
        ep = custom.get("ep")
        if ep is not None:
            if ep not in ("dispatch", "combine"):
                raise ValueError(f"FX node '{n.name}': annotation ep={ep!r}, expected 'dispatch' or 'combine'")
            regions.setdefault(custom.get("layer"), {}).setdefault(ep, n.name)
        ins = [value_of[x] for x in _inputs(n) if x in value_of]
        if _is_wait(n.target) and isinstance(n.args[0] if n.args else None, fx.Node) and _is_wait(n.args[0].target):
            # Waiting again for a waited tensor is a no-op (a user's explicit wait after the
            # autograd collective's own).
            nodes.append({"name": n.name, "source": source, "kind": "noop", "inputs": ins, "outputs": [n.name]})
            value_of[n] = n.name
            continue
        if _is_wait(n.target):
            launch = n.args[0] if n.args else None
            if isinstance(launch, fx.Node) and launch.op == "placeholder":
                # Launched by an earlier graph (a graph break between launch and wait): a
                # stand-in launch at the graph's start, a no-op here, so the wait still comes
                # as late as its first use and the budget counts the transfer in flight.
                stand = f"{n.name}.in_flight"
                nodes.append({"name": stand, "source": source, "kind": "comm_launch", "inputs": [value_of[launch]],
                              "outputs": [{"value": stand, "bytes": 0, "alloc": "consumer"}]})
                nodes.append({"name": n.name, "source": source, "kind": "comm_wait", "launch": stand})
                value_of[n] = stand
                continue
            if not isinstance(launch, fx.Node) or not _is_collective(launch.target) or _is_wait(launch.target):
                raise ValueError(f"FX node '{n.name}' waits for '{getattr(launch, 'name', launch)}', which is not a functional collective")
            waited.add(launch)
            nodes.append({"name": n.name, "source": source, "kind": "comm_wait", "launch": launch.name})
            value_of[n] = value_of[launch]  # the launch's output, usable from here on
            continue
        node: dict[str, Any] = {"name": n.name, "source": source, "inputs": ins, "outputs": [_out(n)]}
        if _is_collective(n.target):
            node["kind"] = "comm_launch"
            # Allocated by the collective on the caller's (compute) stream at launch.
            node["outputs"] = [_out(n, alloc="consumer")]
        elif _is_view(n.target):
            node["kind"] = "noop"
            node["outputs"] = [n.name]  # a view: its storage is its input's
        else:
            node["kind"] = "compute"
        written = [value_of[x] for x in _written_args(n) if x in value_of]
        if written:
            node["mutates"] = written
        nodes.append(node)
        value_of[n] = n.name
        if not _is_collective(n.target) and (_is_seeded(n.target) or n.is_impure()):
            if last_ordered is not None:
                control.append([last_ordered, n.name])
            last_ordered = n.name
    returned_nodes = {x for o in g.find_nodes(op="output") for x in o.all_input_nodes}
    for n in g.nodes:
        if n.op == "call_function" and _is_collective(n.target) and not _is_wait(n.target) and n not in waited:
            if n not in returned_nodes:
                raise ValueError(f"FX node '{n.name}' ({n.target}) is a collective whose result is never waited (no wait_tensor)")
            # Returned unwaited: a later graph waits for it (a graph break between). A stand-in
            # wait, a no-op here, closes it for the budget at the end of this graph.
            nodes.append({"name": f"{n.name}.handed_on", "source": nodes_source.get(n.name, default_source), "kind": "comm_wait", "launch": n.name})
    for layer, kinds in regions.items():
        if "dispatch" in kinds and "combine" not in kinds:
            raise ValueError(f"FX node '{kinds['dispatch']}' opens an EP dispatch region (layer {layer!r}) with no combine")
    control += _storage_order(g, {n["name"]: n["kind"] for n in nodes})
    returned = []
    for n in g.find_nodes(op="output"):
        for x in n.all_input_nodes:
            v = value_of.get(x)
            if v is not None and v not in inputs and v not in returned:
                returned.append(v)
    table = {"sources": [{"name": s, "phase": p} for s, p in sources.items()], "inputs": inputs, "nodes": nodes, "outputs": returned}
    if control:
        table["control"] = control
    return table
