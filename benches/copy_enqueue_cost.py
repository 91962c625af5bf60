"""Host time of queueing one device -> pinned host copy (`copy_(non_blocking=True)` on a side
stream), by size: does a page-out's copy cost the host more the larger the tensor? (Issue 27:
inside the paged Qwen3-MoE step the one-call page copy took about 36 us per call, against a
few us for 64 KiB copies in `page_host_parts.py`'s loop.) Per size: the call alone with the
stream idle (synchronized before each), the call queued right after 8 copies of its size (still
running from 4 MiB up; at 64 KiB each ends before the next is queued), the call on a stream that waits on an event of the compute stream still busy (a
page-out's case: it waits for the work that made its tensor), and a second copy after that one
(waiting2: what a group of page-outs behind one wait would pay per copy); medians, us. Also host
-> device. CUDA only.

    python benches/copy_enqueue_cost.py [--sizes 65536,4194304,67108864,268435456] [--reps 15] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=",".join(str(x) for x in (1 << 16, 1 << 22, 1 << 26, 1 << 28)))
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("copy_enqueue_cost.py needs CUDA")
    side = torch.cuda.Stream()
    rows = []
    print(f"host time to queue one copy, us (median of {a.reps}); {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'bytes':>11} {'d2h idle':>9} {'d2h queued':>11} {'d2h waiting':>12} {'h2d idle':>9} {'h2d queued':>11} {'h2d waiting':>12} {'d2h waiting2':>13} {'h2d waiting2':>13}")
    for n in (int(x) for x in a.sizes.split(",")):
        dev = torch.empty(n, dtype=torch.uint8, device="cuda")
        hosts = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for _ in range(9)]
        row = {"bytes": n}
        for way in ("d2h", "h2d"):

            def queue(h: torch.Tensor) -> None:  # one copy between `dev` and host buffer `h`, this way
                h.copy_(dev, non_blocking=True) if way == "d2h" else dev.copy_(h, non_blocking=True)

            for mode in ("idle", "queued", "waiting", "waiting2"):
                ts = []
                for _ in range(a.reps):
                    torch.cuda.synchronize()
                    if mode in ("waiting", "waiting2"):
                        torch.cuda._sleep(20_000_000)  # about 10 ms of the compute stream
                        side.wait_event(torch.cuda.current_stream().record_event())
                    with torch.cuda.stream(side):
                        if mode == "waiting2":  # a first copy behind the wait; the second is timed
                            queue(hosts[1])
                        if mode == "queued":
                            for h in hosts[1:]:
                                queue(h)
                        t0 = time.perf_counter()
                        queue(hosts[0])
                        ts.append((time.perf_counter() - t0) * 1e6)
                row[f"{way}_{mode}_us"] = statistics.median(ts)
        torch.cuda.synchronize()
        rows.append(row)
        print(f"{n:>11} {row['d2h_idle_us']:>9.1f} {row['d2h_queued_us']:>11.1f} {row['d2h_waiting_us']:>12.1f}"
              f" {row['h2d_idle_us']:>9.1f} {row['h2d_queued_us']:>11.1f} {row['h2d_waiting_us']:>12.1f} {row['d2h_waiting2_us']:>13.1f} {row['h2d_waiting2_us']:>13.1f}")
        del dev, hosts
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
