"""Does the host thread slow down while the copy engines move data to and from pinned host
memory? Paging's traced steps (benches/trace_stalls.py on `hf_paging_ab.py --profile --trace`)
showed every operator's host time about 2x longer in the paged forward than in the unpaged one;
this measures the host's own speed with nothing else running and with the copy engines busy.

For each background (none, device->host, host->device, both), with the copies queued on side
streams long enough to cover the measurement:

    launch   us per small kernel launch (`x.add_(1)` on a 1-element tensor, compute stream)
    cpu op   us per small CPU operator (`add` of two 4-element tensors: the dispatcher's host cost)
    python   us per 1000 iterations of a pure-Python loop (no CUDA)
    memory   us to sum a 64 MiB CPU tensor (host memory bandwidth)

and the machine's NUMA layout (the GPU's node, this thread's CPUs).

    python benches/host_under_dma.py [--mib 1024] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def numa() -> dict:
    out: dict = {"cpus": sorted(os.sched_getaffinity(0))}
    try:
        bus = torch.cuda.get_device_properties(0).pci_bus_id if hasattr(torch.cuda.get_device_properties(0), "pci_bus_id") else None
    except Exception:
        bus = None
    if bus is None:
        try:
            import subprocess

            bus = subprocess.run(["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip().splitlines()[0]
        except Exception:
            bus = None
    out["gpu_bus"] = bus
    if bus:
        b = bus.lower()
        b = b[4:] if len(b.split(":")[0]) == 8 else b  # 00000000:19:00.0 -> 0000:19:00.0
        for cand in (f"/sys/bus/pci/devices/{b}/numa_node", f"/sys/bus/pci/devices/{bus.lower()}/numa_node"):
            if os.path.exists(cand):
                out["gpu_numa_node"] = open(cand).read().strip()
    nodes = "/sys/devices/system/node"
    if os.path.isdir(nodes):
        out["nodes"] = {n: open(f"{nodes}/{n}/cpulist").read().strip() for n in sorted(os.listdir(nodes)) if n.startswith("node")}
    return out


def measure(reps: int = 7) -> dict:
    x = torch.zeros(1, device="cuda")
    cpu = torch.ones(16 << 20)  # 64 MiB
    small = torch.ones(4)
    launch, python, memory, cpu_op = [], [], [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(500):
            x.add_(1)
        launch.append((time.perf_counter() - t0) / 500 * 1e6)
        t0 = time.perf_counter()
        s = 0
        for i in range(100_000):
            s += i
        python.append((time.perf_counter() - t0) / 100 * 1e6)
        t0 = time.perf_counter()
        for _ in range(500):
            small.add(1)
        cpu_op.append((time.perf_counter() - t0) / 500 * 1e6)
        t0 = time.perf_counter()
        cpu.sum()
        memory.append((time.perf_counter() - t0) * 1e6)
    return {k: statistics.median(v) for k, v in (("launch_us", launch), ("python_us_per_1000", python), ("cpu_op_us", cpu_op), ("memory_us", memory))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=1024, help="bytes per copy")
    ap.add_argument("--json")
    a = ap.parse_args()
    n = a.mib << 20
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    dev2 = torch.empty(n, dtype=torch.uint8, device="cuda")
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    host2 = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    d2h, h2d = torch.cuda.Stream(), torch.cuda.Stream()
    rows = {}
    for bg in ("none", "d2h", "h2d", "both", "none_again"):
        torch.cuda.synchronize()
        copies = 40  # at ~55 GB/s, 40 x 1 GiB is about 0.8 s per direction: longer than a measurement
        if bg in ("d2h", "both"):
            with torch.cuda.stream(d2h):
                for _ in range(copies):
                    host.copy_(dev, non_blocking=True)
        if bg in ("h2d", "both"):
            with torch.cuda.stream(h2d):
                for _ in range(copies):
                    dev2.copy_(host2, non_blocking=True)
        t0 = time.perf_counter()
        rows[bg] = measure()
        rows[bg]["measure_ms"] = (time.perf_counter() - t0) * 1e3
        busy = not (d2h.query() and h2d.query())
        rows[bg]["copies_still_running_at_end"] = busy
        torch.cuda.synchronize()
    info = numa()
    print(f"host under DMA: {torch.cuda.get_device_name()}, torch {torch.__version__}, copies of {a.mib} MiB; NUMA {info}")
    print(f"{'background':<12} {'launch us':>10} {'cpu op us':>10} {'python us/1k':>13} {'64MiB sum us':>13}  copies covered the measurement")
    for bg, r in rows.items():
        print(f"{bg:<12} {r['launch_us']:10.2f} {r['cpu_op_us']:10.2f} {r['python_us_per_1000']:13.2f} {r['memory_us']:13.1f}  {r['copies_still_running_at_end']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"numa": info, "rows": rows, "mib": a.mib}, f, indent=1)


if __name__ == "__main__":
    main()
