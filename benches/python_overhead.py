"""Per-tensor host overhead of bind + retire + acquire through `sl.LifetimeManager` (its eager
entry, `sched_lifetime._direct`: the ops' Rust calls without the torch.ops round trip) vs an
equivalent pure-Python manager (same checks, same events, same release), side by side; then
the eager pattern against `record_stream`, with the raw torch.ops route beside it.

On CUDA the tensors cross streams (event record, owner wait, resize_(0)); on CPU they retire
on their owner stream (immediate release). Prints a table; --json writes the figures."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

import torch

if importlib.util.find_spec("sched_lifetime") is None:  # PYTHONPATH may name another build (an A/B)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "torch_ops"))
import sched_lifetime as sl  # noqa: E402


class PyManager:
    """The protocol in plain Python: what the ops replace."""

    def __init__(self) -> None:
        self.bindings: dict[int, tuple[torch.Tensor, torch.Stream]] = {}
        self.pending: dict[torch.Stream, list[tuple[torch.Tensor, str]]] = {}
        self.events: dict[torch.Stream, torch.Event] = {}
        self.parked: set[int] = set()

    def bind(self, tensors, owner) -> None:
        for t in tensors:
            b = self.bindings.get(id(t))
            if b is not None and b[1] != owner:
                raise RuntimeError("already bound")
            if id(t) in self.parked:
                raise RuntimeError("already retired")
        for t in tensors:
            self.bindings.setdefault(id(t), (t, owner))

    def retire(self, tensors, consumer, action="empty_storage") -> None:
        seen = set()
        cross = False
        for t in tensors:
            key = t.untyped_storage()._cdata
            if key in seen:
                raise RuntimeError("alias")
            seen.add(key)
            if id(t) in self.parked:
                raise RuntimeError("retired twice")
            b = self.bindings.get(id(t))
            cross |= b is not None and b[1] != consumer
        if cross:
            ev = self.events.get(consumer)
            if ev is None:
                ev = self.events[consumer] = torch.Event(device=consumer.device)
            ev.record(consumer)
        for t in tensors:
            b = self.bindings.pop(id(t), None)
            if b is None:
                if consumer.device.type != "cpu":
                    t.record_stream(consumer)
            elif b[1] == consumer:
                self._release(t, action)
            else:
                self.pending.setdefault(b[1], []).append((t, action, consumer))
                self.parked.add(id(t))

    def acquire(self, stream) -> int:
        q = self.pending.pop(stream, None)
        if not q:
            return 0
        for c in {c for _, _, c in q}:
            stream.wait_event(self.events[c])
        for t, action, _ in q:
            self.parked.discard(id(t))
            self._release(t, action)
        return len(q)

    @staticmethod
    def _release(t: torch.Tensor, action: str) -> None:
        if action == "empty_storage":
            t.untyped_storage().resize_(0)


def measure(kind: str, batch: int, iters: int, device: torch.device) -> tuple[float, float]:
    """Microseconds per tensor: (bind + retire + acquire, retire + acquire alone)."""
    owner = sl.current_stream(device)
    consumer = torch.cuda.Stream(device) if device.type == "cuda" else owner
    mgr = sl.LifetimeManager("bench") if kind == "ops" else PyManager()
    clock = time.perf_counter
    for warm in (True, False):
        n = max(iters // 10, 5) if warm else iters
        # Fresh tensors every iteration: a retired tensor cannot be bound again (rule 8).
        pool = [[torch.empty(16, device=device) for _ in range(batch)] for _ in range(n)]
        t0 = clock()
        part = 0.0
        for i in range(n):
            ts = pool[i]
            mgr.bind(ts, owner)
            t1 = clock()
            mgr.retire(ts, consumer)
            mgr.acquire(owner)
            part += clock() - t1
        dt = clock() - t0
    if device.type == "cuda":
        torch.cuda.synchronize()
    per = 1e6 / (iters * batch)
    return dt * per, part * per


def pattern(kind: str, batch: int, iters: int, device: torch.device, produce: bool = False) -> float:
    """Microseconds per tensor in the eager pattern (Megatron's): tensors produced one at a
    time, then retired together and acquired. `bind_each`: a bind per tensor as produced, then
    one retire + one acquire; `retire_owned`: no binds, one retire that names the owner, then
    one acquire; `release_after`: the same two in one call; `retire_owned_op`: retire + acquire
    through torch.ops (what graphs and capture call); `record_stream`: one record_stream per
    tensor (CUDA only); `record+wait`: the same, plus the owner's `wait_stream(consumer)` that
    the pattern needs anyway before the owner reads what the consumer produced (Megatron's
    compute stream waiting on the all-to-all), which ours' acquire already is. `produce`: the tensors are allocated inside the timed loop (every arm
    pays the same allocations; record_stream's allocator also polls its pending frees' events
    there, which is where its deferred free costs the host); otherwise they are allocated
    before the clock starts."""
    owner = sl.current_stream(device)
    consumer = torch.cuda.Stream(device) if device.type == "cuda" else owner
    mgr = sl.LifetimeManager("pattern")
    retire_owned_op, acquire_op = sl.ops.retire_owned.default, sl.ops.acquire.default
    clock = time.perf_counter
    for warm in (True, False):
        n = max(iters // 10, 5) if warm else iters
        pool = None if produce else [[torch.empty(16, device=device) for _ in range(batch)] for _ in range(n)]
        t0 = clock()
        for i in range(n):
            # The batch's last references die inside the timed loop (`ts = t = None` below), so each
            # arm pays for its free: record_stream's deferred free records an allocator event
            # per recorded stream there, ours released the storage in acquire already.
            if produce:
                ts = [torch.empty(16, device=device) for _ in range(batch)]
            else:
                ts, pool[i] = pool[i], None
            if kind == "bind_each":
                for t in ts:
                    mgr.bind(t, owner)
                mgr.retire(ts, consumer)
                mgr.acquire(owner)
            elif kind == "retire_owned":
                mgr.retire(ts, consumer, owner_stream=owner)
                mgr.acquire(owner)
            elif kind == "release_after":
                mgr.release_after(ts, consumer, owner)
            elif kind == "retire_owned_op":
                retire_owned_op(mgr.handle, ts, owner, consumer, 0)
                acquire_op(mgr.handle, owner)
            else:
                for t in ts:
                    t.record_stream(consumer)
                if kind == "record+wait":
                    owner.wait_stream(consumer)
            ts = t = None  # noqa: F841 (drop the last references here)
        dt = clock() - t0
    if device.type == "cuda":
        torch.cuda.synchronize()
    mgr.finalize()
    return dt * 1e6 / (iters * batch)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    path = "cross-stream (event, wait, resize_(0))" if device.type == "cuda" else "same-stream (immediate resize_(0))"
    print(f"sched_lifetime from {os.path.dirname(os.path.abspath(sl.__file__))}")
    print(f"per-tensor host overhead of bind+retire+acquire on {device}, {path}")
    print(f"{'':>6}{'bind+retire+acquire':^38}{'retire+acquire':^38}")
    print(f"{'batch':>6}" + f"{'sl (us)':>12}{'python (us)':>14}{'sl/python':>12}" * 2)
    rows = []
    for batch in (1, 8, 64):
        iters = max(args.iters // batch, 50)
        ops_us, ops_ra = measure("ops", batch, iters, device)
        py_us, py_ra = measure("python", batch, iters, device)
        rows.append({"batch": batch, "ops_us": ops_us, "python_us": py_us, "ops_retire_acquire_us": ops_ra,
                     "python_retire_acquire_us": py_ra})
        print(f"{batch:>6}{ops_us:>12.2f}{py_us:>14.2f}{ops_us / py_us:>12.2f}{ops_ra:>12.2f}{py_ra:>14.2f}{ops_ra / py_ra:>12.2f}")
    kinds = ["bind_each", "retire_owned", "release_after", "retire_owned_op"] + (["record_stream", "record+wait"] if device.type == "cuda" else [])
    prow = {}
    for produce in (False, True):
        where = "allocated in the timed loop" if produce else "allocated before the clock"
        print(f"\neager pattern on {device} (tensors produced one at a time, retired together; {where}), us per tensor")
        print(f"{'batch':>6}" + "".join(f"{k:>16}" for k in kinds))
        prow["produce" if produce else "pattern"] = rows_here = []
        for batch in (1, 8, 64):
            iters = max(args.iters // batch, 50)
            # Interleaved rounds, the median per arm: host noise (other processes, clocks)
            # falls on every arm alike.
            got = {k: [] for k in kinds}
            for _ in range(3):
                for k in kinds:
                    got[k].append(pattern(k, batch, iters, device, produce))
            med = {k: statistics.median(v) for k, v in got.items()}
            rows_here.append({"batch": batch, **med})
            print(f"{batch:>6}" + "".join(f"{med[k]:>16.2f}" for k in kinds))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "rows": rows, **prow}, f, indent=1)


if __name__ == "__main__":
    main()
