"""Arming a forward for the next backward: how an overlapped F/B pair meets inside one backward."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import nn


class _Armed:
    """The forward waiting to run inside the next backward (one pipeline thread arms it; the
    autograd engine may run the backward on its device thread, so this is not thread-local)."""

    stage: Any = None
    args: tuple = ()


_ARMED = _Armed()


def _take_ready(stage: Any, args: Sequence[Any]) -> Any:
    """The result an overlapped backward computed for `stage`'s next forward (then cleared),
    or None; it must be for exactly these inputs (the armed forward is called next)."""
    ready, stage._ready = stage._ready, None
    if ready is None:
        return None
    rargs, result = ready
    if len(rargs) != len(args) or any(a is not b for a, b in zip(rargs, args)):
        raise RuntimeError("an overlapped forward was computed for other inputs than this call's (the armed forward must be called next)")
    return result


def _take_armed(kind: type) -> tuple:
    """The armed forward if it is a `kind` stage (a node stage pairs with a node stage, a
    graph stage with a graph stage); else (None, ()) and it stays armed."""
    if not isinstance(_ARMED.stage, kind):
        return None, ()
    stage, args = _ARMED.stage, _ARMED.args
    _ARMED.stage, _ARMED.args = None, ()
    return stage, args


class _DualPipeHook:
    """deepseek-ai DualPipe/DualPipeV call `type(module0).overlapped_forward_backward` when both
    stage modules are of one type that has it: NodeStage and GraphStage do."""

    @classmethod
    def overlapped_forward_backward(
        cls,
        module0: nn.Module,
        inputs0: Sequence[torch.Tensor],
        criterion0: Optional[Callable[..., torch.Tensor]],
        labels0: Optional[Sequence[torch.Tensor]],
        module1: nn.Module,
        loss1: Optional[torch.Tensor],
        outputs1: Optional[Sequence[torch.Tensor]],
        output_grads1: Optional[Sequence[torch.Tensor]],
    ) -> tuple[list[torch.Tensor], Optional[torch.Tensor]]:
        """deepseek-ai DualPipe/DualPipeV's hook: forward of `module0` on `inputs0` (and its
        loss when `criterion0` is given) multiplexed with the backward of `module1` (from
        `loss1`, or `outputs1` with `output_grads1`)."""

        def backward() -> None:
            if loss1 is not None:
                loss1.backward()
                loss1.detach_()
            else:
                outs = tuple(o for o in outputs1 or () if o.requires_grad)
                grads = tuple(g for o, g in zip(outputs1 or (), output_grads1 or ()) if o.requires_grad)
                # DualPipe frees sent outputs' data (Megatron's deallocation), so call the engine
                # directly: torch.autograd.backward would reject the emptied shapes.
                torch.autograd.Variable._execution_engine.run_backward(outs, grads, False, False, (), True, True)

        outputs0 = overlapped(module0, tuple(inputs0), backward)
        outputs0 = [outputs0] if isinstance(outputs0, torch.Tensor) else list(outputs0)
        loss0 = criterion0(*outputs0, *(labels0 or ())) if criterion0 is not None else None
        return outputs0, loss0


def overlapped(fstage: nn.Module, fargs: tuple, backward: Callable[[], None]) -> Any:
    """Run `backward()` with the forward `fstage(*fargs)` armed, then return that forward's
    output (computed inside the backward when it reached a stage of the same kind, else now)."""
    with _armed(fstage, fargs):
        backward()
    # Ready if the backward reached a stage of fstage's kind; otherwise it runs on its own now.
    return fstage(*fargs)


@contextlib.contextmanager
def _armed(fstage: Any, fargs: tuple) -> Iterator[None]:
    """Arm `fstage(*fargs)` (a NodeStage or GraphStage) for the next backward of a stage of
    the same kind; disarmed on the way out."""
    if _ARMED.stage is not None:
        raise RuntimeError("a forward is already armed: overlapped calls do not nest")
    if isinstance(fstage, _DualPipeHook):  # a NodeStage or GraphStage
        _ARMED.stage, _ARMED.args = fstage, fargs
    try:
        yield
    finally:
        _ARMED.stage, _ARMED.args = None, ()
