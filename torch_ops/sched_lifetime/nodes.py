"""Eager node API (DESIGN.md §6), in the shape of Megatron-LM's schedule nodes.

A model chunk is a list of `NodeDef`s: compute nodes (a forward function and the parameters
it uses) and comm nodes (an EP dispatch/combine with an explicit transpose for its backward).
From that list, `Chunk` derives two graph tables for the scheduler: the forward source and the
backward source, whose nodes are the backward of each forward node, split into dI (`B.<node>`)
and dW (`B.<node>.dw`, weight-gradient work the scheduler may defer). Each compute node's
backward runs through autograd on its own detached inputs, so one microbatch's backward is
split per node and can be interleaved with another microbatch's forward.

`Chunk.run(...)` runs a forward of one microbatch, a backward of another, or both multiplexed
(`combined_step`) through the executor, in the scheduler's order or a baseline's; `train_step`
runs a whole step of n microbatches (warm-up F, combined F(i+1)+B(i), cool-down B) with
gradient accumulation. The order, streams, syncs and lifetime points all come from Rust.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from .executor import Executor
from .paging import HostPool, group_plan, is_weight, page_plan, restorable
from .schedule import schedule, schedule_order


@dataclass
class NodeDef:
    """One forward node of a chunk.

    `inputs` / `outputs` are value names local to the chunk. `grad_inputs`: inputs that get a
    gradient; `grad_outputs`: outputs whose gradient flows back (float activations). For a
    comm node, `fn(*inputs, alloc_stream=...)` returns `(outputs, ctx)` and
    `transpose(ctx, *grads_of_grad_outputs, alloc_stream=...)` returns the grads of
    `grad_inputs`; its outputs in `consumer_alloc` are allocated on the consumer stream.
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


@dataclass
class MicrobatchState:
    """What one microbatch's forward keeps for its backward: per node, the detached leaf
    inputs and the outputs of its autograd graph (compute), or the comm's context."""

    index: int
    saved: dict[str, Any] = field(default_factory=dict)
    loss: Optional[torch.Tensor] = None
    #: Paging: per paged node, the saved activations waiting for their page-out (device
    #: tensors), then their host handles; and after the page-in, the reloaded tensors.
    paged: dict[str, list] = field(default_factory=dict)
    paged_in: dict[str, list] = field(default_factory=dict)
    #: Per paged node, the host pool's `mark()` when its page-in was queued.
    page_marks: dict[str, int] = field(default_factory=dict)
    #: Per paged node, the host pool's `mark()` right after its page-out was queued.
    page_out_end: dict[str, int] = field(default_factory=dict)
    #: The step's last backward: each node's data-parallel gradients are final after its
    #: weight gradients here, and their all-reduce starts then (`Chunk.enable_grad_reduce`).
    last: bool = False


class GradReduce:
    """Data-parallel gradient averaging inside the step, as DDP / Megatron's
    `overlap_grad_reduce` do: the gradients of `params` are summed over `group` and divided by
    its size. `launch(params)` flattens the given ones' gradients (as they are now: the caller
    launches once they are final) into one bucket and starts its all-reduce asynchronously (c10d
    queues it on its own stream after the current stream's work); `finish()` waits for every
    bucket on the current stream and writes the averages back into `.grad`. The arithmetic is
    the one all-reduce of the flattened gradients after the step does (with two ranks the sum of
    each element is the same wherever its bucket ends)."""

    def __init__(self, params: Sequence[torch.nn.Parameter], group: Any = None) -> None:
        import torch.distributed as dist

        self.ids = {id(p) for p in params}
        if len(self.ids) != len(list(params)):
            raise ValueError("enable_grad_reduce: a parameter is listed twice")
        self.group = group
        self.world = dist.get_world_size(group)
        self.pending: list[tuple[list[torch.Tensor], torch.Tensor, Any]] = []
        self.buckets = 0  # buckets launched so far, in all

    def launch(self, params: Sequence[torch.Tensor]) -> None:
        import torch.distributed as dist

        grads = [p.grad for p in params if id(p) in self.ids and p.grad is not None]
        if not grads:
            return
        flat = torch._utils._flatten_dense_tensors(grads)
        work = dist.all_reduce(flat, group=self.group, async_op=True)
        self.pending.append((grads, flat, work))
        self.buckets += 1

    def finish(self) -> None:
        pending, self.pending = self.pending, []
        for grads, flat, work in pending:
            work.wait()
            flat /= self.world
            for g, f in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(f)

    def abandon(self) -> None:
        """A step cut short: wait for what was launched (every rank launched it) and drop it."""
        pending, self.pending = self.pending, []
        for _, _, work in pending:
            work.wait()


class _Ctx:
    """The microbatches the multiplexed callables work on now."""

    def __init__(self) -> None:
        self.fwd: Optional[MicrobatchState] = None
        self.bwd: Optional[MicrobatchState] = None
        self.compute: Optional[torch.Stream] = None


def _grad_name(v: str, consumer: str) -> str:
    return f"B.g.{v}@{consumer}"


