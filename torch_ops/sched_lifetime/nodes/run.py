"""Running a chunk: the executor hand-off and the steps built from it.

`run_pair` runs F of one chunk with B of another (or either alone) through an `Executor` made
once per pairing (`_executor`), feeding the graph inputs and the chunks' contexts;
`run_two` runs two microbatches of one phase (the second on the chunk's twin); `combined_step`
is one F(i+1)+B(i); `train_step` a whole step of n microbatches with gradient accumulation
(warm-up F, combined F(i+1)+B(i), cool-down B), then the in-step reduce's finish.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch

from ..calibrate import CALIBRATED, Calibration, apply_plans, timed_end
from ..ep import agree_across_ranks, digest, schedule_digest
from ..executor import Executor
from .graph import _order_schedule, _pair_graph, _two_graph, check_order, is_ours
from .state import MicrobatchState

if TYPE_CHECKING:
    from .chunk import Chunk


def _executor(fchunk: Optional[Chunk], bchunk: Optional[Chunk], order: str, lifetime: str) -> Executor:
    """The executor of F of `fchunk` with B of `bchunk` (made once per pair, cached on the
    backward chunk, or the forward one when there is no backward)."""
    home = bchunk if bchunk is not None else fchunk
    assert home is not None
    cal = _calibration_of(home, fchunk, bchunk)
    # Calibration times its executors itself (`Executor.timing`, read at the step's end).
    timing = order != CALIBRATED and bool((fchunk and fchunk.timing) or (bchunk and bchunk.timing))
    key = (id(fchunk), id(bchunk), order, lifetime, timing)
    ex = home._executors.get(key)
    if ex is None:
        g = _pair_graph(fchunk, bchunk)
        s = home._calibrated.pop(key, None) or _order_schedule(g, order, cal)
        calls = {}
        if fchunk is not None:
            calls.update(fchunk.callables(True, False, release_points=bchunk is not None))
        if bchunk is not None:
            calls.update(bchunk.callables(False, True))
        # Page-in nodes are the backward chunk's: its pool's setting puts them on a stream.
        two_way = bchunk.page_two_way if bchunk is not None else False
        ex = home._executors[key] = Executor(g, s, calls, device=home.device, lifetime=lifetime, timing=timing, two_way_paging=two_way)
        if fchunk is not None:
            ex.autograd_saved = fchunk.autograd_saved
        ex.graph = g
    if order == CALIBRATED:
        ex.timing = cal.active
    return ex


def _calibration_of(home: Chunk, fchunk: Optional[Chunk], bchunk: Optional[Chunk]) -> Calibration:
    """The Calibration behind an executor homed on `home`: the chunk's own (its forward and/or
    backward, `run_two`), or for a pipeline's F of another chunk with B of `home` one per forward
    chunk, made with the chunk's settings (the two chunks' node names may coincide: a stage's
    `describe` names its layers L0, L1, ... whatever the stage)."""
    if fchunk is None or bchunk is None or fchunk is bchunk:
        return home.calibration
    cal = home._pair_calibrations.get(id(fchunk))
    if cal is None:
        base = home.calibration
        cal = home._pair_calibrations[id(fchunk)] = Calibration(base.steps, base.smoothing, base.group, base.background, base.wait_after)
    return cal


def _label(chunk: Chunk, key: tuple) -> str:
    """An executor key of `chunk` (`_executor`, `run_two`) as text that every rank spells the
    same: the sources it multiplexes and its lifetime policy (`F'k`: the forward of the k-th other
    chunk paired with this one's backward, in the order they first paired)."""
    if key[0] == "two":
        return f"{key[1]}+{key[1]}2/{key[3]}"
    if key[0] in chunk._pair_calibrations:  # (an absent chunk's id is id(None): not in it)
        k = list(chunk._pair_calibrations).index(key[0])
        return f"F'{k}+B/{key[3]}"
    f, b = key[0] == id(chunk), key[1] == id(chunk)
    return f"{'F' if f else ''}{'+' if f and b else ''}{'B' if b else ''}/{key[3]}"


def _cal_groups(chunk: Chunk) -> list[tuple[Calibration, dict]]:
    """`chunk`'s calibrated executors by the Calibration that times them: its own, then one per
    other forward chunk paired with its backward (each {key: executor})."""
    own: dict = {}
    pairs: dict[int, dict] = {}
    for k, ex in chunk._executors.items():
        if k[2] != CALIBRATED:
            continue
        if k[0] in chunk._pair_calibrations:
            pairs.setdefault(k[0], {})[k] = ex
        else:
            own[k] = ex
    return [(chunk.calibration, own)] + [(chunk._pair_calibrations[f], exs) for f, exs in pairs.items()]


def end_calibration(chunk: Chunk, order: str, no_step_start: bool = False) -> None:
    """At a step's end with order `"calibrated"` while calibrating: the step's node times (one
    device sync), agreed across the ranks and smoothed (`Calibration.end_step`), then every
    calibrated executor of `chunk` scheduled again (`Calibration.plan`: now, or in the
    background, applied by `begin_calibrated_step` two steps on). A pipeline's F of another
    chunk with B of this one has a Calibration of its own (`_calibration_of`), ended here too.
    `no_step_start` (steps of runs made with `Chunk.run`, whose starts nobody marks): a
    background search's orders are taken here instead, for the next step, once a whole step
    ran beside it and every rank's search is done. Nothing once calibration is done."""
    if order != CALIBRATED:
        return
    for cal, mine in _cal_groups(chunk):
        if not cal.active:
            if no_step_start:
                _apply_plans(chunk, cal, cal.take_plans(wait=False, at_end=True))
            continue
        # A label the same on every rank (the keys hold object ids): which sources, which lifetime.
        labels = {_label(chunk, k): k for k in mine}
        chunk._cal_keys.update(labels)
        cal.finish_step(
            lambda: timed_end(cal, mine.values(), chunk.device),
            {label: mine[k].graph for label, k in sorted(labels.items())},
            lambda plans: _apply_plans(chunk, cal, plans),
            group=chunk.rank_group,
        )


def begin_calibrated_step(chunk: Chunk, order: str) -> None:
    """At a step's start with order `"calibrated"`: a background search's orders take over
    once one whole step has run beside it (the same step on every rank)."""
    if order == CALIBRATED:
        for cal, _ in _cal_groups(chunk):
            _apply_plans(chunk, cal, cal.take_plans(wait=False))


def _apply_plans(chunk: Chunk, cal: Calibration, plans: Optional[dict]) -> None:
    if plans is None:
        return

    def rebuild(label: str, s: dict) -> None:
        key = chunk._cal_keys[label]
        chunk._calibrated[key] = s  # the next use builds the executor with it
        chunk._executors.pop(key, None)

    current = {label: (chunk._executors[k]._order if k in chunk._executors else None) for label, k in chunk._cal_keys.items() if label in plans}
    apply_plans(cal, plans, current, rebuild)


def _feed_forward(c: Chunk, source: str, fwd: tuple[MicrobatchState, dict[str, Any]], inputs: dict[str, Any]) -> None:
    """Source `source` runs the forward of `fwd` (its state, its chunk inputs) on `c`: the
    graph inputs `<source>.<name>` and `c`'s context."""
    if not isinstance(fwd[1], dict):
        raise TypeError(f"a microbatch is a dict of the chunk's inputs by name ({c.inputs}), got {type(fwd[1]).__name__}")
    missing = sorted(set(c.inputs) - set(fwd[1]))
    if missing:
        raise ValueError(f"chunk inputs missing: {missing}")
    inputs.update({f"{source}.{k}": v for k, v in fwd[1].items()})
    c.ctx.compute = _compute_stream(c)
    c.ctx.fwd = fwd[0]
    fwd[0].tied_grads.clear()  # a state reused after a step that raised keeps no partial


def _feed_backward(c: Chunk, source: str, bwd: MicrobatchState, out_grad: torch.Tensor, inputs: dict[str, Any]) -> None:
    """Source `source` runs the backward of `bwd` on `c`, starting from `out_grad`."""
    inputs[f"{source}.g.{c.loss_output}"] = out_grad
    c.ctx.compute = _compute_stream(c)
    c.ctx.bwd = bwd


def _compute_stream(c: Chunk) -> Optional[torch.Stream]:
    return torch.cuda.current_stream(c.device) if c.device.type == "cuda" else None


def _loss_grad(c: Chunk, st: MicrobatchState, scale: float) -> torch.Tensor:
    """The gradient a microbatch's backward starts from: its loss scale (1/n when accumulating)."""
    if st.loss.numel() != 1:
        raise ValueError(
            f"the loss output '{c.loss_output}' of microbatch {st.index} is a {tuple(st.loss.shape)} tensor: the loss must be "
            "a scalar tensor (reduce it, e.g. .mean())"
        )
    return torch.full((), scale, device=c.device, dtype=st.loss.dtype)


def run_pair(
    fchunk: Optional[Chunk],
    fwd: Optional[tuple[MicrobatchState, dict[str, Any]]],
    bchunk: Optional[Chunk],
    bwd: Optional[MicrobatchState],
    out_grad: Optional[torch.Tensor],
    order: str = "ours",
    lifetime: str = "scheduled",
) -> dict[str, Any]:
    """Forward of one microbatch on `fchunk` with the backward of another on `bchunk` (the
    same chunk, or another: a pipeline's F of stage a with B of stage b), multiplexed in one
    schedule. `out_grad`: the gradient of the backward chunk's output (`loss_output`).
    Returns the executor's values: the forward's outputs (`F.<name>`) and the backward's
    input gradients (`B.g.<input>@<consumer>`, one partial per consumer)."""
    if fwd is None and bwd is None:
        raise ValueError("nothing to run: give a forward, a backward, or both")
    if (fwd is None) != (fchunk is None) or (bwd is None) != (bchunk is None):
        raise ValueError("a forward needs its chunk and a backward its chunk")
    if bwd is not None:
        if not bwd.saved:
            raise ValueError(f"microbatch {bwd.index} has no saved forward to run a backward on")
        if out_grad is None:
            raise ValueError(f"the backward of microbatch {bwd.index} needs the gradient of its output")
    ex = _executor(fchunk, bchunk, order, lifetime)
    inputs: dict[str, Any] = {}
    touched = [c for c in (fchunk, bchunk) if c is not None]
    if fwd is not None:
        _feed_forward(fchunk, "F", fwd, inputs)
    if bwd is not None:
        _feed_backward(bchunk, "B", bwd, out_grad, inputs)
    try:
        out = ex.run(inputs)
        if ex.timing and order != CALIBRATED:
            for n, us in ex.node_times_us().items():
                touched[0]._times.setdefault(n, []).append(us)
        return out
    finally:
        for c in touched:
            c.ctx.fwd = c.ctx.bwd = None


def _twin(chunk: Chunk) -> Chunk:
    """A second Chunk over the same nodes (the same modules and parameters) with its own
    context: the other microbatch of a `run_two` pair (made once)."""
    if chunk._twin_chunk is None:
        chunk._twin_chunk = type(chunk)(chunk.nodes, chunk.inputs, chunk.loss_output, chunk.device, chunk.dw_nodes)
        # Same nodes: what one saves for autograd, the other does (found once, shared).
        chunk._twin_chunk.autograd_saved, chunk._twin_chunk._probed = chunk.autograd_saved, chunk._probed
        chunk._twin_chunk._checked = chunk._checked
    return chunk._twin_chunk


def run_two(
    chunk: Chunk, phase: str, items: Sequence[Any], order: str = "ours", lifetime: str = "scheduled", grad_scale: float = 1.0
) -> dict[str, Any]:
    """Two microbatches of the same phase multiplexed in one schedule: `phase="F"`, `items`
    two (state, chunk inputs) pairs; `phase="B"`, two states, in microbatch order (the
    first's weight gradients accumulate first on every node). What `train_step(...,
    paired_ends=True)` runs for its warm-up and cool-down. Our orders only; not with paging or
    deferred dW."""
    if phase not in ("F", "B"):
        raise ValueError(f"phase must be 'F' or 'B', got {phase!r}")
    if len(items) != 2:
        raise ValueError(f"run_two takes two microbatches, got {len(items)}")
    if chunk._paged or chunk.deferred_dw is not None:
        raise ValueError("run_two: not with paging or deferred dW (a chunk of the pipelining hooks)")
    twin = _twin(chunk)
    twin.grad_reduce = chunk.grad_reduce  # the second microbatch's dW launches the chunk's reduce
    key = ("two", phase, order, lifetime)
    ex = chunk._executors.get(key)
    if ex is None:
        g = _two_graph(chunk, phase)
        calls = chunk.callables(phase == "F", phase == "B")
        calls.update({phase + "2" + k[1:]: f for k, f in twin.callables(phase == "F", phase == "B").items()})
        s = chunk._calibrated.pop(key, None) or _order_schedule(g, order, chunk.calibration)
        ex = chunk._executors[key] = Executor(g, s, calls, device=chunk.device, lifetime=lifetime)
        if phase == "F":
            ex.autograd_saved = chunk.autograd_saved  # the twin shares it (`_twin`)
        ex.graph = g
    if order == CALIBRATED:
        ex.timing = chunk.calibration.active
    inputs: dict[str, Any] = {}
    for c, p, item in ((chunk, phase, items[0]), (twin, phase + "2", items[1])):
        if phase == "F":
            _feed_forward(c, p, item, inputs)
        else:
            if not item.saved or item.loss is None:
                raise ValueError(f"microbatch {item.index} has no saved forward to run a backward on")
            _feed_backward(c, p, item, _loss_grad(c, item, grad_scale), inputs)
    try:
        return ex.run(inputs)
    finally:
        for c in (chunk, twin):
            c.ctx.fwd = c.ctx.bwd = None


def _rank_facts(chunk: Chunk, order: str, lifetime: str) -> dict:
    """What decides the collectives of a chunk's step besides the microbatch count: the F+B
    schedule (graph, order, budgets, costs) and the paging plan (paged nodes, calibrated bytes)."""
    ex = _executor(chunk, chunk, order, lifetime)
    paging = chunk.pages.plan
    return {
        "schedule": schedule_digest(ex),
        "paging plan": digest(sorted(chunk._paged), chunk.pages.saved_bytes, paging and paging.get("host_bytes")) if chunk._paged else None,
    }


def combined_step(
    chunk: Chunk,
    forward: tuple[MicrobatchState, dict[str, Any]],
    backward: MicrobatchState,
    order: str = CALIBRATED,
    lifetime: str = "scheduled",
    grad_scale: float = 1.0,
) -> dict[str, Any]:
    """F of one microbatch with B of another, multiplexed in one schedule: the steady state
    of combined 1F1B (Megatron-LM's `--overlap-moe-expert-parallel-comm`), in the
    scheduler's order (`order="calibrated"`, the default: each call is a step of the chunk's
    cost calibration, see `train_step`; `"ours"`, timing-free; or `"ours:<rules,budgets>"`) or
    a baseline's (`"b_then_f"`, `"sequential"`). `forward`: (its `MicrobatchState`, its chunk inputs);
    `backward`: the state of a microbatch whose forward has run; `grad_scale`: the gradient
    its loss starts from (1/n when accumulating n microbatches). `lifetime`: "scheduled" (the
    lifetime manager) or "record_stream". Returns the executor's values (the forward's
    outputs as `F.<value>`). Weight gradients are accumulated into `.grad`. With
    torch.distributed, the ranks first agree on its schedule and paging plan (as `train_step`).

    Example:

        >>> import sched_lifetime as sl
        >>> from sched_lifetime.models import CONFIGS, MoEModel
        >>> model = MoEModel(CONFIGS["tiny"])
        >>> chunk = model.chunk()
        >>> mb0, mb1 = sl.MicrobatchState(0), sl.MicrobatchState(1)
        >>> _ = chunk.run((mb0, model.batch(0, 0)), None)                     # warm-up F(0)
        >>> out = sl.combined_step(chunk, (mb1, model.batch(0, 1)), mb0)      # F(1) with B(0)
        >>> _ = chunk.run(None, mb1)                                           # cool-down B(1)
        >>> "F.loss" in out, mb1.loss is not None
        (True, True)
    """
    begin_calibrated_step(chunk, order)
    agree_across_ranks(chunk, "combined_step", {"order": order, "lifetime": lifetime, **_rank_facts(chunk, order, lifetime)})
    out = chunk.run(forward, backward, order, lifetime, grad_scale)
    end_calibration(chunk, order)
    return out


def train_step(
    chunk: Chunk,
    microbatches: Sequence[dict[str, Any]],
    order: str = CALIBRATED,
    lifetime: str = "scheduled",
    on_run: Optional[Callable[[], None]] = None,
    paired_ends: bool = False,
) -> list[torch.Tensor]:
    """One step over n microbatches with gradient accumulation (loss scaled by 1/n).

    `order="sequential"`: F(i) then B(i), one microbatch at a time, each comm waited at once.
    Otherwise the steady state: warm-up F(0), then F(i+1) multiplexed with B(i), cool-down
    B(n-1), each multiplexing in `order` ("calibrated", "ours", "ours:<rules,budgets>" or
    "b_then_f"). Returns the losses.

    `order="calibrated"` (the default): the first `chunk.calibration.steps` steps (1 unless
    set) time every node (CUDA events, one sync at the step's end; host clock on CPU), and at
    each such step's end the ranks agree on the costs (one collective: each node's maximum),
    which are smoothed over the calibration steps, and every graph of the step is scheduled
    again under rule `search` with them, in a thread while the next step runs the old order,
    taking over at the first step after it that finds every rank's search done, on every rank
    at once (`chunk.calibration = Calibration(background=False)`: at that step's end, applying
    from the next step); an
    executor is rebuilt only when its order changed, and the orders are checked rank-identical. Before the first calibration step's end, and
    for `order="ours"` always, the order is the timing-free one. Later steps time nothing.
    See `sched_lifetime.calibrate`.

    `paired_ends` (n >= 2, our orders): the warm-up and the cool-down are multiplexed too, so
    their transfers also run under another microbatch's compute: F(0) with F(1), then F(i+2)
    with B(i), then B(n-2) with B(n-1) (`run_two`). One more microbatch's activations are live
    in the steady state (three forwards ahead of their backward instead of two). Gradients
    accumulate in microbatch order as without it (bit-exact).

    With torch.distributed, the ranks first agree on what decides the step's collectives (the
    microbatch count, the schedule, the paging plan) with one small collective over
    `chunk.rank_group` (None: the default group), and raise on every rank with the same message
    if they differ, instead of hanging in a collective: when this rank's facts are new
    (`chunk.rank_check="new_plan"`, the default), on every step (`"every_step"`: when the
    microbatch count can change on one rank alone), or never (`"off"`); see
    `sched_lifetime.ep.agree_across_ranks`.

    `lifetime`: "scheduled" (the lifetime manager) or "record_stream" (the baseline);
    `on_run`: called after each multiplexed run (the main job samples memory there). A step
    cut short by an exception gives back any paging buffers, so the next step works. Guide:
    docs/nodes.md.

    Example (bit-exact against plain `loss.backward()` per microbatch):

        >>> import torch, sched_lifetime as sl
        >>> from sched_lifetime.models import CONFIGS, MoEModel
        >>> model, ref = MoEModel(CONFIGS["tiny"]), MoEModel(CONFIGS["tiny"])
        >>> mbs = [model.batch(0, i) for i in range(3)]
        >>> losses = sl.train_step(model.chunk(), mbs, order="ours")
        >>> for mb in mbs:
        ...     (ref(**mb) / 3).backward()
        >>> all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))
        True
    """
    n = len(microbatches)
    if n == 0:
        raise ValueError("train_step needs at least one microbatch")
    check_order(order)
    if paired_ends and not is_ours(order):
        raise ValueError(f"paired_ends needs one of our orders ('calibrated', 'ours' or 'ours:...'), got {order!r}")
    if paired_ends and n == 1:  # a setting that selects nothing: say so
        warnings.warn("train_step: paired_ends pairs two microbatches; with 1 the step runs F(0) then B(0) unpaired", stacklevel=2)
    begin_calibrated_step(chunk, order)
    facts = {"microbatch count": n, "order": order, "lifetime": lifetime, "paired_ends": bool(paired_ends and n >= 2)}
    agree_across_ranks(chunk, "train_step", {**facts, **_rank_facts(chunk, order, lifetime)})
    scale = 1.0 / n
    states = [MicrobatchState(i) for i in range(n)]
    reduce = chunk.grad_reduce
    if reduce is not None and chunk.deferred_dw is not None:
        raise ValueError("train_step: grad reduce in the step is not supported with deferred dW")
    in_step = reduce is not None and is_ours(order)
    states[-1].last = in_step

    def after() -> None:
        if on_run is not None:
            on_run()

    try:
        if order == "sequential":
            for i in range(n):
                chunk.run((states[i], microbatches[i]), None, order, lifetime)
                after()
                chunk.run(None, states[i], order, lifetime, scale)
                after()
        elif paired_ends and n >= 2:
            run_two(chunk, "F", [(states[0], microbatches[0]), (states[1], microbatches[1])], order, lifetime)
            after()
            for i in range(n - 2):
                chunk.run((states[i + 2], microbatches[i + 2]), states[i], order, lifetime, scale)
                after()
            run_two(chunk, "B", [states[n - 2], states[n - 1]], order, lifetime, scale)
            after()
        else:
            chunk.run((states[0], microbatches[0]), None, order, lifetime)
            after()
            for i in range(n - 1):
                chunk.run((states[i + 1], microbatches[i + 1]), states[i], order, lifetime, scale)
                after()
            chunk.run(None, states[n - 1], order, lifetime, scale)
            after()
    except BaseException:
        if reduce is not None:
            reduce.abandon()
        # A step cut short gives its host buffers back (page-outs never paged in), so the next
        # step finds the pool whole; the original error is what the caller sees.
        if chunk.pages.pool is not None:
            chunk.pages.pool.abandon()  # the compute stream waits for the copies in flight first
        raise
    if chunk.pages.pool is not None:  # page-outs still holding device storage: the step ends here
        chunk.pages.pool.drain()
    if reduce is not None:
        if not in_step:  # a baseline's step: every gradient at once, after the step
            reduce.launch([p for node in chunk.nodes for p in node.params])
        reduce.finish()
    for s in states:
        if s.saved:
            raise RuntimeError(f"microbatch {s.index}: backward left state behind for {sorted(s.saved)[:5]}")
    end_calibration(chunk, order)
    return [s.loss for s in states]
