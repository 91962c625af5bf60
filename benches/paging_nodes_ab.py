"""GPU A/B: paging through page nodes in a pipelined node-path step, one GPU, one process.

The embedded MoE model as one chunk (EP=1), `train_step` of N microbatches in our order
(warm-up F(0), F(i+1) multiplexed with B(i), cool-down B): two microbatches' activations are
alive at once, the case paging across microbatches is for. Arms: no paging, and
`Chunk.enable_paging(budget=FRACTION, prefetch=K)` with the page-stream launch budget B
(`page:FRACTION:K:B`). One model per arm with the same weights, no optimizer step (every arm
computes the same gradients); steps interleaved across arms, medians. Per arm: step time, peak
allocated above the step's start, bytes paged per step, parity (torch.equal on every loss and
gradient against no paging, every step).

    PYTHONPATH=torch_ops python3 benches/paging_nodes_ab.py --config h200 --microbatches 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

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
            _, frac, pf, pb = spec.split(":")
            plan = chunk.enable_paging(model.batch(0, 0), budget=float(frac), prefetch=int(pf), min_bytes=a.min_bytes)
            order = f"ours:page_budget={int(pb)}"
        arms[spec] = (model, chunk, order, plan)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rows = {k: {"ms": [], "peak": [], "parity": True} for k in arms}
    for step in range(a.steps + 1):  # step 0 warms up (timed steps follow)
        ref = None
        for name, (model, chunk, order, _) in arms.items():
            for p in model.parameters():
                p.grad = None
            mbs = [model.batch(step, k) for k in range(a.microbatches)]
            sync()
            base = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            t0 = time.perf_counter()
            losses = train_step(chunk, mbs, order=order)
            sync()
            ms = (time.perf_counter() - t0) * 1e3
            peak = (torch.cuda.max_memory_allocated(dev) - base) if dev.type == "cuda" else 0
            got = [x.detach().clone() for x in losses] + [p.grad.clone() for p in model.parameters()]
            if ref is None:
                ref = got
            elif not all(torch.equal(x, y) for x, y in zip(ref, got)):
                rows[name]["parity"] = False
            if step > 0:
                rows[name]["ms"].append(ms)
                rows[name]["peak"].append(peak)
    off = next(iter(rows))
    base_ms, base_peak = statistics.median(rows[off]["ms"]), max(rows[off]["peak"])
    print(f"paging through page nodes, config {a.config}, {dev}, train_step of {a.microbatches} microbatches (ours), medians of {a.steps} interleaved steps")
    print(f"{'arm':<16}{'step ms':>9}{'vs ' + off:>9}{'peak MiB':>10}{'saved':>8}{'paged MiB/mb':>14}{'parity':>8}")
    out = {}
    for name, r in rows.items():
        ms, peak = statistics.median(r["ms"]), max(r["peak"])
        plan = arms[name][3]
        paged = plan["bytes_paged"] if plan else None
        out[name] = {"ms": ms, "peak_bytes": peak, "paged_bytes_per_microbatch": paged, "parity": r["parity"], "all_ms": r["ms"], "plan_nodes": plan["page"] if plan else None}
        print(
            f"{name:<16}{ms:>9.1f}{ms / base_ms:>8.3f}x{peak / 2**20:>10.0f}{(1 - peak / base_peak) if base_peak else 0:>8.1%}"
            f"{'' if paged is None else f'{paged / 2**20:.0f}':>14}{str(r['parity']):>8}"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": a.config, "device": str(dev), "microbatches": a.microbatches, "arms": out}, f, indent=1)


if __name__ == "__main__":
    main()
