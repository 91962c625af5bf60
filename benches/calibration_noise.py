"""SIMULATED (issue 31): how much a noisy cost measurement costs the calibrated order.

For each family shape, rule `search` runs on the shape's own costs (the order `ours:search`
gets) and on the same costs with per-node measurement noise (each node's cost times 1 + e, e
normal with standard deviation `--noise`), once from one timed run and once from the median of
`--runs` runs (what `Calibration` takes when a step runs a node several times, or over several
calibration steps). Every order is then rated by the simulator under the TRUE costs: the
calibrated order's makespan over search's says what the noise alone costs, with nothing of a
GPU's run-to-run spread in it. Prints, per noise level, how many shapes stay within 1% of search
and the worst ratio; `--json` writes every draw.

    PYTHONPATH=torch_ops python benches/calibration_noise.py --noise 0.01,0.03,0.1 --seeds 5
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "torch_ops"))
import sched_lifetime as sl  # noqa: E402
from sched_lifetime.calibrate import with_costs  # noqa: E402

FAMILY = ["symmetric_4", "router+shared_2", "router+shared_4", "dense1+moe_4", "mtp_3", "F2_with_B4", "F4_with_B2", "three_sources_3", "jittered_shared_4"]


def noisy(costs: dict, sigma: float, runs: int, rng: random.Random) -> dict:
    """Each node's median over `runs` draws of cost x (1 + e), e ~ N(0, sigma), at least 1 us."""
    return {n: max(1.0, statistics.median(c * (1 + rng.gauss(0, sigma)) for _ in range(runs))) for n, c in costs.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ratios", default="0.5,1.0,2.0")
    p.add_argument("--noise", default="0.01,0.03,0.1", help="standard deviations of the per-node relative error")
    p.add_argument("--runs", type=int, default=5, help="timed runs the second arm takes each node's median of")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    shapes = [(m, float(r)) for r in args.ratios.split(",") for m in FAMILY]
    base = {}
    for m, r in shapes:
        g = sl.scenario_graph(f"family:{m}:{r}")["graph"]
        costs = {n["name"]: float(n["cost"]) for n in g["nodes"] if n.get("cost")}
        ms = sl.simulate_schedule(g, sl.schedule(g, rules="search")["order"])["makespan_us"]
        base[m, r] = (g, costs, ms)
    rows = []
    print("SIMULATED: calibrated order's makespan under the true costs / search's (the shape's own costs)")
    print(f"{'noise':>6}{'runs':>5}{'shapes within 1% (all seeds)':>30}{'draws within 1%':>17}{'median':>8}{'worst':>8}")
    for sigma in [float(s) for s in args.noise.split(",")]:
        for runs in (1, args.runs):
            ratios = {}
            for (m, r), (g, costs, ms) in base.items():
                for seed in range(args.seeds):
                    rng = random.Random(f"{m}:{r}:{sigma}:{runs}:{seed}")
                    order = sl.schedule(with_costs(g, noisy(costs, sigma, runs, rng)), rules="search")["order"]
                    ratios.setdefault((m, r), []).append(sl.simulate_schedule(g, order)["makespan_us"] / ms)
            flat = [x for v in ratios.values() for x in v]
            shapes_ok = sum(1 for v in ratios.values() if max(v) <= 1.01)
            print(f"{sigma:>6.2f}{runs:>5}{shapes_ok:>22} of {len(ratios):<5}{sum(x <= 1.01 for x in flat):>10} of {len(flat):<4}"
                  f"{statistics.median(flat):>8.3f}{max(flat):>8.3f}")
            rows += [{"member": m, "ratio": r, "noise": sigma, "runs": runs, "over_search": v} for (m, r), v in ratios.items()]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
