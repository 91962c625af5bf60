"""The OVERLAP_F_B handler for `torch.distributed.pipelining` (`enable_overlap`)."""

from __future__ import annotations

from typing import Any


from ..calibrate import CALIBRATED
from .arming import _armed
from .graph_stage import GraphStage
from .node_stage import NodeStage


def enable_overlap(schedule: Any) -> bool:
    """Set a `torch.distributed.pipelining` schedule up for NodeStage / GraphStage stages: a
    NodeStage's weight gradients split off to the dW hook (BACKWARD_INPUT / BACKWARD_WEIGHT
    actions; a GraphStage does both at BACKWARD_INPUT), and the OVERLAP_F_B handler
    registered. Returns whether the handler was registered: False for schedules that never
    emit OVERLAP_F_B (single-stage schedules such as Schedule1F1B, or multi-stage ones whose
    order has none): the runtime's default path runs them, and the stages are ordinary
    modules there. Raises when the schedule emits OVERLAP_F_B but a stage is neither kind
    (nothing to multiplex). Guide: docs/pipelining.md.

    Example (needs a process group; two ranks under torchrun on GPUs, see the guide for a
    one-process CPU run):

        >>> from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV  # doctest: +SKIP
        >>> stages = [PipelineStage(NodeStage(m), k, 4, dev) for k, m in my_stage_modules]  # doctest: +SKIP
        >>> sched = ScheduleDualPipeV(stages, n_microbatches=8, loss_fn=loss_fn)  # doctest: +SKIP
        >>> enable_overlap(sched)  # doctest: +SKIP
        True
        >>> sched.step(tokens, target=labels, losses=losses)  # doctest: +SKIP
    """
    from torch.distributed.pipelining.schedules import OVERLAP_F_B

    stages = list(getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)] or [])
    if not stages or any(getattr(st, "submod", None) is None for st in stages):
        raise TypeError(
            f"enable_overlap takes a torch.distributed.pipelining schedule (e.g. ScheduleDualPipeV(stages, ...)), "
            f"got {type(schedule).__name__}"
        )
    for st in stages:
        if isinstance(st.submod, NodeStage):
            # dI at BACKWARD_INPUT, dW at BACKWARD_WEIGHT: the runtime calls the stage's
            # dw_builder right after the input backward and runs it at the weight action. A
            # full backward (FULL_BACKWARD, OVERLAP_F_B) keeps its dW nodes where the scheduler
            # put them, inside the multiplexed pair.
            st.dw_builder = st.submod.dw_builder
            _split_dw_on_input_backward(st)
        elif isinstance(st.submod, GraphStage):
            # No split in a compiled backward: BACKWARD_INPUT runs all of it, the weight
            # action has nothing left to do.
            st.dw_builder = GraphStage.dw_builder
    if not hasattr(schedule, "register_custom_function"):
        return False
    order = getattr(schedule, "pipeline_order", {}) or {}
    emits = any(a is not None and a.computation_type == OVERLAP_F_B for acts in order.values() for a in acts)
    if not emits:
        return False
    plain = [s.stage_index for s in stages if not isinstance(s.submod, (NodeStage, GraphStage))]
    if plain:
        raise ValueError(
            f"stages {plain} are neither NodeStage nor GraphStage modules: wrap each stage's module as "
            "sl.pipelining.NodeStage(module, nodes) (eager) or GraphStage(module, example_inputs) "
            "(compiled) so its forward and backward can be multiplexed"
        )
    kinds = {type(s.submod).__name__ for s in stages}
    if len(kinds) > 1:
        raise ValueError(
            f"the stages of this rank are of two kinds ({sorted(kinds)}): OVERLAP_F_B multiplexes two stages of one "
            "kind (their graphs run as one schedule), so nothing would overlap; wrap every stage of a rank the same way"
        )
    schedule.register_custom_function(OVERLAP_F_B, _overlap_f_b)
    return True


