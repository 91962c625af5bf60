"""Node callables: what each node of a chunk's graph runs when the executor issues it.

A compute node's forward runs its function under autograd on detached copies of its inputs
and keeps the leaves and outputs in the forward microbatch's state; its backward is split
into dI (`B.<node>`, input gradients) and dW (`B.<node>.dw`, weight gradients, or deferred to
a pipeline's BACKWARD_WEIGHT), or fused into one call. A comm node's forward and backward call
its function and its transpose. Paged nodes also get their page-out/page-in callables
(`PageHooks`). Each callable reads the microbatch it works on from the chunk's `ctx`.
"""

from __future__ import annotations

import contextlib

from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch

from .grads import _WeightSplit, accumulate_grads, grad_ids
from .graph import NodeDef
from .state import MicrobatchState

if TYPE_CHECKING:
    from .chunk import Chunk


def _unpack_checked(packed: tuple) -> torch.Tensor:
    """The probe's unpack: autograd's in-place check, which saved-tensor hooks turn off (a
    detached tensor shares its base's version counter)."""
    t, version = packed
    if t._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"a saved {tuple(t.shape)} {t.dtype} tensor is at version {t._version}; expected version {version} instead. "
            "Hint: clone the tensor before changing it in place."
        )
    return t


def _storage_id(t: torch.Tensor) -> int:
    """The address of a tensor's storage (0 for none): what a saved tensor shares with a value."""
    return t.untyped_storage().data_ptr() if t.layout == torch.strided else 0


def forward_fn(chunk: Chunk, n: NodeDef, release_points: bool) -> Callable[..., Any]:
    """The callable of `F.<node>`; `release_points`: it also releases the device storage of the
    page-outs the graph's release edges made it wait for."""
    ctx, pages = chunk.ctx, chunk.pages
    keep = chunk._has_backward(n)  # else no backward node will take the state back
    if n.kind == "comm":

        def comm(*args: Any) -> Any:
            outs, cctx = n.fn(*args, alloc_stream=ctx.compute)
            if keep:
                ctx.fwd.saved[n.name] = cctx
            return outs

        return comm
    grad_ix = [i for i, v in enumerate(n.inputs) if v in n.grad_inputs]
    flowing = chunk._flowing(n)
    out_ix = [i for i, v in enumerate(n.outputs) if v in flowing]

    release = list(chunk._release_at.get(n.name, ())) if release_points else []

    def compute(*args: Any) -> Any:
        if release:  # the compute stream has waited for these page-outs (control edges)
            pages.release_page_outs(ctx.fwd, release)
        args = list(args)
        leaves = []
        for i in grad_ix:
            args[i] = args[i].detach().requires_grad_(True)
            leaves.append(args[i])
        hooks = pages.saved_tensors_hooks(n.name, n.name in chunk._paged, ctx.fwd)
        probe = n.name not in chunk._probed and isinstance(hooks, contextlib.nullcontext)
        if probe:  # first forward of a node with no hooks of its own: which storages it saves
            saved: set[int] = set()
            # Packed detached: the tensor itself would tie a saved output back to its grad_fn
            # (a reference cycle through C++ that the collector never frees).
            hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.add(_storage_id(t)), (t.detach(), t._version))[1], _unpack_checked)
        with torch.enable_grad(), hooks:
            outs = n.fn(*args)
        outs = outs if isinstance(outs, tuple) else (outs,)
        for i in out_ix:  # a gradient flows back through these: they must be tensors
            if i < len(outs) and not isinstance(outs[i], torch.Tensor):
                raise TypeError(
                    f"node '{n.name}' returned {type(outs[i]).__name__} for its output '{n.outputs[i]}', which takes a "
                    "gradient (grad_outputs): return a torch.Tensor"
                )
        if probe:
            chunk._probed.add(n.name)
            for v, t in [*zip(n.inputs, args), *zip(n.outputs, outs)]:
                if isinstance(t, torch.Tensor) and _storage_id(t) in saved - {0}:
                    chunk.autograd_saved.add(v)
        if keep:
            ctx.fwd.saved[n.name] = (leaves, [outs[i] for i in out_ix])
        if n.outputs and n.outputs[-1] == chunk.loss_output and len(n.outputs) == 1:
            ctx.fwd.loss = outs[0].detach()
        return tuple(o.detach() if isinstance(o, torch.Tensor) and o.requires_grad else o for o in outs)

    return compute


