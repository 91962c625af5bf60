"""Where a step's GPU idle time goes, from a Chrome trace of one profiled step (torch.profiler
with CPU and CUDA activity, as `benches/hf_paging_ab.py --profile --trace DIR` writes them).

The compute stream is the stream that ran the most kernels. Each gap between two of its kernels
is split by when the next kernel was launched (its runtime call, matched by correlation id):

    host late   the launch call ended after the gap began: the GPU waited for the host
    stalled     the kernel was queued before the gap began and still did not run: it waited on
                something else (an event of another stream: a page-in, a released page-out,
                a collective), or the launch latency (a few us a gap)
    under copy  the part of `stalled` while a memcpy ran on another stream

and the host's side: the CUDA runtime calls and the operators (inclusive times) that took the
most time.

`--kernels-vs REF`: where the compute stream's busy time grew against a reference trace (an
unpaged step): per kernel name the count and time in both, the largest differences first; the
time kernels of a name run as often as in REF took more than their same occurrence there, split
by whether a copy ran under at least half of the kernel (the copies' memory traffic slowing it)
or not; and the time added by names run more (or less) often than in REF.

`--host-speed REF`: how fast the host thread ran over the step, against a reference trace (an
unpaged step): each operator's self time (its time minus the operators and runtime calls it
made) divided by the median self time of the same operator in REF, the median of those ratios
per 10 ms of the step, `*` where a device -> host copy ran more than half of it, and where the
forward ended (the first backward event). A host slowed by the copies' traffic shows as ratios
above 1 in the starred bins only.

    python benches/trace_stalls.py TRACE.json [TRACE2.json ...]
    python benches/trace_stalls.py --host-speed REF.json TRACE.json [...]
    python benches/trace_stalls.py --kernels-vs REF.json TRACE.json [...]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "torch_ops"))
from sched_lifetime.train.figures import union  # noqa: E402  (the interval union the profile figures use)


def load(path: str) -> list:
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        d = json.load(f)
    return d["traceEvents"] if isinstance(d, dict) else d


def analyse(events: list) -> dict:
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    # Merged: copies on two streams at once count once.
    copies = union([(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X" and e.get("cat") in ("gpu_memcpy", "gpu_memset")
                    and "Memcpy" in e.get("name", "")])
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    streams = collections.Counter(e["args"].get("stream") for e in kernels)
    if not streams:
        return {}
    compute = streams.most_common(1)[0][0]
    ks = sorted((e for e in kernels if e["args"].get("stream") == compute), key=lambda e: e["ts"])
    busy = sum(e["dur"] for e in ks)
    late = stalled = under_copy = 0.0
    waits = collections.Counter()
    for prev, nxt in zip(ks, ks[1:]):
        g0, g1 = prev["ts"] + prev["dur"], nxt["ts"]
        if g1 <= g0:
            continue
        launch = launches.get(nxt["args"].get("correlation"))
        queued = (launch["ts"] + launch["dur"]) if launch else g0
        lt = min(max(0.0, queued - g0), g1 - g0)
        late += lt
        s0 = g0 + lt
        stalled += g1 - s0
        for c0, c1 in copies:
            if c0 >= g1:
                break
            under_copy += max(0.0, min(c1, g1) - max(c0, s0))
        if g1 - s0 > 50:
            waits[prev["name"][:60]] += g1 - s0
    span = ks[-1]["ts"] + ks[-1]["dur"] - ks[0]["ts"]
    runtime, ops = collections.Counter(), collections.Counter()
    counts = collections.Counter()
    for e in events:
        if e.get("ph") != "X":
            continue
        if e.get("cat") == "cuda_runtime":
            runtime[e["name"]] += e["dur"]
            counts[e["name"]] += 1
        elif e.get("cat") == "cpu_op":
            ops[e["name"]] += e["dur"]
            counts[e["name"]] += 1
    return {"stream": compute, "kernels": len(ks), "span_ms": span / 1e3, "busy_ms": busy / 1e3, "idle_ms": (span - busy) / 1e3,
            "host_late_ms": late / 1e3, "stalled_ms": stalled / 1e3, "stalled_under_copy_ms": under_copy / 1e3,
            "copy_ms": sum(c1 - c0 for c0, c1 in copies) / 1e3,  # time with any copy running
            "top_stalls_after": [(k, v / 1e3) for k, v in waits.most_common(5)],
            "top_runtime_calls": [(k, v / 1e3, counts[k]) for k, v in runtime.most_common(6)],
            "top_cpu_ops": [(k, v / 1e3, counts[k]) for k, v in ops.most_common(10)],
            "our_ops": [(k, v / 1e3, counts[k]) for k, v in ops.most_common() if "sched_lifetime" in k]}


def compute_kernels(events: list) -> list:
    """The kernels of the stream that ran the most, in time order."""
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    streams = collections.Counter(e["args"].get("stream") for e in kernels)
    if not streams:
        return []
    compute = streams.most_common(1)[0][0]
    return sorted((e for e in kernels if e["args"].get("stream") == compute), key=lambda e: e["ts"])


def kernels_vs(ref: list, events: list, width: int = 90) -> dict:
    """The compute stream's kernels of `events` against `ref`'s (see the module docstring)."""
    rk, ks = compute_kernels(ref), compute_kernels(events)
    by_ref: dict = collections.defaultdict(list)
    by: dict = collections.defaultdict(list)
    for e in rk:
        by_ref[e["name"][:width]].append(e["dur"])
    for e in ks:
        by[e["name"][:width]].append(e["dur"])
    rows = [(n, len(by_ref.get(n, ())), sum(by_ref.get(n, ())) / 1e3, len(by.get(n, ())), sum(by.get(n, ())) / 1e3)
            for n in set(by_ref) | set(by)]
    rows.sort(key=lambda r: -abs(r[4] - r[2]))
    copies = union([(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X" and e.get("cat") == "gpu_memcpy"])
    nth: dict = collections.Counter()
    under = free = changed = 0.0
    n_under = n_free = 0
    for e in ks:
        n = e["name"][:width]
        ref_durs = by_ref.get(n, ())
        if len(ref_durs) != len(by[n]):  # run a different number of times: counted apart
            changed += e["dur"]
            continue
        extra = e["dur"] - ref_durs[nth[n]]  # the same name's same occurrence in REF
        nth[n] += 1
        a, b = e["ts"], e["ts"] + e["dur"]
        cov = sum(max(0.0, min(b, c1) - max(a, c0)) for c0, c1 in copies if c0 < b and c1 > a)
        if e["dur"] > 0 and cov >= 0.5 * e["dur"]:
            under += extra
            n_under += 1
        else:
            free += extra
            n_free += 1
    changed -= sum(sum(v) for n, v in by_ref.items() if len(v) != len(by.get(n, ())))
    return {"busy_ref_ms": sum(e["dur"] for e in rk) / 1e3, "busy_ms": sum(e["dur"] for e in ks) / 1e3,
            "kernels_ref": len(rk), "kernels": len(ks), "rows": rows[:12],
            "extra_under_copy_ms": under / 1e3, "kernels_under_copy": n_under,
            "extra_no_copy_ms": free / 1e3, "kernels_no_copy": n_free, "count_changed_ms": changed / 1e3}


def self_times(events: list) -> tuple[list, float, list]:
    """(start us from the first operator, name, self time us) of every operator on the host, the
    forward's end (the first backward event, same origin) and the device -> host copies'
    intervals (same origin)."""
    calls = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver"):
            calls[e.get("tid")].append(e)
    own: dict = {}
    for evs in calls.values():  # self = duration minus the direct children on the same thread
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list = []
        for e in evs:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            own.setdefault(id(e), e["dur"])
            if stack:
                own[id(stack[-1])] -= e["dur"]
            stack.append(e)
    ops = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"), key=lambda e: e["ts"])
    if not ops:
        return [], 0.0, []
    t0 = ops[0]["ts"]
    bwd = [e["ts"] for e in events if e.get("ph") == "X" and "backward" in e.get("name", "").lower()
           and e.get("cat") in ("cpu_op", "python_function", "user_annotation")]
    d2h = [(e["ts"] - t0, e["ts"] + e["dur"] - t0) for e in events if e.get("ph") == "X" and e.get("cat") == "gpu_memcpy" and "DtoH" in e.get("name", "")]
    return [(e["ts"] - t0, e["name"], own[id(e)]) for e in ops], (min(bwd) - t0 if bwd else float("nan")), d2h


def host_speed(ref: list, events: list, bin_us: float = 10_000) -> tuple[list, float]:
    """Per `bin_us` of the step: (bin start ms, median of each operator's self time over its
    median in `ref`'s self times, share of the bin with a device -> host copy running); and the
    forward's end in ms. Operators seen fewer than 20 times in `ref` are left out."""
    by = collections.defaultdict(list)
    for _, name, own in self_times(ref)[0]:
        by[name].append(own)
    med = {n: statistics.median(v) for n, v in by.items() if len(v) >= 20 and statistics.median(v) > 0}
    ops, fwd_end, d2h = self_times(events)
    out = []
    t = 0.0
    while ops and t <= ops[-1][0]:
        r = [own / med[n] for s, n, own in ops if t <= s < t + bin_us and n in med]
        cov = sum(max(0.0, min(t + bin_us, b) - max(t, a)) for a, b in d2h if a < t + bin_us and b > t) / bin_us
        out.append((t / 1e3, statistics.median(r) if r else None, cov))
        t += bin_us
    return out, fwd_end / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--kernels-vs", metavar="REF", help="each trace's compute-stream kernels against REF's")
    ap.add_argument("--host-speed", metavar="REF", help="per 10 ms of each trace, its operators' self times against REF's")
    a = ap.parse_args()
    if a.host_speed:
        ref = load(a.host_speed)
        for path in a.traces:
            bins, fwd_end = host_speed(ref, load(path))
            print(f"{path.rsplit('/', 1)[-1]}: forward ends at {fwd_end:.0f} ms; per 10 ms, operators' self time / REF's (* = D2H copy > half):")
            print("    " + " ".join(f"{t:.0f}:{'-' if r is None else f'{r:.2f}'}{'*' if c > 0.5 else ''}" for t, r, c in bins))
        return
    if a.kernels_vs:
        ref = load(a.kernels_vs)
        for path in a.traces:
            r = kernels_vs(ref, load(path))
            print(f"{path.rsplit('/', 1)[-1]}: busy {r['busy_ms']:.1f} ms in {r['kernels']} kernels, REF {r['busy_ref_ms']:.1f} ms in {r['kernels_ref']}; "
                  f"against the same kernel in REF: {r['extra_under_copy_ms']:+.2f} ms in {r['kernels_under_copy']} kernels under a copy, "
                  f"{r['extra_no_copy_ms']:+.2f} ms in {r['kernels_no_copy']} not; kernels run more or less often than in REF {r['count_changed_ms']:+.2f} ms")
            print(f"    {'REF n':>6} {'REF ms':>8} {'n':>6} {'ms':>8}  kernel")
            for n, rn, rms, kn, kms in r["rows"]:
                print(f"    {rn:>6} {rms:>8.2f} {kn:>6} {kms:>8.2f}  {n}")
        return
    print(f"{'trace':<40}{'span ms':>9}{'busy':>8}{'idle':>8}{'host late':>10}{'stalled':>9}{'under copy':>11}{'copies':>8}")
    for path in a.traces:
        r = analyse(load(path))
        if not r:
            print(f"{path}: no kernels")
            continue
        name = path.rsplit("/", 1)[-1]
        print(f"{name:<40}{r['span_ms']:>9.1f}{r['busy_ms']:>8.1f}{r['idle_ms']:>8.1f}{r['host_late_ms']:>10.1f}{r['stalled_ms']:>9.1f}"
              f"{r['stalled_under_copy_ms']:>11.1f}{r['copy_ms']:>8.1f}")
        for k, v in r["top_stalls_after"]:
            print(f"    stalled {v:.2f} ms after {k}")
        for k, v, n in r["top_runtime_calls"]:
            print(f"    runtime {k}: {v:.2f} ms in {n} calls")
        for k, v, n in r["top_cpu_ops"] + r["our_ops"]:
            print(f"    host op {k}: {v:.2f} ms in {n} calls (inclusive)")


if __name__ == "__main__":
    main()
