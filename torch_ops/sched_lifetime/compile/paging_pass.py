"""The paging pass (option `paging=True`): saved activations of a compiled forward go to host
memory and come back in the backward. GraphModule in, GraphModule out; what to page is Rust's
choice (`page_plan`, the same planner as `sl.Pager`), the copies run through the same
`HostPool` (page-outs on the page stream, page-ins on the page-in stream unless
`paging_two_way=False`, pinned buffers allocated once at compile time, each buffer's copies in
order: `SlotOrder`, device storage released through the lifetime manager).

At partition time (AOTAutograd's partition function, wrapped) both graphs are known: every
saved value that is an activation (not a graph input: parameters and user inputs stay) with at
least `min_bytes` is a candidate, with its save order in the forward and the order of its first
use in the backward; Rust picks under the budget. After Rust's scheduling pass:

- forward: `_page_out` right after the node that produces a chosen value (its copy is queued on
  the page stream behind the compute so far and runs under the rest of the forward); the graph
  saves the host tensor it returns instead of the device one, so the device storage goes once
  the copy is done and the forward no longer reads it;
- backward: `_page_in_launch` `prefetch` compute nodes before the value's first use (a device
  tensor allocated on the compute stream, the copy queued on the page stream, the host buffer
  back on the freelist), `_page_wait` right before the use (the compute stream waits on the
  copy's event); the uses read the waited tensor.

Timed (`paging_timed=True`, the default): the same nodes, but every candidate gets them and
an `sl.Pager` decides at run time, as it does under `saved_tensors_hooks`: the first step (the
first two on CUDA) calibrates (memory timeline, then time line and link rates), then Rust pages
only what hides under the forward and lowers the peak, releases each page-out where its copy is
done and queues each page-in as late as the link allows. A step is one forward and its
backward; a second forward before the backward is an error (`paging_timed=False`, the static
plan above, allows `paging_buffers` forwards in flight).

Eager only: the release of a paged-out tensor's device storage asks whether its copy is done
(an event query), which capture does not allow; `paging` with `cudagraphs` is an error.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from ..paging import Budget, HostPool, Pager, page_plan

#: Live pagers by key (the graphs' page nodes carry the key, an int, as their first argument).
_PAGERS: "weakref.WeakValueDictionary[int, GraphPager]" = weakref.WeakValueDictionary()
_KEYS = itertools.count()


class GraphPager:
    """One compiled function's paging: the plan, the host pool and the per-step stats."""

    def __init__(
        self, budget: Budget, prefetch: int = 2, buffers: int = 2, min_bytes: int = 1 << 16, timed: bool = False, slack: float = 1.25,
        two_way: bool = True,
    ) -> None:
        # The values come checked (`compile.check_options`).
        self.budget, self.prefetch, self.buffers, self.min_bytes = budget, prefetch, buffers, min_bytes
        self.two_way = two_way
        self.key = next(_KEYS)
        _PAGERS[self.key] = self
        self._static_plan: Optional[dict] = None
        self.pool: Optional[HostPool] = None
        self.chosen: list[str] = []
        self._num_fwd_outputs = 0
        self._held: dict[int, Any] = {}  # host buffer address -> Paged
        self._events: dict[int, Any] = {}  # id of a paged-in tensor -> its copy's event
        self._stats = {"bytes_out": 0, "bytes_in": 0, "copies_out": 0, "copies_in": 0}
        #: Timed: the Pager that calibrates and decides at run time (None: the static plan).
        self.pager: Optional[Pager] = Pager(budget, min_bytes=min_bytes, prefetch=prefetch, slack=slack, two_way=two_way) if timed else None
        self._index: dict[str, int] = {}  # timed: candidate -> its save index in the forward
        self._open = False

    @property
    def plan(self) -> Optional[dict]:
        """Rust's plan: the static one (made at partition time), or the timed Pager's (made
        after calibration; None until then)."""
        return self.pager.plan if self.pager is not None else self._static_plan

    @property
    def stats(self) -> dict:
        """Bytes (and, static, copies) paged out and in; equal after every backward."""
        return self.pager.stats() if self.pager is not None else dict(self._stats)

    @property
    def host_pool(self) -> Optional[HostPool]:
        """The host buffers (timed: allocated once the Pager has calibrated)."""
        return self.pager.pool if self.pager is not None else self.pool

    @property
    def paged(self) -> list[str]:
        """The saved values paged: the static plan's, or (timed) the calibrated plan's."""
        if self.pager is None:
            return list(self.chosen)
        if self.pager.plan is None:
            return []
        names = {i: n for n, i in self._index.items()}
        return [names[int(x[1:])] for x in self.pager.plan["page"]]

    # -- planning (partition time) -----------------------------------------------------

    def partition(self, partition_fn: Callable) -> Callable:
        """`partition_fn` that also plans what to page from the two graphs it returns."""

        def partition(joint: fx.GraphModule, inputs: Any, *, num_fwd_outputs: int, **kw: Any) -> tuple:
            fw, bw = partition_fn(joint, inputs, num_fwd_outputs=num_fwd_outputs, **kw)
            self._plan(fw, bw, num_fwd_outputs)
            return fw, bw

        return partition

    def _plan(self, fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int) -> None:
        self._num_fwd_outputs = num_fwd_outputs
        out = next(iter(fw.graph.find_nodes(op="output"))).args[0]
        saved = [n for n in out[num_fwd_outputs:] if isinstance(n, fx.Node)]
        pos = {n: i for i, n in enumerate(fw.graph.nodes)}
        bw_ph = {n.name: n for n in bw.graph.find_nodes(op="placeholder")}
        bw_pos = {n: i for i, n in enumerate(bw.graph.nodes)}
        from torch.multiprocessing.reductions import StorageWeakRef

        # Inputs (parameters, user inputs) and views of them (a matmul saves its weight's
        # transpose) stay: paging them frees nothing.
        inputs = {
            StorageWeakRef(n.meta["val"].untyped_storage())
            for n in fw.graph.find_nodes(op="placeholder")
            if isinstance(n.meta.get("val"), torch.Tensor)
        }
        cands = []
        for n in dict.fromkeys(saved):  # a value saved twice is one candidate
            val = n.meta.get("val")
            if n.op == "placeholder" or not isinstance(val, torch.Tensor) or n.name not in bw_ph:
                continue
            if StorageWeakRef(val.untyped_storage()) in inputs:
                continue
            nbytes = val.numel() * val.element_size()
            users = list(bw_ph[n.name].users)
            if nbytes < self.min_bytes or not users:
                continue
            cands.append((n, nbytes, min(bw_pos[u] for u in users)))
        if self.pager is not None:  # timed: every candidate gets page nodes; the Pager decides
            self.chosen = [n.name for n, _, _ in sorted(cands, key=lambda c: pos[c[0]])]
            return
        by_save = {n: i for i, (n, _, _) in enumerate(sorted(cands, key=lambda c: pos[c[0]]))}
        by_use = {n: i for i, (n, _, _) in enumerate(sorted(cands, key=lambda c: c[2]))}
        prefix = [{"name": n.name, "bytes": b, "saved_at": by_save[n], "used_at": by_use[n]} for n, b, _ in cands]
        self._static_plan = page_plan(prefix, self.budget)
        self.chosen = list(self._static_plan["page"])
        sizes = {n.name: b for n, b, _ in cands}
        devices = {n.name: n.meta["val"].device for n, _, _ in cands}
        if self.chosen:
            dev = {devices[c] for c in self.chosen}
            if len(dev) != 1:
                raise ValueError(f"sched_lifetime backend: paging across several devices is not supported ({sorted(map(str, dev))})")
            # Allocated once, here (compile time, outside the tracer's fake mode), never during
            # a step: `buffers` host buffers per paged value (forwards in flight before their
            # backwards).
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            with unset_fake_temporarily():
                self.pool = HostPool([sizes[c] for c in self.chosen for _ in range(self.buffers)], device=dev.pop(), two_way=self.two_way)

    # -- rewriting (after Rust's order) --------------------------------------------------

    def forward(self, gm: fx.GraphModule) -> fx.GraphModule:
        """Page-outs after the chosen values' producers; the graph saves the host tensors."""
        if not self.chosen:
            return gm
        g = gm.graph
        by_name = {n.name: n for n in g.nodes}
        out = next(iter(g.find_nodes(op="output")))
        outs = list(out.args[0])
        missing = [c for c in self.chosen if c not in by_name]
        if missing:
            raise RuntimeError(f"sched_lifetime paging: the forward graph lost saved values {missing[:5]}")
        if self.pager is not None:  # save indices in the order the forward runs them
            where = {n: i for i, n in enumerate(g.nodes)}
            self._index = {c: i for i, c in enumerate(sorted(self.chosen, key=lambda c: where[by_name[c]]))}
        for name in self.chosen:
            n = by_name[name]
            with g.inserting_after(n):
                if self.pager is not None:
                    host = g.call_function(_page_save, (self.key, self._index[name], n))
                else:
                    host = g.call_function(_page_out, (self.key, n))
            outs = [host if (i >= self._num_fwd_outputs and o is n) else o for i, o in enumerate(outs)]
        out.args = (tuple(outs),)
        g.lint()
        gm.recompile()
        gm._sl_pager = self  # the registry holds pagers weakly; the graphs keep theirs alive
        return gm

    def backward(self, gm: fx.GraphModule) -> fx.GraphModule:
        """Page-in launches `prefetch` compute nodes before each chosen value's first use, and
        its wait right before that use."""
        if not self.chosen:
            return gm
        g = gm.graph
        nodes = list(g.nodes)
        where = {n: i for i, n in enumerate(nodes)}
        phs = {n.name: n for n in g.find_nodes(op="placeholder")}
        calls = [n for n in nodes if n.op == "call_function"]
        for name in self.chosen:
            ph = phs.get(name)
            if ph is None:
                raise RuntimeError(f"sched_lifetime paging: the backward graph has no input for saved value '{name}'")
            first = min(ph.users, key=lambda u: where[u])
            if self.pager is not None:  # the Pager launches page-ins; the use waits on it
                with g.inserting_before(first):
                    ready = g.call_function(_page_use, (self.key, self._index[name], ph))
                ph.replace_all_uses_with(ready, delete_user_cb=lambda u: u is not ready)
                continue
            k = calls.index(first) if first in calls else 0
            launch_before = calls[max(0, k - self.prefetch)] if calls else first
            with g.inserting_before(launch_before):
                dev = g.call_function(_page_in_launch, (self.key, ph))
            with g.inserting_before(first):
                ready = g.call_function(_page_wait, (self.key, dev))
            ph.replace_all_uses_with(ready, delete_user_cb=lambda u: u is not dev)
        last = next(iter(g.find_nodes(op="output")))
        with g.inserting_before(last):
            g.call_function(_page_finish, (self.key,))
        g.lint()
        gm.recompile()
        gm._sl_pager = self
        return gm


