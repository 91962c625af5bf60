"""The paging pass (option `paging=True`): saved activations of a compiled forward go to host
memory and come back in the backward. GraphModule in, GraphModule out; what to page is Rust's
choice (`page_plan`, the same planner as `sl.Pager`), the copies run through the same
`HostPool` (page-outs on the page stream, page-ins on the page-in stream unless
`paging_two_way=False`, pinned buffers allocated once at compile time, each buffer's copies in
order: `SlotOrder`, device storage released through the lifetime manager).

At partition time (AOTAutograd's partition function, wrapped) both graphs are known: every
saved value that is an activation (not a graph input: parameters and user inputs stay) with at
least `min_bytes` (and one element), whose elements do not share memory (a stride-0 expand
could not come back with its strides), is a candidate, with its save order in the forward and
the order of its first use in the backward; Rust picks under the budget. After Rust's
scheduling pass:

- forward: `_page_out` right after the node that produces a chosen value (its copy is queued on
  the page stream behind the compute so far and runs under the rest of the forward); the graph
  saves the host tensor it returns instead of the device one, so the device storage goes once
  the copy is done and the forward no longer reads it (a value that comes at run time unlike its
  trace, whose host buffer was sized from the trace, stays on the device, with a warning);
- backward: `_page_in_launch` `prefetch` compute nodes before the value's first use (a device
  tensor allocated on the compute stream, the copy queued on the page stream, the host buffer
  back on the freelist), `_page_wait` right before the use (the compute stream waits on the
  copy's event); the uses read the waited tensor.

Timed (`paging_timed=True`, the default): the same nodes, but every candidate gets them and
an `sl.Pager` decides at run time, as it does under `saved_tensors_hooks`: the first step (the
first two on CUDA) calibrates (memory timeline, then time line and link rates), then Rust pages
only what hides under the forward and lowers the peak, releases each page-out where its copy is
done and queues each page-in as late as the link allows.

Runs: one compiled graph can run several times before its backwards (a graph break inside each
layer makes every layer run the same graph; a pipeline keeps forwards in flight). Each run in
flight has its own plan and host buffers (a `_Run`: timed, its own `Pager`; static, its own
`HostPool`): a forward takes the lowest run slot whose backward has finished, and a backward
finds its run by the saved values it reads (each is registered under its save index and storage
address at the forward), so backwards may come in any order. Slots, and their host buffers, are
made when a run first needs one: host memory is sized from what runs, `paging_buffers` slots are
made up front (static). `MAX_RUNS` forwards of one graph waiting for their backwards is an error
(a forward whose backward never runs holds its slot: run such forwards under `torch.no_grad()`).

Dynamic shapes (`dynamic=True`): a saved value whose size is symbolic is not a candidate (a
plan and its host buffers are made for one size); `GraphPager.explain()` lists each value left
out and why.

Autograd's check that a saved value was not changed in place before the backward compares the
saved tensor's version counter, and the graph saves the host copy: each page-out keeps the
device tensor's counter (not its storage, `SavedVersion`) and its page-in raises autograd's error
when the version moved.

Eager only: the release of a paged-out tensor's device storage asks whether its copy is done
(an event query), which capture does not allow; `paging` with `cudagraphs` is an error.
"""

from __future__ import annotations

import functools
import itertools
import warnings
import weakref
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from ..paging import Budget, HostPool, Pager, page_plan
from ..paging.pager import outside_dynamo
from ..paging.paged import SavedVersion, plain, restorable

#: Live pagers by key (the graphs' page nodes carry the key, an int, as their first argument).
_PAGERS: "weakref.WeakValueDictionary[int, GraphPager]" = weakref.WeakValueDictionary()
_KEYS = itertools.count()

#: Forwards of one compiled graph that may wait for their backwards at once.
MAX_RUNS = 64

#: The end of the error a second read of a saved value raises.
TWICE = (
    " (backward run twice? a second backward through one graph, retain_graph=True or torch.autograd.grad(..., "
    "retain_graph=True) then backward(), is not supported with paging=True: compile this model without paging)"
)


