"""What the calibration steps record: the live prefix and, timed on CUDA, the memory and time lines (`Calibration`).

A `Pager`'s first step records every tensor autograd saves (metadata only: its device, bytes,
shape, dtype, whether a weight or restorable) and the backward order of its first use: the live
prefix Rust plans from. Timed on CUDA, that first step also measures the memory line (the most
memory allocated between saves and unpacks) and a second step the time line (an event at every
save and unpack), to which `timing` adds the link's measured rates (for a two-way pager, both
directions at once too: Rust then plans page-outs that end in the backward) and the host time
one page-out and its page-in take (`page_host_us`: Rust keeps a tensor whose copy is shorter);
both measured once per device in a process and shared by every Pager (`forget_measurements`).
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch

from .paged import is_weight, pageable
from .plan import link_rates, page_host_us


class MemoryLine:
    """The device's allocation peaks between marks, shared by every calibration in the process:
    each mark reads the peak since the last mark (anyone's) and resets it, so calibrations that
    run at once (one compiled graph run per layer, each run with its own Pager) do not cut each
    other's intervals short: an interval's peak is the highest of the marks inside it.
    `read(dev)` returns the peak since the last reset and resets it (CUDA: the allocator's
    statistic)."""

    def __init__(self, read: Any = None) -> None:
        self.read = read or _cuda_peak_and_reset
        self.peaks: list[int] = []  # the peak of each interval between consecutive marks
        self.users = 0  # calibrations measuring now; the line is cleared when none is

    def mark(self, dev: Any) -> int:
        """End the current interval: its index (a calibration keeps the indices of its marks)."""
        self.peaks.append(int(self.read(dev)))
        return len(self.peaks) - 1

    def peak(self, after: int, upto: int) -> int:
        """The most bytes allocated between mark `after` (exclusive; -1: from the line's start)
        and mark `upto` (inclusive)."""
        return max(self.peaks[after + 1 : upto + 1], default=0)

    def join(self) -> None:
        self.users += 1

    def leave(self) -> None:
        self.users -= 1
        if self.users <= 0:
            self.users, self.peaks = 0, []


#: The link's rates and a page round trip's host time, per device (and two-way setting), measured
#: at the first timed calibration on it in this process and shared by every later one: a property
#: of the machine, not of a Pager (a compiled graph that runs once per layer calibrates a Pager
#: per run slot: each measured again, and their plans differed by the measurement's noise).
#: `forget_measurements()` makes the next calibration measure again.
_MEASURED: dict[tuple, Any] = {}


def measured(key: tuple, measure: Any) -> Any:
    """`measure()`, once per `key` in this process (see `_MEASURED`)."""
    v = _MEASURED.get(key)
    if v is None:
        v = _MEASURED[key] = measure()
    return v


def forget_measurements() -> None:
    """The next timed calibration measures the link's rates and the host time again (e.g. after
    the machine's load changed)."""
    _MEASURED.clear()


def _device_key(dev: Any) -> tuple:
    dev = torch.device(dev)
    index = dev.index if dev.index is not None or dev.type != "cuda" else torch.cuda.current_device()
    return (dev.type, index)


def _cuda_peak_and_reset(dev: Any) -> int:
    peak = torch._C._cuda_memoryStats(dev.index)["allocated_bytes"]["all"]["peak"]
    torch._C._cuda_resetPeakMemoryStats(dev.index)
    return peak


#: The one memory line of this process.
LINE = MemoryLine()


class Calibration:
    """The calibration steps' record of one `Pager`: `saved` (one entry per save), `first_use`
    (save index -> the backward unpack that first reads it) and, when `timed` on CUDA, the
    memory line of the first step and the time line of the second (`timing_pass`)."""

    def __init__(self, timed: bool, slack: float, two_way: bool = False, count_host: bool = True) -> None:
        self.timed = timed
        self.count_host = count_host  # measure the host time of a page-out: the plan keeps shorter copies
        self.slack = slack  # copies planned that many times slower than measured
        self.two_way = two_way  # page-outs and page-ins on two streams: the plan gets the two-way rate
        self.saved: list[dict] = []
        self.first_use: dict[int, int] = {}
        self.timing_pass = False  # the memory line is measured: this step measures the time line
        self._events: dict[str, list] = {"save": [], "unpack": []}  # the time line
        self._peaks: dict[str, list] = {"save": [], "unpack": []}  # the memory line: (from, to) marks of `LINE`
        self._tail = 0
        self._dev: Any = None  # the CUDA device the memory line is read on (its first CUDA save's)
        self._start = -1  # the mark the step started at
        self._last = -1  # the last mark of this calibration
        self.line = LINE

    def start(self) -> None:
        """A calibration step starts (the first memory interval starts with it)."""
        if self.timed and not self.timing_pass and torch.cuda.is_available():
            self._dev = torch.device("cuda", torch.cuda.current_device())
            self.line.join()
            self._start = self._last = self.line.mark(self._dev)

    def save(self, i: int, t: torch.Tensor) -> None:
        """Saved tensor `i` is `t`: recorded (first step) or checked and timed (second step)."""
        if self.timing_pass:  # second calibration step: the timeline only
            c = self.saved[i] if i < len(self.saved) else None
            if c is None or c["shape"] != tuple(t.shape) or c["dtype"] != t.dtype:
                raise RuntimeError(f"paging: saved tensor #{i} is {tuple(t.shape)} {t.dtype}, the first calibration step saw {c and (c['shape'], c['dtype'])}")
            self._events["save"].append(self._event_now())
            return
        if self._dev is not None and (t.is_cuda or self._peaks["save"]):
            # Every save once the line is on (a CPU tensor saved between CUDA ones included): a
            # memory line with a peak per save, never a partial one.
            self._peak("save")
        # Metadata only: a reference here would keep every activation alive through the
        # backward and distort the memory timeline.
        self.saved.append({"device": t.device, "bytes": t.numel() * t.element_size(), "shape": tuple(t.shape), "dtype": t.dtype, "weight": is_weight(t), "restorable": pageable(t)})

    def unpack(self, i: int, u: int) -> None:
        """Saved tensor `i` is read by the backward's unpack number `u`."""
        if self.timing_pass:
            self._events["unpack"].append(self._event_now())
        elif self._peaks["save"]:  # a timed calibration on CUDA
            self._peak("unpack")
        self.first_use.setdefault(i, u)

    def had_backward(self) -> bool:
        """Whether this calibration step's backward read a saved tensor (a forward alone, a
        warm-up or a step that skipped its backward, tells nothing of the backward's order)."""
        return bool(self._events["unpack"]) if self.timing_pass else bool(self.first_use)

    def abort(self) -> None:
        """Forget this calibration step's record (it raised, or had no backward): the next step
        calibrates again; a second timed step keeps the first's memory line."""
        self._events = {"save": [], "unpack": []}
        if self.timing_pass:
            return
        if self._dev is not None:
            self.line.leave()
            self._dev = None
        self.saved, self.first_use = [], {}
        self._peaks = {"save": [], "unpack": []}
        self._start = self._last = -1

    def finish_step(self) -> bool:
        """A calibration step ran to its end: whether the record is complete. After the first of
        two timed steps on CUDA it is not: the next step measures the time line."""
        if self.timed and self._peaks["save"] and not self.timing_pass:
            end = self.line.mark(self._dev)
            self._tail = self.line.peak(self._last, end)
            self._resolve()
            self.line.leave()
            self.timing_pass = True
            return False
        if self._dev is not None and not self.timing_pass:  # nothing measured on CUDA after all
            self.line.leave()
            self._dev = None
        return True

    def prefix(self, min_bytes: int) -> list[dict]:
        """The live prefix Rust plans from: the saved tensors worth paging (at least
        `min_bytes`, not a weight, restorable, read by the backward) in save order."""
        prefix = []
        for i, c in enumerate(self.saved):
            if c["bytes"] < min_bytes or c["weight"] or not c["restorable"] or i not in self.first_use:
                continue
            prefix.append({"name": f"#{i}", "bytes": c["bytes"], "saved_at": i, "used_at": self.first_use[i]})
        small = [c["bytes"] for c in self.saved if c["bytes"] < min_bytes and not c["weight"]]
        if not prefix and small:  # a setting that selects nothing: say so once, with the fix
            warnings.warn(f"Pager: nothing to page: every saved activation is under min_bytes={min_bytes} bytes (the largest is {max(small)}); pass a smaller min_bytes")
        # used_at counts backward steps from the boundary: the first unpack is step 0.
        return prefix

    def launches(self, paged: list[int], launch_at: Optional[list[int]], prefetch: int) -> tuple[dict[int, int], list[int]]:
        """Per paged save index, the backward unpack at which its page-in is queued (a timed
        plan's `launch_at`; untimed, `prefetch` unpacks before its first use), and the paged
        save indices in the order their page-ins are queued."""
        if launch_at is not None:
            at = dict(zip(paged, launch_at))
        else:
            at = {i: max(0, self.first_use[i] - prefetch) for i in paged}
        return at, sorted(set(paged), key=lambda i: (at[i], self.first_use[i], i))

    def host_buffers(self, page: list[int]) -> tuple[list[int], torch.device]:
        """The host buffer sizes of the saved tensors `page` and their one device."""
        devs = {self.saved[i]["device"] for i in page}
        if len(devs) > 1:
            raise RuntimeError(f"paging: saved tensors on several devices {sorted(map(str, devs))}; use one Pager per device")
        return [self.saved[i]["bytes"] for i in page], devs.pop()

    @staticmethod
    def _event_now() -> Any:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def _peak(self, kind: str) -> None:
        """First calibration step: the interval since this calibration's last save or unpack, as
        marks of the shared memory line (slow on the host, so the timeline is measured in a
        second step)."""
        now = self.line.mark(self._dev)
        self._peaks[kind].append((self._last, now))
        self._last = now

    def _resolve(self) -> None:
        """The marks of the step as bytes: each interval's peak."""
        for kind in ("save", "unpack"):
            self._peaks[kind] = [self.line.peak(a, b) for a, b in self._peaks[kind]]

    def timing(self) -> Optional[dict]:
        """The calibration step's timeline (us from its first save / first unpack) and the
        link's measured rates, or None when untimed or nothing ran on CUDA."""
        saves, unpacks = self._events["save"], self._events["unpack"]
        peaks = self._peaks
        self._events, self._peaks = {"save": [], "unpack": []}, {"save": [], "unpack": []}
        if not saves:
            return None
        if len(saves) != len(self.saved) or len(unpacks) != len(peaks["unpack"]):
            raise RuntimeError(
                f"paging: the second calibration step saved {len(saves)} and unpacked {len(unpacks)} tensors, "
                f"the first {len(self.saved)} and {len(peaks['unpack'])}; make a new Pager for a new shape"
            )
        dev = self._dev if self._dev is not None else self.saved[0]["device"]
        torch.cuda.synchronize(dev)  # the step's events are read below (a measurement made earlier does not sync)
        rates = measured(("link_rates", *_device_key(dev)), lambda: link_rates(dev))
        out = {
            "save_us": [saves[0].elapsed_time(e) * 1e3 for e in saves],
            "unpack_us": [unpacks[0].elapsed_time(e) * 1e3 for e in unpacks],
            "d2h_bytes_per_us": rates.d2h,
            "h2d_bytes_per_us": rates.h2d,
            "slack": self.slack,
            "save_peak": peaks["save"],
            "unpack_peak": peaks["unpack"],
            "tail_peak": self._tail,
            # A tensor whose copy is shorter than this is kept: the host calls would cost more.
            "page_host_us": measured(("page_host_us", *_device_key(dev), self.two_way), lambda: page_host_us(dev, self.two_way))
            if self.count_host
            else 0.0,
        }
        if self.two_way:
            out["both_bytes_per_us"] = rates.both
        return out
