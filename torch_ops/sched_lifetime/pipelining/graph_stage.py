"""`GraphStage`: a stage run as compiled forward and backward graphs in Rust's order."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from ..nodes import accumulate_grads
from ..nodes.grads import grad_ids
from .arming import _DualPipeHook, _take_armed, _take_ready


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
        accumulate_grads(stage.params, grads[:n], grad_ids(grads[n:]))  # those go on to the previous stage
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
        from ..compile import boxed, capture_graphs, compile_graphs

        super().__init__()
        self.module = module
        # A stage's floating-point inputs take gradients (activations from the previous stage).
        example = tuple(x.detach().requires_grad_(x.is_floating_point()) if isinstance(x, torch.Tensor) else x for x in example_inputs)
        _, self.params, self.graphs, _ = capture_graphs(module, example)
        #: What the graphs were captured for: each input's (shape, dtype), None for a non-tensor.
        self.input_meta = [(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else None for x in example]
        self.fwd, self.bwd, self.n_fwd_out = compile_graphs(self.graphs, ep_budget)
        self._run_bwd = boxed(self.bwd)
        self.ep_budget = ep_budget
        #: Per armed forward stage: the boxed runner of the module `multiplex` built for the pair.
        self._mux: dict[int, Any] = {}
        self._ready: Optional[tuple] = None
        #: How many of this stage's forwards ran multiplexed with another stage's backward.
        self.overlapped = 0

    def forward(self, *args: Any) -> torch.Tensor:
        want = self.input_meta
        if len(args) != len(want):
            raise ValueError(f"GraphStage: called with {len(args)} inputs, the graphs were captured with {len(want)}")
        for j, (t, w) in enumerate(zip(args, want)):
            got = (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else None
            if w is not None and got != w:
                raise ValueError(
                    f"GraphStage: input {j} is {'not a tensor' if got is None else f'shape {list(got[0])} {got[1]}'}, the graphs were "
                    f"captured for shape {list(w[0])} {w[1]} (static shapes and dtypes): give every microbatch the example's, "
                    "or make a GraphStage per shape"
                )
        return _GraphChain.apply(self, len(args), *args, *self.params)

    def multiplexed_with(self, fstage: "GraphStage") -> Any:
        """The module running `fstage`'s forward graph with this stage's backward graph."""
        return self._runner(fstage).module

    def _runner(self, fstage: "GraphStage") -> Any:
        """`multiplexed_with(fstage)` under the boxed convention (`compile.boxed`), built once
        per pair."""
        from ..compile import boxed, multiplex

        r = self._mux.get(id(fstage))
        if r is None:
            r = self._mux[id(fstage)] = boxed(multiplex(fstage.graphs["fwd"], self.graphs["bwd"], ep_budget=self.ep_budget))
        return r

    @staticmethod
    def dw_builder() -> Callable[[], None]:
        """`PipelineStage(dw_builder=...)`'s hook: called right after a backward, returns
        what runs that backward's deferred weight gradients."""
        return lambda: None
