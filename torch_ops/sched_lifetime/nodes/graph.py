"""The graph of a chunk: its nodes and the forward/backward graph tables the scheduler reads.

Pure: no tensor is touched here. A chunk is a list of `NodeDef`s; `ChunkGraph` checks it and
derives the forward source (`F.<node>`, with comm launch/wait pairs and, for paged nodes, the
page-out and its wait) and the backward source (per node dI `B.<node>` and dW `B.<node>.dw`,
page-ins before a paged node's backward) with their control edges. `_pair_graph` puts one
chunk's forward beside another's backward (the multiplexed F+B), `_two_graph` two microbatches
of one phase (`_renamed` gives the second its own source), and `_order_schedule` asks Rust
for the order of a graph: ours, or a baseline's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from ..calibrate import CALIBRATED, Calibration
from ..schedule import schedule, schedule_order

if TYPE_CHECKING:
    import torch

#: The orders `train_step` and `Chunk.run` take (besides `"ours:<rules,budgets>"`):
#: `calibrated` is ours re-planned under rule `search` with node costs measured in the first
#: steps (`Chunk.calibration`); `ours` the timing-free order.
ORDERS = (CALIBRATED, "ours", "b_then_f", "sequential")


def is_ours(order: str) -> bool:
    """Whether `order` is one of the scheduler's orders (not a baseline's)."""
    return order in ("ours", CALIBRATED) or order.startswith("ours:")


def check_order(order: str, who: str = "") -> None:
    """Raise unless `order` is one of `ORDERS` or `ours:<rules,budgets>` (`who`: the message's
    prefix, e.g. "NodeStage: ")."""
    if order not in ORDERS and not order.startswith("ours:"):
        raise ValueError(f"{who}order must be one of {ORDERS} (or 'ours:<rules,budgets>'), got {order!r}")


@dataclass
class NodeDef:
    """One forward node of a chunk.

    `inputs` / `outputs` are value names local to the chunk. `grad_inputs`: inputs that get a
    gradient; `grad_outputs`: outputs whose gradient flows back (float activations). For a
    comm node, `fn(*inputs, alloc_stream=...)` returns `(outputs, ctx)` and
    `transpose(ctx, *grads_of_grad_outputs, alloc_stream=...)` returns the grads of
    `grad_inputs`; its outputs in `consumer_alloc` are allocated on the consumer stream.

    A forward value that crosses streams (a compute output a comm node reads, a comm output a
    compute node reads) has its storage emptied after its last forward consumer: so a comm
    output that a later node's backward keeps must be in `consumer_alloc` (owned by the
    compute stream, never emptied), and a compute node whose output feeds a comm node must not
    need that output in its own backward (end it with a Linear or a permutation, not an
    activation that saves its result). Guide: docs/nodes.md.

    Example (a compute node with weights, and an all-to-all stand-in with its transpose):

        >>> import torch, sched_lifetime as sl
        >>> lin = torch.nn.Linear(8, 8)
        >>> up = sl.NodeDef("up", "compute", ["x"], ["h"], lin, list(lin.parameters()), grad_outputs=["h"])
        >>> a2a = sl.NodeDef(
        ...     "dispatch", "comm", ["h"], ["d"],
        ...     fn=lambda h, alloc_stream=None: ((h.clone(),), None),       # (outputs, ctx)
        ...     transpose=lambda ctx, g, alloc_stream=None: (g.clone(),),   # grads of grad_inputs
        ...     grad_inputs=["h"], grad_outputs=["d"], consumer_alloc=["d"])
        >>> up.kind, a2a.kind
        ('compute', 'comm')
    """

    name: str
    kind: str  # "compute" or "comm"
    inputs: Sequence[str]
    outputs: Sequence[str]
    fn: Callable[..., Any]
    params: Sequence[torch.nn.Parameter] = ()
    grad_inputs: Sequence[str] = ()
    grad_outputs: Sequence[str] = ()
    transpose: Optional[Callable[..., Any]] = None
    consumer_alloc: Sequence[str] = ()


def _grad_name(v: str, consumer: str) -> str:
    return f"B.g.{v}@{consumer}"


def sum_partials(parts: Sequence[Any]) -> Any:
    """One value's gradient from its consumers' partials (in table order, the forward's), added
    as autograd's engine accumulates them: the last consumer's first (its backward runs first),
    then each earlier one's. With three or more consumers the grouping decides the last bits;
    this is `loss.backward()`'s when each consumer but the last reads the value once (a node
    that reads it more often sums its uses first: `callables.check_node_graph` warns)."""
    g = parts[-1] if parts else None
    for p in reversed(parts[:-1]):
        g = g + p
    return g


class ChunkGraph:
    """A chunk's nodes, checked, and the graph tables derived from them.

    `loss_output`: the value whose gradient starts the backward (given as the backward
    source's graph input `B.g.<loss_output>`). The paging settings (`_paged`,
    `page_prefetch`, `page_release`) only add page nodes and edges here; `Chunk.enable_paging`
    chooses them."""

    ORDERS = ORDERS

    def __init__(self, nodes: Sequence[NodeDef], inputs: Sequence[str], loss_output: str, dw_nodes: bool = True) -> None:
        self.nodes = list(nodes)
        #: True: each compute node with weights has a separate dW node (`B.<node>.dw`) the
        #: scheduler may defer under the other source's transfers. False: its dI node computes
        #: dW too, in the same autograd call (fewer nodes and engine calls: for chunks with
        #: little or no communication to hide, where the host path is what costs).
        self.dw_nodes = dw_nodes
        self.inputs = list(inputs)
        self.loss_output = loss_output
        names = [n.name for n in self.nodes]
        if len(set(names)) != len(names):
            raise ValueError("node names must be unique")
        self._by_name = {n.name: n for n in self.nodes}
        #: Node costs (us) by graph node name, e.g. a previous run's `durations.json`: written
        #: into the graph's `cost` fields so the opt-in cost rules (order `"ours:search"`) can
        #: use them; the default order is timing-free and never reads them.
        self.costs: dict[str, float] = {}
        #: Cost calibration of order `"calibrated"` (`sched_lifetime.calibrate`): the first
        #: `steps` steps are timed, then the order is re-planned with the measured costs.
        #: Replace it to change the settings (`Calibration(steps=3, smoothing=0.5)`).
        self.calibration = Calibration()
        produced = set(self.inputs)
        for n in self.nodes:
            for v in n.inputs:
                if v not in produced:
                    raise ValueError(f"node '{n.name}' reads '{v}' before any node produces it")
            for v in list(n.grad_inputs):
                if v not in n.inputs:
                    raise ValueError(f"node '{n.name}': grad input '{v}' is not an input")
            for v in list(n.grad_outputs) + list(n.consumer_alloc):
                if v not in n.outputs:
                    raise ValueError(f"node '{n.name}': '{v}' is not an output")
            if n.kind == "comm" and n.transpose is None:
                raise ValueError(f"comm node '{n.name}' needs a transpose for its backward")
            if n.kind not in ("compute", "comm"):
                raise ValueError(f"node '{n.name}': kind must be compute or comm, got {n.kind!r}")
            produced.update(n.outputs)
        written = [v for n in self.nodes for v in n.outputs]
        if loss_output not in written:
            # Caught here, not at the first backward (a KeyError on `F.<name>`, far from the cause).
            raise ValueError(
                f"loss output '{loss_output}' is written by no node (their outputs: {written}); "
                "name the value whose gradient starts the backward"
            )
        # Consumers that take a gradient of each value, in table order.
        self._grad_consumers: dict[str, list[str]] = {}
        for n in self.nodes:
            for v in n.grad_inputs:
                self._grad_consumers.setdefault(v, []).append(n.name)
        # Paging's page nodes: the compute nodes whose saved activations are paged, the page-in
        # prefetch distance and the page-out release distance (`Chunk.enable_paging`).
        self._paged: set[str] = set()
        self.page_prefetch: Optional[int] = None
        self.page_release: Optional[int] = None
        # Forward compute node -> the paged nodes whose page-out it waits for and releases.
        self._release_at: dict[str, list[str]] = {}
        self._forward_table = self._forward_nodes()
        self._backward_table = self._backward_nodes()

    def _rebuild(self) -> None:
        """Derive the tables again (after the paging settings changed)."""
        self._forward_table = self._forward_nodes()
        self._backward_table = self._backward_nodes()

    def _flowing(self, n: NodeDef) -> list[str]:
        """The grad outputs of `n` a gradient actually reaches: the loss, or a value some later
        node takes a gradient of (a declared grad output nobody differentiates gets none)."""
        return [v for v in n.grad_outputs if v == self.loss_output or v in self._grad_consumers]

    def _tied_params(self) -> dict[int, int]:
        """Parameters whose gradient several nodes' backwards add (tied weights), by id: how
        many nodes (each adds once per microbatch)."""
        counts: dict[int, int] = {}
        for n in self.nodes:
            if n.kind == "compute" and n.params and self._has_backward(n):
                for i in {id(p) for p in n.params}:
                    counts[i] = counts.get(i, 0) + 1
        return {i: k for i, k in counts.items() if k > 1}

    def _has_dw_node(self, n: NodeDef) -> bool:
        """Whether `n`'s backward has a separate dW node: it has weights, and either dW nodes
        are on or no input takes a gradient (then the whole backward is dW)."""
        return bool(n.params) and (self.dw_nodes or not n.grad_inputs)

    def _has_backward(self, n: NodeDef) -> bool:
        """Whether `n` gets a backward node: a gradient flows into it and it has something to
        compute from it (a comm's transpose, an input's gradient or a dW). Otherwise its forward
        keeps no state for a backward (a parameter-free node whose inputs take no gradient)."""
        if not self._grads_into(n):
            return False
        return n.kind == "comm" or bool(n.grad_inputs) or self._has_dw_node(n)

    def _grads_into(self, n: NodeDef) -> list[str]:
        """Gradient values a backward node of `n` reads: per flowing grad output, the partials
        of its consumers (the loss output reads the source's input)."""
        out = []
        for v in self._flowing(n):
            if v == self.loss_output:
                out.append(f"B.g.{v}")
            out.extend(_grad_name(v, c) for c in self._grad_consumers.get(v, ()))
        return out

    def _forward_nodes(self) -> list[dict]:
        table = []
        self._forward_control: list[list[str]] = []
        self._release_at = {}
        computes = [n.name for n in self.nodes if n.kind == "compute"]
        for n in self.nodes:
            ins = [f"F.{v}" for v in n.inputs]
            if n.kind == "compute":
                table.append({"name": f"F.{n.name}", "source": "F", "kind": "compute", "inputs": ins, "outputs": [f"F.{v}" for v in n.outputs]})
                if n.name in self._paged:
                    # The node's saved activations go to host memory on the page stream after
                    # it (a control edge: the copy reads what the node saved, not its outputs).
                    po = f"F.{n.name}.page_out"
                    table.append({"name": po, "source": "F", "kind": "page_out", "inputs": [], "outputs": []})
                    table.append({"name": f"{po}.wait", "source": "F", "kind": "page_wait", "launch": po})
                    self._forward_control.append([f"F.{n.name}", po])
                    # The compute node `page_release` nodes later waits for the page-out and
                    # releases its device storage (`_release_edges`).
                    k = computes.index(n.name) + (self.page_release or 0)
                    if self.page_release is not None and k < len(computes):
                        self._release_at.setdefault(computes[k], []).append(n.name)
            else:
                outs = [
                    {"value": f"F.{v}", "alloc": "consumer"} if v in n.consumer_alloc else f"F.{v}" for v in n.outputs
                ]
                table.append({"name": f"F.{n.name}", "source": "F", "kind": "comm_launch", "inputs": ins, "outputs": outs})
                table.append({"name": f"F.{n.name}.wait", "source": "F", "kind": "comm_wait", "launch": f"F.{n.name}"})
        return table

    def _release_edges(self) -> list[list[str]]:
        """Control edges from each paged node's page-out wait to the forward compute node that
        releases its storage (the scheduler issues the wait before it). Only for a forward beside
        a backward source (`_pair_graph`): a forward alone (a warm-up) has nothing to hide the
        copies under, and its memory is not the step's peak (its page-outs go on queries and at
        the page-ins)."""
        return [[f"F.{x}.page_out.wait", f"F.{target}"] for target, xs in self._release_at.items() for x in xs]

    def _backward_nodes(self) -> list[dict]:
        table: list[dict] = []
        self._backward_control: list[list[str]] = []
        # Backward compute nodes issued so far (table order), for the page-in prefetch distance.
        done: list[str] = []
        for n in reversed(self.nodes):
            grads = self._grads_into(n)
            if not grads:
                continue
            partials = [_grad_name(v, n.name) for v in n.grad_inputs]
            if n.kind == "comm":
                outs = [{"value": p, "alloc": "consumer"} for p in partials]
                table.append({"name": f"B.{n.name}", "source": "B", "kind": "comm_launch", "inputs": grads, "outputs": outs})
                table.append({"name": f"B.{n.name}.wait", "source": "B", "kind": "comm_wait", "launch": f"B.{n.name}"})
                continue
            if n.name in self._paged:
                # Back from host memory before the node's backward (dI and dW both read it).
                # It needs nothing from this source: a control edge from the backward compute
                # node `page_prefetch` nodes earlier holds it back until then (None: ready at
                # once; the scheduler then launches it as soon as the page budget allows).
                pi = f"B.{n.name}.page_in"
                table.append({"name": pi, "source": "B", "kind": "page_in", "inputs": [], "outputs": [{"value": f"B.p.{n.name}", "alloc": "consumer"}]})
                table.append({"name": f"{pi}.wait", "source": "B", "kind": "page_wait", "launch": pi})
                if self.page_prefetch is not None and len(done) >= self.page_prefetch > 0:
                    self._backward_control.append([done[-self.page_prefetch], pi])
                grads = grads + [f"B.p.{n.name}"]
            if partials:
                table.append({"name": f"B.{n.name}", "source": "B", "kind": "compute", "inputs": grads, "outputs": partials})
                done.append(f"B.{n.name}")
            if self._has_dw_node(n):
                # dW reads what dI reads, so dI's live-ins stay until dW has run; it runs
                # after dI (a control edge), from the gradients dI computed.
                if partials:
                    self._backward_control.append([f"B.{n.name}", f"B.{n.name}.dw"])
                table.append(
                    {"name": f"B.{n.name}.dw", "source": "B", "kind": "compute", "wgrad": True, "inputs": grads, "outputs": [f"B.w.{n.name}"]}
                )
        return table

    def graph(self, forward: bool, backward: bool) -> dict:
        """The graph table of a forward source, a backward source, or both multiplexed."""
        return _pair_graph(self if forward else None, self if backward else None)

    def order_schedule(self, forward: bool, backward: bool, order: str) -> dict:
        """Our schedule, or a baseline's: `b_then_f` (every backward node, then every forward
        node) or `sequential` (the same, each comm waited at once: table order)."""
        return _order_schedule(self.graph(forward, backward), order, self.calibration)


def _pair_graph(fchunk: Optional[ChunkGraph], bchunk: Optional[ChunkGraph]) -> dict:
    """The graph table of F of `fchunk` multiplexed with B of `bchunk` (either may be None)."""
    sources, nodes, inputs, control = [], [], [], []
    if bchunk is not None:
        sources.append({"name": "B", "phase": "B"})
        nodes += bchunk._backward_table
        control += bchunk._backward_control
        inputs.append(f"B.g.{bchunk.loss_output}")
    if fchunk is not None:
        sources.append({"name": "F", "phase": "F"})
        nodes += fchunk._forward_table
        control += fchunk._forward_control
        if bchunk is not None:
            control += fchunk._release_edges()
        inputs += [f"F.{v}" for v in fchunk.inputs]
    costs = {**(bchunk.costs if bchunk is not None else {}), **(fchunk.costs if fchunk is not None else {})}
    if costs:
        nodes = [dict(n, cost=float(costs[n["name"]])) if n["name"] in costs else n for n in nodes]
    g = {"sources": sources, "inputs": inputs, "nodes": nodes}
    if control:
        g["control"] = control
    return g


def _order_schedule(g: dict, order: str, calibration: Optional[Calibration] = None) -> dict:
    if order == "ours":
        return schedule(g)
    if order == CALIBRATED:
        if calibration is None:
            raise ValueError("order 'calibrated' needs the chunk's calibration (Chunk.calibration)")
        return calibration.schedule(g)
    if order.startswith("ours:"):  # ours with named rules and budgets, e.g. "ours:classic,ep_budget=1"
        rules, budgets = [], {}
        for item in filter(None, (x.strip() for x in order[len("ours:") :].split(","))):
            key, eq, val = item.partition("=")
            if eq and key in ("ep_budget", "page_budget"):
                if not val.isdigit():
                    raise ValueError(f"order {order!r}: {key} must be a positive integer, got {val!r}")
                budgets[key] = int(val)
            elif eq:
                raise ValueError(f"order {order!r}: unknown setting {key!r} (ep_budget, page_budget)")
            else:
                rules.append(item)
        return schedule(g, rules=",".join(rules), **budgets)
    if order in ("b_then_f", "sequential"):
        # Table order lists B first, and each wait right after its launch.
        return schedule_order(g, [n["name"] for n in g["nodes"]])
    raise ValueError(f"order must be one of {ORDERS} (or 'ours:<rules,budgets>'), got {order!r}")


def _renamed(nodes: list[dict], control: list[list[str]], old: str, new: str) -> tuple[list[dict], list[list[str]]]:
    """A source's graph table and control edges with its prefix `old.` renamed `new.` (node,
    value and launch names) and its nodes moved to source `new`."""

    def r(x: str) -> str:
        return new + x[len(old) :] if x.startswith(old + ".") else x

    out = []
    for n in nodes:
        m = dict(n, name=r(n["name"]), source=new)
        if "launch" in m:
            m["launch"] = r(m["launch"])
        if "inputs" in m:
            m["inputs"] = [r(v) for v in m["inputs"]]
        if "outputs" in m:
            m["outputs"] = [dict(o, value=r(o["value"])) if isinstance(o, dict) else r(o) for o in m["outputs"]]
        out.append(m)
    return out, [[r(a), r(b)] for a, b in control]


def _two_graph(chunk: ChunkGraph, phase: str) -> dict:
    """The graph of two microbatches of the same phase multiplexed: `F` with `F2` (two
    forwards) or `B` with `B2` (two backwards; the second source's weight-gradient work on each
    node after the first's, so the gradients accumulate in microbatch order)."""
    # The second microbatch's table is the first's renamed (the twin's tables are the same).
    first = chunk._forward_table if phase == "F" else chunk._backward_table
    ctrl = chunk._forward_control if phase == "F" else chunk._backward_control
    if chunk.costs:  # both microbatches' nodes cost what the chunk's do (rule `search` reads them)
        first = [dict(n, cost=float(chunk.costs[n["name"]])) if n["name"] in chunk.costs else n for n in first]
    nodes2, control2 = _renamed(first, ctrl, phase, phase + "2")
    control = list(ctrl) + control2
    if phase == "B":
        names = {n["name"] for n in first}
        for n in chunk.nodes:
            if not n.params:
                continue
            # The node that adds this node's weight gradients into `.grad`: dW, or the fused dI.
            acc = f"B.{n.name}.dw" if chunk._has_dw_node(n) else f"B.{n.name}"
            if acc in names:  # a node no gradient reaches has no backward node
                control.append([acc, "B2" + acc[1:]])
        inputs = [f"B.g.{chunk.loss_output}", f"B2.g.{chunk.loss_output}"]
    else:
        inputs = [f"F.{v}" for v in chunk.inputs] + [f"F2.{v}" for v in chunk.inputs]
    g = {"sources": [{"name": phase, "phase": phase}, {"name": phase + "2", "phase": phase}], "inputs": inputs, "nodes": list(first) + nodes2}
    if control:
        g["control"] = control
    return g


def two_schedule(chunk: ChunkGraph, phase: str, order: str = "ours") -> dict:
    """The schedule `run_two(chunk, phase, ...)` runs (for the ranks' digest and for tests)."""
    return _order_schedule(_two_graph(chunk, phase), order, chunk.calibration)
