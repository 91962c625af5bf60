"""GPU A/B of issue orders for one MoE chunk (forward of one microbatch + backward of another)
on real streams, run by the package's executor (each node on the stream its schedule names): our
schedule vs Megatron-LM's fixed combined-1F1B order vs backward-then-forward (torchtitan's
multiplexed graph today) vs everything on one stream, same process.

Compute nodes are bf16 matmuls on the current stream, sized to the graph's costs; each EP
dispatch/combine is a device-to-pinned-host copy on a high-priority side stream, sized the same
way: on one GPU the copy engine stands in for the all-to-all (a device-to-device copy would be
an SM kernel and could not run beside the matmuls). Like the real transports (`AllToAll`,
the emulated link, torch's NCCL groups), a copy first makes its stream wait for everything issued
to the compute stream so far (they allocate the received rows there: `wait_stream`), so compute
issued ahead of a launch delays it; `--edge-only-comm` leaves that wait out (the stand-in before
2026-12-04). Each order runs with the record/wait edges its schedule lists. Prints a table;
--json writes the figures."""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "torch_ops"))
import sched_lifetime as sl  # noqa: E402

MM = 4096
SMALL = 8  # a small matmul has MM / SMALL rows: the unit for what a full one would overshoot


def calibrate() -> tuple[float, float, float]:
    """(us per 4096^3 bf16 matmul, us per 512x4096x4096 one, us per MiB of device-to-host copy)."""
    a = torch.randn(MM, MM, device="cuda", dtype=torch.bfloat16)
    src = torch.empty(512 << 20, device="cuda", dtype=torch.uint8)
    dst = torch.empty(512 << 20, dtype=torch.uint8, pin_memory=True)

    def timed(fn, n: int) -> float:
        for _ in range(3):
            fn()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(n):
            fn()
        e.record()
        torch.cuda.synchronize()
        return s.elapsed_time(e) * 1e3 / n

    mm_us = timed(lambda: a @ a, 50)
    small_us = timed(lambda: a[: MM // SMALL] @ a, 50)
    copy_us_per_mib = timed(lambda: dst.copy_(src, non_blocking=True), 5) / 512
    return mm_us, small_us, copy_us_per_mib


class Runner:
    """Each arm is an `sl.Executor` over the same graph: compute nodes are matmuls sized to their
    cost, launches are device-to-host copies sized to theirs; every node runs on the stream its
    schedule names, with that schedule's record/wait edges."""

    def __init__(self, graph: dict, mm_us: float, small_us: float, copy_us_per_mib: float, launch_wait: bool = True) -> None:
        self.graph = graph
        self.launch_wait = launch_wait
        self.compute: "torch.cuda.Stream | None" = None  # the stream a run starts on (`_timed`)
        self.nodes = {n["name"]: n for n in graph["nodes"]}
        self.mm_us, self.small_us, self.copy_us_per_mib = mm_us, small_us, copy_us_per_mib
        self.a = torch.randn(MM, MM, device="cuda", dtype=torch.bfloat16)
        self.out = torch.empty(MM, MM, device="cuda", dtype=torch.bfloat16)
        self.small = self.a[: MM // SMALL]
        self.small_out = torch.empty(MM // SMALL, MM, device="cuda", dtype=torch.bfloat16)
        big = max((n.get("cost", 0) for n in graph["nodes"] if n["kind"] == "comm_launch"), default=0)
        self.max_bytes = int(big / copy_us_per_mib * (1 << 20)) + (1 << 20)
        self.src = torch.empty(self.max_bytes, device="cuda", dtype=torch.uint8)
        self.dst = torch.empty(self.max_bytes, dtype=torch.uint8, pin_memory=True)
        self.executors: dict = {}

    def callables(self, skip: str) -> dict:
        def node_fn(name: str):
            n = self.nodes[name]
            outs = (None,) * len(n.get("outputs", []))

            def fn(*_args):
                if n["kind"] == "compute" and skip != "compute":
                    big, small = self.split(n["cost"])
                    for _ in range(big):
                        torch.matmul(self.a, self.a, out=self.out)
                    for _ in range(small):
                        torch.matmul(self.small, self.a, out=self.small_out)
                elif n["kind"] == "comm_launch" and skip != "comm":
                    here = torch.cuda.current_stream()
                    if self.launch_wait and self.compute is not None and here != self.compute:
                        here.wait_stream(self.compute)  # as a transport allocating on the compute stream
                    nbytes = int(n["cost"] / self.copy_us_per_mib * (1 << 20))
                    self.dst[:nbytes].copy_(self.src[:nbytes], non_blocking=True)
                return outs

            return fn

        return {name: node_fn(name) for name, n in self.nodes.items() if n["kind"] in ("compute", "comm_launch")}

    def split(self, cost: float) -> tuple[int, int]:
        """(full matmuls, small matmuls) that take about `cost` us; at least one small one."""
        big = int(cost // self.mm_us)
        return big, max(1 if big == 0 else 0, round((cost - big * self.mm_us) / self.small_us))

    def run(self, arm: str, schedule: dict, one_stream: bool = False, skip: str = "") -> float:
        """Milliseconds from the first issue to the last completion on any stream."""
        ex = self.executors.get(arm)
        if ex is None:
            ex = self.executors[arm] = sl.Executor(
                self.graph, schedule, self.callables(skip), device="cuda", lifetime="none", single_stream=one_stream
            )
        return self._timed(ex)

    def measure(self, arm: str, schedule: dict, runs: int = 3) -> list:
        """Per-node times (us) of `runs` runs of `arm` with executor timing on: what the
        calibrated order's first step measures (events after each node's waits, one sync)."""
        self.run(arm, schedule)  # made and warm
        ex = self.executors[arm]
        ex.timing = True
        for _ in range(runs):
            self._timed(ex)
        ex.timing = False
        return ex.take_times()

    def _timed(self, ex) -> float:
        comp = self.compute = torch.cuda.current_stream()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(comp)
        ex.run({v if isinstance(v, str) else v["value"]: None for v in self.graph.get("inputs", [])})
        end.record(comp)
        torch.cuda.synchronize()
        return start.elapsed_time(end)


def interleaved(arms: dict, r: "Runner", iters: int) -> dict:
    """Median ms per arm over `iters` rounds after 2 warm-up rounds; every round runs each arm
    once, in an order shuffled per round (seeded), so drift and what the arm before leaves
    behind (a copy-only arm idles the SMs, and the next run starts at a lower clock) hit every
    arm alike: in a fixed order two arms with the same schedule measured up to 6% apart
    (H200, 2026-12-04, s4g)."""
    rng = random.Random(0)
    keys = list(arms)
    for _ in range(2):
        for k in keys:
            r.run(k, *arms[k])
    times = {k: [] for k in keys}
    for _ in range(iters):
        rng.shuffle(keys)
        for k in keys:
            times[k].append(r.run(k, *arms[k]))
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--ratios", default="0.5,1.0,2.0")
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--json", default=None)
    p.add_argument("--edge-only-comm", action="store_true", help="the stand-in copy waits only for its schedule's edges, not for all compute"
                   " issued before it (the bench before 2026-12-04; real transports wait for it)")
    p.add_argument("--calibrate-runs", type=int, default=1, help="family: timed runs of ours the calibrated order's costs come from (1: one step, as train_step's default)")
    p.add_argument("--calibrate-runs-b", type=int, default=0, help="family: a second calibrated arm, `calibrated_b`, from this many timed runs (0: none)")
    p.add_argument("--costs-file-runs", type=int, default=15, help="family: timed runs of ours (a separate measurement, as an earlier run's costs file) "
                   "whose medians arm `search_file` searches with: the reference issue 31 sets the calibrated order against")
    p.add_argument(
        "--family",
        default="",
        help="comma-separated family members (sl.scenario_graph('family:M:R')), or 'all': run those "
        "shapes instead of the symmetric chunk, with ours:search and the layer pairing where it exists",
    )
    args = p.parse_args()
    mm_us, small_us, copy_us = calibrate()
    print(
        f"calibration: 4096^3 bf16 matmul {mm_us:.1f} us, {MM // SMALL}x4096x4096 {small_us:.1f} us, "
        f"device-to-host copy {copy_us:.2f} us/MiB"
    )
    if args.family:
        family(args, mm_us, small_us, copy_us)
        return
    print(f"{'layers':>6}{'ratio':>7}{'compute':>9}{'comm':>8}{'one stream':>12}{'B-then-F':>10}{'Megatron':>10}{'ours':>8}{'ours/Meg':>10}{'ours/bound':>12}   (ms, median of {args.iters})")
    rows = []
    for ratio in [float(r) for r in args.ratios.split(",")]:
        sc = sl.scenario_graph(f"moe_chunk:{args.layers}:{ratio}")
        graph = sc["graph"]
        ours = sl.schedule(graph)
        r = Runner(graph, mm_us, small_us, copy_us, launch_wait=not args.edge_only_comm)
        arms = {
            "one_stream": (ours, True, ""),
            "b_then_f": (sc["orders"]["b_then_f"], False, ""),
            "megatron": (sc["orders"]["megatron"], False, ""),
            "ours": (ours, False, ""),
            "compute_only": (ours, True, "comm"),
            "comm_only": (ours, False, "compute"),
        }
        med = interleaved(arms, r, args.iters)
        bound = max(med["compute_only"], med["comm_only"])
        rows.append({"layers": args.layers, "ratio": ratio, **med, "bound": bound})
        print(
            f"{args.layers:>6}{ratio:>7.2f}{med['compute_only']:>9.2f}{med['comm_only']:>8.2f}{med['one_stream']:>12.2f}"
            f"{med['b_then_f']:>10.2f}{med['megatron']:>10.2f}{med['ours']:>8.2f}{med['ours'] / med['megatron']:>10.3f}{med['ours'] / bound:>12.3f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mm_us": mm_us, "copy_us_per_mib": copy_us, "rows": rows}, f, indent=1)


def family(args, mm_us: float, small_us: float, copy_us: float) -> None:
    """Each family member (issue 8's asymmetric shapes) on real streams: one stream, B-then-F, the
    layer pairing (where the layers pair), ours, ours under rule `launch_first`, ours under rule
    `search` (costs: the graph's),
    the calibrated order (the default of `train_step`: ours timed on these streams, then rule
    `search` with the measured costs, `sl.Calibration`), rule `search` with a costs file (node
    times measured apart, `search_file`: issue 31's reference for the calibrated order), and the
    SIMULATED makespan of ours and search beside the measured ones."""
    members = FAMILY if args.family == "all" else args.family.split(",")
    print(
        f"{'member':>20}{'ratio':>6}{'bound':>7}{'one str':>8}{'BthenF':>8}{'pairing':>8}{'ours':>7}{'first':>7}{'search':>7}{'calib':>7}"
        f"{'ours/pair':>10}{'srch/ours':>10}{'cal/srch':>9}{'same':>5}{'cal/bnd':>8}{'sim ours':>9}{'sim srch':>9}   (ms, median of {args.iters})"
    )
    rows = []
    for ratio in [float(r) for r in args.ratios.split(",")]:
        for m in members:
            sc = sl.scenario_graph(f"family:{m}:{ratio}")
            graph = sc["graph"]
            ours = sl.schedule(graph)
            searched = sl.schedule(graph, rules="search")
            first = sl.schedule(graph, rules="launch_first")
            r = Runner(graph, mm_us, small_us, copy_us, launch_wait=not args.edge_only_comm)
            arms = {
                "first": (first, False, ""),
                "one_stream": (ours, True, ""),
                "b_then_f": (sc["orders"]["b_then_f"], False, ""),
                "ours": (ours, False, ""),
                "search": (searched, False, ""),
                "compute_only": (ours, True, "comm"),
                "comm_only": (ours, False, "compute"),
            }
            if "pairing" in sc["orders"]:
                arms["pairing"] = (sc["orders"]["pairing"], False, "")
            # The calibrated order: one calibration step's node times of ours on these streams
            # (the graph's own costs are not used), agreed (one process) and searched.
            # `calibrated_b`: the same from more timed runs (the Calibration takes each node's median).
            # `search_file`: rule search with a costs file, i.e. node times measured apart from the
            # calibration (`--costs-file-runs` runs' medians): the stand-ins do not run the graph's
            # costs exactly (a compute node is whole matmuls: measured/graph cost 0.4-1.4 in s4g), so
            # `search` (the graph's costs) rates orders for costs the GPU does not run.
            cal_runs = {"calibrated": args.calibrate_runs, "search_file": args.costs_file_runs,
                        **({"calibrated_b": args.calibrate_runs_b} if args.calibrate_runs_b else {})}
            cals = {}
            for arm, runs in cal_runs.items():
                cals[arm] = cal = sl.Calibration(steps=1)
                cal.end_step(r.measure("ours", ours, runs=runs))
                arms[arm] = (cal.schedule(graph), False, "")
            med = interleaved(arms, r, args.iters)
            sim = {k: sl.simulate_schedule(graph, o["order"])["makespan_us"] / 1e3 for k, o in (("ours", ours), ("search", searched))}
            bound = max(med["compute_only"], med["comm_only"])
            rows.append(
                {"member": m, "ratio": ratio, **med, "bound": bound, "sim_ours": sim["ours"], "sim_search": sim["search"],
                 "measured_costs": cals["calibrated"].costs, "file_costs": cals["search_file"].costs,
                 **{f"{arm}_same_as_search": arms[arm][0]["order"] == searched["order"] for arm in cals},
                 "calibrated_same_as_search_file": arms["calibrated"][0]["order"] == arms["search_file"][0]["order"]}
            )
            pair = med.get("pairing")
            print(
                f"{m:>20}{ratio:>6.2f}{bound:>7.2f}{med['one_stream']:>8.2f}{med['b_then_f']:>8.2f}"
                + (f"{pair:>8.2f}" if pair else f"{'-':>8}")
                + f"{med['ours']:>7.2f}{med['first']:>7.2f}{med['search']:>7.2f}{med['calibrated']:>7.2f}"
                + (f"{med['ours'] / pair:>10.3f}" if pair else f"{'-':>10}")
                + f"{med['search'] / med['ours']:>10.3f}{med['calibrated'] / med['search']:>9.3f}{'yes' if rows[-1]['calibrated_same_as_search'] else 'no':>5}{med['calibrated'] / bound:>8.3f}"
                + f"{sim['ours']:>9.2f}{sim['search']:>9.2f}"
                + f"  search_file {med['search_file']:.2f}, calibrated {med['calibrated'] / med['search_file']:.3f} of it"
                + (" (same order)" if rows[-1]["calibrated_same_as_search_file"] else "")
                + (f"  calibrated_b {med['calibrated_b']:.2f} ({med['calibrated_b'] / med['search_file']:.3f} of search_file)" if "calibrated_b" in med else "")
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mm_us": mm_us, "small_us": small_us, "copy_us_per_mib": copy_us, "family": rows}, f, indent=1)


FAMILY = [
    "symmetric_4",
    "router+shared_2",
    "router+shared_4",
    "dense1+moe_4",
    "mtp_3",
    "F2_with_B4",
    "F4_with_B2",
    "three_sources_3",
    "jittered_shared_4",
]


if __name__ == "__main__":
    main()