class _Run:
    """One run slot of a compiled graph: a forward and its backward, with their own plan (timed:
    a `Pager`) or host buffers (static: a `HostPool`)."""

    def __init__(self, pager: Optional[Pager] = None, pool: Optional[HostPool] = None) -> None:
        self.pager, self.pool = pager, pool
        self.open = False  # a forward ran; its backward has not finished
        self.owed: set = set()  # (save index, address) of saved values its backward has not read yet
        self.versions: dict[int, SavedVersion] = {}  # save index of a paged value -> its device tensor's version
        self.kept: set = set()  # static: save indices kept on the device at run time (unlike their trace)
        self.gen = 0  # forwards this slot has started (a dead forward's finalizer names the one it watched)
        self.aside = False  # this forward ran inside torch.utils.checkpoint: it pages nothing (`GraphPager.beside_outer_hooks`)

    def close(self) -> None:
        """Its backward is over (finished, or refused): the slot's per-run state is dropped."""
        self.owed.clear()
        self.versions.clear()
        self.kept.clear()
        self.open = False


class GraphPager:
    """One compiled function's paging: the candidates, the plan, the run slots (each with its
    Pager or host pool; see the module docstring) and the stats."""

    def __init__(
        self, budget: Budget, prefetch: int = 2, buffers: int = 2, min_bytes: int = 1 << 16, timed: bool = False, slack: float = 1.25,
        two_way: bool = True, count_host: bool = True, group_out: int = 1,
    ) -> None:
        # The values come checked (`compile.check_options`).
        self.count_host = count_host
        self.group_out = group_out
        self.budget, self.prefetch, self.buffers, self.min_bytes = budget, prefetch, buffers, min_bytes
        self.two_way = two_way
        self.key = next(_KEYS)
        _PAGERS[self.key] = self
        self._static_plan: Optional[dict] = None
        self.timed, self.slack = timed, slack
        self.candidates: list[str] = []  # saved values that may be paged, in save order
        self.chosen: list[str] = []  # those that get page nodes (static: Rust's plan; timed: all)
        self._num_fwd_outputs = 0
        self._held: dict[int, Any] = {}  # host buffer address -> (Paged, its run, SavedVersion)
        self._expect: list = []  # save index -> (shape, dtype) the forward was traced with
        self._warned: set = set()  # save indices whose run-time difference from the trace was said
        self._events: dict[int, Any] = {}  # id of a paged-in tensor -> (its copy's event, its pool); None: kept on the device
        self._stats = {"bytes_out": 0, "bytes_in": 0, "copies_out": 0, "copies_in": 0}
        self._index: dict[str, int] = {}  # candidate -> its save index in the forward
        self._sizes: list[int] = []  # static: host buffer bytes per chosen value
        self._device: Any = None
        #: Run slots (see the module docstring), made as runs need them.
        self.runs: list[_Run] = []
        self._fwd: Optional[_Run] = None  # the run whose forward is running
        self._bwd: Optional[_Run] = None  # the run whose backward is running
        self._owner: dict[tuple, _Run] = {}  # (save index, address) of a saved value -> its run
        # What the page nodes handed the forward to save (`owns`), by layout (address, shape,
        # strides, dtype: another tensor may start at a kept value's address; AOTAutograd saves a
        # view's `detach()`, so not by identity) -> its `_owner` key, valid while that key is.
        self._mine: dict[tuple, tuple] = {}
        #: Saved values left out of paging and why (name -> reason).
        self.left_out: dict[str, str] = {}
        #: Saved values (with elements, read by the backward) under `min_bytes`: counted, not listed.
        self.under_min_bytes = 0
        #: (run, generation) of forwards whose saved values autograd let go before their backward
        #: ran (the loss dropped: a skipped step); their slots are given back at the next forward.
        self._dead: list[tuple[_Run, int]] = []
        #: Run slots given back that way (their page-outs count in `stats()["bytes_out"]`, with no page-in).
        self.dropped_runs = 0
        #: > 0 while the graph runs inside torch.utils.checkpoint (`beside_outer_hooks`): its runs page nothing.
        self._aside = 0
        #: Forwards that ran inside torch.utils.checkpoint and paged nothing.
        self.aside_runs = 0

    @property
    def pager(self) -> Optional[Pager]:
        """Timed: the first run slot's Pager (None: the static plan, or no run yet)."""
        return self.runs[0].pager if self.timed and self.runs else None

    @property
    def pool(self) -> Optional[HostPool]:
        """Static: the first run slot's host buffers."""
        return self.runs[0].pool if not self.timed and self.runs else None

    @property
    def plan(self) -> Optional[dict]:
        """Rust's plan: the static one (made at partition time), or the first run slot's timed
        Pager's (made after calibration; None until then)."""
        if not self.timed:
            return self._static_plan
        return self.pager.plan if self.pager is not None else None

    @property
    def stats(self) -> dict:
        """Bytes (and, static, copies) paged out and in, over every run slot; equal after every
        backward. Timed: the Pagers' counters added up (`steps`: forward + backward runs)."""
        if not self.timed:
            return dict(self._stats)
        total: dict = {}
        for r in self.runs:
            for k, v in r.pager.stats().items():
                total[k] = max(total.get(k, 0), v) if k == "max_prefetched" else total.get(k, 0) + v
        return total or {"steps": 0, "bytes_out": 0, "bytes_in": 0, "bytes_abandoned": 0, "host_bytes": 0, "max_prefetched": 0, "kept_unlike_calibration": 0}

    @property
    def host_pool(self) -> Optional[HostPool]:
        """The first run slot's host buffers (timed: allocated once its Pager has calibrated)."""
        return self.pager.pool if self.timed and self.pager is not None else self.pool

    def host_pools(self) -> list[HostPool]:
        """Every run slot's host buffers (timed: those calibrated so far)."""
        pools = [r.pager.pool if self.timed else r.pool for r in self.runs]
        return [p for p in pools if p is not None]

    @property
    def paged(self) -> list[str]:
        """The saved values paged: the static plan's, or (timed) the first run slot's
        calibrated plan's."""
        if not self.timed:
            return list(self.chosen)
        if self.pager is None or self.pager.plan is None:
            return []
        names = {i: n for n, i in self._index.items()}
        return [names[int(x[1:])] for x in self.pager.plan["page"]]

    def summary(self, phase: str) -> str:
        """One line for the backend's `explain`: what the paging pass put into the `phase` graph."""
        n, c = len(self.chosen), len(self.candidates)
        if self.timed:
            what = "page-out/in nodes" if phase == "fwd" else "page-in nodes"
            return f"{what} on {n} of {c} candidate saved values; each run's Pager picks what to page after calibration (GraphPager.explain())"
        if phase == "fwd":
            return f"{n} of {c} candidate saved values paged out after their producers"
        return f"{n} page-ins, each launched {self.prefetch} compute nodes before its first use"

    def explain(self) -> str:
        """What this graph's paging chose and left out: the candidates, each value left out
        and why, and per run slot its plan (timed: the Pager's `explain`)."""
        kind = "timed: every candidate has page nodes, each run slot's Pager decides" if self.timed else f"static: {len(self.chosen)} paged"
        small = f", {self.under_min_bytes} under paging_min_bytes={self.min_bytes}" if self.under_min_bytes else ""
        lines = [f"{len(self.candidates)} candidate saved values ({kind}){small}, {len(self.runs)} run slot(s)"]
        lines += [f"{n}: not paged ({why})" for n, why in self.left_out.items()]
        if not self.timed and self._static_plan is not None:
            from ..paging import explain_plan

            lines.append(explain_plan(self._static_plan))
        for k, r in enumerate(self.runs):
            if r.pager is not None:
                lines.append(f"run slot {k}: " + r.pager.explain())
        return "\n".join(lines)

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
            numel = val.numel()
            if not isinstance(numel, int):  # dynamic=True: a plan and its buffers fit one size
                self.left_out[n.name] = f"its size is symbolic ({numel}): dynamic shapes are not paged"
                continue
            if StorageWeakRef(val.untyped_storage()) in inputs:
                continue
            nbytes = numel * val.element_size()
            users = list(bw_ph[n.name].users)
            # No elements: nothing to page, and runs cannot tell such values apart (each has
            # address 0: `_saved`). Rust's plan would not page one either.
            if nbytes < max(self.min_bytes, 1) or not users:
                self.under_min_bytes += bool(users and nbytes)
                continue
            if not restorable(val):
                self.left_out[n.name] = f"its elements share memory (shape {tuple(val.shape)}, strides {val.stride()}): it cannot come back with its strides"
                continue
            cands.append((n, nbytes, min(bw_pos[u] for u in users)))
        self.candidates = [n.name for n, _, _ in sorted(cands, key=lambda c: pos[c[0]])]
        symbolic = sum("its size is symbolic" in why for why in self.left_out.values())
        if not cands and symbolic:  # dynamic shapes select nothing: said, with the fix
            warnings.warn(
                f"sched_lifetime backend: paging=True pages nothing in this graph: its {symbolic} saved activation(s) have "
                "symbolic sizes (dynamic shapes: dynamic=True, or torch.compile's automatic dynamic once an input's size "
                "changed between calls), and a plan and its host buffers are made for one size; pass dynamic=False to "
                "torch.compile (a graph per size, each paged) or pad inputs to a few fixed sizes",
                stacklevel=2,
            )
        elif not cands and self.under_min_bytes:  # a setting that selects nothing: said, with the fix (as Pager does)
            warnings.warn(
                f"sched_lifetime backend: paging=True pages nothing in this graph: every saved activation is under "
                f"paging_min_bytes={self.min_bytes} bytes; pass a smaller paging_min_bytes to page them",
                stacklevel=2,
            )
        if self.timed:  # every candidate gets page nodes; each run's Pager decides
            self.chosen = list(self.candidates)
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
            # `buffers` run slots made here (compile time, outside the tracer's fake mode), one
            # host buffer per paged value each; more only if more forwards run before their
            # backwards.
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            self._sizes, self._device = [sizes[c] for c in self.chosen], dev.pop()
            with unset_fake_temporarily():
                for _ in range(self.buffers):
                    self.runs.append(_Run(pool=self._new_pool()))

    def _new_pool(self) -> HostPool:
        return HostPool(list(self._sizes), device=self._device, two_way=self.two_way, group_out=self.group_out)

    # -- runs ------------------------------------------------------------------------------

    def begin_forward(self) -> _Run:
        """A forward starts: the lowest run slot whose backward has finished (a new one if none).
        Slots of forwards whose backward can no longer run (autograd freed their saved values)
        are given back first."""
        self._give_back_dead()
        run = next((r for r in self.runs if not r.open), None)
        if run is None:
            if len(self.runs) >= MAX_RUNS:
                raise RuntimeError(
                    f"sched_lifetime paging: {MAX_RUNS} forwards of this compiled graph are waiting for their backwards; "
                    "a forward whose backward never runs holds its host buffers while its outputs are alive: run it "
                    "under torch.no_grad(), or drop its outputs (their slots come back at the next forward)"
                )
            if self.timed:
                run = _Run(pager=Pager(self.budget, min_bytes=self.min_bytes, prefetch=self.prefetch, slack=self.slack, two_way=bool(self.two_way), count_host=bool(self.count_host), group_out=self.group_out))
            else:
                run = _Run(pool=self._new_pool())
            self.runs.append(run)
        run.open = True
        run.gen += 1
        run.aside = self._aside > 0
        self.aside_runs += run.aside
        if self.timed and not run.aside:
            run.pager.begin()
        self._fwd = run
        return run

    def watch(self, run: _Run, saved: torch.Tensor) -> torch.Tensor:
        """What the forward saves in place of `saved` (its first saved value): an alias of it
        (`detach()`: the same storage, strides and version counter) that only autograd holds
        (host views are cached by their pool: `saved` itself may outlive the graph). When the
        alias goes and `run`'s backward never started, the slot is noted as dead; it is given
        back at the next forward, not from the collector's callback, which may come in the
        middle of a paging call."""
        alias = saved.detach()
        weakref.finalize(alias, self._dead.append, (run, run.gen))
        return alias

    def _give_back_dead(self) -> None:
        dead, self._dead = self._dead, []
        for run, gen in dead:
            if run.open and run.gen == gen and run is not self._bwd:
                if run.aside:  # checkpoint dropped its values (its recompute saves them again): no copy to wait for, not a dropped step
                    self._close(run)
                    continue
                self.abandon(run)
                self.dropped_runs += 1

    def _set_index(self, nodes: list) -> None:
        """The paged values' save indices (`nodes`, in the order the forward saves them) and what
        each was traced as (static: its host buffer is sized from it)."""
        self._index = {n.name: i for i, n in enumerate(nodes)}
        self._expect = [(tuple(n.meta["val"].shape), n.meta["val"].dtype) for n in nodes]

    def _keep_unlike_trace(self, run: _Run, i: int, t: torch.Tensor) -> None:
        """Static: saved value `i` came unlike its trace; it stays on the device (said once)."""
        run.kept.add(i)
        self._saved(run, i, t)
        self._stats["kept_unlike_trace"] = self._stats.get("kept_unlike_trace", 0) + 1
        if i not in self._warned:
            self._warned.add(i)
            shape, dtype = self._expect[i]
            warnings.warn(
                f"sched_lifetime paging: saved value #{i} came at run time as {tuple(t.shape)} {t.dtype} (strides {t.stride()}), "
                f"traced as {shape} {dtype}; its host buffer was sized from the trace (and a value whose elements share memory "
                "cannot come back with its strides), so it stays on the device",
                stacklevel=2,
            )

    def _saved(self, run: _Run, i: int, t: torch.Tensor) -> None:
        key = (i, t.data_ptr())
        self._owner[key] = run
        run.owed.add(key)

    def owns(self, t: torch.Tensor) -> bool:
        """Whether `t` is a value a page node of this graph handed its forward to save (the host
        tensor of a page-out, or a value kept on the device) and its backward has not read yet:
        one with its address, shape, strides and dtype. A sparse tensor or a subclass (no
        address to read; the page nodes hand over neither) is not."""
        if t.layout != torch.strided or not plain(t):
            return False
        key = self._mine.get(_layout(t))
        return key is not None and key in self._owner

    def _give(self, run: _Run, i: int, out: torch.Tensor) -> torch.Tensor:
        """What the forward saves as value `i` of `run` (`out`, or for the first an alias that
        watches the run), noted as this pager's own (`owns`)."""
        self._mine[_layout(out)] = (i, out.data_ptr())
        return self.watch(run, out) if i == 0 else out

    def beside_outer_hooks(self, fn: Any) -> Any:
        """`fn` (the compiled function) run so that saved-tensor hooks the caller has on (e.g.
        `torch.autograd.graph.save_on_cpu`, an `sl.Pager`, activation offloading) still apply
        to every value the graph saves except this pager's own: the backward finds those by
        their address, which an outer hook's copy would change (it read "a backward read saved
        value #1, which no forward of this graph saved"). Nothing is added with no hooks on.

        Inside `torch.utils.checkpoint` (non-reentrant: its hooks are the outer ones, at the
        forward and at the recompute) the graph steps aside: that run pages nothing and every
        value goes to checkpoint's hooks, which drop the forward's and hand the backward the
        recompute's. Kept from checkpoint, the values the page nodes hand over would stay alive
        until the backward: more memory than with no checkpoint at all (found by a new user's
        trial: HF `gradient_checkpointing_enable()` with each layer compiled)."""
        top, enabled = torch._C._autograd._top_saved_tensors_default_hooks, torch._C._autograd._saved_tensors_hooks_is_enabled

        @functools.wraps(fn)
        def run(*args: Any) -> Any:
            outer = top(True)
            if outer is None or not enabled():
                return fn(*args)
            pack0, unpack0 = outer
            if _is_checkpoints(pack0):
                self._aside += 1
                try:
                    return fn(*args)
                finally:
                    self._aside -= 1

            def pack(t: torch.Tensor) -> tuple:
                return (True, t) if self.owns(t) else (False, pack0(t))

            def unpack(p: tuple) -> torch.Tensor:
                return p[1] if p[0] else unpack0(p[1])

            with torch.autograd.graph.saved_tensors_hooks(*outside_dynamo(pack, unpack)):
                return fn(*args)

        return run

    def _forget_read(self) -> None:
        """`owns`' entries whose values were read (or given up) leave with them."""
        self._mine = {lay: key for lay, key in self._mine.items() if key in self._owner}

    def _reader(self, i: int, x: torch.Tensor) -> _Run:
        """The run that saved `x` as saved value `i` (it is read once, by its backward)."""
        key = (i, x.data_ptr())
        run = self._owner.pop(key, None)
        if run is None:
            raise RuntimeError(f"sched_lifetime paging: a backward read saved value #{i}, which no forward of this graph saved" + TWICE)
        run.owed.discard(key)
        self._bwd = run
        return run

    def abandon(self, run: _Run) -> None:
        """A backward of `run` refused (a paged value changed in place): its copies are waited
        for and its buffers and device storage given back, its slot free again (else it would
        stay taken: at `MAX_RUNS` such slots every forward fails)."""
        if self._bwd is run:
            self._bwd = None
        aside = run.aside
        self._close(run)
        if self.timed:
            if not aside:
                run.pager.end(False)
            return
        for addr in [a for a, h in self._held.items() if h[1] is run]:
            del self._held[addr]
        launched = [self._events.pop(k)[0] for k, e in list(self._events.items()) if e is not None and e[1] is run.pool]
        run.pool.abandon()  # before the unwaited page-ins' events are reused
        for ev in launched:
            run.pool.recycle(ev)

    def _close(self, run: _Run) -> None:
        """`run`'s saved values forgotten (`owns`, the backward's lookup) and its slot closed."""
        for key in [k for k, r in self._owner.items() if r is run]:
            del self._owner[key]
        self._forget_read()
        run.close()

    def check_version(self, run: _Run, i: int, version: SavedVersion) -> None:
        """Autograd's in-place check for paged value `i` of `run` at its page-in; a refused
        backward gives its run slot back (`abandon`) before the error goes up."""
        try:
            version.check(f"saved value #{i} of this compiled graph, paged to host memory")
        except RuntimeError:
            self.abandon(run)
            raise

    def end_backward(self) -> None:
        """A backward finished: its run slot is free again."""
        run, self._bwd = self._bwd, None
        if run is None:
            return
        for key in run.owed:  # saved values this backward did not read (none expected)
            self._owner.pop(key, None)
        self._forget_read()
        aside = run.aside
        run.close()
        if self.timed:
            if not aside:
                run.pager.end(True)
        else:
            run.pool.drain()

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
        # Save indices in the order the forward runs them; the first one starts the run.
        where = {n: i for i, n in enumerate(g.nodes)}
        self._set_index(sorted((by_name[c] for c in self.chosen), key=where.__getitem__))
        for name in self.chosen:
            n = by_name[name]
            with g.inserting_after(n):
                if self.timed:
                    host = g.call_function(_page_save, (self.key, self._index[name], n))
                else:
                    host = g.call_function(_page_out, (self.key, self._index[name], n))
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
            if self.timed:  # the run's Pager launches page-ins; the use waits on it
                with g.inserting_before(first):
                    ready = g.call_function(_page_use, (self.key, self._index[name], ph))
                ph.replace_all_uses_with(ready, delete_user_cb=lambda u: u is not ready)
                continue
            k = calls.index(first) if first in calls else 0
            launch_before = calls[max(0, k - self.prefetch)] if calls else first
            with g.inserting_before(launch_before):
                dev = g.call_function(_page_in_launch, (self.key, self._index[name], ph))
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


