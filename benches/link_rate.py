"""The emulated EP link's own rate (issue 28): `HostLinkAllToAll` all-to-alls of a few sizes on
one GPU, full duplex (the default) and serial, beside the plain copy rates for the same bytes.
One table.

A message of `k * j` MiB keeps rank 0's 1/k on the device and moves the other `(k-1) * j` MiB
device -> pinned host -> device. Columns, all GB/s of crossing bytes (one direction) per
message time (the local copy and the host work included for the link):
- `duplex`: the default link, chunked: device -> host of chunk i on the current stream while
  host -> device of chunk i-1 runs on the helper stream;
- `serial`: `duplex=False`, both copies on the current stream one after the other;
- `d2h`, `h2d`: `sched_lifetime.paging.link_rates`, one direction alone (plain copies);
- `both`: the same bytes device -> host and host -> device at once on two streams (plain
  copies), per direction: the ceiling of a link that sends and receives at once when the two
  directions share the bus;
- `duplex/1way`: duplex against the slower one-way rate (the issue's target: within 10% for
  large messages; above `both`'s share it cannot go); `duplex/both`: against the ceiling.

    PYTHONPATH=torch_ops python3 benches/link_rate.py [--k 8] [--j 1,4,16,64] [--reps 20] [--chunks 8] [--min-chunk-mib 1]

On a machine without a GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import sys

import torch


def both_ways(dev: torch.device, nbytes: int, reps: int) -> float:
    """GB/s per direction of `nbytes` device -> pinned host and pinned host -> device at once,
    each on its own stream, `reps` times after a warm-up, timed with CUDA events."""
    d_src, h_dst = torch.empty(nbytes, dtype=torch.uint8, device=dev), torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    h_src, d_dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), torch.empty(nbytes, dtype=torch.uint8, device=dev)
    main = torch.cuda.current_stream(dev)
    side = torch.cuda.Stream(dev)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for timed in (False, True):
        torch.cuda.synchronize(dev)
        if timed:
            start.record(main)
        side.wait_stream(main)
        for _ in range(reps if timed else 1):
            h_dst.copy_(d_src, non_blocking=True)
            with torch.cuda.stream(side):
                d_dst.copy_(h_src, non_blocking=True)
        main.wait_stream(side)
        if timed:
            end.record(main)
    end.synchronize()
    return reps * nbytes / (start.elapsed_time(end) * 1e6)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=8, help="emulated EP ranks (default 8)")
    ap.add_argument("--j", default="1,4,16,64", help="message sizes as multiples of k MiB (comma-separated)")
    ap.add_argument("--hidden", type=int, default=4096, help="row width (bf16 elements)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--chunks", type=int, default=8, help="duplex: most chunks a message is split into (the link's default 8)")
    ap.add_argument("--min-chunk-mib", type=float, default=1.0, help="duplex: no chunk below this (the link's default 1 MiB)")
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
    links = {
        "duplex": HostLinkAllToAll(k, device=dev, chunks=a.chunks, min_chunk_bytes=int(a.min_chunk_mib * (1 << 20))),
        "serial": HostLinkAllToAll(k, device=dev, duplex=False),
    }
    print(f"emulated EP link, k={k}, {torch.cuda.get_device_name(dev)}, {a.reps} messages per size, bf16 rows of {a.hidden}; {links['duplex'].describe()}")
    print("GB/s of crossing bytes, one direction, per message (link) or per copy (plain)")
    print(
        f"{'message MiB':>11} {'cross MiB':>9} {'chunks':>6} {'duplex us':>9} {'duplex':>7} {'serial':>7} "
        f"{'d2h':>7} {'h2d':>7} {'both':>7} {'duplex/1way':>11} {'duplex/both':>11}"
    )
    for j in (int(s) for s in a.j.split(",")):
        rows = k * j * ((1 << 20) // row)  # k*j MiB; the (k-1)/k that crosses is (k-1)*j MiB
        x = torch.randn(rows, a.hidden, device=dev).to(torch.bfloat16)
        us, chunks = {}, 0
        for name, link in links.items():
            for _ in range(2):  # warm: host buffers, events and streams made, kernels loaded
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
                sys.exit(f"link_rate.py: the {name} link changed the data")
            us[name] = start.elapsed_time(end) * 1e3 / a.reps
            moved = link.moved()
            assert moved.d2h // a.reps == (k - 1) * j << 20, moved
            if name == "duplex":
                chunks = moved.chunks // a.reps
            del out
        cross = (k - 1) * j << 20
        rates = link_rates(dev, mib=(k - 1) * j, reps=5)
        d2h, h2d = rates.d2h / 1e3, rates.h2d / 1e3  # GB/s
        both = both_ways(dev, cross, 5)
        rate = {n: cross / t / 1e3 for n, t in us.items()}
        print(
            f"{k * j:>11} {(k - 1) * j:>9} {chunks:>6} {us['duplex']:>9.1f} {rate['duplex']:>7.2f} {rate['serial']:>7.2f} "
            f"{d2h:>7.2f} {h2d:>7.2f} {both:>7.2f} {rate['duplex'] / min(d2h, h2d):>11.3f} {rate['duplex'] / both:>11.3f}"
        )
        del x
    for name, link in links.items():
        print(f"{name}: pinned host buffers: {link.allocations} allocations, {link.host_bytes >> 20} MiB held")


if __name__ == "__main__":
    main()
