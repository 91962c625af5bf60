"""Host time of queueing one device -> pinned host copy (`copy_(non_blocking=True)` on a side
stream), by size: does a page-out's copy cost the host more the larger the tensor? (Issue 27:
inside the paged Qwen3-MoE step the one-call page copy took about 36 us per call, against a
few us for 64 KiB copies in `page_host_parts.py`'s loop.) Per size: the call alone with the
stream idle (synchronized before each), the call queued right after 8 copies of its size (still
running from 4 MiB up; at 64 KiB each ends before the next is queued), the call on a stream that waits on an event of the compute stream still busy (a
page-out's case: it waits for the work that made its tensor), and a second copy after that one
(waiting2: what a group of page-outs behind one wait would pay per copy); medians, us. Also host
-> device. Controls (`--controls`): the wait on an event that is already done (recorded and
synchronized before the wait: is it the wait, or the unfinished work?), and the compute stream's
side of a release: the host time of a small kernel launched on the compute stream right after it
waits on an event of a side stream still copying (a page-out's release), against the same launch
with no wait. CUDA only.

    python benches/copy_enqueue_cost.py [--sizes 65536,4194304,67108864,268435456] [--reps 15] [--controls] [--json OUT]
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
    ap.add_argument("--controls", action="store_true", help="also the done-event wait and the kernel launch behind a wait (see above)")
    ap.add_argument("--json")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("copy_enqueue_cost.py needs CUDA")
    side = torch.cuda.Stream()
    rows = []
    print(f"host time to queue one copy, us (median of {a.reps}); {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'bytes':>11} {'d2h idle':>9} {'d2h queued':>11} {'d2h waiting':>12} {'h2d idle':>9} {'h2d queued':>11} {'h2d waiting':>12} {'d2h waiting2':>13} {'h2d waiting2':>13}"
          + (f" {'d2h waiting done':>16} {'h2d waiting done':>16}" if a.controls else ""))
    for n in (int(x) for x in a.sizes.split(",")):
        dev = torch.empty(n, dtype=torch.uint8, device="cuda")
        hosts = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for _ in range(9)]
        row = {"bytes": n}
        for way in ("d2h", "h2d"):

            def queue(h: torch.Tensor) -> None:  # one copy between `dev` and host buffer `h`, this way
                h.copy_(dev, non_blocking=True) if way == "d2h" else dev.copy_(h, non_blocking=True)

            modes = ("idle", "queued", "waiting", "waiting2") + (("waiting_done",) if a.controls else ())
            for mode in modes:
                ts = []
                for _ in range(a.reps):
                    torch.cuda.synchronize()
                    if mode in ("waiting", "waiting2"):
                        torch.cuda._sleep(20_000_000)  # about 10 ms of the compute stream
                        side.wait_event(torch.cuda.current_stream().record_event())
                    if mode == "waiting_done":  # control: the same wait, on an event already done
                        ev = torch.cuda.current_stream().record_event()
                        ev.synchronize()
                        side.wait_event(ev)
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
              f" {row['h2d_idle_us']:>9.1f} {row['h2d_queued_us']:>11.1f} {row['h2d_waiting_us']:>12.1f} {row['d2h_waiting2_us']:>13.1f} {row['h2d_waiting2_us']:>13.1f}"
              + (f" {row['d2h_waiting_done_us']:>16.1f} {row['h2d_waiting_done_us']:>16.1f}" if a.controls else ""))
        if a.controls:
            row.update(release_launch(dev, hosts[0], side, a.reps))
            print(f"{'':>11} kernel on the compute stream, us: alone {row['launch_alone_us']:.1f}, behind compute {row['launch_busy_us']:.1f}, "
                  f"right after a wait on a copy still running {row['launch_after_wait_us']:.1f}, after a wait on a done copy {row['launch_after_done_us']:.1f}")
        del dev, hosts
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


def release_launch(dev: torch.Tensor, host: torch.Tensor, side: torch.cuda.Stream, reps: int) -> dict:
    """A release's compute-stream side: the host time of launching a small kernel on the compute
    stream alone (idle GPU), behind busy compute, right after the compute stream waits on an
    event of `side` still copying `dev` to `host` (as a page-out's release does when the host
    runs ahead), and after a wait on a copy already done. Medians, us."""
    small = torch.zeros(256, device="cuda")
    comp = torch.cuda.current_stream()
    out = {}
    for mode in ("alone", "busy", "after_wait", "after_done"):
        ts = []
        for _ in range(reps):
            torch.cuda.synchronize()
            if mode == "busy":
                torch.cuda._sleep(20_000_000)
            if mode in ("after_wait", "after_done"):
                with torch.cuda.stream(side):
                    host.copy_(dev, non_blocking=True)
                ev = side.record_event()
                if mode == "after_done":
                    ev.synchronize()
                comp.wait_event(ev)
            t0 = time.perf_counter()
            small.add_(1)
            ts.append((time.perf_counter() - t0) * 1e6)
        out[f"launch_{mode}_us"] = statistics.median(ts)
    torch.cuda.synchronize()
    return out


if __name__ == "__main__":
    main()