def _is_checkpoints(pack: Any) -> bool:
    """Whether saved-tensor pack hook `pack` is torch.utils.checkpoint's (non-reentrant: the
    forward's, which drops what it is given, or the recompute's)."""
    return getattr(pack, "__module__", None) == "torch.utils.checkpoint" and getattr(pack, "__qualname__", "").split(".")[0] in (
        "_checkpoint_hook", "_recomputation_hook"
    )


def _layout(t: torch.Tensor) -> tuple:
    """What tells a saved value from another tensor at its address (`GraphPager.owns`)."""
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


def _pager(key: int) -> GraphPager:
    gp = _PAGERS.get(key)
    if gp is None:
        raise RuntimeError("sched_lifetime paging: this graph's pager is gone (its compiled function was freed)")
    return gp


def _page_out(key: int, i: int, t: torch.Tensor) -> torch.Tensor:
    """Static: saved value `i` (the first starts a run) copied into its run's host buffer. One
    that comes at run time unlike its trace (another dtype: CPU autocast's BatchNorm statistics)
    has no buffer of its size: it stays on the device, with a warning."""
    gp = _pager(key)
    run = gp.begin_forward() if i == 0 else gp._fwd
    want = gp._expect[i]
    if run.aside:  # inside torch.utils.checkpoint: it discards the value, the recompute saves it again
        run.kept.add(i)
        gp._saved(run, i, t)
        out = t
    elif t.shape != want[0] or t.dtype != want[1] or not restorable(t):
        gp._keep_unlike_trace(run, i, t)
        out = t
    else:
        version = SavedVersion(t)
        p = run.pool.page_out(t)
        out = run.pool.view_of(p)
        gp._held[out.data_ptr()] = (p, run, version)
        gp._saved(run, i, out)
        gp._stats["bytes_out"] += p.nbytes
        gp._stats["copies_out"] += 1
    return gp._give(run, i, out)


