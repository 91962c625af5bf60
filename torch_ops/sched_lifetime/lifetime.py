"""`LifetimeManager`: the Python face of the Rust lifetime manager (DESIGN.md §2).

All decisions (what to park, when to wait, what to release, the fallback) are made in Rust;
this module checks Python types, picks default streams and calls Rust: through the eager entry
`sched_lifetime._direct` (the ops' Rust calls without the torch.ops round trip), or the ops for
tensors the entry does not take (subclasses, fakes)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any, Optional, Union

import torch

from ._ops import INFO, STATS_FIELDS, direct, ops

# Resolved overloads: calling them skips the packet's overload lookup (~0.8 us a call). Eager
# calls go through `direct` (the same Rust entry points without the torch.ops round trip, which
# costs more than the work at one tensor); it answers NotImplemented for tensors that are not
# plain (subclasses, fakes), and those take the op, whose dispatch handles them.
_bind, _retire, _passthrough = ops.bind.default, ops.retire.default, ops.passthrough.default
_retire_owned = ops.retire_owned.default

class Actions(dict):
    """Retire actions by name, with their integer codes across the FFI (from Rust):
    `empty_storage` (a forward input: `untyped_storage().resize_(0)` at the drain; the
    default), `drop_reference` (an incoming gradient: hold one reference, drop it at the
    drain, never resize), `preserve` (storage someone else owns: EP library buffers,
    symmetric memory; only the reference is dropped).

    Example:

        >>> import sched_lifetime as sl
        >>> sorted(sl.ACTIONS.items())
        [('drop_reference', 1), ('empty_storage', 0), ('preserve', 2)]
    """


#: Action names accepted by `retire`, with their integer codes across the FFI (from Rust).
ACTIONS: Actions = Actions(INFO["actions"])
_DEFAULT_ACTION: int = ACTIONS[INFO["default_action"]]
_direct_release, _direct_retire = direct.release, direct.retire  # module-level: one lookup fewer per call
#: Codes of the actions that empty a tensor's storage at its release (from Rust).
_EMPTYING = frozenset(ACTIONS[a] for a in INFO["storage_emptying_actions"])
_storage_use_count = torch._C._storage_Use_Count

_names = itertools.count()
_CPU_STREAM: Optional[torch.Stream] = None

Tensors = Union[torch.Tensor, Iterable[torch.Tensor]]


def current_stream(device: torch.device) -> torch.Stream:
    """The stream work on `device` is issued to now (the CPU has exactly one, made once).

    Example:

        >>> import torch, sched_lifetime as sl
        >>> s = sl.current_stream(torch.device("cpu"))
        >>> isinstance(s, torch.Stream), s is sl.current_stream(torch.device("cpu"))
        (True, True)
    """
    global _CPU_STREAM
    if device.type == "cpu":
        if _CPU_STREAM is None:
            _CPU_STREAM = torch.Stream(device="cpu")
        return _CPU_STREAM
    if device.type == "cuda":
        return torch.cuda.current_stream(device)
    return torch.accelerator.current_stream(device)


def _action_code(action: Optional[str], verb: str) -> int:
    """An action name's code across the FFI (None: Rust's default)."""
    code = _DEFAULT_ACTION if action is None else ACTIONS.get(action)
    if code is None:
        raise ValueError(f"{verb}: unknown action {action!r}; expected one of {sorted(ACTIONS)}")
    return code


def _tensor_list(tensors: Tensors, verb: str) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    try:
        items = list(tensors)
    except TypeError:
        raise ValueError(f"{verb}: expected a tensor or a sequence of tensors, got {type(tensors).__name__}") from None
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{verb}: item {i} is a {type(t).__name__}, not a torch.Tensor")
    return items


def _refuse_autograd_held(tensors: Tensors, bound_in_call: bool, verb: str) -> None:
    """Refuse to empty the storage of a tensor autograd holds: one that requires grad and whose
    data something else references (an op saved it for the backward, as input or output, or a
    view shares it). Emptying it makes the backward read freed memory: a crash, or garbage
    gradients with no error. Autograd's saved tensors cannot be listed; the reference counts
    are the tell (the tensor itself, the manager's binding unless it is made in this call, the
    storage's Python object here). A detached alias (`t.detach()`) of a saved tensor is not
    caught: it does not require grad."""
    for i, t in enumerate((tensors,) if isinstance(tensors, torch.Tensor) else tensors):
        if not (isinstance(t, torch.Tensor) and t.requires_grad):
            continue
        uses, shared = t._use_count(), _storage_use_count(t.untyped_storage()._cdata)
        if uses > (1 if bound_in_call else 2) or shared > 2:
            also = " (or bind() bound it already and this call binds it again: bind it once)" if bound_in_call and uses == 2 and shared <= 2 else ""
            raise RuntimeError(
                f"{verb}: tensor {i} ({tuple(t.shape)} {t.dtype}) requires grad and something else holds its data "
                f"(an op saved it for the backward, or a view shares it){also}: emptying its storage would make the "
                "backward read freed memory. Retire it with action='drop_reference' (its memory goes when autograd "
                "lets go of it), or after the backward"
            )


def _stream(stream: Optional[torch.Stream], tensors: list[torch.Tensor], what: str) -> torch.Stream:
    if stream is None:
        return current_stream(tensors[0].device) if tensors else current_stream(torch.device("cpu"))
    if type(stream) is not torch.cuda.Stream and not isinstance(stream, torch.Stream):
        raise ValueError(f"{what} must be a torch.Stream (or torch.cuda.Stream), got {type(stream).__name__}")
    return stream


def _checked_event(event: Any, verb: str) -> Any:
    """`event` if it is an event a stream can wait on (torch's stream calls do not check: a
    string crashed the process)."""
    if not isinstance(event, (torch.Event, torch.cuda.Event)):
        raise ValueError(f"{verb}: event must be a torch.Event or torch.cuda.Event, got {type(event).__name__} {event!r:.60}")
    return event


class LifetimeManager:
    """Frees tensors that cross streams when the schedule proves it safe, for one plan.

    `bind` records a tensor's owner stream (where its storage was allocated); `retire` says a
    consumer stream is done with it; `acquire(owner)` is called before the owner's next node
    and enqueues the owner's wait on this plan's event, then releases what it can. The manager
    records its plan event on the consumer stream at each cross-stream `retire`, so no caller
    event is needed for safety; an `event` given to `acquire`/`finalize` is waited on as well.
    One manager per plan (a microbatch's chunk); `finalize` at the plan's end raises if a bound
    tensor was never retired. A tensor retired without a binding takes the
    `record_stream(consumer)` fallback (counted in `stats()["fallback_record_stream"]`).
    Guide: docs/lifetime.md.

    Example (CPU: one stream, so a retire releases at once; on CUDA pass the streams):

        >>> import torch, sched_lifetime as sl
        >>> mgr = sl.LifetimeManager("mb0 forward")
        >>> x = torch.ones(1024)
        >>> mgr.bind(x)                      # owner: the current stream
        >>> mgr.retire(x, action="empty_storage")
        >>> x.untyped_storage().nbytes()     # released
        0
        >>> mgr.finalize()["retired_empty_storage"]
        1
        >>> mgr.close()
    """

    def __init__(self, name: Optional[str] = None) -> None:
        if name is not None and not isinstance(name, str):
            raise ValueError(f"LifetimeManager: name must be a str (the plan's name in errors), got {type(name).__name__} {name!r}")
        self.name = name if name is not None else f"plan{next(_names)}"
        self._handle: Optional[int] = direct.create(self.name)

    @property
    def handle(self) -> int:
        if self._handle is None:
            raise RuntimeError(f"lifetime manager '{self.name}' was closed")
        return self._handle

    def bind(self, tensors: Tensors, owner_stream: Optional[torch.Stream] = None) -> None:
        """Record that `tensors` were allocated on `owner_stream` (default: the current stream)."""
        if owner_stream is not None and direct.bind(self.handle, tensors, owner_stream) is None:
            return
        ts = _tensor_list(tensors, "bind")
        _bind(self.handle, ts, _stream(owner_stream, ts, "owner_stream"))

    def passthrough(self, tensors: Tensors) -> None:
        """A noop/view node handed these same objects on: their bindings stay (rule 6)."""
        _passthrough(self.handle, _tensor_list(tensors, "passthrough"))

    def retire(
        self,
        tensors: Tensors,
        consumer_stream: Optional[torch.Stream] = None,
        action: Optional[str] = None,
        owner_stream: Optional[torch.Stream] = None,
    ) -> None:
        """The consumer on `consumer_stream` (default: current) has queued its last use.
        `action` defaults to Rust's default (`INFO["default_action"]`, emptying the storage).
        `owner_stream`: bind the tensors to it in the same call (the eager hot path: no
        separate bind per tensor as it is produced)."""
        h = self._handle
        if h is None:
            h = self.handle  # raises: closed
        code = _DEFAULT_ACTION if action is None else _action_code(action, "retire")
        if code in _EMPTYING and (type(tensors) is not torch.Tensor or tensors.requires_grad):  # one plain tensor: no call
            if not isinstance(tensors, (torch.Tensor, list, tuple)):
                tensors = _tensor_list(tensors, "retire")  # read twice
            _refuse_autograd_held(tensors, owner_stream is not None, "retire")
        if consumer_stream is not None and _direct_retire(h, tensors, consumer_stream, code, owner_stream) is None:
            return
        ts = _tensor_list(tensors, "retire")
        consumer = _stream(consumer_stream, ts, "consumer_stream")
        if owner_stream is None:
            _retire(self.handle, ts, consumer, code)
        else:
            _retire_owned(self.handle, ts, _stream(owner_stream, ts, "owner_stream"), consumer, code)

    def release_after(
        self,
        tensors: Tensors,
        consumer_stream: torch.Stream,
        owner_stream: torch.Stream,
        action: Optional[str] = None,
    ) -> int:
        """`retire(tensors, consumer_stream, action, owner_stream=owner_stream)` then
        `acquire(owner_stream)`, in one call: the consumer has queued its last use, the owner
        stream waits for it now and the storage goes back to the owner's pool at once
        (`record_stream`'s one-call replacement, with no deferred free). Returns how many
        tensors were released (this plan's others parked for the owner included)."""
        # The hot path, per tensor in eager code: no property, no helper call when defaulted.
        h = self._handle
        if h is None:
            h = self.handle  # raises: closed
        code = _DEFAULT_ACTION if action is None else _action_code(action, "release_after")
        if code in _EMPTYING and (type(tensors) is not torch.Tensor or tensors.requires_grad):  # one plain tensor: no call
            if not isinstance(tensors, (torch.Tensor, list, tuple)):
                tensors = _tensor_list(tensors, "release_after")  # read twice
            _refuse_autograd_held(tensors, True, "release_after")
        got = _direct_release(h, tensors, consumer_stream, code, owner_stream)
        if got is not NotImplemented:
            return got
        ts = _tensor_list(tensors, "release_after")
        _retire_owned(self.handle, ts, owner_stream, consumer_stream, code)
        return direct.acquire(self.handle, owner_stream)

    def acquire(self, stream: Optional[torch.Stream] = None, event: Optional[torch.Event] = None) -> int:
        """Before the next node on `stream`: wait on the plan event, then release the tensors
        this plan parked for `stream`. Returns how many were released."""
        s = current_stream(_default_device()) if stream is None else stream
        if event is not None:
            s.wait_event(_checked_event(event, "acquire"))
        return direct.acquire(self.handle, s)

    def finalize(self, event: Optional[torch.Event] = None) -> dict[str, int]:
        """Terminal hand-back: every owner stream with parked tensors waits and drains.
        Raises if tensors were bound but never retired. Returns the final stats."""
        if event is not None:
            current_stream(_default_device()).wait_event(_checked_event(event, "finalize"))
        return dict(zip(STATS_FIELDS, direct.finalize(self.handle)))

    def stats(self) -> dict[str, int]:
        """Counters: retired by action, immediate, fallbacks, drains, waits, pending peaks."""
        return dict(zip(STATS_FIELDS, direct.stats(self.handle)))

    def close(self) -> None:
        """Drop the manager. Parked tensors of an unfinalized plan take the record_stream
        fallback, so nothing is reused early."""
        if self._handle is not None:
            h, self._handle = self._handle, None
            direct.destroy(h)

    def __enter__(self) -> "LifetimeManager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"LifetimeManager(name={self.name!r}, handle={self._handle})"


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
