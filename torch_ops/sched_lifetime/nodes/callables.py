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
import warnings
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch

from .grads import _WeightSplit, accumulate_grads, grad_ids
from .graph import NodeDef, sum_partials
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


def _reads(outs: Sequence[Any], args: Sequence[Any] = ()) -> dict[int, tuple[torch.Tensor, int]]:
    """The leaf tensors that `outs`' autograd graph reads (by id: the tensor and how many of
    the graph's edges read it): a node's detached inputs and the parameters its function used.
    The walk stops at `args`' own history (an input with a grad_fn: what made it is not the node's)."""
    out: dict[int, tuple[torch.Tensor, int]] = {}
    stack = [o.grad_fn for o in outs if isinstance(o, torch.Tensor) and o.grad_fn is not None]
    # The wrappers kept alive: torch makes one per graph node while it lives, else ids recur.
    seen: dict[int, Any] = {id(a.grad_fn): a.grad_fn for a in args if isinstance(a, torch.Tensor) and a.grad_fn is not None}
    while stack:
        fn = stack.pop()
        if id(fn) in seen:
            continue
        seen[id(fn)] = fn
        for nxt, _ in fn.next_functions:
            if nxt is None:
                continue
            v = getattr(nxt, "variable", None)
            if isinstance(v, torch.Tensor):  # AccumulateGrad: a leaf
                t, k = out.get(id(v), (v, 0))
                out[id(v)] = (t, k + 1)
            else:
                stack.append(nxt)
    return out


def check_node_graph(chunk: Chunk, n: NodeDef, args: Sequence[Any], grad_ix: Sequence[int], outs: Sequence[Any]) -> None:
    """On a node's first forward, what its autograd graph reads: an `nn.Parameter` that requires
    grad and is missing from `n.params` is an error (its gradient would never reach `.grad`,
    where plain autograd puts it; a leaf the function makes itself is no parameter); an input read more than once by a node that is not the last
    to read it is a warning (its gradient is summed node by node, autograd's use by use: the last
    bits may differ from `loss.backward()`; `graph.sum_partials`)."""
    reads = _reads(outs, args)
    leaves = {n.inputs[i]: args[i] for i in grad_ix}
    listed = {id(p) for p in n.params} | {id(a) for a in args}  # (an input that requires grad but takes none is not a parameter)
    stray = [t for i, (t, _) in reads.items() if i not in listed and isinstance(t, torch.nn.Parameter) and t.requires_grad]
    if stray:
        t = stray[0]
        raise ValueError(
            f"node '{n.name}': its function used a tensor that requires grad ({tuple(t.shape)} {t.dtype}, a Parameter) "
            f"that is not in its params ({len(stray)} such): "
            "its gradient would be lost; list every parameter the function uses in NodeDef.params"
        )
    for v, leaf in leaves.items():
        uses = reads.get(id(leaf), (leaf, 0))[1]
        consumers = chunk._grad_consumers.get(v, [])
        if uses > 1 and consumers and consumers[-1] != n.name:
            warnings.warn(
                f"node '{n.name}' reads '{v}' {uses} times and node '{consumers[-1]}' reads it after: autograd sums a "
                f"value's gradient use by use, this step node by node, so the gradient of '{v}' (and of what comes "
                f"before it) may differ from loss.backward() in the last bits; for bit-exact parity read '{v}' once in "
                f"'{n.name}' or put its uses in one node",
                stacklevel=3,
            )


