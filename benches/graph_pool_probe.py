"""Whole-step CUDA graph pool against the eager step, on one GPU (EP=1), and where the pool's
bytes are: per stream, allocated at capture end vs free inside the pool's segments.

Both sides start from no gradients and an empty cache, so both count the gradients the step
writes (the captured step allocates them in its pool), the activations, temporaries and the
cuBLAS workspaces their own run allocates. Arms: `ours+graph` (scheduled lifetime),
`ours+graph+record` (record_stream: its frees on other streams wait for the capture to end) and
with `--page F` `ours+graph+page` (page nodes under budget F, captured too).

    python benches/graph_pool_probe.py [--microbatches 3] [--page 0.5] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch


def _by_stream(segs: list[dict], names: dict[int, str]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for s in segs:
        row = out.setdefault(names.get(s["stream"], hex(s["stream"])), {"segments": 0, "reserved": 0, "allocated": 0, "sizes_mib": []})
        row["segments"] += 1
        row["sizes_mib"].append(round(s["total_size"] / 2**20, 1))
        row["reserved"] += s["total_size"]
        row["allocated"] += sum(b["size"] for b in s["blocks"] if b["state"] == "active_allocated")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--microbatches", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--page", type=float, default=0.0, help="also capture the step with page nodes (this budget fraction)")
    args = ap.parse_args()

    from sched_lifetime import ep, executor
    from sched_lifetime.models import CONFIGS
    from sched_lifetime.models import moe as moe_mod
    from sched_lifetime.train import Arm, eager_step_growth, eager_step_pool, pool_segments, same_grads

    torch.use_deterministic_algorithms(True)
    dev = torch.device("cuda", torch.cuda.current_device())
    moe_mod.deterministic_sdpa(dev, torch.float32)
    cfg = replace(CONFIGS["tiny"], capacity_factor=1.0, hidden=512, heads=8, expert_ffn=1024, shared_ffn=512, seq=256, batch=8)
    t = ep.AllToAll(None)
    n = args.microbatches
    eager = Arm("ours", cfg, t, dev, 0.05)
    graphs = {a: Arm(a, cfg, t, dev, 0.05) for a in ("ours+graph", "ours+graph+record")}
    if args.page:
        # The page-node path captured too: the same graph arm with `enable_paging(budget)`.
        paged = graphs["ours+graph+page"] = Arm("ours+graph", cfg, t, dev, 0.05)
        print("paged nodes:", paged.chunk.enable_paging(paged.model.batch(0, 0), budget=args.page)["page"])
    parity = {a: True for a in graphs}
    for step in range(4):
        eager.step(step, n)
        for a, g in graphs.items():
            g.step(step, n)
            parity[a] = parity[a] and same_grads(g, eager) and torch.equal(g.losses[-1], eager.losses[-1])
    torch.cuda.synchronize()
    side = executor.SideStreams.of(dev)
    # Capture runs on torch.cuda.graph's own stream: shown by its handle.
    names = {torch.cuda.current_stream(dev).cuda_stream: "default", side.ep.cuda_stream: "ep", side.page.cuda_stream: "page"}
    grad_bytes = sum(p.numel() * p.element_size() for p in eager.model.parameters())
    rows = {}
    for a, g in graphs.items():
        segs = pool_segments(g.graph.pool())
        rows[a] = {"pool_large": g.graph_pool_large, "pool": g.graph_pool, "by_stream": _by_stream(segs, names), "parity": parity[a]}
    # Eager step from no gradients and an empty cache (what the capture starts from).
    rows["ours (eager)"] = {
        **eager_step_growth(eager, 9, n),
        "by_stream": _by_stream([s for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", (0, 0))) == (0, 0)], names),
        "parity": True,
    }
    # The same eager step with its allocations routed into a private pool, as the capture's are.
    rows["ours (eager, own pool)"] = {**eager_step_pool(eager, 10, n), "by_stream": {}, "parity": True}
    mib = 2**20
    print(f"microbatches {n}, gradients {grad_bytes / mib:.1f} MiB, {torch.cuda.get_device_name(dev)}")
    print("| arm | parity | large pool MiB | all pools MiB | eager: allocated peak MiB |")
    print("|---|---|---:|---:|---:|")
    for a, r in rows.items():
        ap = f"{r['allocated_peak'] / mib:.1f}" if "allocated_peak" in r else "-"
        print(f"| {a} | {'=' if r['parity'] else 'DIFF'} | {r['pool_large'] / mib:.1f} | {r['pool'] / mib:.1f} | {ap} |")
    for a, r in rows.items():
        for s, v in r["by_stream"].items():
            print(f"  {a:20s} stream {s:10s} segments {v['segments']:3d} reserved {v['reserved'] / mib:8.1f} MiB, allocated now {v['allocated'] / mib:8.1f} MiB")
            print(f"  {'':20s} segment sizes MiB: {sorted(v['sizes_mib'], reverse=True)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"microbatches": n, "grad_bytes": grad_bytes, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
