"""The emulated EP link's own rate (issue 28): `HostLinkAllToAll` all-to-alls of a few sizes on
one GPU, beside `sched_lifetime.paging.link_rates` (plain device -> pinned host and pinned host
-> device copies) for the same crossing bytes. One table.

A message of `k * j` MiB keeps rank 0's 1/k on the device and moves the other `(k-1) * j` MiB
device -> host, then host -> device, both on the current stream one after the other. Columns:
`link GB/s` is crossing bytes (one direction) per message time (the local copy and the host
work included); `serial GB/s` is what the two copies alone allow, 1 / (1/d2h + 1/h2d) from
`link_rates` for the same bytes; `link/serial` their ratio (the issue's target: within 10%).
A real EP link sends and receives at once; these copies do not overlap, so the emulated link
runs at about half of one direction's rate (`d2h`, `h2d`).

    PYTHONPATH=torch_ops python3 benches/link_rate.py [--k 8] [--j 1,4,16,64] [--reps 20]

On a machine without a GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import sys

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=8, help="emulated EP ranks (default 8)")
    ap.add_argument("--j", default="1,4,16,64", help="message sizes as multiples of k MiB (comma-separated)")
    ap.add_argument("--hidden", type=int, default=4096, help="row width (bf16 elements)")
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("link_rate.py: the emulated link's rate needs a CUDA GPU (PCIe copy engines); none here, nothing measured")
        return
    from sched_lifetime.ep import HostLinkAllToAll
    from sched_lifetime.paging import link_rates

    dev = torch.device("cuda", torch.cuda.current_device())
    k, row = a.k, a.hidden * 2
    if (1 << 20) % row:
        sys.exit(f"--hidden {a.hidden}: a MiB must hold whole rows of {row} bytes")
    link = HostLinkAllToAll(k, device=dev)
    header = f"{'message MiB':>11} {'cross MiB':>9} {'us/msg':>9} {'link GB/s':>9} {'d2h GB/s':>8} {'h2d GB/s':>8} {'serial GB/s':>11} {'link/serial':>11}"
    print(f"emulated EP link, k={k}, {torch.cuda.get_device_name(dev)}, {a.reps} messages per size, bf16 rows of {a.hidden}")
    print(header)
    for j in (int(s) for s in a.j.split(",")):
        rows = k * j * ((1 << 20) // row)  # k*j MiB; the (k-1)/k that crosses is (k-1)*j MiB
        x = torch.randn(rows, a.hidden, device=dev).to(torch.bfloat16)
        for _ in range(2):  # warm: host buffers allocated, kernels loaded
            link.all_to_all(x, rows, None, None)
        torch.cuda.synchronize(dev)
        link.reset_moved()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(a.reps):
            out = link.all_to_all(x, rows, None, None)
        end.record()
        end.synchronize()
        if not torch.equal(out.view(torch.int16), x.view(torch.int16)):
            sys.exit("link_rate.py: the emulated link changed the data")
        us = start.elapsed_time(end) * 1e3 / a.reps
        cross = link.moved().d2h // a.reps
        assert cross == (k - 1) * j << 20, cross
        d2h, h2d = (r / 1e3 for r in link_rates(dev, mib=(k - 1) * j, reps=5))  # GB/s
        serial = 1 / (1 / d2h + 1 / h2d)
        rate = cross / us / 1e3
        print(f"{k * j:>11} {(k - 1) * j:>9} {us:>9.1f} {rate:>9.2f} {d2h:>8.2f} {h2d:>8.2f} {serial:>11.2f} {rate / serial:>11.3f}")
        del x, out
    print(f"pinned host buffers: {link.allocations} allocations, {link.host_bytes >> 20} MiB held")


if __name__ == "__main__":
    main()
