"""The chunk: a graph of nodes (`ChunkGraph`) put to work on a device.

`Chunk` adds to its graph what running it needs: the context its node callables read, the
executors made for it, paging (`PageHooks`), the in-step gradient reduce, node timing, and
`run(...)`, a forward, a backward, or both multiplexed through the executor.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from ..executor import Executor
from .callables import node_callables
from .grads import GradReduce, grad_reduce_for
from .graph import ChunkGraph, NodeDef
from .page_hooks import PageHooks, enable_paging
from .run import _executor, _loss_grad, run_pair
from .state import MicrobatchState, _Ctx


class Chunk(ChunkGraph):
    """A model chunk as nodes, with the graph tables and callables the executor runs.

    `nodes`: the `NodeDef`s in forward order; `inputs`: the chunk's input value names (a
    microbatch is a dict of them); `loss_output`: the value whose gradient starts the backward
    (given as the backward source's graph input `B.g.<loss_output>`); `dw_nodes`: separate
    weight-gradient nodes the scheduler may defer (True), or dW computed with dI in one call
    (False: fewer nodes, a cheaper host path). `run`, `combined_step` and `train_step` run it;
    `enable_paging` and `enable_grad_reduce` add paging and the in-step gradient all-reduce.
    Guide: docs/nodes.md.

    Example:

        >>> import torch, sched_lifetime as sl
        >>> l1, l2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)
        >>> chunk = sl.Chunk([
        ...     sl.NodeDef("l1", "compute", ["x"], ["h"], lambda x: torch.relu(l1(x)), list(l1.parameters()), grad_outputs=["h"]),
        ...     sl.NodeDef("l2", "compute", ["h", "y"], ["loss"], lambda h, y: (l2(h) - y).square().mean(),
        ...                list(l2.parameters()), grad_inputs=["h"], grad_outputs=["loss"]),
        ... ], inputs=["x", "y"], loss_output="loss", device=torch.device("cpu"))
        >>> [n["name"] for n in chunk.graph(forward=False, backward=True)["nodes"]]
        ['B.l2', 'B.l2.dw', 'B.l1.dw']
        >>> losses = sl.train_step(chunk, [{"x": torch.randn(4, 8), "y": torch.randn(4, 1)} for _ in range(2)])
        >>> len(losses), l1.weight.grad.shape
        (2, torch.Size([8, 8]))
    """

    def __init__(
        self, nodes: Sequence[NodeDef], inputs: Sequence[str], loss_output: str, device: torch.device, dw_nodes: bool = True
    ) -> None:
        super().__init__(nodes, inputs, loss_output, dw_nodes)
        self.device = device
        self.ctx = _Ctx()
        #: When a list, dW nodes queue their work here instead of running it (the caller runs
        #: it later: a pipeline schedule's BACKWARD_WEIGHT).
        self.deferred_dw: Optional[list[Callable[[], None]]] = None
        #: Paging's tensor side: the host pool, the calibration, the bytes moved.
        self.pages = PageHooks()
        #: Page-ins on their own stream beside the page-outs (`enable_paging(two_way=)`).
        self.page_two_way = False
        self._executors: dict[tuple, Executor] = {}
        # Schedules a calibration step chose for executors it dropped (built at the next use).
        self._calibrated: dict[tuple, dict] = {}
        # Executor keys of the last calibration step, by their rank-independent label.
        self._cal_keys: dict[str, tuple] = {}
        #: Order "calibrated" on a pipeline's F of another chunk with B of this one: a
        #: Calibration per forward chunk (by id; its node names may be this chunk's too).
        self._pair_calibrations: dict[int, Any] = {}
        #: Values (chunk names) that some node's forward saved for its backward (autograd holds
        #: their storage): their cross-stream retire drops the reference instead of emptying the
        #: storage (rule 3 would make that backward read freed memory). Found on each node's
        #: first forward (`callables.forward_fn`); the executors read this same set.
        self.autograd_saved: set[str] = set()
        self._probed: set[str] = set()
        self._checked: set[str] = set()  # nodes whose autograd graph was checked (`callables.check_node_graph`)
        #: The second microbatch's Chunk of a `run_two` pair (same nodes, own context).
        self._twin_chunk: Optional[Chunk] = None
        #: Data-parallel gradient averaging in the step (`enable_grad_reduce`), or None.
        self.grad_reduce: Optional[GradReduce] = None
        #: Time every node (`Executor(timing=True)`); `node_times_us` collects the times.
        self.timing = False
        self._times: dict[str, list[float]] = {}
        #: Cross-rank agreement of `train_step` / `combined_step` (`sched_lifetime.ep.RANK_CHECKS`):
        #: "new_plan", "every_step" or "off", over `rank_group` (None: the default group).
        self.rank_check = "new_plan"
        self.rank_group: Any = None
        self._rank_agreed: Optional[str] = None

    def _rebuild(self) -> None:
        super()._rebuild()
        self._executors.clear()
        self._calibrated.clear()

    # -- paging ------------------------------------------------------------------------

    @property
    def pool(self) -> Any:
        """The pinned host pool of the paged nodes (`enable_paging`), or None."""
        return self.pages.pool

    @property
    def page_stats(self) -> dict[str, int]:
        """Bytes moved by the page nodes (out == in once every paged microbatch has run its
        backward)."""
        return self.pages.stats

    @property
    def page_plan(self) -> Optional[dict]:
        """The plan `enable_paging` returned, or None."""
        return self.pages.plan

    @property
    def page_min_bytes(self) -> int:
        """Saved activations smaller than this stay on the device."""
        return self.pages.min_bytes

    def enable_paging(
        self,
        example: dict[str, Any],
        budget: Any = None,
        nodes: Optional[Sequence[str]] = None,
        in_flight: int = 2,
        min_bytes: int = 1 << 16,
        min_distance: int = 1,
        prefetch: Optional[int] = 2,
        release: Optional[int] = 4,
        two_way: bool = False,
    ) -> dict:
        """Page the saved activations of some compute nodes to pinned host memory through page
        nodes of the graph (`F.<node>.page_out` after the node, `B.<node>.page_in` before its
        backward), which the scheduler interleaves with the other source's work. Calibration:
        one forward of `example` (the chunk's inputs; with EP every rank calls this together:
        it runs the collectives) records each node's saved activations; Rust's `page_plan`
        picks the nodes under `budget` (furthest backward use first), or `nodes` names them.
        The host pool is allocated here, `in_flight` microbatches deep (a combined F(i+1)+B(i)
        step holds two), never during a step. `prefetch`: a page-in may start once the backward
        compute node that many dI nodes before its consumer has been issued (None: at once).
        `release`: the forward compute node that many compute nodes after a paged one waits for
        its page-out and releases its device storage (a control edge from the page-out's wait:
        the bytes leave the device under the forward, by a point the copy has had that many
        nodes of compute to finish in; None: released only when a host-side query finds the
        copy done, or at the page-in). `two_way` (CUDA): page-in nodes run on the page-in
        stream and page-outs on the page stream, so the link's two directions run at once
        (False: both on the page stream, the baseline). Returns the plan."""
        return enable_paging(self, example, budget, nodes, in_flight, min_bytes, min_distance, prefetch, release, two_way)

    # -- gradients ---------------------------------------------------------------------

    def enable_grad_reduce(self, params: Sequence[torch.nn.Parameter], group: Any = None) -> GradReduce:
        """Average the gradients of `params` (the data-parallel ones: not the experts) over
        `group` inside `train_step` with our orders: in the step's last backward, each node's
        all-reduce starts right after its weight gradients are final, so it runs under the
        rest of that backward (the scheduler's placement of the dW nodes decides when), and the
        step ends by waiting for them. Baseline orders reduce every gradient at once after the
        step. Each parameter must belong to one node (its gradient is final after that node's
        last dW). Not with deferred dW (a pipeline's BACKWARD_WEIGHT)."""
        self.grad_reduce = grad_reduce_for(self.nodes, params, group)
        return self.grad_reduce

    # -- running -----------------------------------------------------------------------

    def callables(self, forward: bool, backward: bool, release_points: bool = False) -> dict[str, Callable[..., Any]]:
        """The node callables of a forward and/or backward source; `release_points`: the
        forward runs beside a backward source, with the page-outs' release points."""
        return node_callables(self, forward, backward, release_points)

    def executor(self, forward: bool, backward: bool, order: str = "ours", lifetime: str = "scheduled") -> Executor:
        """The executor of one multiplexing (made once, reused every step)."""
        return _executor(self if forward else None, self if backward else None, order, lifetime)

    def end_calibration_step(self) -> None:
        """End a step of runs of order `"calibrated"` made with `run` (`train_step` and
        `combined_step` end theirs themselves): while calibrating, agree on the node times and
        re-plan (see `train_step`); after, a background search's orders take over from the next
        step once one whole step ran beside it and it is done on every rank. Every rank calls it
        together, at every step's end."""
        from .run import end_calibration

        end_calibration(self, "calibrated", no_step_start=True)

    def node_times_us(self) -> dict[str, float]:
        """Median time of each node over the timed runs so far (µs, by graph node name): the
        `durations` table `sl.simulate` reads for a program lowered from this chunk's graph."""
        import statistics

        return {n: statistics.median(v) for n, v in sorted(self._times.items())}

    def run(
        self,
        fwd: Optional[tuple[MicrobatchState, dict[str, Any]]] = None,
        bwd: Optional[MicrobatchState] = None,
        order: str = "ours",
        lifetime: str = "scheduled",
        grad_scale: float = 1.0,
    ) -> dict[str, Any]:
        """Forward of one microbatch (`fwd`: its state and chunk inputs), backward of another
        (`bwd`), or both multiplexed in one schedule."""
        grad = None
        if bwd is not None and bwd.loss is not None:
            grad = _loss_grad(self, bwd, grad_scale)
        return run_pair(self if fwd else None, fwd, self if bwd else None, bwd, grad, order, lifetime)
