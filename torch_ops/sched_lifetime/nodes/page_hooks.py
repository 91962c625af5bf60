"""Paging hooks of a chunk: the page-out/page-in node callables and `enable_paging`.

The graph side (which nodes are paged, the page nodes and their edges) is `ChunkGraph`'s;
this is the tensor side. `PageHooks` holds a chunk's pinned host pool and calibration, and
makes what the node callables use: the `saved_tensors_hooks` of a paged node's forward, the
`F.<node>.page_out` and `B.<node>.page_in` callables, and the release of page-outs' device
storage at the points the schedule proves the copy done. `enable_paging` calibrates, asks
Rust's `page_plan` which nodes to page, and sizes the pool.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch

from ..paging import HostPool, group_plan, is_weight, page_plan
from ..paging.paged import SavedVersion, pageable
from .state import MicrobatchState, _Ctx

if TYPE_CHECKING:
    from .chunk import Chunk


class PageHooks:
    """One chunk's paging state: the pool, the calibration and the bytes moved."""

    def __init__(self) -> None:
        #: The pinned host pool (`HostPool`), sized by `enable_paging`; None without paging.
        self.pool: Any = None
        #: Smaller saved activations stay on the device.
        self.min_bytes = 1 << 16
        #: Per paged node, the bytes of each activation it saved at calibration.
        self.saved_bytes: dict[str, list[int]] = {}
        # While calibrating: per node, the saved bytes, and the saved tensors (host layout).
        self.calibrating: Optional[dict[str, list[int]]] = None
        self.calib_saved: dict[str, list[torch.Tensor]] = {}
        #: The plan `enable_paging` returned.
        self.plan: Optional[dict] = None
        #: Bytes moved by the page nodes (out == in once every paged microbatch has run its
        #: backward).
        self.stats = {"bytes_out": 0, "bytes_in": 0}
        # While calibrating: per node, the largest activation left out for being under
        # `min_bytes` (what the warning of a plan that pages nothing quotes).
        self.calib_small: dict[str, int] = {}

    def saved_tensors_hooks(self, name: str, paged: bool, st: Optional[MicrobatchState]) -> Any:
        """`saved_tensors_hooks` for a paged node's forward (activations of at least
        `min_bytes` are held for the page-out; weights, the node's detached inputs and
        tensors whose elements share memory stay), for every node while calibrating (bytes
        counted), else nothing."""
        calib = self.calibrating
        if calib is None and not paged:
            return contextlib.nullcontext()

        def worth_paging(t: torch.Tensor) -> bool:
            return not is_weight(t) and pageable(t) and t.numel() * t.element_size() >= self.min_bytes

        # Nothing packed refers back to the graph: the autograd graph keeps what the hooks
        # pack (in C++, out of the garbage collector's sight), so a kept tensor with its
        # grad_fn, or the microbatch state (which keeps the graph), would make a cycle that
        # leaks a graph whose backward never runs (the calibration forward's), with its
        # activations and its parameters' gradient accumulators (made on the stream of that
        # eager forward: a later CUDA graph capture then fails on them). Kept tensors are
        # packed detached (the unpacked tensor gets its grad_fn back from autograd) and the
        # state weakly.
        ref = weakref.ref(st) if st is not None else None

        # Each packed tuple ends with the tensor's `SavedVersion`: autograd's in-place check,
        # which these hooks turn off, is done at the unpack.
        def _kept(t: torch.Tensor) -> Any:
            d = t.detach()  # shares t's counter; held without t's autograd history
            return ("keep", d, SavedVersion(d, held=True))

        def pack(t: torch.Tensor) -> Any:
            if not worth_paging(t):
                if calib is not None and not is_weight(t):
                    self.calib_small[name] = max(self.calib_small.get(name, 0), t.numel() * t.element_size())
                return _kept(t)
            if calib is not None:
                calib.setdefault(name, []).append(t.numel() * t.element_size())
                self.calib_saved.setdefault(name, []).append(t.detach())  # for the host layout
                return _kept(t)
            held = ref().paged.setdefault(name, [])
            held.append(t)
            return ("paged", ref, name, len(held) - 1, SavedVersion(t))

        def unpack(packed: Any) -> torch.Tensor:
            if packed[0] == "keep":
                packed[2].check(f"a tensor node '{name}' saved")
                return packed[1]
            _, owner_ref, node, i, version = packed
            version.check(f"a tensor node '{node}' saved")
            owner = owner_ref()
            if owner is None:
                raise RuntimeError(f"node '{node}': saved activation #{i} unpacked after its microbatch's state was dropped")
            reloaded = owner.paged_in.get(node)
            if reloaded is None:
                raise RuntimeError(f"node '{node}': saved activation #{i} read before its page-in (microbatch {owner.index})")
            return reloaded[i]

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def release_page_outs(self, st: MicrobatchState, names: Sequence[str]) -> None:
        """A forward release point: the compute stream has waited for the page-outs of `names`
        (a control edge), so their device storage goes now."""
        for x in names:
            mark = st.page_out_end.pop(x, None)
            if mark is not None:
                self.pool.release_queued_before(mark)

    def release_paged_out(self, st: MicrobatchState, name: str) -> None:
        """The compute stream has waited for `name`'s page-in (its sync edge), which ran after
        the page-outs its mark counts (on one page stream every one queued before it; two-way
        those up to the one that wrote its buffer): their device storage goes now, with no
        query (the capture-safe release point; eager also frees on queries)."""
        self.pool.release_queued_before(st.page_marks.pop(name))

    def _stream(self) -> Any:
        """The stream the executor runs the current page node on (None on CPU): the pool
        copies there, so the node's recorded event covers its copy."""
        return self.pool.current_stream() if self.pool.device.type == "cuda" else None

    def page_out_fn(self, ctx: _Ctx, name: str) -> Callable[..., Any]:
        """The callable of `F.<name>.page_out`: the forward microbatch's held activations of
        `name` to the host pool, on the page stream."""

        def page_out() -> tuple:
            st = ctx.fwd
            held = st.paged.get(name, [])
            got = [t.numel() * t.element_size() for t in held]
            if got != self.saved_bytes[name]:
                raise ValueError(
                    f"saved {got} bytes, calibration saw {self.saved_bytes[name]}: the host pool is sized for the "
                    "calibrated shapes (counted EP dispatch changes them each microbatch: page with a fixed capacity_factor)"
                )
            st.paged[name] = self.pool.page_out_group(held, owner=ctx.compute, ordered=True, stream=self._stream())
            st.page_out_end[name] = self.pool.page_outs
            self.stats["bytes_out"] += sum(h.nbytes for h in st.paged[name])
            return ()

        return page_out

    def page_in_fn(self, ctx: _Ctx, name: str) -> Callable[..., Any]:
        """The callable of `B.<name>.page_in`: the backward microbatch's activations of `name`
        back from the host pool; its output is the token the node's backward waits on."""

        def page_in() -> tuple:
            st = ctx.bwd
            handles = st.paged.pop(name, None)
            if handles is None:
                raise RuntimeError(f"node '{name}': page-in of microbatch {st.index}, which was never paged out")
            self.pool.release_done()  # page-outs whose copy is done give their device storage back
            st.page_marks[name] = self.pool.mark(handles[0].slot if handles else None)
            st.paged_in[name] = self.pool.page_in_group(handles, alloc_stream=ctx.compute, stream=self._stream())[0]
            self.stats["bytes_in"] += sum(h.nbytes for h in handles)
            return (st.paged_in[name],)

        return page_in