def _pager(key: int) -> GraphPager:
    gp = _PAGERS.get(key)
    if gp is None:
        raise RuntimeError("sched_lifetime paging: this graph's pager is gone (its compiled function was freed)")
    return gp


def _page_out(key: int, t: torch.Tensor) -> torch.Tensor:
    gp = _pager(key)
    p = gp.pool.page_out(t)
    host = gp.pool.view_of(p)
    gp._held[host.data_ptr()] = p
    gp._stats["bytes_out"] += p.nbytes
    gp._stats["copies_out"] += 1
    return host


def _page_in_launch(key: int, host: torch.Tensor) -> torch.Tensor:
    gp = _pager(key)
    p = gp._held.pop(host.data_ptr(), None)
    if p is None:
        raise RuntimeError("sched_lifetime paging: a backward read a host buffer no forward paged out (backward run twice?)")
    gp.pool.release_done()
    out, ev = gp.pool.page_in_launch(p)
    gp._events[id(out)] = ev
    gp._stats["bytes_in"] += p.nbytes
    gp._stats["copies_in"] += 1
    return out


def _page_wait(key: int, t: torch.Tensor) -> torch.Tensor:
    gp = _pager(key)
    ev = gp._events.pop(id(t))
    gp.pool.page_wait(ev)
    gp.pool.recycle(ev)
    return t


