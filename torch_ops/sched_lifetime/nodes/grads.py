"""Gradients of a chunk's nodes: the dI/dW split, accumulation into `.grad`, the in-step reduce.

`_WeightSplit` splits one node's backward into its input gradients now and its weight
gradients later; `accumulate_grads` adds a node's weight gradients into `.grad` as autograd
does; `GradReduce` averages the data-parallel gradients over a group inside the step
(`grad_reduce_for` checks that each parameter belongs to one node first).
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false

from .graph import NodeDef


def accumulate_grads(params: Sequence[torch.Tensor], grads: Sequence[Optional[torch.Tensor]], keep: Iterable[int] = ()) -> None:
    """Add gradients into `.grad` as autograd's accumulation (AccumulateGrad) does: the first
    one is taken as it is when nothing else refers to it and it has the layout autograd gives a
    gradient (`_stealable`), else a copy in that layout; later ones are added in place. None
    skips. `keep`: the ids of tensors the caller still uses or has passed on (the input
    gradients, the incoming ones; `grad_ids`): a gradient among them is copied. A graph may
    return one tensor as two parameters' gradients (`x @ (w1 + w2)`), `x + p` hands `p` the
    gradient it hands `x`, and a broadcast gradient (`w.sum()`) has stride 0: taken as they
    are, one `.grad` would alias another tensor, or an add into it would write one element
    twice."""
    taken = set(keep)
    for p, g in zip(params, grads):
        if g is None:
            continue
        if p.grad is None:
            if id(g) in taken or not _stealable(p, g):
                g = _in_layout(p, g)
            taken.add(id(g))
            p.grad = g
        else:
            p.grad.add_(g)


def grad_ids(*groups: Iterable[Optional[torch.Tensor]]) -> set:
    """`accumulate_grads`' `keep` for these tensors (ids only: nothing is kept alive; an id
    reused by a later tensor only costs that one a copy)."""
    return {id(t) for ts in groups for t in ts if t is not None}


def _stealable(p: torch.Tensor, g: torch.Tensor) -> bool:
    """Whether `.grad` may be `g` itself, as AccumulateGrad decides: no other tensor refers to
    it (a view of it holds a reference: its use count is then above 1) and it obeys the layout
    contract: the parameter's strides where the parameter is dense (a size-1 dimension may
    differ, but not with stride 0), else contiguous."""
    if g.layout != torch.strided or g._use_count() > 1:
        return False
    if is_non_overlapping_and_dense_or_false(p):
        return g.shape == p.shape and all(
            (s == q) if n != 1 else s != 0 for s, q, n in zip(g.stride(), p.stride(), g.shape)
        )
    return g.is_contiguous()


def _in_layout(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """A copy of `g` in the layout autograd gives a gradient it cannot take as it is."""
    if is_non_overlapping_and_dense_or_false(p):
        return torch.empty_strided(p.shape, p.stride(), dtype=g.dtype, device=g.device).copy_(g)
    return g.clone(memory_format=torch.contiguous_format)


class _WeightSplit:
    """A node's backward split into dI now and dW later, as torch.distributed.pipelining's
    stage_backward_input / stage_backward_weight split a stage: hooks on the autograd nodes
    where the weights join the inputs' graph keep the gradients dI computes there, and dW
    starts from them (so dW does only the weight-gradient work). Weights whose graph never
    joins the inputs' (none in the embedded model) get theirs from the outputs at dW."""

    def __init__(self, outs: Sequence[torch.Tensor], leaves: Sequence[torch.Tensor], params: Sequence[torch.nn.Parameter]) -> None:
        from torch.distributed.pipelining._backward import _get_grad_fn_or_grad_acc, construct_reverse_graph, get_param_groups

        self.outs, self.leaves, self.params = list(outs), list(leaves), list(params)
        self.passed_on: set = set()  # ids of the input gradients dI passed on (`accumulate_grads`' keep)
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
        if not self.leaves:  # no input takes a gradient here (token ids): dW does it all
            self.grads = grads
            return ()
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


def grad_reduce_for(nodes: Sequence[NodeDef], params: Sequence[torch.nn.Parameter], group: Any = None) -> GradReduce:
    """A `GradReduce` of `params` over `group`, once each parameter is known to belong to one
    node of `nodes` (its gradient is final after that node's last dW)."""
    owners: dict[int, str] = {}
    for n in nodes:
        for p in n.params:
            if id(p) in owners and owners[id(p)] != n.name:
                raise ValueError(f"enable_grad_reduce: a parameter of node '{n.name}' also belongs to '{owners[id(p)]}'")
            owners[id(p)] = n.name
    missing = [i for i, p in enumerate(params) if id(p) not in owners]
    if missing:
        raise ValueError(f"enable_grad_reduce: parameters {missing[:5]} belong to no node of this chunk")
    return GradReduce(params, group)
