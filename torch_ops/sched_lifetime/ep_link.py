"""An emulated EP link: expert parallelism of `k` ranks on one GPU, its traffic over PCIe.

`HostLinkAllToAll` is a `Transport` (see `ep.py`) for one process that stands for rank 0 of an
EP group of `k` ranks. To the model it is a world of one: every expert is local and computed
here, exactly as with the local `AllToAll()`. Each all-to-all is a pure data movement that
returns the same values as the local one (bit-exact), but the rows that an EP=k dispatch or
combine would send over the network go device -> pinned host -> device through the copy
engines, on the caller's current stream (the executor makes that the EP stream), so the link
costs what a real one would and the schedule has something to hide.

Which rows cross. The experts are sharded over the `k` emulated ranks in blocks (rank `i` owns
experts `[i*E/k, (i+1)*E/k)`), and the buffer is in split order, so rank 0's rows come first:
- `in_splits` of length `k` (what `MoELayer.dispatch` passes when the transport has
  `emulated_ranks`): rows `[0, in_splits[0])` are rank 0's and stay; the rest cross.
- `in_splits` None (the fixed-capacity dispatch: `E * capacity` rows, expert-major) or of
  length 1 (a world-of-one caller): an even row split, the first `rows // k` stay and the rest
  cross. With fixed capacity that is exactly the expert blocks.
The bytes crossing each way are the bytes rank 0 of an EP=k group would send (device -> host)
and, as a loopback, receive (host -> device). Both copies run on the one current stream, one
after the other: a message takes `bytes / d2h_rate + bytes / h2d_rate`.

Host buffers. A small ring of host buffers (pinned on a GPU), all of one capacity (a power of
two, a quarter above the message that set it), allocated on the first message and grown only
when a bigger message comes (never during CUDA graph
capture: that is an error asking for one eager step first). Each buffer has an event recorded
after the host -> device copy that last read it; a message reusing the buffer from another
stream makes the current stream wait on that event (no host sync). From the same stream the
stream order already does it. Under capture, only events recorded in the same capture are
waited on (`torch.cuda.graph` synchronizes before capturing, so earlier copies are done); after
replaying a captured step, order the next eager message after the replay (same stream or a
sync), as with any graph output.

The output is allocated on `alloc_stream` (the consumer) exactly as `AllToAll` does. With an
input that requires grad (the plain `MoEModel.forward`), the backward is the same move of the
gradient: it crosses the link too. On CPU the same transport runs with plain host buffers and
synchronous copies: no timing meaning, the same numerics, so CI tests it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from .lifetime import current_stream

#: The smallest host buffer (bytes). Buffers are powers of two with at least a quarter of
#: headroom, so a slightly larger message of the next step (counted routing varies) does not
#: reallocate; torch's pinned allocator rounds a block up to a power of two anyway.
_MIN_BUFFER = 1 << 20


def consumer_output(x: torch.Tensor, rows: int, alloc_stream: Optional[torch.Stream]) -> torch.Tensor:
    """An output buffer of `rows` rows like `x`, allocated on `alloc_stream` (the stream that
    will consume it) before the current stream writes it: the current stream waits for the
    consumer stream's handover. Without a distinct CUDA `alloc_stream`, on the current one."""
    here = current_stream(x.device)
    if alloc_stream is not None and alloc_stream != here and isinstance(alloc_stream, torch.cuda.Stream):
        with torch.cuda.stream(alloc_stream):
            out = x.new_empty((rows, *x.shape[1:]))
        # The side stream writes it only after the consumer stream handed it over.
        here.wait_stream(alloc_stream)
        return out
    return x.new_empty((rows, *x.shape[1:]))


