"""Pipelines (wiring only): an OVERLAP_F_B handler for `torch.distributed.pipelining` and an
`overlapped_forward_backward` for deepseek-ai's DualPipe/DualPipeV, both running the forward
of one stage and the backward of another as one multiplexed schedule (the scheduler's order,
streams and lifetime points, all from Rust) in one thread.

Graph stages: `GraphStage(module, example_inputs)` runs the stage as compiled forward and
backward graphs (AOTAutograd, no Inductor) in Rust's order, and an OVERLAP_F_B pair of graph
stages as the one module `compile.multiplex` builds for that pair.

An eager stage module takes part by being a `NodeStage`: its module described as nodes (`NodeDef`s;
`describe` makes them from a list of layers, where a layer that knows its dispatch and combine
gives its own nodes). `NodeStage.forward` runs those nodes and joins autograd through one
function whose backward runs the nodes' backward, so the runtime's ordinary forward and
backward calls (and any schedule without OVERLAP_F_B) work unchanged, with the same ops.

The overlap itself: the handler does the F and B sub-actions' bookkeeping as the runtime's
default path does (recv waits, loss, backward counters, same-rank hand-off), but arms the
forward stage and its inputs before it starts the backward. When the backward reaches the
backward stage's nodes, they run multiplexed with the armed forward's nodes (`run_pair`); the
forward call that follows finds its result ready and returns it. If the backward never reaches
a `NodeStage` (a plain stage), the forward runs on its own afterwards: same results, no overlap
(`NodeStage.overlapped` counts the overlaps that happened).
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import nn

from .nodes import Chunk, MicrobatchState, NodeDef, accumulate_grads, run_pair


class _Armed:
    """The forward waiting to run inside the next backward (one pipeline thread arms it; the
    autograd engine may run the backward on its device thread, so this is not thread-local)."""

    stage: Any = None
    args: tuple = ()


_ARMED = _Armed()


def _take_ready(stage: Any, args: Sequence[Any]) -> Any:
    """The result an overlapped backward computed for `stage`'s next forward (then cleared),
    or None; it must be for exactly these inputs (the armed forward is called next)."""
    ready, stage._ready = stage._ready, None
    if ready is None:
        return None
    rargs, result = ready
    if len(rargs) != len(args) or any(a is not b for a, b in zip(rargs, args)):
        raise RuntimeError("an overlapped forward was computed for other inputs than this call's (the armed forward must be called next)")
    return result


def _take_armed(kind: type) -> tuple:
    """The armed forward if it is a `kind` stage (a node stage pairs with a node stage, a
    graph stage with a graph stage); else (None, ()) and it stays armed."""
    if not isinstance(_ARMED.stage, kind):
        return None, ()
    stage, args = _ARMED.stage, _ARMED.args
    _ARMED.stage, _ARMED.args = None, ()
    return stage, args


class _DualPipeHook:
    """deepseek-ai DualPipe/DualPipeV call `type(module0).overlapped_forward_backward` when both
    stage modules are of one type that has it: NodeStage and GraphStage do."""

    @classmethod
    def overlapped_forward_backward(
        cls,
        module0: nn.Module,
        inputs0: Sequence[torch.Tensor],
        criterion0: Optional[Callable[..., torch.Tensor]],
        labels0: Optional[Sequence[torch.Tensor]],
        module1: nn.Module,
        loss1: Optional[torch.Tensor],
        outputs1: Optional[Sequence[torch.Tensor]],
        output_grads1: Optional[Sequence[torch.Tensor]],
    ) -> tuple[list[torch.Tensor], Optional[torch.Tensor]]:
        """deepseek-ai DualPipe/DualPipeV's hook: forward of `module0` on `inputs0` (and its
        loss when `criterion0` is given) multiplexed with the backward of `module1` (from
        `loss1`, or `outputs1` with `output_grads1`)."""

        def backward() -> None:
            if loss1 is not None:
                loss1.backward()
                loss1.detach_()
            else:
                outs = tuple(o for o in outputs1 or () if o.requires_grad)
                grads = tuple(g for o, g in zip(outputs1 or (), output_grads1 or ()) if o.requires_grad)
                # DualPipe frees sent outputs' data (Megatron's deallocation), so call the engine
                # directly: torch.autograd.backward would reject the emptied shapes.
                torch.autograd.Variable._execution_engine.run_backward(outs, grads, False, False, (), True, True)

        outputs0 = overlapped(module0, tuple(inputs0), backward)
        outputs0 = [outputs0] if isinstance(outputs0, torch.Tensor) else list(outputs0)
        loss0 = criterion0(*outputs0, *(labels0 or ())) if criterion0 is not None else None
        return outputs0, loss0


class _Chain(torch.autograd.Function):
    """A stage's nodes as one autograd function: forward runs the nodes (or takes the result
    an overlapped backward computed), backward runs their backward (with the armed forward)."""

    @staticmethod
    def forward(ctx: Any, stage: "NodeStage", n_args: int, *args_and_params: Any) -> torch.Tensor:
        # The parameters come in only so that the output requires grad whenever they do (a
        # first stage's inputs are tokens); their gradients are accumulated by the nodes.
        args = args_and_params[:n_args]
        ctx.n_params = len(args_and_params) - n_args
        ready = _take_ready(stage, args)
        if ready is not None:
            state, out = ready
        else:
            state = MicrobatchState(next(stage._count))
            out = stage._forward(state, args)
        ctx.stage, ctx.state = stage, state
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        stage: NodeStage = ctx.stage
        fstage, fargs = _take_armed(NodeStage)
        fwd = None
        if fstage is not None:
            fstate = MicrobatchState(next(fstage._count))
            fwd = (fstate, fstage._inputs(fargs))
        if stage.split_dw:
            stage.chunk.deferred_dw = []
        try:
            out = run_pair(fstage.chunk if fstage else None, fwd, stage.chunk, ctx.state, grad, stage.order, stage.lifetime)
        finally:
            stage._dw_jobs, stage.chunk.deferred_dw = stage.chunk.deferred_dw, None
        stage.dw_deferred["full" if stage._full_backward else "input"] += len(stage._dw_jobs or ())
        if fstage is not None:
            fstage._ready = (fargs, (fstate, out[f"F.{fstage.chunk.loss_output}"]))
            fstage.overlapped += 1
        return (None, None, *stage._input_grads(out), *([None] * ctx.n_params))


class NodeStage(_DualPipeHook, nn.Module):
    """A pipeline stage module described as nodes.

    `nodes`: the description (defaults to `module.nodes()`); `inputs`: the names of the
    forward's positional arguments; `output`: the value it returns (one tensor). `order`:
    "ours" (the scheduler's) or a baseline ("b_then_f", "sequential"); `lifetime`:
    "scheduled" or "record_stream" (the executor's modes); `dw_nodes`: separate dW nodes the
    scheduler can place under transfers and a pipeline can defer to BACKWARD_WEIGHT (True), or
    dW computed with dI in one autograd call (False: a cheaper host path, no dI/dW split).
    Wrap each stage module before `PipelineStage(...)`, then call `enable_overlap(schedule)`;
    deepseek-ai's DualPipe finds `overlapped_forward_backward` on it. Reentrant activation
    checkpointing inside the module is refused (non-reentrant composes). Guide:
    docs/pipelining.md.

    Example (one stage alone: forward and backward run the nodes through the executor):

        >>> import torch
        >>> from sched_lifetime.pipelining import NodeStage, describe
        >>> layers = [torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8)]
        >>> stage = NodeStage(torch.nn.Sequential(*layers), nodes=describe(layers))
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> stage(x).sum().backward()
        >>> x.grad.shape, layers[0].weight.grad is not None
        (torch.Size([4, 8]), True)
    """

    def __init__(
        self,
        module: nn.Module,
        nodes: Optional[Sequence[NodeDef]] = None,
        inputs: Sequence[str] = ("x",),
        output: str = "out",
        device: Any = None,
        order: str = "ours",
        lifetime: str = "scheduled",
        dw_nodes: bool = True,
    ) -> None:
        super().__init__()
        self.module = module
        if nodes is None:
            if not hasattr(module, "nodes"):
                raise ValueError(f"{type(module).__name__} has no nodes(): pass nodes=, or build them with sl.pipelining.describe")
            nodes = module.nodes()
        _refuse_reentrant_checkpoint(module)
        nodes = list(nodes)
        written = [v for n in nodes for v in n.outputs]
        if output not in written:
            raise ValueError(
                f"NodeStage: output '{output}' is written by no node of {type(module).__name__} (their outputs: {written}); "
                "pass output=<the value the stage returns>"
            )
        dev = torch.device(device) if device is not None else _module_device(module)
        self.chunk = Chunk(nodes, inputs, output, dev, dw_nodes=dw_nodes)
        self._params = [p for n in self.chunk.nodes for p in n.params]
        self.order, self.lifetime = order, lifetime
        self._count = itertools.count()
        self._ready: Optional[tuple] = None
        #: How many of this stage's forwards ran multiplexed with another stage's backward.
        self.overlapped = 0
        #: Defer dW to `dw_builder()`'s runner (set by `enable_overlap`'s wrapper for the
        #: length of an input-only backward: the stage runs dI at BACKWARD_INPUT and dW at
        #: BACKWARD_WEIGHT; a full backward runs its dW nodes where the scheduler put them).
        self.split_dw = False
        #: dW jobs deferred to the dw_builder's runner, by the kind of backward that deferred
        #: them ("full": FULL_BACKWARD / OVERLAP_F_B, "input": BACKWARD_INPUT).
        self.dw_deferred = {"full": 0, "input": 0}
        self._full_backward = True
        self._dw_jobs: Optional[list[Callable[[], None]]] = None

    def dw_builder(self) -> Callable[[], None]:
        """`PipelineStage(dw_builder=...)`'s hook: called right after a backward, returns
        what runs that backward's deferred weight gradients."""
        jobs, self._dw_jobs = self._dw_jobs or [], None

        def run() -> None:
            for job in jobs:
                job()

        return run

    def forward(self, *args: Any) -> torch.Tensor:
        if len(args) != len(self.chunk.inputs):
            raise ValueError(f"stage takes {len(self.chunk.inputs)} inputs {self.chunk.inputs}, got {len(args)}")
        return _Chain.apply(self, len(args), *args, *self._params)

    def _inputs(self, args: Sequence[Any]) -> dict[str, Any]:
        return dict(zip(self.chunk.inputs, args))

    def _forward(self, state: MicrobatchState, args: Sequence[Any]) -> torch.Tensor:
        out = run_pair(self.chunk, (state, self._inputs(args)), None, None, None, self.order, self.lifetime)
        return out[f"F.{self.chunk.loss_output}"]

    def _input_grads(self, out: dict[str, Any]) -> list[Optional[torch.Tensor]]:
        grads: list[Optional[torch.Tensor]] = []
        for v in self.chunk.inputs:
            parts = [out[f"B.g.{v}@{c}"] for c in self.chunk._grad_consumers.get(v, ())]
            g = parts[0] if parts else None
            for p in parts[1:]:
                g = g + p
            grads.append(g)
        return grads


class _GraphChain(torch.autograd.Function):
    """A graph stage's compiled forward as one autograd function: forward runs the forward
    graph (or takes the result an overlapped backward computed), backward runs the backward
    graph, or, with an armed graph stage, the module `compile.multiplex` built for the pair."""

    @staticmethod
    def forward(ctx: Any, stage: "GraphStage", n_args: int, *args_and_params: Any) -> torch.Tensor:
        args = args_and_params[:n_args]
        ctx.n_params = len(args_and_params) - n_args
        ready = _take_ready(stage, args)
        if ready is not None:
            out, saved = ready
        else:
            res = stage.fwd(*stage.params, *args)
            out, saved = res[0], list(res[1:])
        ctx.stage, ctx.saved_values = stage, saved
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        stage: GraphStage = ctx.stage
        fstage, fargs = _take_armed(GraphStage)
        saved, ctx.saved_values = ctx.saved_values, None
        # The saved values travel in the argument list only, which the boxed runners clear:
        # each dies at its last use in the backward graph.
        if fstage is None:
            saved.append(grad)
            grads = list(stage._run_bwd(saved))
        else:
            args = [*fstage.params, *fargs, *saved, grad]
            saved = None
            res = stage._runner(fstage)(args)
            k = fstage.n_fwd_out
            fstage._ready = (fargs, (res[0], list(res[1:k])))
            fstage.overlapped += 1
            grads = list(res[k:])
        n = len(stage.params)
        accumulate_grads(stage.params, grads[:n])
        return (None, None, *grads[n:], *([None] * ctx.n_params))


class GraphStage(_DualPipeHook, nn.Module):
    """A pipeline stage module run as compiled graphs (AOTAutograd, no Inductor; see
    `compile.capture_graphs`), scheduled by Rust: forward and backward graphs in our order,
    and for OVERLAP_F_B the forward graph of one stage multiplexed with the backward graph of
    another (`compile.multiplex`, built once per pair). `example_inputs`: one microbatch's
    inputs (the graphs are specialized to their shapes). The module's parameters stay its own;
    their gradients are accumulated into `.grad`. `ep_budget`: EP launches in flight (default:
    the environment, else 1). Use it where `ScheduleDualPipeV` refuses a `torch.compile`d
    stage module. Guide: docs/pipelining.md.

    Example:

        >>> import torch
        >>> from sched_lifetime.pipelining import GraphStage
        >>> mod = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
        >>> stage = GraphStage(mod, (torch.randn(4, 8),))
        >>> stage(torch.randn(4, 8, requires_grad=True)).sum().backward()
        >>> mod[0].weight.grad is not None
        True
    """

    def __init__(self, module: nn.Module, example_inputs: tuple, ep_budget: Optional[int] = None) -> None:
        from .compile import boxed, capture_graphs, compile_graphs

        super().__init__()
        self.module = module
        # A stage's floating-point inputs take gradients (activations from the previous stage).
        example = tuple(x.detach().requires_grad_(x.is_floating_point()) if isinstance(x, torch.Tensor) else x for x in example_inputs)
        _, self.params, self.graphs, _ = capture_graphs(module, example)
        self.fwd, self.bwd, self.n_fwd_out = compile_graphs(self.graphs, ep_budget)
        self._run_bwd = boxed(self.bwd)
        self.ep_budget = ep_budget
        #: Per armed forward stage: the boxed runner of the module `multiplex` built for the pair.
        self._mux: dict[int, Any] = {}
        self._ready: Optional[tuple] = None
        #: How many of this stage's forwards ran multiplexed with another stage's backward.
        self.overlapped = 0

    def forward(self, *args: Any) -> torch.Tensor:
        return _GraphChain.apply(self, len(args), *args, *self.params)

    def multiplexed_with(self, fstage: "GraphStage") -> Any:
        """The module running `fstage`'s forward graph with this stage's backward graph."""
        return self._runner(fstage).module

    def _runner(self, fstage: "GraphStage") -> Any:
        """`multiplexed_with(fstage)` under the boxed convention (`compile.boxed`), built once
        per pair."""
        from .compile import boxed, multiplex

        r = self._mux.get(id(fstage))
        if r is None:
            r = self._mux[id(fstage)] = boxed(multiplex(fstage.graphs["fwd"], self.graphs["bwd"], ep_budget=self.ep_budget))
        return r

    @staticmethod
    def dw_builder() -> Callable[[], None]:
        """Nothing is deferred: the compiled backward computes the weight gradients too."""
        return lambda: None


def overlapped(fstage: nn.Module, fargs: tuple, backward: Callable[[], None]) -> Any:
    """Run `backward()` with the forward `fstage(*fargs)` armed, then return that forward's
    output (computed inside the backward when it reached a stage of the same kind, else now)."""
    with _armed(fstage, fargs):
        backward()
    # Ready if the backward reached a stage of fstage's kind; otherwise it runs on its own now.
    return fstage(*fargs)


@contextlib.contextmanager
def _armed(fstage: Any, fargs: tuple) -> Iterator[None]:
    """Arm `fstage(*fargs)` (a NodeStage or GraphStage) for the next backward of a stage of
    the same kind; disarmed on the way out."""
    if _ARMED.stage is not None:
        raise RuntimeError("a forward is already armed: overlapped calls do not nest")
    if isinstance(fstage, (NodeStage, GraphStage)):
        _ARMED.stage, _ARMED.args = fstage, fargs
    try:
        yield
    finally:
        _ARMED.stage, _ARMED.args = None, ()


def describe(layers: Sequence[nn.Module], input: str = "x", output: str = "out") -> list[NodeDef]:
    """Nodes for a stage that applies `layers` in sequence: a layer with
    `sched_nodes(inp, out, prefix)` gives its own nodes (where its dispatch and combine are);
    any other layer is one compute node with its parameters."""
    names = [input] + [f"h{i + 1}" for i in range(len(layers) - 1)] + [output]
    nodes: list[NodeDef] = []
    for i, layer in enumerate(layers):
        a, b, p = names[i], names[i + 1], f"L{i}"
        if hasattr(layer, "sched_nodes"):
            nodes += layer.sched_nodes(a, b, p)
        else:
            nodes.append(NodeDef(p, "compute", [a], [b], layer, list(layer.parameters()), [a], [b]))
    return nodes


def enable_overlap(schedule: Any) -> bool:
    """Set a `torch.distributed.pipelining` schedule up for NodeStage / GraphStage stages: a
    NodeStage's weight gradients split off to the dW hook (BACKWARD_INPUT / BACKWARD_WEIGHT
    actions; a GraphStage does both at BACKWARD_INPUT), and the OVERLAP_F_B handler
    registered. Returns whether the handler was registered: False for schedules that never
    emit OVERLAP_F_B (single-stage schedules such as Schedule1F1B, or multi-stage ones whose
    order has none): the runtime's default path runs them, and the stages are ordinary
    modules there. Raises when the schedule emits OVERLAP_F_B but a stage is neither kind
    (nothing to multiplex). Guide: docs/pipelining.md.

    Example (needs a process group; two ranks under torchrun on GPUs, see the guide for a
    one-process CPU run):

        >>> from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV  # doctest: +SKIP
        >>> stages = [PipelineStage(NodeStage(m), k, 4, dev) for k, m in my_stage_modules]  # doctest: +SKIP
        >>> sched = ScheduleDualPipeV(stages, n_microbatches=8, loss_fn=loss_fn)  # doctest: +SKIP
        >>> enable_overlap(sched)  # doctest: +SKIP
        True
        >>> sched.step(tokens, target=labels, losses=losses)  # doctest: +SKIP
    """
    from torch.distributed.pipelining.schedules import OVERLAP_F_B

    stages = list(getattr(schedule, "_stages", None) or [schedule._stage])
    for st in stages:
        if isinstance(st.submod, NodeStage):
            # dI at BACKWARD_INPUT, dW at BACKWARD_WEIGHT: the runtime calls the stage's
            # dw_builder right after the input backward and runs it at the weight action. A
            # full backward (FULL_BACKWARD, OVERLAP_F_B) keeps its dW nodes where the scheduler
            # put them, inside the multiplexed pair.
            st.dw_builder = st.submod.dw_builder
            _split_dw_on_input_backward(st)
        elif isinstance(st.submod, GraphStage):
            # No split in a compiled backward: BACKWARD_INPUT runs all of it, the weight
            # action has nothing left to do.
            st.dw_builder = GraphStage.dw_builder
    if not hasattr(schedule, "register_custom_function"):
        return False
    order = getattr(schedule, "pipeline_order", {}) or {}
    emits = any(a is not None and a.computation_type == OVERLAP_F_B for acts in order.values() for a in acts)
    if not emits:
        return False
    plain = [s.stage_index for s in stages if not isinstance(s.submod, (NodeStage, GraphStage))]
    if plain:
        raise ValueError(
            f"stages {plain} are neither NodeStage nor GraphStage modules: wrap each stage's module as "
            "sl.pipelining.NodeStage(module, nodes) (eager) or GraphStage(module, example_inputs) "
            "(compiled) so its forward and backward can be multiplexed"
        )
    schedule.register_custom_function(OVERLAP_F_B, _overlap_f_b)
    return True


def _split_dw_on_input_backward(stage: Any) -> None:
    """Wrap `stage.backward_one_chunk` so its NodeStage defers dW (to the dw_builder's runner)
    only for an input-only backward (`full_backward=False`, BACKWARD_INPUT)."""
    if getattr(stage, "_sl_split_wrapped", False):
        return
    orig, mod = stage.backward_one_chunk, stage.submod

    def backward_one_chunk(*args: Any, **kwargs: Any) -> Any:
        full = bool(kwargs.get("full_backward", args[2] if len(args) > 2 else True))
        mod.split_dw, mod._full_backward = not full, full
        try:
            return orig(*args, **kwargs)
        finally:
            mod.split_dw, mod._full_backward = False, True

    stage.backward_one_chunk = backward_one_chunk
    stage._sl_split_wrapped = True


def _overlap_f_b(action: Any, ctx: Any) -> None:
    """OVERLAP_F_B(F of stage a, B of stage b): the default path's bookkeeping for both, with
    the forward armed inside the backward."""
    from torch.distributed.pipelining.schedules import FORWARD, FULL_BACKWARD, _wait_batch_p2p

    sched = ctx.schedule_ref
    f_act, b_act = action.sub_actions
    if f_act.computation_type != FORWARD or b_act.computation_type != FULL_BACKWARD:
        raise ValueError(f"the OVERLAP_F_B handler runs (FORWARD, FULL_BACKWARD) pairs, got {action}")
    stages = {s.stage_index: s for s in sched._stages}
    fs, bs = stages[f_act.stage_index], stages[b_act.stage_index]
    fi, bi = f_act.microbatch_index, b_act.microbatch_index
    # Forward's input: received, handed over by the previous stage on this rank, or the batch.
    if not fs.is_first and fs.stage_index - 1 not in stages:
        _wait_batch_p2p(sched.fwd_recv_ops.pop((fs.stage_index, fi)))
    # Backward's output gradient.
    if not bs.is_last and bs.stage_index + 1 not in stages:
        _wait_batch_p2p(sched.bwd_recv_ops.pop((bs.stage_index, bi)))
    if hasattr(sched, "_assert_unsharded"):
        sched._assert_unsharded(fs)
        sched._assert_unsharded(bs)
    loss = sched._maybe_get_loss(bs, bi)
    sched.backward_counter[bs.stage_index] += 1
    last = sched.backward_counter[bs.stage_index] == sched._n_microbatches
    fargs = ctx.arg_mbs[fi] if fs.is_first else fs._retrieve_recv_activations(fi)
    kwargs = ctx.kwarg_mbs[fi] if ctx.kwarg_mbs else None
    if kwargs:
        raise ValueError("NodeStage / GraphStage forwards take positional inputs only; the schedule passed kwargs")

    with _armed(fs.submod, tuple(fargs)):
        bs.backward_one_chunk(bi, loss=loss, full_backward=True, last_backward=last)
    if bs.stage_index - 1 in stages:
        stages[bs.stage_index - 1].set_local_bwd_input(bs.get_local_bwd_output(bi), bi)
    output = fs.forward_one_chunk(fi, ctx.arg_mbs[fi], kwargs)
    sched._maybe_compute_loss(fs, output, ctx.target_mbs, fi)
    if fs.stage_index + 1 in stages:
        stages[fs.stage_index + 1].set_local_fwd_input(output, fi)


def _module_device(module: nn.Module) -> torch.device:
    p = next(module.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _refuse_reentrant_checkpoint(module: nn.Module) -> None:
    """A layer wrapped by torch's reentrant activation checkpoint (the old `CheckpointWrapper`
    with `CheckpointImpl.REENTRANT`) runs its backward through a nested autograd call that
    would re-run its forward outside the schedule: refuse it, naming the layer."""
    for name, m in module.named_modules():
        impl = getattr(m, "checkpoint_impl", None)
        if impl is not None and getattr(impl, "name", "") == "REENTRANT":
            raise ValueError(
                f"layer '{name}' uses reentrant activation checkpointing, which NodeStage does not "
                "schedule; use non-reentrant checkpointing (use_reentrant=False) for whole layers"
            )
