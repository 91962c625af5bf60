"""Activation paging through `saved_tensors_hooks` (wiring only: what to page is Rust's choice).

`Pager` wraps a plain module's forward and backward:

    pager = sl.Pager(budget={"fraction": 0.5})
    for batch in data:
        with pager.step():
            loss = model(batch); loss.backward()

The first step calibrates: it records the live prefix (every tensor autograd saves, its bytes,
its save order and the backward order of its first use) and asks Rust (`page_plan`) what to
page. Host buffers are then allocated once (pinned on CUDA), never during a step. Later steps
copy the chosen tensors to their host buffer when autograd saves them and back when the
backward unpacks them; the rest stay on the device. On CUDA the copies run on the page stream
(`SideStreams`), the device storage of a paged-out tensor is released through the lifetime
manager (owner: the compute stream, retired on the page stream with `drop_reference`), and a
host buffer is rewritten only by a copy queued on the page stream after the copy that last read
it (one buffer per paged tensor, FIFO on one stream: no host sync). On CPU the copies are plain.

A step whose saved tensors differ from the calibration (count, shape or dtype) raises: no
silent fallback. `stats()` gives bytes out and in (equal every step) and peak host bytes.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any, Iterator, Optional, Union

import torch

from ._ops import ops
from .executor import SideStreams
from .lifetime import LifetimeManager

Budget = Union[dict, float, int]


def _budget_text(budget: Budget) -> str:
    if isinstance(budget, dict):
        return json.dumps(budget)
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise ValueError(f"paging budget must be bytes (int), a fraction (float) or a dict, got {budget!r}")
    return json.dumps({"bytes": budget} if isinstance(budget, int) else {"fraction": budget})


def page_plan(prefix: list[dict], budget: Budget, min_distance: int = 1) -> dict:
    """Rust's choice for a live prefix (`[{"name", "bytes", "saved_at", "used_at"}]`)."""
    return json.loads(ops.page_plan(json.dumps(prefix), _budget_text(budget), int(min_distance)))


