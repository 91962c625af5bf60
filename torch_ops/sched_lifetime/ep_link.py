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
and, as a loopback, receive (host -> device).

Full duplex (the default, `duplex=True`). A real EP link sends and receives at once, so the
crossing rows are split into row-aligned chunks (`chunk_rows`: at most `chunks`, none smaller
than `min_chunk_bytes` unless it is the only one): the device -> host copy of chunk i runs on
the caller's current stream (the EP stream), the host -> device copy of chunk i on a
high-priority helper stream of the device (`LinkStreams`, created once per device, reused)
after an event recorded behind chunk i's device -> host copy; at the end the caller's stream
waits on the helper's last event. Chunk i+1 goes out while chunk i comes back: a large message
costs about bytes / (the rate of each direction with both running) plus one chunk, instead of
bytes / d2h + bytes / h2d. No host sync; the events are made once (outside any capture) and
re-recorded, so the same code runs inside CUDA graph capture (the helper stream forks from and
joins the captured stream). A message of one chunk runs both copies on the caller's stream.
`duplex=False` is the serial emulation (both copies on the caller's stream, one after the
other: about half of one direction's rate), kept for comparison. On CPU the same chunk split
runs with synchronous copies: the same bytes, the same numerics.

Host buffers. A small ring of host buffers (pinned on a GPU), all of one capacity (a power of
two, a quarter above the message that set it), allocated on the first message and grown only
when a bigger message comes (never during CUDA graph capture: that is an error asking for one
eager step first). Each buffer has an event recorded after the last host -> device copy that
read it (on the helper stream in duplex) and the stream that joined it; a message reusing the
buffer from another stream makes its stream wait on that event (no host sync). From the same
stream the join already orders it. Under capture, only events recorded in the same capture
are waited on (`torch.cuda.graph` synchronizes before capturing, so earlier copies are done);
after replaying a captured step, order the next eager message after the replay (same stream
or a sync), as with any graph output.

The output is allocated on `alloc_stream` (the consumer) exactly as `AllToAll` does. With an
input that requires grad (the plain `MoEModel.forward`), the backward is the same move of the
gradient: it crosses the link too. On CPU the same transport runs with plain host buffers and
synchronous copies: no timing meaning, the same numerics, so CI tests it.

Compiled graphs (torch.compile with backend "sched_lifetime", `GraphStep`). Traced, the
transport is a launch/wait pair of ops, `sched_lifetime_link::all_to_all` and
`sched_lifetime_link::wait_tensor`, the way a functional collective is
(`_c10d_functional.all_to_all_single` + `wait_tensor`): the compile backend's IR makes them a
comm launch and its wait, and schedules compute between them. The launch runs the move on the
link's own send stream (as NCCL runs on its own stream), forked from the caller's stream,
and keeps its input alive until the wait; the wait makes the caller's stream wait for it.
Their autograd is the same move of the gradient, so the backward graph has its launch/wait
pairs too.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from .lifetime import current_stream

#: The smallest host buffer (bytes). Buffers are powers of two with at least a quarter of
#: headroom, so a slightly larger message of the next step (counted routing varies) does not
#: reallocate; torch's pinned allocator rounds a block up to a power of two anyway.
_MIN_BUFFER = 1 << 20

#: The profiler range around each move (the main job's figures find the link's copies by it).
LINK_RANGE = "sched_lifetime_link::move"


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


def chunk_rows(rows: int, row_bytes: int, chunks: int, min_chunk_bytes: int) -> list[int]:
    """Row counts of the chunks `rows` crossing rows of `row_bytes` bytes are split into, in
    order: at most `chunks` and at most one a row, none below `min_chunk_bytes` unless it is
    the only one, as even as rows allow (the first ones one row longer). No rows: no chunk."""
    if rows <= 0:
        return []
    n = min(chunks, rows)
    if min_chunk_bytes > 0:
        n = min(n, (rows * row_bytes) // min_chunk_bytes)
    n = max(n, 1)
    q, r = divmod(rows, n)
    return [q + 1] * r + [q] * (n - r)


class LinkStreams:
    """The emulated link's streams of one device, created once (outside any capture) and
    reused: `recv`, the high-priority helper the host -> device copies run on, and `send`,
    the high-priority stream a traced launch runs the whole move on (as NCCL has its own)."""

    _lock = threading.Lock()
    _by_device: dict = {}

    def __init__(self, device: torch.device) -> None:
        lo, hi = torch.cuda.Stream.priority_range()
        prio = min(lo, hi)  # the numerically lower value is the higher priority
        self.recv = torch.cuda.Stream(device=device, priority=prio)
        self.send = torch.cuda.Stream(device=device, priority=prio)

    @classmethod
    def of(cls, device: torch.device) -> "LinkStreams":
        """The link streams of CUDA `device` (made on first use)."""
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        with cls._lock:
            s = cls._by_device.get(device)
            if s is None:
                s = cls._by_device[device] = LinkStreams(device)
            return s


@dataclass(frozen=True)
class LinkBytes:
    """Bytes the emulated link moved since its last `reset_moved`."""

    d2h: int  # device -> host: what rank 0 of an EP=k group would send
    h2d: int  # host -> device: what it would receive (a loopback: equal to d2h)
    local: int  # rows of rank 0's own experts, copied on the device
    messages: int  # all-to-alls (forward and backward)
    chunks: int = 0  # device -> host copies (a message's chunks; serial: one per crossing message)


@dataclass
class _Slot:
    """One host buffer of the ring and what its last use left behind."""

    buf: Optional[torch.Tensor] = None
    event: Any = None  # recorded after the host -> device copy that last read `buf`
    stream: Any = None  # (stream id, device index) of the stream that joined that copy; None: never used
    epoch: Optional[int] = None  # the capture it was recorded in (None: outside any capture)


#: Links by id, for the traced ops (an op argument is an int, not an object).
_LINKS: "weakref.WeakValueDictionary[int, HostLinkAllToAll]" = weakref.WeakValueDictionary()
_ids = iter(range(1, 1 << 62))


class HostLinkAllToAll:
    """EP transport emulating an EP group of `k` ranks on one device (see the module doc).

    `k`: emulated EP ranks (>= 2; the model's expert count must be a multiple, `check`).
    `device`: "cuda", "cuda:N" or "cpu"; None: "cuda" when a GPU is available, else "cpu".
    `ring`: host buffers in the ring (messages from different streams in flight at once).
    `duplex`: device -> host and host -> device at once, chunk by chunk (True, the default);
    False: both copies of a message on the caller's stream, one after the other.
    `chunks`: the most chunks a message is split into (duplex); `min_chunk_bytes`: no chunk
    smaller, unless it is the message's only one (each copy costs a few microseconds).
    """

    world = 1
    rank = 0

    def __init__(
        self,
        k: int = 8,
        device: Any = None,
        ring: int = 2,
        num_experts: Optional[int] = None,
        duplex: bool = True,
        chunks: int = 8,
        min_chunk_bytes: int = 1 << 20,
    ) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 2:
            raise ValueError(
                f"emulated EP link: k={k!r} is not a number of emulated EP ranks; k must be an integer >= 2 "
                "(use the local AllToAll() for one rank)"
            )
        if isinstance(ring, bool) or not isinstance(ring, int) or ring < 1:
            raise ValueError(f"emulated EP link: ring={ring!r}; the host buffer ring needs an integer >= 1 buffers")
        if not isinstance(duplex, bool):
            raise ValueError(f"emulated EP link: duplex={duplex!r}; True (send and receive at once) or False (serial)")
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"emulated EP link: chunks={chunks!r}; a message is split into an integer >= 1 chunks")
        if isinstance(min_chunk_bytes, bool) or not isinstance(min_chunk_bytes, int) or min_chunk_bytes < 0:
            raise ValueError(f"emulated EP link: min_chunk_bytes={min_chunk_bytes!r}; an integer >= 0 (0: chunks of any size)")
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
        self.duplex = duplex
        self.chunks = chunks
        self.min_chunk_bytes = min_chunk_bytes
        self._slots = [_Slot() for _ in range(ring)]
        self._next = 0
        self.capacity = 0  # bytes of each host buffer
        self.allocations = 0  # host buffers allocated so far (a step after the first adds none)
        self._epoch = 0  # captures seen so far
        self._was_capturing = False
        self._chunk_events: list = []  # recorded behind each chunk's device -> host copy (duplex)
        self._spare: list = []  # launch-done events of the traced path, free to re-record
        self._pending: dict[int, tuple] = {}  # traced launches not yet waited: id(out) -> (out, x, event)
        self._id = next(_ids)
        _LINKS[self._id] = self
        self.reset_moved()
        if num_experts is not None:
            self.check(num_experts)

    @classmethod
    def from_spec(cls, spec: str, device: Any = None, **options: Any) -> "HostLinkAllToAll":
        """From a setting `host` (k = 8) or `host:K`, as a command line gives it; `options` are
        the constructor's other settings (`duplex`, `chunks`, ...)."""
        kind, colon, k = str(spec).partition(":")
        if kind != "host":
            raise ValueError(f"EP link {spec!r}: unknown kind {kind!r}; accepted: 'host' or 'host:K' (K emulated EP ranks, >= 2)")
        if not colon:
            return cls(device=device, **options)
        if not k:
            raise ValueError(f"EP link {spec!r}: K is missing after ':'; accepted: 'host' (K = 8) or 'host:K' with K >= 2")
        try:
            n = int(k)
        except ValueError:
            raise ValueError(f"EP link {spec!r}: K={k!r} is not an integer; accepted: 'host' or 'host:K' with K >= 2") from None
        return cls(n, device=device, **options)

    def check(self, num_experts: int) -> None:
        """Raise unless `num_experts` shard evenly over the `k` emulated ranks."""
        k = self.emulated_ranks
        if num_experts % k:
            fits = [d for d in range(2, num_experts + 1) if num_experts % d == 0]
            raise ValueError(
                f"emulated EP link: k={k} does not divide the model's {num_experts} experts "
                f"(each emulated rank owns a block of experts); pick k in {fits or 'none: one expert has no EP'}"
            )

    def describe(self) -> str:
        """One line for a table's header: what this link is."""
        how = f"full duplex, up to {self.chunks} chunks of >= {self.min_chunk_bytes >> 10} KiB" if self.duplex else "serial copies"
        where = "pinned host memory (copy engines)" if self.device.type == "cuda" else "host memory (CPU: numerics only)"
        return f"emulated link: EP={self.emulated_ranks} over {where}, {how}"

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
        if _traced(x):
            # torch.compile / AOTAutograd: a launch and its wait, as a functional collective.
            ops = torch.ops.sched_lifetime_link
            return ops.wait_tensor(ops.all_to_all(x, keep, self._id), x, keep, self._id)
        if torch.is_grad_enabled() and x.requires_grad:
            return _LinkMove.apply(x, self, keep, alloc_stream)
        return self._move(x, keep, alloc_stream)

    def exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """As the local transport: a clone (the emulation moves token rows only)."""
        return counts.clone()

    # -- figures -------------------------------------------------------------------------

    def moved(self) -> LinkBytes:
        """Bytes moved since the last `reset_moved` (queued copies; on a GPU they may still run)."""
        return LinkBytes(self._d2h, self._h2d, self._local, self._messages, self._chunks)

    def reset_moved(self) -> None:
        """Start counting `moved` from zero (a bench does it after its warm-up)."""
        self._d2h = self._h2d = self._local = self._messages = self._chunks = 0

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
        if torch.autograd.profiler._is_profiler_enabled:
            # A profile tells the link's copies from other device <-> host copies (page copies).
            with torch.profiler.record_function(LINK_RANGE):
                return self._move_rows(x, keep, alloc_stream)
        return self._move_rows(x, keep, alloc_stream)

    def _move_rows(self, x: torch.Tensor, keep: int, alloc_stream: Optional[torch.Stream]) -> torch.Tensor:
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
            pieces = chunk_rows(cross, row_bytes, self.chunks, self.min_chunk_bytes) if self.duplex else [cross]
            if len(pieces) > 1 and self.device.type == "cuda":
                self._duplex(x[keep:], out[keep:], host, pieces, slot, here)
            else:  # serial, one chunk, or CPU (synchronous copies: the chunk split alone)
                a = 0
                for n in pieces:
                    host[a : a + n].copy_(x[keep + a : keep + a + n], non_blocking=True)
                    out[keep + a : keep + a + n].copy_(host[a : a + n], non_blocking=True)
                    a += n
                self._release(slot, here, here)
            self._chunks += len(pieces)
        self._d2h += nbytes
        self._h2d += nbytes
        self._local += keep * row_bytes
        self._messages += 1
        return out

    def _duplex(self, src: torch.Tensor, dst: torch.Tensor, host: torch.Tensor, pieces: list[int], slot: _Slot, here: Any) -> None:
        """Chunk i device -> host on `here`, then host -> device on the helper stream after an
        event behind it; `here` joins the helper at the end (no host sync)."""
        recv = LinkStreams.of(self.device).recv
        evs = self._chunk_events
        bounds, a = [], 0
        for i, n in enumerate(pieces):
            host[a : a + n].copy_(src[a : a + n], non_blocking=True)
            evs[i].record(here)
            bounds.append((a, a + n))
            a += n
        with torch.cuda.stream(recv):
            for i, (a, b) in enumerate(bounds):
                recv.wait_event(evs[i])
                dst[a:b].copy_(host[a:b], non_blocking=True)
        self._release(slot, recv, here)
        here.wait_event(slot.event)

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

    def _release(self, slot: _Slot, last: Any, joined: Any) -> None:
        """Mark the buffer's last reader: the copy just queued on `last`, which `joined` (the
        caller's stream) waits for (or is)."""
        if self.device.type != "cuda":
            return
        slot.event.record(last)
        slot.stream = _stream_key(joined)
        slot.epoch = self._epoch if self._was_capturing else None

    def _grow(self, nbytes: int) -> None:
        """Reallocate every buffer of the ring to hold `nbytes` (plus headroom), so that a
        capture after one eager step finds each buffer big enough. The old ones go back to
        torch's host allocator, which keeps them until their queued copies are done. On the
        first call on a GPU, the events and streams are made too (never during capture)."""
        cap = max(_MIN_BUFFER, 1 << (nbytes + nbytes // 4 - 1).bit_length())
        pin = self.device.type == "cuda"
        for slot in self._slots:
            slot.buf = torch.empty(cap, dtype=torch.uint8, pin_memory=pin)
            self.allocations += 1
        self.capacity = cap
        if pin and not self._chunk_events:
            self._make_events()

    def _make_events(self) -> None:
        """Every event the link records, made and recorded once here (a CUDA event is created
        at its first record): none is created during capture."""
        here = current_stream(self.device)
        LinkStreams.of(self.device)
        self._chunk_events = [torch.cuda.Event() for _ in range(self.chunks)]
        for slot in self._slots:
            slot.event = torch.cuda.Event()
        self._spare = [torch.cuda.Event() for _ in range(2 * len(self._slots) + 2)]
        for ev in self._chunk_events + [s.event for s in self._slots] + self._spare:
            ev.record(here)

    @property
    def host_bytes(self) -> int:
        """Host memory the ring holds."""
        return self.capacity * len(self._slots) if self.allocations else 0

    # -- the traced path: launch and wait ------------------------------------------------

    def _launch(self, x: torch.Tensor, keep: int) -> torch.Tensor:
        """The move on the link's send stream, forked from the caller's stream; its output
        is the caller's (allocated on it) and is handed out by `_wait`. Returns the launch's
        token (an empty tensor). CPU: the move, done at once."""
        token = torch.empty(0, dtype=torch.uint8, device=x.device)
        if self.device.type != "cuda":
            self._pending[id(token)] = (token, self._move(x, keep, None), None)
            return token
        here = current_stream(x.device)
        send = LinkStreams.of(self.device).send
        with torch.cuda.stream(send):
            out = self._move(x, keep, alloc_stream=here)  # send waits for here: the fork
        done = self._spare.pop() if self._spare else torch.cuda.Event()
        done.record(send)
        self._pending[id(token)] = (token, out, done)
        return token

    def _wait(self, token: torch.Tensor) -> torch.Tensor:
        """The output of the launch of `token`, the caller's stream waiting for it (the join).
        The launch's input is the wait's argument too, so the graph keeps it alive until here."""
        got = self._pending.pop(id(token), None)
        if got is None:
            raise RuntimeError("emulated EP link: a wait for a launch that is not pending (waited twice, or never launched)")
        _, out, done = got
        if done is not None:
            current_stream(out.device).wait_event(done)
            self._spare.append(done)
        return out


def _stream_key(s: Any) -> tuple:
    return (s.stream_id, s.device_index)


def _traced(x: torch.Tensor) -> bool:
    """Whether `x` is being traced (torch.compile's Dynamo, or AOTAutograd's fake/functional
    tensors): then the move is a launch/wait pair of ops, not Python copies."""
    if torch.compiler.is_compiling():
        return True
    return type(x) not in (torch.Tensor, torch.nn.Parameter) or torch._C._functorch.is_functionaltensor(x)


class _LinkMove(torch.autograd.Function):
    """The move with autograd (an identity on values): the gradient makes the same trip."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, link: HostLinkAllToAll, keep: int, alloc_stream: Any) -> torch.Tensor:
        ctx.link, ctx.keep = link, keep
        return link._move(x, keep, alloc_stream)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        return ctx.link._move(g, ctx.keep, None), None, None, None


# -- the traced ops ---------------------------------------------------------------------
# A launch returns an empty token and its wait the moved rows (a new tensor, no alias of an
# argument: what custom ops may return). The wait takes the launch's input too, so a compiled
# graph keeps it alive while the send stream reads it, as c10d does until `wait_tensor`.

_lib = torch.library.Library("sched_lifetime_link", "DEF")
_lib.define("all_to_all(Tensor x, SymInt keep, int link) -> Tensor")
_lib.define("wait_tensor(Tensor launched, Tensor x, SymInt keep, int link) -> Tensor")


def _link(i: int) -> HostLinkAllToAll:
    got = _LINKS.get(i)
    if got is None:
        raise RuntimeError(f"emulated EP link #{i} is gone: a compiled graph outlived the HostLinkAllToAll it was traced with")
    return got


def _launch_impl(x: torch.Tensor, keep: int, link: int) -> torch.Tensor:
    return _link(link)._launch(x, keep)


def _wait_impl(launched: torch.Tensor, x: torch.Tensor, keep: int, link: int) -> torch.Tensor:
    return _link(link)._wait(launched)


for _key in ("CPU", "CUDA"):
    _lib.impl("all_to_all", _launch_impl, _key)
    _lib.impl("wait_tensor", _wait_impl, _key)


@torch.library.register_fake("sched_lifetime_link::all_to_all", lib=_lib)
def _launch_fake(x: torch.Tensor, keep: int, link: int) -> torch.Tensor:
    return x.new_empty(0, dtype=torch.uint8)


@torch.library.register_fake("sched_lifetime_link::wait_tensor", lib=_lib)
def _wait_fake(launched: torch.Tensor, x: torch.Tensor, keep: int, link: int) -> torch.Tensor:
    return x.new_empty(x.shape)


def _wait_setup(ctx: Any, inputs: tuple, output: Any) -> None:
    ctx.keep, ctx.link = inputs[2], inputs[3]


def _wait_backward(ctx: Any, g: torch.Tensor) -> tuple:
    # The gradient makes the same trip: a launch and its wait in the backward graph.
    ops = torch.ops.sched_lifetime_link
    g = g.contiguous()
    return None, ops.wait_tensor(ops.all_to_all(g, ctx.keep, ctx.link), g, ctx.keep, ctx.link), None, None


torch.library.register_autograd("sched_lifetime_link::wait_tensor", _wait_backward, setup_context=_wait_setup, lib=_lib)
