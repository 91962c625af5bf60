"""The paging pass on a whole traced training step (forward, loss and backward in one FX graph,
as torchtitan's graph_trainer traces it): forward values the backward reads go to pinned host
memory after their producer and come back before their first backward use. GraphModule in,
GraphModule out (nodes added in place).

Which nodes are the backward: `node.meta["autograd_backward"]`, which torch's autograd engine
sets while the step is traced (torchtitan's `cpu_offload` reads the same mark). A candidate is
a forward `call_function` value with a static size of at least `min_bytes` that a backward
node reads, that is not a view, does not share storage with a graph input (parameters, user
inputs: paging them frees nothing) or with an earlier candidate (`detach` aliases), is not
written in place by an aten operator (the copy would be stale) and is not returned by the step. Rust's `page_plan` picks
under the budget (the static plan: the step's save order against its use order), the same
planner `GraphPager` uses; the copies are `GraphPager`'s (`HostPool`: page-outs on the page
stream, device storage released through the lifetime manager, each host buffer's copies in
order), so a page-out runs under the rest of the forward and a page-in is launched `prefetch`
backward nodes before its use, with the wait right before it.

Run it after the order pass (the save and use orders are read off the graph as it will run).
Static only: the timed plan (`paging_timed`) calibrates per saved-tensor hook, which needs
AOTAutograd's forward/backward split; a step compiled whole by Inductor cannot hold these
nodes (refused by the caller)."""

from __future__ import annotations

import warnings
from typing import Optional

import torch
import torch.fx as fx

from ..paging import Budget, page_plan
from .paging_pass import GraphPager, _Run, _page_finish, _page_in_launch, _page_out, _page_wait


def _backward(n: fx.Node) -> bool:
    return bool(n.meta.get("autograd_backward", False))