def _capturing(device: torch.device) -> bool:
    """Whether CUDA graph capture is under way on the current stream of `device`."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


@dataclass(frozen=True)
class LinkBytes:
    """Bytes the emulated link moved since its last `reset_moved`."""

    d2h: int  # device -> host: what rank 0 of an EP=k group would send
    h2d: int  # host -> device: what it would receive (a loopback: equal to d2h)
    local: int  # rows of rank 0's own experts, copied on the device
    messages: int  # all-to-alls (forward and backward)


@dataclass
class _Slot:
    """One host buffer of the ring and what its last use left behind."""

    buf: Optional[torch.Tensor] = None
    event: Any = None  # recorded after the host -> device copy that last read `buf`
    stream: Any = None  # (stream id, device index) of that copy; None: never used
    epoch: Optional[int] = None  # the capture it was recorded in (None: outside any capture)


class HostLinkAllToAll:
    """EP transport emulating an EP group of `k` ranks on one device (see the module doc).

    `k`: emulated EP ranks (>= 2; the model's expert count must be a multiple, `check`).
    `device`: "cuda", "cuda:N" or "cpu"; None: "cuda" when a GPU is available, else "cpu".
    `ring`: host buffers in the ring (messages from different streams in flight at once).
    """

    world = 1
    rank = 0

    def __init__(self, k: int = 8, device: Any = None, ring: int = 2, num_experts: Optional[int] = None) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 2:
            raise ValueError(
                f"emulated EP link: k={k!r} is not a number of emulated EP ranks; k must be an integer >= 2 "
                "(use the local AllToAll() for one rank)"
            )
        if isinstance(ring, bool) or not isinstance(ring, int) or ring < 1:
            raise ValueError(f"emulated EP link: ring={ring!r}; the host buffer ring needs an integer >= 1 buffers")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                f"emulated EP link: device={str(device)!r} asks for the host link over PCIe, but no CUDA GPU is "
                "available; use device='cpu' (host copies, same numerics, no timing meaning) or run on a GPU"
            )
        if dev.type not in ("cuda", "cpu"):
            raise ValueError(f"emulated EP link: device={str(device)!r}; the host link runs on 'cuda' or 'cpu'")
        self.emulated_ranks = k
        self.device = dev
        self._slots = [_Slot() for _ in range(ring)]
        self._next = 0
        self.capacity = 0  # bytes of each host buffer
        self.allocations = 0  # host buffers allocated so far (a step after the first adds none)
        self._epoch = 0  # captures seen so far
        self._was_capturing = False
        self.reset_moved()
        if num_experts is not None:
            self.check(num_experts)

    @classmethod
    def from_spec(cls, spec: str, device: Any = None) -> "HostLinkAllToAll":
        """From a setting `host` (k = 8) or `host:K`, as a command line gives it."""
        kind, _, k = str(spec).partition(":")
        if kind != "host":
            raise ValueError(f"EP link {spec!r}: unknown kind {kind!r}; accepted: 'host' or 'host:K' (K emulated EP ranks, >= 2)")
        if not k:
            return cls(device=device)
        try:
            n = int(k)
        except ValueError:
            raise ValueError(f"EP link {spec!r}: K={k!r} is not an integer; accepted: 'host' or 'host:K' with K >= 2") from None
        return cls(n, device=device)

    def check(self, num_experts: int) -> None:
        """Raise unless `num_experts` shard evenly over the `k` emulated ranks."""
        k = self.emulated_ranks
        if num_experts % k:
            fits = [d for d in range(2, num_experts + 1) if num_experts % d == 0]
            raise ValueError(
                f"emulated EP link: k={k} does not divide the model's {num_experts} experts "
                f"(each emulated rank owns a block of experts); pick k in {fits or 'none: one expert has no EP'}"
            )

    # -- the Transport protocol ----------------------------------------------------------

    def all_to_all(
        self,
        x: torch.Tensor,
        out_rows: int,
        out_splits: Optional[Sequence[int]],
        in_splits: Optional[Sequence[int]],
        alloc_stream: Optional[torch.Stream] = None,
    ) -> torch.Tensor:
        """The local all-to-all's result (a copy of `x`), its crossing rows through the host."""
        keep = self._local_rows(x, out_rows, out_splits, in_splits)
        if torch.is_grad_enabled() and x.requires_grad:
            return _LinkMove.apply(x, self, keep, alloc_stream)
        return self._move(x, keep, alloc_stream)

    def exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """As the local transport: a clone (the emulation moves token rows only)."""
        return counts.clone()

    # -- figures -------------------------------------------------------------------------

    def moved(self) -> LinkBytes:
        """Bytes moved since the last `reset_moved` (queued copies; on a GPU they may still run)."""
        return LinkBytes(self._d2h, self._h2d, self._local, self._messages)

    def reset_moved(self) -> None:
        """Start counting `moved` from zero (a bench does it after its warm-up)."""
        self._d2h = self._h2d = self._local = self._messages = 0

    # -- the move ------------------------------------------------------------------------

    def _local_rows(self, x: torch.Tensor, out_rows: int, out_splits: Optional[Sequence[int]], in_splits: Optional[Sequence[int]]) -> int:
        """Rows of emulated rank 0 (they stay on the device); the rest cross. Validates the call."""
        if x.device.type != self.device.type or (self.device.index is not None and x.device != self.device):
            raise ValueError(f"emulated EP link on {self.device}: got a tensor on {x.device}; build the link with device={str(x.device)!r}")
        if x.dim() == 0:
            raise ValueError("emulated EP link: all_to_all needs a tensor of rows (at least 1-D), got a scalar")
        rows, k = x.shape[0], self.emulated_ranks
        if out_rows != rows:
            raise ValueError(f"emulated EP link: out_rows={out_rows} but the input has {rows} rows; the emulation is a loopback (world 1)")
        if (out_splits is None) != (in_splits is None) or (in_splits is not None and list(out_splits) != list(in_splits)):  # type: ignore[arg-type]
            raise ValueError(
                f"emulated EP link: out_splits={out_splits} differ from in_splits={in_splits}; the emulation is a loopback "
                "(world 1), both are the emulated ranks' row counts"
            )
        if in_splits is None:
            return rows // k
        splits = list(in_splits)
        if len(splits) not in (1, k) or any(s < 0 for s in splits) or sum(splits) != rows:
            raise ValueError(
                f"emulated EP link of k={k}: in_splits={splits} must be {k} (one per emulated rank) or 1 non-negative "
                f"row counts summing to the input's {rows} rows"
            )
        return splits[0] if len(splits) == k else rows // k

    def _move(self, x: torch.Tensor, keep: int, alloc_stream: Optional[torch.Stream]) -> torch.Tensor:
        rows = x.shape[0]
        out = consumer_output(x, rows, alloc_stream)
        row_bytes = x[0].numel() * x.element_size() if rows else 0
        if keep:
            out[:keep].copy_(x[:keep])
        cross = rows - keep
        nbytes = cross * row_bytes
        if nbytes:
            here = current_stream(x.device)
            slot = self._take(nbytes, here)
            host = slot.buf[:nbytes].view(x.dtype).view(cross, *x.shape[1:])
            host.copy_(x[keep:], non_blocking=True)
            out[keep:].copy_(host, non_blocking=True)
            self._release(slot, here)
        self._d2h += nbytes
        self._h2d += nbytes
        self._local += keep * row_bytes
        self._messages += 1
        return out

    def _take(self, nbytes: int, here: Any) -> _Slot:
        """The next ring buffer, at least `nbytes`, free for the current stream to write."""
        capturing = _capturing(self.device)
        if capturing and not self._was_capturing:
            self._epoch += 1
        self._was_capturing = capturing
        if nbytes > self.capacity:
            if capturing:
                raise RuntimeError(
                    f"emulated EP link: a {nbytes}-byte message during CUDA graph capture, but the host buffers hold "
                    f"{self.capacity} bytes and cannot be allocated while capturing; run one eager step first"
                )
            self._grow(nbytes)
        slot = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        if slot.stream is not None and slot.stream != _stream_key(here):
            # Another stream's host -> device copy may still read this buffer.
            if not capturing or slot.epoch == self._epoch:
                here.wait_event(slot.event)
        return slot

    def _release(self, slot: _Slot, here: Any) -> None:
        """Mark the buffer's last reader: the copy just queued on `here`."""
        if self.device.type != "cuda":
            return
        if slot.event is None:
            slot.event = torch.cuda.Event()
        slot.event.record(here)
        slot.stream = _stream_key(here)
        slot.epoch = self._epoch if self._was_capturing else None

    def _grow(self, nbytes: int) -> None:
        """Reallocate every buffer of the ring to hold `nbytes` (plus headroom), so that a
        capture after one eager step finds each buffer big enough. The old ones go back to
        torch's host allocator, which keeps them until their queued copies are done."""
        cap = max(_MIN_BUFFER, 1 << (nbytes + nbytes // 4 - 1).bit_length())
        pin = self.device.type == "cuda"
        for slot in self._slots:
            slot.buf = torch.empty(cap, dtype=torch.uint8, pin_memory=pin)
            self.allocations += 1
        self.capacity = cap

    @property
    def host_bytes(self) -> int:
        """Host memory the ring holds."""
        return self.capacity * len(self._slots) if self.allocations else 0


def _stream_key(s: Any) -> tuple:
    return (s.stream_id, s.device_index)


class _LinkMove(torch.autograd.Function):
    """The move with autograd (an identity on values): the gradient makes the same trip."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, link: HostLinkAllToAll, keep: int, alloc_stream: Any) -> torch.Tensor:
        ctx.link, ctx.keep = link, keep
        return link._move(x, keep, alloc_stream)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        return ctx.link._move(g, ctx.keep, None), None, None, None
