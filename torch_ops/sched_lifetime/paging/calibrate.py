"""What the calibration steps record: the live prefix and, timed on CUDA, the memory and time lines (`Calibration`).

A `Pager`'s first step records every tensor autograd saves (metadata only: its device, bytes,
shape, dtype, whether a weight or restorable) and the backward order of its first use: the live
prefix Rust plans from. Timed on CUDA, that first step also measures the memory line (the most
memory allocated between saves and unpacks) and a second step the time line (an event at every
save and unpack), to which `timing` adds the link's measured rates (for a two-way pager, both
directions at once too: Rust then plans page-outs that end in the backward).
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch

from .paged import is_weight, restorable
from .plan import link_rates


class Calibration:
    """The calibration steps' record of one `Pager`: `saved` (one entry per save), `first_use`
    (save index -> the backward unpack that first reads it) and, when `timed` on CUDA, the
    memory line of the first step and the time line of the second (`timing_pass`)."""

    def __init__(self, timed: bool, slack: float, two_way: bool = True) -> None:
        self.timed = timed
        self.slack = slack  # copies planned that many times slower than measured
        self.two_way = two_way  # page-outs and page-ins on two streams: the plan gets the two-way rate
        self.saved: list[dict] = []
        self.first_use: dict[int, int] = {}
        self.timing_pass = False  # the memory line is measured: this step measures the time line
        self._events: dict[str, list] = {"save": [], "unpack": []}  # the time line
        self._peaks: dict[str, list] = {"save": [], "unpack": []}  # the memory line
        self._tail = 0

    def start(self) -> None:
        """A calibration step starts (the first memory interval starts with it)."""
        if self.timed and not self.timing_pass and torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def save(self, i: int, t: torch.Tensor) -> None:
        """Saved tensor `i` is `t`: recorded (first step) or checked and timed (second step)."""
        if self.timing_pass:  # second calibration step: the timeline only
            c = self.saved[i] if i < len(self.saved) else None
            if c is None or c["shape"] != tuple(t.shape) or c["dtype"] != t.dtype:
                raise RuntimeError(f"paging: saved tensor #{i} is {tuple(t.shape)} {t.dtype}, the first calibration step saw {c and (c['shape'], c['dtype'])}")
            self._events["save"].append(self._event_now())
            return
        if self.timed and t.is_cuda:
            self._peak("save", t.device)
        # Metadata only: a reference here would keep every activation alive through the
        # backward and distort the memory timeline.
        self.saved.append({"device": t.device, "bytes": t.numel() * t.element_size(), "shape": tuple(t.shape), "dtype": t.dtype, "weight": is_weight(t), "restorable": restorable(t)})

    def unpack(self, i: int, u: int) -> None:
        """Saved tensor `i` is read by the backward's unpack number `u`."""
        if self.timing_pass:
            self._events["unpack"].append(self._event_now())
        elif self._peaks["save"]:  # a timed calibration on CUDA
            self._peak("unpack", self.saved[0]["device"])
        self.first_use.setdefault(i, u)

    def finish_step(self) -> bool:
        """A calibration step ran to its end: whether the record is complete. After the first of
        two timed steps on CUDA it is not: the next step measures the time line."""
        if self.timed and self._peaks["save"] and not self.timing_pass:
            self._tail = torch.cuda.max_memory_allocated(self.saved[0]["device"])
            self.timing_pass = True
            return False
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

    def _peak(self, kind: str, dev: torch.device) -> None:
        """First calibration step: the most bytes allocated since the last save or unpack (the
        peak statistic is reset at each; slow on the host, so the timeline is measured in a
        second step)."""
        self._peaks[kind].append(torch._C._cuda_memoryStats(dev.index)["allocated_bytes"]["all"]["peak"])
        torch._C._cuda_resetPeakMemoryStats(dev.index)

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
        rates = link_rates(self.saved[0]["device"])
        out = {
            "save_us": [saves[0].elapsed_time(e) * 1e3 for e in saves],
            "unpack_us": [unpacks[0].elapsed_time(e) * 1e3 for e in unpacks],
            "d2h_bytes_per_us": rates.d2h,
            "h2d_bytes_per_us": rates.h2d,
            "slack": self.slack,
            "save_peak": peaks["save"],
            "unpack_peak": peaks["unpack"],
            "tail_peak": self._tail,
        }
        if self.two_way:
            out["both_bytes_per_us"] = rates.both
        return out
