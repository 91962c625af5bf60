"""Host time of the pager's page-out / page-in calls (no profiler): a group of N saved tensors
as one `page_out_group` / `page_in_group`, against N single `page_out` / `page_in_launch`
calls, the GPU idle before each call (synchronized), medians over reps. One GPU.

    PYTHONPATH=torch_ops python3 benches/page_host_cost.py --tensors 15 --mib 20
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import sched_lifetime as sl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensors", type=int, default=15)
    ap.add_argument("--mib", type=float, default=20)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    dev = torch.device("cuda")
    n = int(a.mib * 2**20) // 2
    ts = [torch.randn(n // 64, 64, device=dev, dtype=torch.bfloat16) for _ in range(a.tensors)]
    sizes = [t.numel() * t.element_size() for t in ts]
    comp = torch.cuda.current_stream(dev)
    rows = {}
    for kind in ("group", "single"):
        pool = sl.HostPool([sl.paging.group_plan(ts).nbytes] if kind == "group" else sizes, dev)
        out_us, in_us = [], []
        for _ in range(a.reps + 2):
            torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            if kind == "group":
                ps = pool.page_out_group(ts, owner=comp, ordered=True)
            else:
                ps = [pool.page_out(t, owner=comp) for t in ts]
            t1 = time.perf_counter()
            torch.cuda.synchronize(dev)
            pool.drain()
            torch.cuda.synchronize(dev)
            t2 = time.perf_counter()
            if kind == "group":
                back, ev = pool.page_in_group(ps, alloc_stream=comp)
            else:
                back = [pool.page_in_launch(p, alloc_stream=comp)[0] for p in ps]
            t3 = time.perf_counter()
            torch.cuda.synchronize(dev)
            assert all(torch.equal(b, t) for b, t in zip(back, ts))
            del back
            out_us.append((t1 - t0) * 1e6)
            in_us.append((t3 - t2) * 1e6)
        rows[kind] = (statistics.median(out_us[2:]), statistics.median(in_us[2:]))
    print(f"host us per call, {a.tensors} tensors of {a.mib} MiB (medians of {a.reps}):")
    for kind, (o, i) in rows.items():
        print(f"  {kind:<7} page-out {o:8.1f}  page-in {i:8.1f}")


if __name__ == "__main__":
    main()