def _page_in_launch(key: int, i: int, host: torch.Tensor) -> torch.Tensor:
    gp = _pager(key)
    held = gp._held.get(host.data_ptr())
    if held is None:
        run = gp._owner.get((i, host.data_ptr()))
        if run is not None and i in run.kept:  # kept on the device at run time (`_page_out`)
            run.kept.discard(i)
            gp._reader(i, host)
            gp._events[id(host)] = None  # `_page_wait`: nothing to wait for
            return host
        raise RuntimeError("sched_lifetime paging: a backward read a host buffer no forward paged out" + TWICE)
    p, run, version = held
    gp.check_version(run, i, version)
    del gp._held[host.data_ptr()]
    gp._reader(i, host)
    run.pool.release_done()
    out, ev = run.pool.page_in_launch(p)
    gp._events[id(out)] = (ev, run.pool)
    gp._stats["bytes_in"] += p.nbytes
    gp._stats["copies_in"] += 1
    return out


def _page_wait(key: int, t: torch.Tensor) -> torch.Tensor:
    gp = _pager(key)
    got = gp._events.pop(id(t))
    if got is None:  # kept on the device: nothing to wait for
        return t
    ev, pool = got
    pool.page_wait(ev)
    pool.recycle(ev)
    return t


def _page_finish(key: int) -> None:
    """End of a backward: its run's page-outs released (static: the compute stream waits on
    copies that are done by now), timed: its Pager's step ends; the run slot is free again."""
    _pager(key).end_backward()