class JointPager(GraphPager):
    """Paging of one traced step graph (static plan; see the module docstring). `page(gm)`
    plans and rewrites; `stats`, `explain()`, `paged` as `GraphPager`'s."""

    def __init__(self, budget: Budget, prefetch: int = 2, buffers: int = 1, min_bytes: int = 1 << 16, two_way: bool = False) -> None:
        super().__init__(budget, prefetch, buffers, min_bytes, timed=False, two_way=two_way)

    def begin_forward(self) -> _Run:
        """A step starts. One call of the graph is one whole step, so a run still open is a
        step that raised between its page-outs and its end: its copies are waited for and its
        buffers and device storage given back (nothing held, no new pool per failed step)."""
        for r in self.runs:
            if r.open:
                r.pool.abandon()
                r.close()
        self._held.clear()
        self._owner.clear()
        self._events.clear()
        return super().begin_forward()

    def page(self, gm: fx.GraphModule) -> fx.GraphModule:
        """Plan what to page in `gm` (as ordered now) and add the page nodes; `gm` back (as it
        was when it has no backward: nothing to page)."""
        nodes = list(gm.graph.nodes)
        pos = {n: i for i, n in enumerate(nodes)}
        if not any(_backward(n) for n in nodes):
            self.left_out["(graph)"] = "no node is marked as backward (meta['autograd_backward']): nothing to page"
            return gm
        cands = self._candidates(gm, pos)
        if not cands:
            return gm
        by_save = {n: i for i, (n, _, _) in enumerate(sorted(cands, key=lambda c: pos[c[0]]))}
        by_use = {n: i for i, (n, _, _) in enumerate(sorted(cands, key=lambda c: pos[c[2]]))}
        prefix = [{"name": n.name, "bytes": b, "saved_at": by_save[n], "used_at": by_use[n]} for n, b, _ in cands]
        self._static_plan = page_plan(prefix, self.budget)
        chosen = set(self._static_plan["page"])
        picked = sorted((c for c in cands if c[0].name in chosen), key=lambda c: pos[c[0]])
        self.chosen = [n.name for n, _, _ in picked]
        if not picked:
            return gm
        devs = {n.meta["val"].device for n, _, _ in picked}
        if len(devs) != 1:
            raise ValueError(f"sched_lifetime paging: paging across several devices is not supported ({sorted(map(str, devs))})")
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        self._sizes, self._device = [b for _, b, _ in picked], devs.pop()
        with unset_fake_temporarily():
            for _ in range(self.buffers):
                self.runs.append(_Run(pool=self._new_pool()))
        self._set_index([n for n, _, _ in picked])
        self._rewrite(gm, picked, pos)
        return gm

    def _candidates(self, gm: fx.GraphModule, pos: dict) -> list:
        from torch.multiprocessing.reductions import StorageWeakRef

        inputs = {
            StorageWeakRef(n.meta["val"].untyped_storage())
            for n in gm.graph.find_nodes(op="placeholder")
            if isinstance(n.meta.get("val"), torch.Tensor)
        }
        out = next(iter(gm.graph.find_nodes(op="output")))
        returned = set(out.all_input_nodes)
        written = _written_storages(gm)
        cands, seen = [], set()
        for n in gm.graph.nodes:
            val = n.meta.get("val")
            if n.op != "call_function" or _backward(n) or not isinstance(val, torch.Tensor) or n in returned:
                continue
            users = [u for u in n.users if _backward(u)]
            if not users:
                continue
            numel = val.numel()
            if not isinstance(numel, int):
                self.left_out[n.name] = f"its size is symbolic ({numel}): dynamic shapes are not paged"
                continue
            st = StorageWeakRef(val.untyped_storage())
            if val._is_view() or st in inputs:
                continue
            if st in seen:  # an alias that is not a view (`detach`): its storage is paged once, as the first value
                continue
            seen.add(st)
            if st in written:  # a copy taken before a later in-place write would be stale
                self.left_out[n.name] = "an operator writes its storage in place"
                continue
            nbytes = numel * val.element_size()
            if nbytes < max(self.min_bytes, 1):  # no elements: nothing to page (as GraphPager)
                self.under_min_bytes += bool(nbytes)
                continue
            cands.append((n, nbytes, min(users, key=lambda u: pos[u])))
        self.candidates = [n.name for n, _, _ in sorted(cands, key=lambda c: pos[c[0]])]
        if not cands and self.under_min_bytes:  # a setting that selects nothing: said, with the fix (as GraphPager does)
            warnings.warn(
                f"sched_lifetime paging: the step pages nothing: every forward value the backward reads is under "
                f"paging_min_bytes={self.min_bytes} bytes; pass a smaller paging_min_bytes to page them",
                stacklevel=3,
            )
        return cands

    def _rewrite(self, gm: fx.GraphModule, picked: list, pos: dict) -> None:
        g = gm.graph
        bwd_calls = [n for n in g.nodes if n.op == "call_function" and _backward(n)]
        where = {n: i for i, n in enumerate(bwd_calls)}
        for n, _, first in picked:
            i = self._index[n.name]
            with g.inserting_after(n):
                host = g.call_function(_page_out, (self.key, i, n))
            k = where.get(first, 0)
            launch_before = bwd_calls[max(0, k - self.prefetch)]
            if pos[launch_before] < pos[n]:  # a backward node before the producer: launch at the use
                launch_before = first
            with g.inserting_before(launch_before):
                dev = g.call_function(_page_in_launch, (self.key, i, host))
            with g.inserting_before(first):
                ready = g.call_function(_page_wait, (self.key, dev))
            for m in (dev, ready):
                m.meta["autograd_backward"] = True
                m.meta["val"] = n.meta.get("val")
            n.replace_all_uses_with(ready, delete_user_cb=lambda u: _backward(u) and u not in (dev, ready))
        last = next(iter(g.find_nodes(op="output")))
        with g.inserting_before(last):
            fin = g.call_function(_page_finish, (self.key,))
            fin.meta["autograd_backward"] = True
        g.lint()
        gm.recompile()
        gm._sl_pager = self  # the registry holds pagers weakly; the graph keeps its own alive


def _written_storages(gm: fx.GraphModule) -> set:
    """Storages some node writes in place (an operator's argument its schema marks written:
    `copy_`, `add_`, an `out=` tensor), by their fake values' storages."""
    from torch.multiprocessing.reductions import StorageWeakRef

    out = set()
    for n in gm.graph.nodes:
        schema = getattr(n.target, "_schema", None) if n.op == "call_function" else None
        if schema is None:
            continue
        for i, a in enumerate(schema.arguments):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            x = n.args[i] if i < len(n.args) else n.kwargs.get(a.name)
            for m in x if isinstance(x, (list, tuple)) else (x,):
                val = m.meta.get("val") if isinstance(m, fx.Node) else None
                if isinstance(val, torch.Tensor):
                    out.add(StorageWeakRef(val.untyped_storage()))
    return out


def page_step(gm: fx.GraphModule, budget: Budget, prefetch: int = 2, min_bytes: int = 1 << 16, two_way: bool = False) -> Optional[JointPager]:
    """`JointPager(...).page(gm)`: the pager (its `stats`, `explain()`), or None when nothing
    was paged."""
    jp = JointPager(budget, prefetch=prefetch, min_bytes=min_bytes, two_way=two_way)
    jp.page(gm)
    return jp if jp.chosen else None
