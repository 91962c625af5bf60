"""Where a paged tensor's host time goes: one page-out and its page-in through a `HostPool`
(what `page_host_us` times), then each CUDA primitive those calls are made of, timed alone
with the host clock (the GPU runs the copies meanwhile: small tensors, so it keeps up), then
the round trip under cProfile by function. CUDA only (on CPU the pool makes plain copies);
prints tables, --json writes the figures.

    python benches/page_host_parts.py [--nbytes 65536] [--reps 2000] [--two-way]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import importlib.util
import io
import json
import os
import pstats
import sys
import time

import torch

if importlib.util.find_spec("sched_lifetime") is None:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "torch_ops"))
import sched_lifetime as sl  # noqa: E402
from sched_lifetime.paging import streams  # noqa: E402
from sched_lifetime.paging.plan import page_host_us  # noqa: E402


def per_call_us(fn, reps: int) -> float:
    """Median over 5 batches of `reps` calls, us per call (host clock)."""
    fn()
    out = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        out.append((time.perf_counter() - t0) * 1e6 / reps)
        torch.cuda.synchronize()
    return sorted(out)[2]


@contextlib.contextmanager
def copy_calls(kind: str):
    """The pool's copies: "native" (one `page_copy` call per copy, as shipped) or "python" (the
    same CUDA calls one by one from Python, as before)."""
    was = streams.PageStreams.native_copy
    streams.PageStreams.native_copy = kind == "native"
    try:
        yield
    finally:
        streams.PageStreams.native_copy = was


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nbytes", type=int, default=1 << 16)
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--two-way", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("page_host_parts.py measures CUDA host calls: no GPU here")
    dev = torch.device("cuda", torch.cuda.current_device())
    t = torch.empty(a.nbytes, dtype=torch.uint8, device=dev)
    pool = sl.HostPool([a.nbytes] * 4, dev, drain_distance=1, two_way=a.two_way)

    def round_trip() -> None:
        p = pool.page_out(t)
        pool.drain()
        out, ev = pool.page_in_launch(p)
        pool.page_wait(ev)
        pool.recycle(ev)

    comp = torch.cuda.current_stream(dev)
    side = torch.cuda.Stream(dev)
    ev = torch.cuda.Event()
    host = torch.empty(a.nbytes, dtype=torch.uint8, pin_memory=True)
    raw = comp.stream_id
    parts = {
        "page_host_us (the plan's figure)": None,
        "round trip: page_out + drain + page_in_launch + page_wait": round_trip,
        "page_out + drain": lambda: (pool.page_out(t), pool.drain(), pool.reclaim()),
        "Event.record": lambda: ev.record(comp),
        "Stream.wait_event": lambda: side.wait_event(ev),
        "torch.cuda.Event()": torch.cuda.Event,
        "Event.query": ev.query,
        "is_current_stream_capturing": torch.cuda.is_current_stream_capturing,
        "_cuda_getCurrentStream": lambda: torch._C._cuda_getCurrentStream(dev.index),
        "_cuda_setStream": lambda: torch._C._cuda_setStream(stream_id=raw, device_index=dev.index, device_type=1),
        "copy_ device->pinned host (non_blocking)": lambda: host.copy_(t, non_blocking=True),
        "copy_ pinned host->device (non_blocking)": lambda: t.copy_(host, non_blocking=True),
        "torch.empty_strided on the device": lambda: torch.empty_strided((a.nbytes,), (1,), dtype=torch.uint8, device=dev),
        "LifetimeManager: new + bind + retire + acquire + finalize + close": None,
    }

    def manager() -> None:
        m = sl.LifetimeManager("page_out")
        m.bind([t], comp)
        m.retire([t], side, "drop_reference")
        m.acquire(comp)
        m.finalize()
        m.close()

    parts["LifetimeManager: new + bind + retire + acquire + finalize + close"] = manager
    parts["Event.record through streams.record (raw)"] = lambda: streams.record(ev, comp)
    parts["Stream.wait_event through streams.wait (raw)"] = lambda: streams.wait(ev, side)
    rows = {}
    for name, fn in parts.items():
        if fn is None:
            rows[name] = page_host_us(dev, a.two_way, a.nbytes, reps=64)
        else:
            rows[name] = per_call_us(fn, a.reps if "round" not in name else a.reps // 4)
    print(f"host time per call, us (H2D/D2H of {a.nbytes} bytes, two_way={a.two_way}, torch {torch.__version__}, {torch.cuda.get_device_name(dev)})")
    for name, us in rows.items():
        print(f"{us:9.2f}  {name}")
    # The pool's copies as one native call each (as shipped) against the same calls from Python
    # (as before), alternating in this process: 64 round trips per measurement, 7 times each.
    ab: dict = {"native": [], "python": []}
    for _ in range(7):
        for kind in ab:
            with copy_calls(kind):
                ab[kind].append(page_host_us(dev, a.two_way, a.nbytes, reps=64))
    print("page_host_us by copy calls, us (7 alternating measurements each): " + "; ".join(
        f"{k}: median {sorted(v)[3]:.1f}, min {min(v):.1f}" for k, v in ab.items()))
    rows.update({f"page_host_us, {k} copy calls (median of 7)": sorted(v)[3] for k, v in ab.items()})
    cp = cProfile.Profile()
    cp.enable()
    for _ in range(500):
        round_trip()
    cp.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(cp, stream=s).sort_stats("tottime").print_stats(30)
    print("== cProfile, 500 round trips, by own time\n" + s.getvalue())
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"nbytes": a.nbytes, "two_way": a.two_way, "us": rows}, f, indent=1)


if __name__ == "__main__":
    main()