# `_page_finish` returns nothing and has no users: dead-code elimination must keep it.
fx.node._side_effectful_functions.add(_page_finish)


def _page_save(key: int, i: int, t: torch.Tensor) -> torch.Tensor:
    """Timed: the run's Pager's save hook for saved value `i` (the first starts a run); returns
    what the forward saves: `t`, or the host tensor it was paged into."""
    gp = _pager(key)
    run = gp.begin_forward() if i == 0 else gp._fwd
    if run.aside:  # inside torch.utils.checkpoint: kept as it is, the run's Pager not involved
        gp._saved(run, i, t)
        return gp._give(run, i, t)
    pg = run.pager
    if pg._index != i:
        raise RuntimeError(f"sched_lifetime paging: saved value #{i} came as save #{pg._index} of this run")
    packed = pg._pack(t)
    if packed[0] == "keep":
        out = t
    else:
        out = pg.pool.view_of(pg._handles[i])
        run.versions[i] = packed[3]  # the Pager's (its unpack, called without it, does not check)
    gp._saved(run, i, out)
    return gp._give(run, i, out)


def _page_use(key: int, i: int, x: torch.Tensor) -> torch.Tensor:
    """Timed: the Pager's unpack hook for saved value `i` at its first backward use, in the
    run that saved `x`."""
    gp = _pager(key)
    run = gp._reader(i, x)
    if run.aside:
        return x
    pg = run.pager
    version = run.versions.pop(i, None)
    if version is not None:
        gp.check_version(run, i, version)
    paged = i in pg._handles or i in pg._ready
    return pg._unpack(("paged", i) if paged else ("keep", i, x))