class Pager:
    """Pages saved activations out to host memory and back (see the module docstring)."""

    def __init__(self, budget: Budget, min_distance: int = 1, min_bytes: int = 1 << 16, drain_distance: int = 2) -> None:
        _budget_text(budget)  # validate now
        if drain_distance < 0:
            raise ValueError(f"drain_distance must be >= 0, got {drain_distance}")
        self.budget = budget
        self.drain_distance = drain_distance
        self._inflight: list[LifetimeManager] = []
        self.min_distance = min_distance
        self.min_bytes = min_bytes
        self.plan: Optional[dict] = None
        self._calib: list[dict] = []
        self._first_use: dict[int, int] = {}
        self._page: set[int] = set()
        self._buffers: dict[int, torch.Tensor] = {}
        self._index = 0
        self._unpacks = 0
        self._stats = {"steps": 0, "bytes_out": 0, "bytes_in": 0, "host_bytes": 0}
        self._shapes: list = []

    # -- hooks -------------------------------------------------------------------------

    def _pack(self, t: torch.Tensor) -> Any:
        i = self._index
        self._index += 1
        if self.plan is None:  # calibrating: record, keep
            # Weights are saved too (a matmul saves its weight); they stay: paging them saves nothing.
            base = t._base if t._base is not None else t
            weight = isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad)
            self._calib.append({"t": t, "bytes": t.numel() * t.element_size(), "shape": tuple(t.shape), "dtype": t.dtype, "weight": weight})
            return ("keep", i, t)
        if i >= len(self._shapes) or (tuple(t.shape), t.dtype) != self._shapes[i]:
            raise RuntimeError(
                f"paging: saved tensor #{i} is {tuple(t.shape)} {t.dtype}, calibration saw "
                f"{self._shapes[i] if i < len(self._shapes) else 'nothing'}; make a new Pager for a new shape"
            )
        if i not in self._page:
            return ("keep", i, t)
        buf = self._buffers[i]
        if t.is_cuda:
            comp, page = torch.cuda.current_stream(t.device), SideStreams.of(t.device).page
            page.wait_stream(comp)
            with torch.cuda.stream(page):
                buf.copy_(t.detach(), non_blocking=True)
            # The device storage must outlive the copy: a manager per paged tensor holds it,
            # and `drain_distance` saves later the compute stream waits on the copy's event
            # and the reference is dropped (rule 1), with no host sync and no record_stream.
            m = LifetimeManager(f"page#{i}")
            m.bind(t, comp)
            m.retire(t, page, "drop_reference")
            self._inflight.append(m)
            while len(self._inflight) > self.drain_distance:
                self._retire_oldest(comp)
        else:
            buf.copy_(t.detach())
        self._stats["bytes_out"] += buf.numel() * buf.element_size()
        return ("paged", i, t.device, t.requires_grad)

    def _unpack(self, packed: Any) -> torch.Tensor:
        kind, i = packed[0], packed[1]
        if self.plan is None:
            self._first_use.setdefault(i, self._unpacks)
            self._unpacks += 1
            return packed[2]
        if kind == "keep":
            return packed[2]
        device, requires_grad = packed[2], packed[3]
        buf = self._buffers[i]
        if device.type == "cuda":
            comp, page = torch.cuda.current_stream(device), SideStreams.of(device).page
            out = torch.empty_like(buf, device=device)  # on the consumer (compute) stream
            page.wait_stream(comp)
            with torch.cuda.stream(page):
                out.copy_(buf, non_blocking=True)
            comp.wait_stream(page)
        else:
            out = buf.clone()
        self._stats["bytes_in"] += buf.numel() * buf.element_size()
        return out.requires_grad_(requires_grad) if requires_grad and out.is_leaf else out

    # -- steps -------------------------------------------------------------------------

    def _retire_oldest(self, comp: torch.Stream) -> None:
        m = self._inflight.pop(0)
        m.acquire(comp)
        m.finalize()
        m.close()

    @contextlib.contextmanager
    def step(self) -> Iterator["Pager"]:
        """One forward + backward with the hooks on; the first one calibrates."""
        self._index = 0
        self._unpacks = 0
        out0, in0 = self._stats["bytes_out"], self._stats["bytes_in"]
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self
            if self.plan is None:
                self._calibrate()
            moved_out, moved_in = self._stats["bytes_out"] - out0, self._stats["bytes_in"] - in0
            if moved_out != moved_in:
                raise RuntimeError(f"paging: {moved_out} bytes paged out but {moved_in} paged in this step (a saved tensor never unpacked?)")
            self._stats["steps"] += 1
        finally:
            while self._inflight:
                self._retire_oldest(torch.cuda.current_stream())

    def _calibrate(self) -> None:
        prefix = []
        for i, c in enumerate(self._calib):
            if c["bytes"] < self.min_bytes or c["weight"] or i not in self._first_use:
                continue
            prefix.append({"name": f"#{i}", "bytes": c["bytes"], "saved_at": i, "used_at": self._first_use[i]})
        # used_at counts backward steps from the boundary: the first unpack is step 0.
        self.plan = page_plan(prefix, self.budget, self.min_distance)
        self._page = {int(n[1:]) for n in self.plan["page"]}
        self._shapes = [(c["shape"], c["dtype"]) for c in self._calib]
        for i in sorted(self._page):
            t = self._calib[i]["t"]
            pin = t.is_cuda
            self._buffers[i] = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
        self._stats["host_bytes"] = sum(b.numel() * b.element_size() for b in self._buffers.values())
        self._calib = []  # drop the references the calibration held

    def stats(self) -> dict[str, int]:
        """Bytes paged out and in (equal after every step), host bytes held, steps."""
        return dict(self._stats)

    def explain(self) -> str:
        """What calibration chose, one line per saved tensor."""
        if self.plan is None:
            return "not calibrated yet"
        p = self.plan
        head = f"paging {len(p['page'])} tensors, {p['bytes_paged']} of {p['bytes_live']} bytes (target {p['target']})"
        return "\n".join([head + (" SHORT of target" if p["short"] else "")] + p["explain"])