def pageable_nodes(chunk: Any) -> list[str]:
    """The nodes `enable_paging(nodes=...)` accepts, in forward order: compute nodes that have a
    backward node (something reads what they save)."""
    has_backward = {t["name"].split(".", 1)[1].removesuffix(".dw") for t in chunk._backward_table if t["kind"] == "compute"}
    return [n.name for n in chunk.nodes if n.kind == "compute" and n.name in has_backward]


def enable_paging(
    chunk: Chunk,
    example: dict[str, Any],
    budget: Any,
    nodes: Optional[Sequence[str]],
    in_flight: int,
    min_bytes: int,
    min_distance: int,
    prefetch: Optional[int],
    release: Optional[int],
    two_way: bool = False,
) -> dict:
    """`Chunk.enable_paging`: check the settings, calibrate, choose the paged nodes, put their
    page nodes in the chunk's graph and size the host pool. Returns the plan."""
    if not isinstance(two_way, bool):
        raise ValueError(f"two_way must be a bool, got {two_way!r}")
    if isinstance(in_flight, bool) or not isinstance(in_flight, int) or in_flight < 1:
        raise ValueError(f"in_flight must be an int >= 1, got {in_flight!r}")
    if (budget is None) == (nodes is None):
        raise ValueError("enable_paging needs a budget or a list of nodes (not both)")
    if prefetch is not None and (isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1):
        raise ValueError(f"prefetch must be an int >= 1 (backward nodes ahead) or None, got {prefetch!r}")
    if release is not None and (isinstance(release, bool) or not isinstance(release, int) or release < 1):
        raise ValueError(f"release must be an int >= 1 (forward compute nodes after the paged one) or None, got {release!r}")
    pages = chunk.pages
    chunk.page_prefetch = prefetch
    chunk.page_release = release
    chunk._paged = set()
    chunk._rebuild()
    compute = pageable_nodes(chunk)
    if nodes is not None:
        unknown = sorted(set(nodes) - set(compute))
        if unknown:
            raise ValueError(f"enable_paging: not compute nodes of this chunk with a backward: {unknown}")
    pages.min_bytes = min_bytes
    pages.calibrating = calib = {}
    pages.calib_saved = {}
    pages.calib_small = small = {}
    try:
        chunk.run(fwd=(MicrobatchState(-1), example))
        # Each node's host buffer: its saved tensors laid out by storage (`group_plan`).
        layout = {x: group_plan(ts).nbytes for x, ts in pages.calib_saved.items()}
    finally:
        pages.calibrating = None
        pages.calib_saved = {}
        pages.calib_small = {}
    nbytes = {x: sum(calib[x]) for x in compute if calib.get(x)}
    if nodes is not None:
        chosen = [x for x in compute if x in set(nodes) and x in nbytes]
        plan = {"page": chosen, "bytes_paged": sum(nbytes[x] for x in chosen), "bytes_live": sum(nbytes.values())}
        left = [x for x in compute if x in set(nodes) and x not in nbytes]
        if left:  # a named node pages nothing: say so once, with the fix
            largest = max((small.get(x, 0) for x in left), default=0)
            warnings.warn(
                f"enable_paging: nodes {left} save no activation of at least min_bytes={min_bytes} bytes (the largest is "
                f"{largest} bytes): they are not paged; pass a smaller min_bytes to page them",
                stacklevel=3,
            )
    else:
        # Forward order saves; the backward reads the last node's first.
        order = [x for x in compute if x in nbytes]
        prefix = [{"name": x, "bytes": nbytes[x], "saved_at": i, "used_at": len(order) - 1 - i} for i, x in enumerate(order)]
        plan = page_plan(prefix, budget, min_distance)
        if not prefix:  # a budget that selects nothing: say so once, with the fix
            warnings.warn(
                f"enable_paging(budget={budget!r}) pages nothing: no compute node saves an activation of at least "
                f"min_bytes={min_bytes} bytes (the largest is {max(small.values(), default=0)} bytes); pass a smaller min_bytes",
                stacklevel=3,
            )
        elif not plan["page"] and plan["short"]:
            warnings.warn(f"enable_paging(budget={budget!r}) pages nothing: " + "; ".join(plan["explain"][:4]), stacklevel=3)
    chunk._paged = set(plan["page"])
    pages.saved_bytes = {x: list(calib[x]) for x in chunk._paged}  # what each paged node saves
    chunk._rebuild()
    sizes = [layout[x] for x in sorted(chunk._paged)] * in_flight
    chunk.page_two_way = two_way
    chunk._executors.clear()  # the executors put page-ins on the page-in stream, or not
    pages.pool = HostPool(sizes, chunk.device, two_way=two_way) if sizes else None
    pages.plan = dict(plan, host_bytes=sum(sizes))
    return pages.plan