def _split_dw_on_input_backward(stage: Any) -> None:
    """Wrap `stage.backward_one_chunk` so its NodeStage defers dW (to the dw_builder's runner)
    only for an input-only backward (`full_backward=False`, BACKWARD_INPUT); and, with order
    "calibrated", end the stage's calibration step after its last backward of the step (the
    runtime's `last_backward`: a full backward's, or the weight action's when dW is split)."""
    if getattr(stage, "_sl_split_wrapped", False):
        return
    orig, mod = stage.backward_one_chunk, stage.submod
    orig_weight = stage.backward_weight_one_chunk

    def end_step(last: bool) -> None:
        if last and mod.order == CALIBRATED:
            # While calibrating: one device sync, the costs agreed over the stage's rank_group,
            # the orders searched again; after: a background search's orders taken over for the
            # next step once done on every rank; then nothing.
            mod.chunk.end_calibration_step()

    def backward_weight_one_chunk(*args: Any, **kwargs: Any) -> Any:
        out = orig_weight(*args, **kwargs)
        end_step(bool(kwargs.get("last_backward", args[1] if len(args) > 1 else False)))
        return out

    def backward_one_chunk(*args: Any, **kwargs: Any) -> Any:
        full = bool(kwargs.get("full_backward", args[2] if len(args) > 2 else True))
        last = bool(kwargs.get("last_backward", args[3] if len(args) > 3 else False))
        mod.split_dw, mod._full_backward = not full, full
        try:
            out = orig(*args, **kwargs)
        finally:
            mod.split_dw, mod._full_backward = False, True
        end_step(last)
        return out

    stage.backward_one_chunk = backward_one_chunk
    stage.backward_weight_one_chunk = backward_weight_one_chunk
    stage._sl_split_wrapped = True


def _overlap_f_b(action: Any, ctx: Any) -> None:
    """OVERLAP_F_B(F of stage a, B of stage b): the default path's bookkeeping for both, with
    the forward armed inside the backward."""
    from torch.distributed.pipelining.schedules import FORWARD, FULL_BACKWARD, _wait_batch_p2p

    sched = ctx.schedule_ref
    f_act, b_act = action.sub_actions
    if f_act.computation_type != FORWARD or b_act.computation_type != FULL_BACKWARD:
        raise ValueError(f"the OVERLAP_F_B handler runs (FORWARD, FULL_BACKWARD) pairs, got {action}")
    stages = {s.stage_index: s for s in sched._stages}
    fs, bs = stages[f_act.stage_index], stages[b_act.stage_index]
    fi, bi = f_act.microbatch_index, b_act.microbatch_index
    # Forward's input: received, handed over by the previous stage on this rank, or the batch.
    if not fs.is_first and fs.stage_index - 1 not in stages:
        _wait_batch_p2p(sched.fwd_recv_ops.pop((fs.stage_index, fi)))
    # Backward's output gradient.
    if not bs.is_last and bs.stage_index + 1 not in stages:
        _wait_batch_p2p(sched.bwd_recv_ops.pop((bs.stage_index, bi)))
    if hasattr(sched, "_assert_unsharded"):
        sched._assert_unsharded(fs)
        sched._assert_unsharded(bs)
    loss = sched._maybe_get_loss(bs, bi)
    sched.backward_counter[bs.stage_index] += 1
    last = sched.backward_counter[bs.stage_index] == sched._n_microbatches
    fargs = tuple(ctx.arg_mbs[fi]) if fs.is_first else tuple(fs._retrieve_recv_activations(fi))
    kwargs = ctx.kwarg_mbs[fi] if ctx.kwarg_mbs else None
    if kwargs:
        raise ValueError("NodeStage / GraphStage forwards take positional inputs only; the schedule passed kwargs")

    with _armed(fs.submod, fargs):
        bs.backward_one_chunk(bi, loss=loss, full_backward=True, last_backward=last)
    if bs.stage_index - 1 in stages:
        stages[bs.stage_index - 1].set_local_bwd_input(bs.get_local_bwd_output(bi), bi)
    output = _forward_one_chunk_with(fs, fi, fargs, ctx.arg_mbs[fi], kwargs)
    sched._maybe_compute_loss(fs, output, ctx.target_mbs, fi)
    if fs.stage_index + 1 in stages:
        stages[fs.stage_index + 1].set_local_fwd_input(output, fi)


def _forward_one_chunk_with(stage: Any, mb: int, activations: tuple, args: Any, kwargs: Any) -> Any:
    """`stage.forward_one_chunk(mb, args, kwargs)` on the received `activations` this handler
    already retrieved (and armed). torch 2.15 made `_retrieve_recv_activations` hand the receive
    buffers over once (`_RecvInfo.take_buffer`: a second call raises "Receive buffer ... has
    not been set"); torch 2.11 returned the same buffers on every call. So the forward's own
    retrieval is answered with the activations retrieved before the backward, in both."""
    if stage.is_first:
        return stage.forward_one_chunk(mb, args, kwargs)
    stage._retrieve_recv_activations = lambda chunk: activations if chunk == mb else type(stage)._retrieve_recv_activations(stage, chunk)
    try:
        return stage.forward_one_chunk(mb, args, kwargs)
    finally:
        del stage._retrieve_recv_activations
