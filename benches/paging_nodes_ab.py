"""GPU A/B: paging through page nodes in a pipelined node-path step, one GPU, one process.

The embedded MoE model as one chunk (EP=1), `train_step` of N microbatches in our order
(warm-up F(0), F(i+1) multiplexed with B(i), cool-down B): two microbatches' activations are
alive at once, the case paging across microbatches is for. Arms: no paging, and
`Chunk.enable_paging(budget=FRACTION, prefetch=K)` with the page-stream launch budget B
(`page:FRACTION:K:B`), or the listed nodes instead of the budget's choice
(`nodes:L1.experts+L2.experts:K:B`). One model per arm with the same weights, no optimizer step (every arm
computes the same gradients); steps interleaved across arms, medians. Per arm: step time, peak
allocated above the step's start, bytes paged per step, parity (torch.equal on every loss and
gradient against no paging, every step).

    PYTHONPATH=torch_ops python3 benches/paging_nodes_ab.py --config h200 --microbatches 4
"""

from __future__ import annotations

import argparse
import json
from typing import Callable

import torch
from paging_ab import interleaved, table  # the same interleaved measurement and table

from sched_lifetime.models import moe as moe_mod
from sched_lifetime.models.moe import CONFIGS, MoEModel, with_overrides
from sched_lifetime.nodes import train_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="h200", choices=sorted(CONFIGS))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--arms", default="off,page:0.3:2:8,page:0.5:2:8,page:0.5:2:2")
    ap.add_argument("--min-bytes", type=int, default=1 << 20, help="smallest saved activation to page")
    ap.add_argument("--json")
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = CONFIGS[a.config]
    if cfg.capacity_factor is None:  # counted routing changes saved shapes every step
        cfg = with_overrides(cfg, capacity_factor=1.0)
    if dev.type == "cuda":
        torch.use_deterministic_algorithms(True)
        moe_mod.deterministic_sdpa(dev, torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32)
    arms = {}
    for spec in a.arms.split(","):
        model = MoEModel(cfg, seed=0, device=dev)
        chunk = model.chunk()
        order, plan = "ours", None
        if spec != "off":
            kind, what, pf, pb = spec.split(":")
            # page:FRACTION:K:B (Rust's choice under the budget) or nodes:A+B+...:K:B (these nodes)
            how = {"nodes": what.split("+")} if kind == "nodes" else {"budget": float(what)}
            plan = chunk.enable_paging(model.batch(0, 0), prefetch=int(pf), min_bytes=a.min_bytes, **how)
            order = f"ours:page_budget={int(pb)}"
        arms[spec] = (model, chunk, order, plan)
    def prepare(model: MoEModel, chunk, order: str) -> Callable[[int], Callable[[], list]]:
        def setup(step: int) -> Callable[[], list]:
            for p in model.parameters():
                p.grad = None
            mbs = [model.batch(step, k) for k in range(a.microbatches)]

            def run() -> list:
                losses = train_step(chunk, mbs, order=order)
                return [x.detach() for x in losses] + [p.grad for p in model.parameters()]

            return run

        return setup

    rows = interleaved({name: prepare(m, c, o) for name, (m, c, o, _) in arms.items()}, a.steps, dev)
    print(f"paging through page nodes, config {a.config}, {dev}, train_step of {a.microbatches} microbatches (ours), medians of {a.steps} interleaved steps")
    paged = {name: plan["bytes_paged"] for name, (_, _, _, plan) in arms.items() if plan}
    out = table(rows, paged, "paged MiB/mb")
    for name, (_, _, _, plan) in arms.items():
        out[name].update(paged_bytes_per_microbatch=paged.get(name), plan_nodes=plan["page"] if plan else None)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": a.config, "device": str(dev), "microbatches": a.microbatches, "arms": out}, f, indent=1)


if __name__ == "__main__":
    main()