def _grad(outs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> tuple:
    """`torch.autograd.grad` over `inputs` (unused ones None), and None for those that do not
    require grad: a frozen parameter gets no gradient, as under `loss.backward()` (autograd.grad
    would raise)."""
    live = [i for i, t in enumerate(inputs) if t.requires_grad]
    got = torch.autograd.grad(outs, [inputs[i] for i in live], grads, allow_unused=True) if live else ()
    res: list[Optional[torch.Tensor]] = [None] * len(inputs)
    for i, r in zip(live, got):
        res[i] = r
    return tuple(res)


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
            if args[i].is_floating_point() or args[i].is_complex():
                args[i] = args[i].detach().requires_grad_(True)
            # else (token ids into a first layer that `pipelining.describe` marks as taking a
            # gradient): no gradient, as under autograd; its backward hands back zeros
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
        if n.name not in chunk._checked:
            chunk._checked.add(n.name)
            check_node_graph(chunk, n, args, grad_ix, outs)
        if keep:
            ctx.fwd.saved[n.name] = (leaves, [outs[i] for i in out_ix])
        if chunk.loss_output in n.outputs:  # (a pipeline stage's output, or the loss: `run._loss_grad` checks)
            k = n.outputs.index(chunk.loss_output)
            if k < len(outs) and isinstance(outs[k], torch.Tensor):
                ctx.fwd.loss = outs[k].detach()
        return tuple(o.detach() if isinstance(o, torch.Tensor) and o.requires_grad else o for o in outs)

    return compute


def backward_fns(chunk: Chunk, n: NodeDef) -> dict[str, Callable[..., Any]]:
    """The callables of `n`'s backward nodes: `B.<node>` (dI, or a comm's transpose) and
    `B.<node>.dw` (dW), those its graph has."""
    ctx, pages = chunk.ctx, chunk.pages
    # Per flowing output: whether the loss's seed comes first among its gradients, and how many.
    per_output = [(v == chunk.loss_output, (v == chunk.loss_output) + len(chunk._grad_consumers.get(v, ()))) for v in chunk._flowing(n)]

    def summed(grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Per flowing output, its gradient: its consumers' partials added as autograd adds them
        (`sum_partials`), after the loss's seed where there is one."""
        out, k = [], 0
        for seed, count in per_output:
            parts = list(grads[k : k + count])
            out.append(sum_partials(parts[1:] + parts[:1] if seed else parts))
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
    params = list({id(p): p for p in n.params}.values())  # one listed twice (tied embedding and head) counts once
    fused = has_dw and not chunk.dw_nodes  # dI computes dW in the same call

    paged = n.name in chunk._paged

    tied = chunk._tied_params()
    position = chunk.nodes.index(n)

    def accumulate(st: MicrobatchState, grads: Sequence[Optional[torch.Tensor]], keep: set) -> None:
        if tied:  # a tied weight's gradient waits for this microbatch's other nodes, then goes in once
            grads, keep = list(grads), set(keep)
            for k, p in enumerate(params):
                if id(p) not in tied:
                    continue
                parts = st.tied_grads.setdefault(id(p), {})
                parts[position] = grads[k]
                grads[k] = None
                if len(parts) == tied[id(p)]:  # every node's part: added last use first, as autograd adds them
                    del st.tied_grads[id(p)]
                    total = sum_partials([g for _, g in sorted(parts.items()) if g is not None])
                    grads[k] = total
                    if total is not None:
                        keep.add(id(total))  # may be another node's tensor: `.grad` gets a copy
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
            res = _grad(outs, [*leaves, *params], g)
            st.paged_in.pop(n.name, None)
            accumulate(st, res[len(leaves) :], grad_ids(res[: len(leaves)], grads, [g]))  # (x + p: p's gradient is x's)
            res = res[: len(leaves)]
        elif not has_dw:
            res = _grad(outs, leaves, g)
            st.paged_in.pop(n.name, None)
        else:
            # dW follows (a control edge orders it): split where the weights join the
            # input's graph, so dW reuses the gradients computed here instead of redoing them.
            live = [leaf for leaf in leaves if leaf.requires_grad]
            split = _WeightSplit(outs, live, params)
            got = iter(split.input_grads(g))
            res = [next(got) if leaf.requires_grad else None for leaf in leaves]
            split.passed_on = grad_ids(res, grads, [g])  # dW's gradients may be these very tensors
            st.saved[n.name] = split
        return tuple(torch.zeros_like(leaf) if r is None else r for r, leaf in zip(res, leaves))

    def weight_grads(st: MicrobatchState, grads: Sequence[torch.Tensor]) -> None:
        saved = st.saved.pop(n.name)
        if isinstance(saved, _WeightSplit):
            res, keep = saved.weight_grads(), saved.passed_on | grad_ids(grads)
        else:  # no dI part (no input takes a gradient): the whole backward is dW
            g = summed(grads)
            res, keep = _grad(saved[1], params, g), grad_ids(grads, [g])
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