def backward_fns(chunk: Chunk, n: NodeDef) -> dict[str, Callable[..., Any]]:
    """The callables of `n`'s backward nodes: `B.<node>` (dI, or a comm's transpose) and
    `B.<node>.dw` (dW), those its graph has."""
    ctx, pages = chunk.ctx, chunk.pages
    per_output = [
        (1 if v == chunk.loss_output else 0) + len(chunk._grad_consumers.get(v, ())) for v in chunk._flowing(n)
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
    fused = has_dw and not chunk.dw_nodes  # dI computes dW in the same call

    paged = n.name in chunk._paged

    def accumulate(st: MicrobatchState, grads: Sequence[Optional[torch.Tensor]], keep: set) -> None:
        accumulate_grads(params, grads, keep)
        if st.last and chunk.grad_reduce is not None:  # this node's gradients are final
            chunk.grad_reduce.launch(params)

    def d_input(*grads: torch.Tensor) -> Any:
        st = ctx.bwd
        if paged:  # the last input is the page-in's token (the unpack hook reads st.paged_in)
            grads = grads[:-1]
            pages.release_paged_out(st, n.name)
        leaves, outs = st.saved[n.name] if has_dw and not fused else st.saved.pop(n.name)
        g = summed(grads)
        if fused:
            res = torch.autograd.grad(outs, [*leaves, *params], g, allow_unused=True)
            st.paged_in.pop(n.name, None)
            accumulate(st, res[len(leaves) :], grad_ids(res[: len(leaves)], grads, [g]))  # (x + p: p's gradient is x's)
            res = res[: len(leaves)]
        elif not has_dw:
            res = torch.autograd.grad(outs, leaves, g, allow_unused=True)
            st.paged_in.pop(n.name, None)
        else:
            # dW follows (a control edge orders it): split where the weights join the
            # input's graph, so dW reuses the gradients computed here instead of redoing them.
            split = _WeightSplit(outs, leaves, params)
            res = split.input_grads(g)
            split.passed_on = grad_ids(res, grads, [g])  # dW's gradients may be these very tensors
            st.saved[n.name] = split
        return tuple(torch.zeros_like(leaf) if r is None else r for r, leaf in zip(res, leaves))

    def weight_grads(st: MicrobatchState, grads: Sequence[torch.Tensor]) -> None:
        saved = st.saved.pop(n.name)
        if isinstance(saved, _WeightSplit):
            res, keep = saved.weight_grads(), saved.passed_on | grad_ids(grads)
        else:  # no dI part (no input takes a gradient): the whole backward is dW
            g = summed(grads)
            res, keep = torch.autograd.grad(saved[1], params, g, allow_unused=True), grad_ids(grads, [g])
        st.paged_in.pop(n.name, None)
        accumulate(st, res, keep)

    def d_weight(*grads: torch.Tensor) -> Any:
        st = ctx.bwd
        if paged and not n.grad_inputs:  # the page-in's consumer is this node
            pages.release_paged_out(st, n.name)
        if paged:
            grads = grads[:-1]
        if chunk.deferred_dw is not None:  # dW later (a pipeline's BACKWARD_WEIGHT)
            chunk.deferred_dw.append(lambda: weight_grads(st, grads))
        else:
            weight_grads(st, grads)
        return None

    if n.grad_inputs:
        fns[f"B.{n.name}"] = d_input
    if chunk._has_dw_node(n):
        fns[f"B.{n.name}.dw"] = d_weight
    return fns


def node_callables(chunk: Chunk, forward: bool, backward: bool, release_points: bool) -> dict[str, Callable[..., Any]]:
    """`Chunk.callables`: every callable of the chunk's forward and/or backward source, by
    graph node name."""
    out: dict[str, Callable[..., Any]] = {}
    names = {n["name"] for n in chunk.graph(forward, backward)["nodes"]}
    for n in chunk.nodes:
        if forward:
            out[f"F.{n.name}"] = forward_fn(chunk, n, release_points)
            if n.name in chunk._paged:
                out[f"F.{n.name}.page_out"] = chunk.pages.page_out_fn(chunk.ctx, n.name)
        if backward:
            out.update(backward_fns(chunk, n))
            if n.name in chunk._paged:
                out[f"B.{n.name}.page_in"] = chunk.pages.page_in_fn(chunk.ctx, n.name)
    return {k: v for k, v in out.items() if k in names}
