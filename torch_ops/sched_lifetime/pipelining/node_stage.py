"""`NodeStage`: an eager stage module as nodes, joined to autograd by one function."""

from __future__ import annotations

import itertools
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from ..nodes import Chunk, MicrobatchState, NodeDef, run_pair
from ..nodes.graph import sum_partials
from .arming import _DualPipeHook, _take_armed, _take_ready


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
    "ours" (the scheduler's timing-free order), "calibrated" (the first step times every node,
    then rule `search` re-plans with the measured costs, in the background by default:
    `enable_overlap` ends each step at the stage's last backward of the step, where the
    calibration step's costs are agreed and a finished search's orders take over; `rank_group` is then the process group of the
    ranks that run this same stage and must agree on its costs, e.g. `dist.new_group([rank])` when
    each rank holds its own stages, required when torch.distributed is initialized with more
    than one rank), or a baseline ("b_then_f", "sequential"); `lifetime`:
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
        rank_group: Any = None,
    ) -> None:
        super().__init__()
        from ..calibrate import CALIBRATED
        from ..nodes.graph import check_order

        check_order(order, "NodeStage: ")
        if order == CALIBRATED and rank_group is None and torch.distributed.is_available() and torch.distributed.is_initialized() \
                and torch.distributed.get_world_size() > 1:
            raise ValueError(
                "NodeStage(order='calibrated') in a process group of several ranks needs rank_group: the ranks that run this "
                "same stage and agree on its measured costs (pipeline ranks run other stages), e.g. dist.new_group([rank]) "
                "when each rank holds its own stages"
            )
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
        readers = [n.name for n in nodes if output in n.inputs]
        if readers:
            final = [v for v in written if not any(v in n.inputs for n in nodes)]
            raise ValueError(
                f"NodeStage: output '{output}' is read by node {readers[0]!r} of the stage: the stage returns a value no node of it "
                f"reads ({final}); pass output= one of those, or end the stage's nodes there"
            )
        dev = torch.device(device) if device is not None else _module_device(module)
        self.chunk = Chunk(nodes, inputs, output, dev, dw_nodes=dw_nodes)
        self.chunk.rank_group = rank_group
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
            grads.append(sum_partials([out[f"B.g.{v}@{c}"] for c in self.chunk._grad_consumers.get(v, ())]))
        return grads


def describe(layers: Sequence[nn.Module], input: str = "x", output: str = "out") -> list[NodeDef]:
    """Nodes for a stage that applies `layers` in sequence: a layer with
    `sched_nodes(inp, out, prefix)` gives its own nodes (where its dispatch and combine are);
    any other layer is one compute node with its parameters. A layer that modifies its input in
    place (`inplace=True`: `nn.ReLU`, `nn.Dropout`, ...) runs in the node of the layer before it
    (a node's inputs are leaves of its own autograd graph; an in-place op on one is an error),
    on a copy of its input (the layer before may return its own input: `nn.Identity`)."""
    names = [input] + [f"h{i + 1}" for i in range(len(layers) - 1)] + [output]
    nodes: list[NodeDef] = []
    for i, layer in enumerate(layers):
        a, b, p = names[i], names[i + 1], f"L{i}"
        if hasattr(layer, "sched_nodes"):
            nodes += layer.sched_nodes(a, b, p)
        elif getattr(layer, "inplace", False) is True:
            prev = nodes[-1] if nodes and i > 0 and not hasattr(layers[i - 1], "sched_nodes") else None
            if prev is not None:  # one node: the layer before, then this one on its output
                nodes[-1] = NodeDef(prev.name, "compute", prev.inputs, [b], nn.Sequential(prev.fn, _OnACopy(layer)), list(prev.params) + list(layer.parameters()), prev.grad_inputs, [b])
            else:
                nodes.append(NodeDef(p, "compute", [a], [b], _OnACopy(layer), list(layer.parameters()), [a], [b]))
        else:
            nodes.append(NodeDef(p, "compute", [a], [b], layer, list(layer.parameters()), [a], [b]))
    return nodes


class _OnACopy(nn.Module):
    """`layer` applied to a copy of its input (a layer that modifies its input in place, as a
    node of its own)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x.clone())


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