class Chunk:
    """A model chunk as nodes, with the graph tables and callables the executor runs.

    `loss_output`: the value whose gradient starts the backward (given as the backward
    source's graph input `B.g.<loss_output>`)."""

    ORDERS = ("ours", "b_then_f", "sequential")

    def __init__(
        self, nodes: Sequence[NodeDef], inputs: Sequence[str], loss_output: str, device: torch.device, dw_nodes: bool = True
    ) -> None:
        self.nodes = list(nodes)
        #: True: each compute node with weights has a separate dW node (`B.<node>.dw`) the
        #: scheduler may defer under the other source's transfers. False: its dI node computes
        #: dW too, in the same autograd call (fewer nodes and engine calls: for chunks with
        #: little or no communication to hide, where the host path is what costs).
        self.dw_nodes = dw_nodes
        self.inputs = list(inputs)
        self.loss_output = loss_output
        self.device = device
        names = [n.name for n in self.nodes]
        if len(set(names)) != len(names):
            raise ValueError("node names must be unique")
        self._by_name = {n.name: n for n in self.nodes}
        #: Node costs (us) by graph node name, e.g. a previous run's `durations.json`: written
        #: into the graph's `cost` fields so the opt-in cost rules (order `"ours:search"`) can
        #: use them; the default order is timing-free and never reads them.
        self.costs: dict[str, float] = {}
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
        # Consumers that take a gradient of each value, in table order.
        self._grad_consumers: dict[str, list[str]] = {}
        for n in self.nodes:
            for v in n.grad_inputs:
                self._grad_consumers.setdefault(v, []).append(n.name)
        self.ctx = _Ctx()
        #: When a list, dW nodes queue their work here instead of running it (the caller runs
        #: it later: a pipeline schedule's BACKWARD_WEIGHT).
        self.deferred_dw: Optional[list[Callable[[], None]]] = None
        # Paging (`enable_paging`): the compute nodes whose saved activations are paged, the
        # pinned host pool, and the calibration's per-node saved bytes.
        self._paged: set[str] = set()
        self._page_bytes: dict[str, list[int]] = {}
        self.pool: Any = None
        self.page_min_bytes = 1 << 16
        self.page_prefetch: Optional[int] = None
        self.page_release: Optional[int] = None
        # Forward compute node -> the paged nodes whose page-out it waits for and releases.
        self._release_at: dict[str, list[str]] = {}
        self._calibrating: Optional[dict[str, list[int]]] = None
        self._calib_saved: dict[str, list[torch.Tensor]] = {}
        self.page_plan: Optional[dict] = None
        #: Bytes moved by the page nodes (out == in once every paged microbatch has run its
        #: backward).
        self.page_stats = {"bytes_out": 0, "bytes_in": 0}
        self._forward_table = self._forward_nodes()
        self._backward_table = self._backward_nodes()
        self._executors: dict[tuple, Executor] = {}
        #: The second microbatch's Chunk of a `run_two` pair (same nodes, own context).
        self._twin_chunk: Optional[Chunk] = None
        #: Data-parallel gradient averaging in the step (`enable_grad_reduce`), or None.
        self.grad_reduce: Optional[GradReduce] = None
        #: Time every node (`Executor(timing=True)`); `node_times_us` collects the times.
        self.timing = False
        self._times: dict[str, list[float]] = {}

    # -- graph tables ------------------------------------------------------------------

    def _flowing(self, n: NodeDef) -> list[str]:
        """The grad outputs of `n` a gradient actually reaches: the loss, or a value some later
        node takes a gradient of (a declared grad output nobody differentiates gets none)."""
        return [v for v in n.grad_outputs if v == self.loss_output or v in self._grad_consumers]

    def _has_dw_node(self, n: NodeDef) -> bool:
        """Whether `n`'s backward has a separate dW node: it has weights, and either dW nodes
        are on or no input takes a gradient (then the whole backward is dW)."""
        return bool(n.params) and (self.dw_nodes or not n.grad_inputs)

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
        return _order_schedule(self.graph(forward, backward), order)

    # -- callables ---------------------------------------------------------------------

    def _forward_fn(self, n: NodeDef, release_points: bool) -> Callable[..., Any]:
        ctx = self.ctx
        if n.kind == "comm":

            def comm(*args: Any) -> Any:
                outs, cctx = n.fn(*args, alloc_stream=ctx.compute)
                ctx.fwd.saved[n.name] = cctx
                return outs

            return comm
        grad_ix = [i for i, v in enumerate(n.inputs) if v in n.grad_inputs]
        flowing = self._flowing(n)
        out_ix = [i for i, v in enumerate(n.outputs) if v in flowing]

        release = list(self._release_at.get(n.name, ())) if release_points else []

        def compute(*args: Any) -> Any:
            for x in release:  # the compute stream has waited for x's page-out (a control edge)
                mark = ctx.fwd.page_out_end.pop(x, None)
                if mark is not None:
                    self.pool.release_queued_before(mark)
            args = list(args)
            leaves = []
            for i in grad_ix:
                args[i] = args[i].detach().requires_grad_(True)
                leaves.append(args[i])
            with torch.enable_grad(), self._page_hooks(n.name, ctx.fwd):
                outs = n.fn(*args)
            outs = outs if isinstance(outs, tuple) else (outs,)
            ctx.fwd.saved[n.name] = (leaves, [outs[i] for i in out_ix])
            if n.outputs and n.outputs[-1] == self.loss_output and len(n.outputs) == 1:
                ctx.fwd.loss = outs[0].detach()
            return tuple(o.detach() if isinstance(o, torch.Tensor) and o.requires_grad else o for o in outs)

        return compute

    def _backward_fns(self, n: NodeDef) -> dict[str, Callable[..., Any]]:
        ctx = self.ctx
        per_output = [
            (1 if v == self.loss_output else 0) + len(self._grad_consumers.get(v, ())) for v in self._flowing(n)
        ]

        def summed(grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
            out, k = [], 0
            for count in per_output:
                g = grads[k]
                for extra in grads[k + 1 : k + count]:
                    g = g + extra
                out.append(g)
                k += count
            return out

        fns: dict[str, Callable[..., Any]] = {}
        if n.kind == "comm":

            def comm_b(*grads: torch.Tensor) -> Any:
                cctx = ctx.bwd.saved.pop(n.name)
                return n.transpose(cctx, *summed(grads), alloc_stream=ctx.compute)

            fns[f"B.{n.name}"] = comm_b
            return fns
        has_dw = bool(n.params)
        params = list(n.params)
        fused = has_dw and not self.dw_nodes  # dI computes dW in the same call

        paged = n.name in self._paged

        def release_paged_out(st: MicrobatchState) -> None:
            # The compute stream has waited for this node's page-in (its sync edge), which the
            # page stream ran after every page-out queued before it: their device storage goes
            # now, with no query (the capture-safe release point; eager also frees on queries).
            self.pool.release_queued_before(st.page_marks.pop(n.name))

        def accumulate(st: MicrobatchState, grads: Sequence[Optional[torch.Tensor]]) -> None:
            accumulate_grads(params, grads)
            if st.last and self.grad_reduce is not None:  # this node's gradients are final
                self.grad_reduce.launch(params)

        def d_input(*grads: torch.Tensor) -> Any:
            st = ctx.bwd
            if paged:  # the last input is the page-in's token (the unpack hook reads st.paged_in)
                grads = grads[:-1]
                release_paged_out(st)
            leaves, outs = st.saved[n.name] if has_dw and not fused else st.saved.pop(n.name)
            g = summed(grads)
            if fused:
                res = torch.autograd.grad(outs, [*leaves, *params], g, allow_unused=True)
                st.paged_in.pop(n.name, None)
                accumulate(st, res[len(leaves) :])
                res = res[: len(leaves)]
            elif not has_dw:
                res = torch.autograd.grad(outs, leaves, g, allow_unused=True)
                st.paged_in.pop(n.name, None)
            else:
                # dW follows (a control edge orders it): split where the weights join the
                # input's graph, so dW reuses the gradients computed here instead of redoing them.
                split = _WeightSplit(outs, leaves, params)
                res = split.input_grads(g)
                st.saved[n.name] = split
            return tuple(torch.zeros_like(leaf) if r is None else r for r, leaf in zip(res, leaves))

        def weight_grads(st: MicrobatchState, grads: Sequence[torch.Tensor]) -> None:
            saved = st.saved.pop(n.name)
            if isinstance(saved, _WeightSplit):
                res = saved.weight_grads()
            else:  # no dI part (no input takes a gradient): the whole backward is dW
                res = torch.autograd.grad(saved[1], params, summed(grads), allow_unused=True)
            st.paged_in.pop(n.name, None)
            accumulate(st, res)

        def d_weight(*grads: torch.Tensor) -> Any:
            st = ctx.bwd
            if paged and not n.grad_inputs:  # the page-in's consumer is this node
                release_paged_out(st)
            if paged:
                grads = grads[:-1]
            if self.deferred_dw is not None:  # dW later (a pipeline's BACKWARD_WEIGHT)
                self.deferred_dw.append(lambda: weight_grads(st, grads))
            else:
                weight_grads(st, grads)
            return None

        if n.grad_inputs:
            fns[f"B.{n.name}"] = d_input
        if self._has_dw_node(n):
            fns[f"B.{n.name}.dw"] = d_weight
        return fns

    def callables(self, forward: bool, backward: bool, release_points: bool = False) -> dict[str, Callable[..., Any]]:
        """The node callables of a forward and/or backward source; `release_points`: the
        forward runs beside a backward source, with the page-outs' release points."""
        out: dict[str, Callable[..., Any]] = {}
        names = {n["name"] for n in self.graph(forward, backward)["nodes"]}
        for n in self.nodes:
            if forward:
                out[f"F.{n.name}"] = self._forward_fn(n, release_points)
                if n.name in self._paged:
                    out[f"F.{n.name}.page_out"] = self._page_out_fn(n.name)
            if backward:
                out.update(self._backward_fns(n))
                if n.name in self._paged:
                    out[f"B.{n.name}.page_in"] = self._page_in_fn(n.name)
        return {k: v for k, v in out.items() if k in names}

    # -- paging ------------------------------------------------------------------------

    def _page_hooks(self, name: str, st: Optional[MicrobatchState]) -> Any:
        """`saved_tensors_hooks` for a paged node's forward (activations of at least
        `page_min_bytes` are held for the page-out; weights, the node's detached inputs and
        tensors whose elements share memory stay), for every node while calibrating (bytes
        counted), else nothing."""
        calib = self._calibrating
        if calib is None and name not in self._paged:
            return contextlib.nullcontext()

        def pageable(t: torch.Tensor) -> bool:
            return not is_weight(t) and restorable(t) and t.numel() * t.element_size() >= self.page_min_bytes

        # Nothing packed refers back to the graph: the autograd graph keeps what the hooks
        # pack (in C++, out of the garbage collector's sight), so a kept tensor with its
        # grad_fn, or the microbatch state (which keeps the graph), would make a cycle that
        # leaks a graph whose backward never runs (the calibration forward's), with its
        # activations and its parameters' gradient accumulators (made on the stream of that
        # eager forward: a later CUDA graph capture then fails on them). Kept tensors are
        # packed detached (the unpacked tensor gets its grad_fn back from autograd) and the
        # state weakly.
        ref = weakref.ref(st) if st is not None else None

        def pack(t: torch.Tensor) -> Any:
            if not pageable(t):
                return ("keep", t.detach())
            if calib is not None:
                calib.setdefault(name, []).append(t.numel() * t.element_size())
                self._calib_saved.setdefault(name, []).append(t.detach())  # for the host layout
                return ("keep", t.detach())
            held = ref().paged.setdefault(name, [])
            held.append(t)
            return ("paged", ref, name, len(held) - 1)

        def unpack(packed: Any) -> torch.Tensor:
            if packed[0] == "keep":
                return packed[1]
            _, owner_ref, node, i = packed
            owner = owner_ref()
            if owner is None:
                raise RuntimeError(f"node '{node}': saved activation #{i} unpacked after its microbatch's state was dropped")
            reloaded = owner.paged_in.get(node)
            if reloaded is None:
                raise RuntimeError(f"node '{node}': saved activation #{i} read before its page-in (microbatch {owner.index})")
            return reloaded[i]

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def _page_out_fn(self, name: str) -> Callable[..., Any]:
        ctx = self.ctx

        def page_out() -> tuple:
            st = ctx.fwd
            held = st.paged.get(name, [])
            got = [t.numel() * t.element_size() for t in held]
            if got != self._page_bytes[name]:
                raise ValueError(
                    f"saved {got} bytes, calibration saw {self._page_bytes[name]}: the host pool is sized for the "
                    "calibrated shapes (counted EP dispatch changes them each microbatch: page with a fixed capacity_factor)"
                )
            st.paged[name] = self.pool.page_out_group(held, owner=ctx.compute, ordered=True)
            st.page_out_end[name] = self.pool.page_outs
            self.page_stats["bytes_out"] += sum(h.nbytes for h in st.paged[name])
            return ()

        return page_out

    def _page_in_fn(self, name: str) -> Callable[..., Any]:
        ctx = self.ctx

        def page_in() -> tuple:
            st = ctx.bwd
            handles = st.paged.pop(name, None)
            if handles is None:
                raise RuntimeError(f"node '{name}': page-in of microbatch {st.index}, which was never paged out")
            self.pool.release_done()  # page-outs whose copy is done give their device storage back
            st.page_marks[name] = self.pool.mark()
            st.paged_in[name] = self.pool.page_in_group(handles, alloc_stream=ctx.compute)[0]
            self.page_stats["bytes_in"] += sum(h.nbytes for h in handles)
            return (st.paged_in[name],)

        return page_in

    def enable_paging(
        self,
        example: dict[str, Any],
        budget: Any = None,
        nodes: Optional[Sequence[str]] = None,
        in_flight: int = 2,
        min_bytes: int = 1 << 16,
        min_distance: int = 1,
        prefetch: Optional[int] = 2,
        release: Optional[int] = 4,
    ) -> dict:
        """Page the saved activations of some compute nodes to pinned host memory through page
        nodes of the graph (`F.<node>.page_out` after the node, `B.<node>.page_in` before its
        backward), which the scheduler interleaves with the other source's work. Calibration:
        one forward of `example` (the chunk's inputs; with EP every rank calls this together:
        it runs the collectives) records each node's saved activations; Rust's `page_plan`
        picks the nodes under `budget` (furthest backward use first), or `nodes` names them.
        The host pool is allocated here, `in_flight` microbatches deep (a combined F(i+1)+B(i)
        step holds two), never during a step. `prefetch`: a page-in may start once the backward
        compute node that many dI nodes before its consumer has been issued (None: at once).
        `release`: the forward compute node that many compute nodes after a paged one waits for
        its page-out and releases its device storage (a control edge from the page-out's wait:
        the bytes leave the device under the forward, by a point the copy has had that many
        nodes of compute to finish in; None: released only when a host-side query finds the
        copy done, or at the page-in). Returns the plan."""
        if isinstance(in_flight, bool) or not isinstance(in_flight, int) or in_flight < 1:
            raise ValueError(f"in_flight must be an int >= 1, got {in_flight!r}")
        if (budget is None) == (nodes is None):
            raise ValueError("enable_paging needs a budget or a list of nodes (not both)")
        if prefetch is not None and (isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1):
            raise ValueError(f"prefetch must be an int >= 1 (backward nodes ahead) or None, got {prefetch!r}")
        if release is not None and (isinstance(release, bool) or not isinstance(release, int) or release < 1):
            raise ValueError(f"release must be an int >= 1 (forward compute nodes after the paged one) or None, got {release!r}")
        self.page_prefetch = prefetch
        self.page_release = release
        self._paged = set()
        self._rebuild()
        # Eligible: compute nodes that have a backward node (something reads what they save).
        has_backward = {t["name"].split(".", 1)[1].removesuffix(".dw") for t in self._backward_table if t["kind"] == "compute"}
        compute = [n.name for n in self.nodes if n.kind == "compute" and n.name in has_backward]
        if nodes is not None:
            unknown = sorted(set(nodes) - set(compute))
            if unknown:
                raise ValueError(f"enable_paging: not compute nodes of this chunk with a backward: {unknown}")
        self.page_min_bytes = min_bytes
        self._calibrating = calib = {}
        self._calib_saved = {}
        try:
            self.run(fwd=(MicrobatchState(-1), example))
            # Each node's host buffer: its saved tensors laid out by storage (`group_plan`).
            layout = {x: group_plan(ts).nbytes for x, ts in self._calib_saved.items()}
        finally:
            self._calibrating = None
            self._calib_saved = {}
        nbytes = {x: sum(calib[x]) for x in compute if calib.get(x)}
        if nodes is not None:
            chosen = [x for x in compute if x in set(nodes) and x in nbytes]
            plan = {"page": chosen, "bytes_paged": sum(nbytes[x] for x in chosen), "bytes_live": sum(nbytes.values())}
        else:
            # Forward order saves; the backward reads the last node's first.
            order = [x for x in compute if x in nbytes]
            prefix = [{"name": x, "bytes": nbytes[x], "saved_at": i, "used_at": len(order) - 1 - i} for i, x in enumerate(order)]
            plan = page_plan(prefix, budget, min_distance)
        self._paged = set(plan["page"])
        self._page_bytes = {x: list(calib[x]) for x in self._paged}  # what each paged node saves
        self._rebuild()
        sizes = [layout[x] for x in sorted(self._paged)] * in_flight
        self.pool = HostPool(sizes, self.device) if sizes else None
        self.page_plan = dict(plan, host_bytes=sum(sizes))
        return self.page_plan

    def enable_grad_reduce(self, params: Sequence[torch.nn.Parameter], group: Any = None) -> GradReduce:
        """Average the gradients of `params` (the data-parallel ones: not the experts) over
        `group` inside `train_step` with our orders: in the step's last backward, each node's
        all-reduce starts right after its weight gradients are final, so it runs under the
        rest of that backward (the scheduler's placement of the dW nodes decides when), and the
        step ends by waiting for them. Baseline orders reduce every gradient at once after the
        step. Each parameter must belong to one node (its gradient is final after that node's
        last dW). Not with deferred dW (a pipeline's BACKWARD_WEIGHT)."""
        owners: dict[int, str] = {}
        for n in self.nodes:
            for p in n.params:
                if id(p) in owners and owners[id(p)] != n.name:
                    raise ValueError(f"enable_grad_reduce: a parameter of node '{n.name}' also belongs to '{owners[id(p)]}'")
                owners[id(p)] = n.name
        missing = [i for i, p in enumerate(params) if id(p) not in owners]
        if missing:
            raise ValueError(f"enable_grad_reduce: parameters {missing[:5]} belong to no node of this chunk")
        self.grad_reduce = GradReduce(params, group)
        return self.grad_reduce

    def _rebuild(self) -> None:
        self._forward_table = self._forward_nodes()
        self._backward_table = self._backward_nodes()
        self._executors.clear()

    # -- running -----------------------------------------------------------------------

    def executor(self, forward: bool, backward: bool, order: str = "ours", lifetime: str = "scheduled") -> Executor:
        """The executor of one multiplexing (made once, reused every step)."""
        return _executor(self if forward else None, self if backward else None, order, lifetime)

    def node_times_us(self) -> dict[str, float]:
        """Median time of each node over the timed runs so far (µs, by graph node name): the
        `durations` table `sl.simulate` reads for a program lowered from this chunk's graph."""
        import statistics

        return {n: statistics.median(v) for n, v in sorted(self._times.items())}

    def run(
        self,
        fwd: Optional[tuple[MicrobatchState, dict[str, Any]]] = None,
        bwd: Optional[MicrobatchState] = None,
        order: str = "ours",
        lifetime: str = "scheduled",
        grad_scale: float = 1.0,
    ) -> dict[str, Any]:
        """Forward of one microbatch (`fwd`: its state and chunk inputs), backward of another
        (`bwd`), or both multiplexed in one schedule."""
        grad = None
        if bwd is not None and bwd.loss is not None:
            grad = _loss_grad(self, bwd, grad_scale)
        return run_pair(self if fwd else None, fwd, self if bwd else None, bwd, grad, order, lifetime)


def _pair_graph(fchunk: Optional[Chunk], bchunk: Optional[Chunk]) -> dict:
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


def _order_schedule(g: dict, order: str) -> dict:
    if order == "ours":
        return schedule(g)
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
    raise ValueError(f"order must be one of {Chunk.ORDERS} (or 'ours:<rules,budgets>'), got {order!r}")


def _executor(fchunk: Optional[Chunk], bchunk: Optional[Chunk], order: str, lifetime: str) -> Executor:
    """The executor of F of `fchunk` with B of `bchunk` (made once per pair, cached on the
    backward chunk, or the forward one when there is no backward)."""
    home = bchunk if bchunk is not None else fchunk
    assert home is not None
    timing = bool((fchunk and fchunk.timing) or (bchunk and bchunk.timing))
    key = (id(fchunk), id(bchunk), order, lifetime, timing)
    ex = home._executors.get(key)
    if ex is None:
        g = _pair_graph(fchunk, bchunk)
        s = _order_schedule(g, order)
        calls = {}
        if fchunk is not None:
            calls.update(fchunk.callables(True, False, release_points=bchunk is not None))
        if bchunk is not None:
            calls.update(bchunk.callables(False, True))
        ex = home._executors[key] = Executor(g, s, calls, device=home.device, lifetime=lifetime, timing=timing)
    return ex


def _feed_forward(c: Chunk, source: str, fwd: tuple[MicrobatchState, dict[str, Any]], inputs: dict[str, Any]) -> None:
    """Source `source` runs the forward of `fwd` (its state, its chunk inputs) on `c`: the
    graph inputs `<source>.<name>` and `c`'s context."""
    missing = sorted(set(c.inputs) - set(fwd[1]))
    if missing:
        raise ValueError(f"chunk inputs missing: {missing}")
    inputs.update({f"{source}.{k}": v for k, v in fwd[1].items()})
    c.ctx.compute = _compute_stream(c)
    c.ctx.fwd = fwd[0]


def _feed_backward(c: Chunk, source: str, bwd: MicrobatchState, out_grad: torch.Tensor, inputs: dict[str, Any]) -> None:
    """Source `source` runs the backward of `bwd` on `c`, starting from `out_grad`."""
    inputs[f"{source}.g.{c.loss_output}"] = out_grad
    c.ctx.compute = _compute_stream(c)
    c.ctx.bwd = bwd


def _compute_stream(c: Chunk) -> Optional[torch.Stream]:
    return torch.cuda.current_stream(c.device) if c.device.type == "cuda" else None


def _loss_grad(c: Chunk, st: MicrobatchState, scale: float) -> torch.Tensor:
    """The gradient a microbatch's backward starts from: its loss scale (1/n when accumulating)."""
    return torch.full((), scale, device=c.device, dtype=st.loss.dtype)


def run_pair(
    fchunk: Optional[Chunk],
    fwd: Optional[tuple[MicrobatchState, dict[str, Any]]],
    bchunk: Optional[Chunk],
    bwd: Optional[MicrobatchState],
    out_grad: Optional[torch.Tensor],
    order: str = "ours",
    lifetime: str = "scheduled",
) -> dict[str, Any]:
    """Forward of one microbatch on `fchunk` with the backward of another on `bchunk` (the
    same chunk, or another: a pipeline's F of stage a with B of stage b), multiplexed in one
    schedule. `out_grad`: the gradient of the backward chunk's output (`loss_output`).
    Returns the executor's values: the forward's outputs (`F.<name>`) and the backward's
    input gradients (`B.g.<input>@<consumer>`, one partial per consumer)."""
    if fwd is None and bwd is None:
        raise ValueError("nothing to run: give a forward, a backward, or both")
    if (fwd is None) != (fchunk is None) or (bwd is None) != (bchunk is None):
        raise ValueError("a forward needs its chunk and a backward its chunk")
    if bwd is not None:
        if not bwd.saved:
            raise ValueError(f"microbatch {bwd.index} has no saved forward to run a backward on")
        if out_grad is None:
            raise ValueError(f"the backward of microbatch {bwd.index} needs the gradient of its output")
    ex = _executor(fchunk, bchunk, order, lifetime)
    inputs: dict[str, Any] = {}
    touched = [c for c in (fchunk, bchunk) if c is not None]
    if fwd is not None:
        _feed_forward(fchunk, "F", fwd, inputs)
    if bwd is not None:
        _feed_backward(bchunk, "B", bwd, out_grad, inputs)
    try:
        out = ex.run(inputs)
        if ex._timing:
            for n, us in ex.node_times_us().items():
                touched[0]._times.setdefault(n, []).append(us)
        return out
    finally:
        for c in touched:
            c.ctx.fwd = c.ctx.bwd = None


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


def _twin(chunk: Chunk) -> Chunk:
    """A second Chunk over the same nodes (the same modules and parameters) with its own
    context: the other microbatch of a `run_two` pair (made once)."""
    if chunk._twin_chunk is None:
        chunk._twin_chunk = Chunk(chunk.nodes, chunk.inputs, chunk.loss_output, chunk.device, chunk.dw_nodes)
    return chunk._twin_chunk


def _two_graph(chunk: Chunk, phase: str) -> dict:
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


def two_schedule(chunk: Chunk, phase: str, order: str = "ours") -> dict:
    """The schedule `run_two(chunk, phase, ...)` runs (for the ranks' digest and for tests)."""
    return _order_schedule(_two_graph(chunk, phase), order)


def run_two(
    chunk: Chunk, phase: str, items: Sequence[Any], order: str = "ours", lifetime: str = "scheduled", grad_scale: float = 1.0
) -> dict[str, Any]:
    """Two microbatches of the same phase multiplexed in one schedule: `phase="F"`, `items`
    two (state, chunk inputs) pairs; `phase="B"`, two states, in microbatch order (the
    first's weight gradients accumulate first on every node). What `train_step(...,
    paired_ends=True)` runs for its warm-up and cool-down. Our orders only; not with paging or
    deferred dW."""
    if phase not in ("F", "B"):
        raise ValueError(f"phase must be 'F' or 'B', got {phase!r}")
    if len(items) != 2:
        raise ValueError(f"run_two takes two microbatches, got {len(items)}")
    if chunk._paged or chunk.deferred_dw is not None:
        raise ValueError("run_two: not with paging or deferred dW (a chunk of the pipelining hooks)")
    twin = _twin(chunk)
    twin.grad_reduce = chunk.grad_reduce  # the second microbatch's dW launches the chunk's reduce
    key = ("two", phase, order, lifetime)
    ex = chunk._executors.get(key)
    if ex is None:
        g = _two_graph(chunk, phase)
        calls = chunk.callables(phase == "F", phase == "B")
        calls.update({phase + "2" + k[1:]: f for k, f in twin.callables(phase == "F", phase == "B").items()})
        ex = chunk._executors[key] = Executor(g, _order_schedule(g, order), calls, device=chunk.device, lifetime=lifetime)
    inputs: dict[str, Any] = {}
    for c, p, item in ((chunk, phase, items[0]), (twin, phase + "2", items[1])):
        if phase == "F":
            _feed_forward(c, p, item, inputs)
        else:
            if not item.saved or item.loss is None:
                raise ValueError(f"microbatch {item.index} has no saved forward to run a backward on")
            _feed_backward(c, p, item, _loss_grad(c, item, grad_scale), inputs)
    try:
        return ex.run(inputs)
    finally:
        for c in (chunk, twin):
            c.ctx.fwd = c.ctx.bwd = None


def accumulate_grads(params: Sequence[torch.Tensor], grads: Sequence[Optional[torch.Tensor]]) -> None:
    """Add gradients into `.grad` as autograd's accumulation does (the first one is taken as
    is, later ones added in place); None skips."""
    for p, g in zip(params, grads):
        if g is None:
            continue
        if p.grad is None:
            p.grad = g
        else:
            p.grad.add_(g)


class _WeightSplit:
    """A node's backward split into dI now and dW later, as torch.distributed.pipelining's
    stage_backward_input / stage_backward_weight split a stage: hooks on the autograd nodes
    where the weights join the inputs' graph keep the gradients dI computes there, and dW
    starts from them (so dW does only the weight-gradient work). Weights whose graph never
    joins the inputs' (none in the embedded model) get theirs from the outputs at dW."""

    def __init__(self, outs: Sequence[torch.Tensor], leaves: Sequence[torch.Tensor], params: Sequence[torch.nn.Parameter]) -> None:
        from torch.distributed.pipelining._backward import _get_grad_fn_or_grad_acc, construct_reverse_graph, get_param_groups

        self.outs, self.leaves, self.params = list(outs), list(leaves), list(params)
        with torch.enable_grad():  # leaves' grad accumulators are found through a view
            out_fns = [f for f in map(_get_grad_fn_or_grad_acc, self.outs) if f is not None]
            leaf_fns = [f for f in map(_get_grad_fn_or_grad_acc, self.leaves) if f is not None]
            self.acc = {}
            for i, p in enumerate(self.params):
                f = _get_grad_fn_or_grad_acc(p)
                if f is not None:
                    self.acc[f] = i
            self.groups = get_param_groups(leaf_fns, list(self.acc), construct_reverse_graph(out_fns))
            covered = set().union(*(grp["params"] for grp in self.groups)) if self.groups else set()
            self.rest = [i for f, i in self.acc.items() if f not in covered]
        self.grads: Optional[list[torch.Tensor]] = None

    def input_grads(self, grads: list[torch.Tensor]) -> tuple:
        handles = []
        for grp in self.groups:
            grp["intermediates"] = list(grp["intermediates"])
            grp["grads"] = [None] * len(grp["intermediates"])
            for i, node in enumerate(grp["intermediates"]):

                def hook(grad_inputs: tuple, grp: dict = grp, i: int = i) -> None:
                    grp["grads"][i] = grad_inputs

                handles.append(node.register_prehook(hook))
        try:
            res = torch.autograd.grad(self.outs, self.leaves, grads, retain_graph=True, allow_unused=True)
        finally:
            for h in handles:
                h.remove()
        if self.rest:
            self.grads = grads
        return res

    def weight_grads(self) -> list[Optional[torch.Tensor]]:
        from torch.autograd.graph import GradientEdge

        res: list[Optional[torch.Tensor]] = [None] * len(self.params)
        for grp in self.groups:
            edges, gouts = [], []
            for grads_tuple, node in zip(grp["grads"], grp["intermediates"]):
                present = [g for g in (grads_tuple or ()) if g is not None]
                if present:
                    total = present[0]
                    for extra in present[1:]:
                        total = total + extra
                    edges.append(GradientEdge(node, 0))
                    gouts.append(total)
            if not edges:
                continue
            accs = list(grp["params"])
            dws = torch.autograd.grad(edges, tuple(GradientEdge(a, 0) for a in accs), grad_outputs=gouts, retain_graph=True)
            for a, dw in zip(accs, dws):
                res[self.acc[a]] = dw
        if self.rest:
            dws = torch.autograd.grad(self.outs, [self.params[i] for i in self.rest], self.grads, allow_unused=True)
            for i, dw in zip(self.rest, dws):
                res[i] = dw
        self.groups, self.outs, self.grads = [], [], None
        return res


def combined_step(
    chunk: Chunk,
    forward: tuple[MicrobatchState, dict[str, Any]],
    backward: MicrobatchState,
    order: str = "ours",
    lifetime: str = "scheduled",
    grad_scale: float = 1.0,
) -> dict[str, Any]:
    """F of one microbatch with B of another, in the scheduler's order (or a baseline's)."""
    return chunk.run(forward, backward, order, lifetime, grad_scale)


def train_step(
    chunk: Chunk,
    microbatches: Sequence[dict[str, Any]],
    order: str = "ours",
    lifetime: str = "scheduled",
    on_run: Optional[Callable[[], None]] = None,
    paired_ends: bool = False,
) -> list[torch.Tensor]:
    """One step over n microbatches with gradient accumulation (loss scaled by 1/n).

    `order="sequential"`: F(i) then B(i), one microbatch at a time, each comm waited at once.
    Otherwise the steady state: warm-up F(0), then F(i+1) multiplexed with B(i), cool-down
    B(n-1), each multiplexing in `order` ("ours" or "b_then_f"). Returns the losses.

    `paired_ends` (n >= 2, our orders): the warm-up and the cool-down are multiplexed too, so
    their transfers also run under another microbatch's compute: F(0) with F(1), then F(i+2)
    with B(i), then B(n-2) with B(n-1) (`run_two`). One more microbatch's activations are live
    in the steady state (three forwards ahead of their backward instead of two). Gradients
    accumulate in microbatch order as without it (bit-exact)."""
    n = len(microbatches)
    if n == 0:
        raise ValueError("train_step needs at least one microbatch")
    if order not in Chunk.ORDERS and not order.startswith("ours:"):
        raise ValueError(f"order must be one of {Chunk.ORDERS} (or 'ours:<rules,budgets>'), got {order!r}")
    if paired_ends and not (order == "ours" or order.startswith("ours:")):
        raise ValueError(f"paired_ends needs one of our orders ('ours' or 'ours:...'), got {order!r}")
    scale = 1.0 / n
    states = [MicrobatchState(i) for i in range(n)]
    reduce = chunk.grad_reduce
    if reduce is not None and chunk.deferred_dw is not None:
        raise ValueError("train_step: grad reduce in the step is not supported with deferred dW")
    in_step = reduce is not None and (order == "ours" or order.startswith("ours:"))
    states[-1].last = in_step

    def after() -> None:
        if on_run is not None:
            on_run()

    try:
        if order == "sequential":
            for i in range(n):
                chunk.run((states[i], microbatches[i]), None, order, lifetime)
                after()
                chunk.run(None, states[i], order, lifetime, scale)
                after()
        elif paired_ends and n >= 2:
            run_two(chunk, "F", [(states[0], microbatches[0]), (states[1], microbatches[1])], order, lifetime)
            after()
            for i in range(n - 2):
                chunk.run((states[i + 2], microbatches[i + 2]), states[i], order, lifetime, scale)
                after()
            run_two(chunk, "B", [states[n - 2], states[n - 1]], order, lifetime, scale)
            after()
        else:
            chunk.run((states[0], microbatches[0]), None, order, lifetime)
            after()
            for i in range(n - 1):
                chunk.run((states[i + 1], microbatches[i + 1]), states[i], order, lifetime, scale)
                after()
            chunk.run(None, states[n - 1], order, lifetime, scale)
            after()
    except BaseException:
        if reduce is not None:
            reduce.abandon()
        # A step cut short gives its host buffers back (page-outs never paged in), so the next
        # step finds the pool whole; the original error is what the caller sees.
        if chunk.pool is not None:
            try:
                chunk.pool.drain()
            finally:
                chunk.pool.reclaim()
        raise
    if chunk.pool is not None:  # page-outs still holding device storage: the step ends here
        chunk.pool.drain()
    if reduce is not None:
        if not in_step:  # a baseline's step: every gradient at once, after the step
            reduce.launch([p for node in chunk.nodes for p in node.params])
        reduce.finish()
    for s in states:
        if s.saved:
            raise RuntimeError(f"microbatch {s.index}: backward left state behind for {sorted(s.saved)[:5]}")
    return [s.loss for s in states]
