"""A/B on one GPU: the embedded MoE model under torch.compile(backend="sched_lifetime") with and
without the paging option, against eager (one forward + backward per step, no optimizer step, so
every arm computes the same gradients). Medians of interleaved steps after two warm-up (compile)
steps; peak = max allocated above the step's start; parity = torch.equal on every gradient
against the first arm. Each compiled arm has its own copy of the model (same initial weights).

    PYTHONPATH=torch_ops python3 benches/compile_paging_ab.py --config h200 --steps 3 \\
        --arms eager,compiled,paging:0.5,paging:1.0 [--set seq=65536,batch=1] [--json OUT]

Arm `paging:BUDGET[:PREFETCH]`: the static plan, options {"paging": True, "paging_budget": BUDGET,
"paging_timed": False, "paging_prefetch": PREFETCH (default 2)}; `timed:BUDGET[:SLACK]`: the
timed plan (an sl.Pager calibrated over the first two steps), "paging_slack": SLACK. Either with
the prefix `1s-`: page-ins on the page stream behind the page-outs ("paging_two_way": False;
without it they run on their own stream, the link's two directions at once).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "torch_ops"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sched_lifetime as sl  # noqa: E402,F401  (registers the backend)
from paging_ab import bench_config, interleaved, table  # noqa: E402
from sched_lifetime import compile as slc  # noqa: E402
from sched_lifetime.models.moe import CONFIGS, MoEModel  # noqa: E402
from sched_lifetime.paging import explain_plan  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="h200", choices=sorted(CONFIGS))
    ap.add_argument("--set", default="", help="config overrides, e.g. seq=8192,batch=1")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--arms", default="eager,compiled,timed:1.0,paging:0.5")
    ap.add_argument("--partition", default="min_cut", choices=["default", "min_cut"], help="the backend's partition option (every sched_lifetime arm; min_cut is its default)")
    ap.add_argument("--json")
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    base = MoEModel(bench_config(a.config, a.set, dev), device=dev)
    pagers: dict = {}
    prepare = {}
    for arm in a.arms.split(","):
        if arm == "eager":
            model, run = base, base
        elif arm in ("compiled", "aot_eager"):
            model = copy.deepcopy(base)
            if arm == "compiled":
                run = torch.compile(model, backend="sched_lifetime", options={"partition": a.partition})
            else:
                run = torch.compile(model, backend="aot_eager")
        elif arm.removeprefix("1s-").startswith(("paging:", "timed:")):
            kind, budget, extra = (arm.removeprefix("1s-").split(":") + [""])[:3]
            b = float(budget) if "." in budget else int(budget)
            opts = {"paging": True, "paging_budget": b, "paging_timed": kind == "timed", "partition": a.partition}
            opts["paging_two_way"] = not arm.startswith("1s-")
            if extra:
                opts["paging_prefetch" if kind == "paging" else "paging_slack"] = int(extra) if kind == "paging" else float(extra)
            model = copy.deepcopy(base)
            run = torch.compile(model, backend="sched_lifetime", options=opts)
            pagers[arm] = None  # its GraphPager, found after its first (compiling) step
        else:
            raise SystemExit(f"unknown arm {arm!r}: eager, compiled, aot_eager, [1s-]paging:BUDGET[:PREFETCH], [1s-]timed:BUDGET[:SLACK]")

        def setup(step: int, model=model, run=run, arm=arm):
            for p in model.parameters():
                p.grad = None
            batch = base.batch(step, 0)

            def go() -> list:
                run(**batch).backward()
                if arm in pagers and pagers[arm] is None:  # compiled in this first step
                    pagers[arm] = slc.history[-1]["module"].sched_lifetime.get("paging")
                return [p.grad for p in model.parameters()]

            return go

        prepare[arm] = setup
    rows = interleaved(prepare, a.steps, dev)
    paged = {arm: pg.plan["bytes_paged"] for arm, pg in pagers.items() if pg is not None and pg.plan}
    stats = {arm: dict(pg.stats) for arm, pg in pagers.items() if pg is not None}
    print(f"compile paging A/B, config {a.config} {a.set}, {dev}, medians of {a.steps} interleaved steps (one fwd+bwd each)")
    out = table(rows, paged, "paged MiB")
    for arm, st in stats.items():
        print(f"{arm}: {st}")
        out[arm]["stats"] = st
        pg = pagers[arm]
        # Rust's reasons, one line per candidate (what was paged, what not and why).
        text = explain_plan(pg.plan) if pg.plan else ""
        out[arm]["explain"] = text
        out[arm]["calibration"] = pg.pager.calibration if pg.pager is not None else None  # timed: Rust's inputs
        print(f"{arm}: {text.splitlines()[0] if text else 'no plan'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": a.config, "set": a.set, "device": str(dev), "arms": out}, f, indent=1)


if __name__ == "__main__":
    main()