def _page_finish(key: int) -> None:
    """End of a backward: release what the finished page-outs still hold (the compute stream
    waits on copies that are done by now); timed, the Pager's step ends here."""
    gp = _pager(key)
    if gp.pager is not None:
        if gp._open:
            gp._open = False
            gp.pager.end(True)
        return
    gp.pool.drain()


def _page_save(key: int, i: int, t: torch.Tensor) -> torch.Tensor:
    """Timed: the Pager's save hook for saved value `i` (a step starts at the first); returns
    what the forward saves: `t`, or the host tensor it was paged into."""
    gp = _pager(key)
    pg = gp.pager
    if i == 0:
        if gp._open:  # the last forward's backward never ran to its end
            gp._open = False
            pg.end(False)
            raise RuntimeError(
                "sched_lifetime paging (timed): a forward started before the last forward's backward finished; "
                "timed paging runs one forward and its backward at a time (paging_timed=False allows forwards in flight)"
            )
        pg.begin()
        gp._open = True
    if pg._index != i:
        raise RuntimeError(f"sched_lifetime paging: saved value #{i} came as save #{pg._index} of this step")
    packed = pg._pack(t)
    if packed[0] == "keep":
        return t
    return pg.pool.view_of(pg._handles[i])


def _page_use(key: int, i: int, x: torch.Tensor) -> torch.Tensor:
    """Timed: the Pager's unpack hook for saved value `i` at its first backward use."""
    pg = _pager(key).pager
    paged = i in pg._handles or i in pg._ready
    return pg._unpack(("paged", i) if paged else ("keep", i, x))

