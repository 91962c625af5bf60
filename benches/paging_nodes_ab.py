"""GPU A/B: paging through page nodes in a pipelined node-path step, one GPU, one process.

The embedded MoE model as one chunk (EP=1), `train_step` of N microbatches in our order
(warm-up F(0), F(i+1) multiplexed with B(i), cool-down B): two microbatches' activations are
alive at once, the case paging across microbatches is for. Arms: no paging, and
`Chunk.enable_paging(budget=FRACTION, prefetch=K[, release=R])` with the page-stream launch
budget B (`page:FRACTION:K:B[:R]`, R 0: no release points), or the listed nodes instead of the
budget's choice (`nodes:L1.experts+L2.experts:K:B[:R]`); page-ins on their own stream beside the
page-outs (the default), or with the prefix `1s-` both on one page stream (`1s-page:0.3:6:8`:
`enable_paging(two_way=False)`, the baseline). One model per arm with the same
weights, no optimizer step (every arm computes the same gradients); steps interleaved across
arms, medians. Per arm: step time, peak allocated above the step's start, bytes paged per step,
parity (torch.equal on every loss and gradient against no paging, every step). `--profile ARMS`
profiles one more step of each: host issue time, the page nodes' host time, the GPU's idle
time split by the page copy running meanwhile.

    PYTHONPATH=torch_ops python3 benches/paging_nodes_ab.py --config h200 --microbatches 4
"""

from __future__ import annotations

import argparse
import json
import time
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
    ap.add_argument("--arms", default="off,1s-page:0.3:6:8,page:0.3:6:8,1s-page:0.5:6:8,page:0.5:6:8")
    ap.add_argument("--min-bytes", type=int, default=1 << 20, help="smallest saved activation to page")
    ap.add_argument("--json")
    ap.add_argument("--cpu-ops", action="store_true", help="with --profile: the host's top ops by self time")
    ap.add_argument("--profile", default="", help="arms (comma-separated) to profile one more step of: where the compute stream idles")
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
            kind, what, pf, pb, *rel = spec.removeprefix("1s-").split(":")
            # [1s-]page:FRACTION:K:B[:R] (Rust's choice under the budget) or nodes:A+B+...:K:B[:R]
            # (these nodes); R: enable_paging's release distance (0: none); 1s-: one page stream
            how = {"nodes": what.split("+")} if kind == "nodes" else {"budget": float(what)}
            how["two_way"] = not spec.startswith("1s-")
            if rel:
                how["release"] = int(rel[0]) or None
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
    for name, (_, c, _, plan) in arms.items():
        if plan:
            print(f"{name}: forced drains {c.pool.forced_drains}, released {c.pool.released}, page-outs {c.pool.page_outs}, nodes {plan['page']}")
        out[name].update(paged_bytes_per_microbatch=paged.get(name), plan_nodes=plan["page"] if plan else None)
    for name in filter(None, a.profile.split(",")):
        m, c, o, _ = arms[name]
        idle_breakdown(name, prepare(m, c, o)(a.steps + 2), dev, a.cpu_ops)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": a.config, "device": str(dev), "microbatches": a.microbatches, "arms": out}, f, indent=1)


def idle_breakdown(name: str, run: Callable[[], list], dev: torch.device, cpu_ops: bool = False) -> None:
    """Profile one step: the compute kernels' busy time, and the step's idle time on the GPU split
    by what the page stream was copying meanwhile (device->host, host->device, nothing)."""
    from torch.profiler import ProfilerActivity, profile

    from sched_lifetime.train import _is_kernel, _is_page_copy, union

    torch.cuda.synchronize(dev)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        h0 = time.perf_counter()
        run()
        host = time.perf_counter() - h0
        torch.cuda.synchronize(dev)
    if cpu_ops:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=48), flush=True)
    comp, d2h, h2d = [], [], []
    cpu: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CPU and (e.name.endswith(".page_out") or e.name.endswith(".page_in")):
            k = e.name.rsplit(".", 1)[1]
            cpu[k] = cpu.get(k, 0.0) + (e.time_range.end - e.time_range.start) / 1e3
        if not _is_kernel(e):
            continue
        iv = (e.time_range.start, e.time_range.end)
        if _is_page_copy(e):
            (d2h if "DtoH" in e.name else h2d).append(iv)
        else:
            comp.append(iv)

    cu = union(comp)
    t0, t1 = cu[0][0], cu[-1][1]
    gaps = [(a[1], b[0]) for a, b in zip(cu, cu[1:]) if b[0] > a[1]]

    def overlap(g: tuple, iv: list) -> float:
        return sum(max(0.0, min(g[1], t) - max(g[0], s)) for s, t in iv)

    du, hu = union(d2h), union(h2d)
    idle = sum(b - a for a, b in gaps)
    od = sum(overlap(g, du) for g in gaps)
    oh = sum(overlap(g, hu) for g in gaps)
    big = sorted(gaps, key=lambda g: g[0] - g[1])[:6]
    print(
        f"{name}: host issue {host * 1e3:.1f} ms (page nodes' CPU ms {cpu}), GPU span {(t1 - t0) / 1e3:.1f} ms, compute busy {sum(b - a for a, b in cu) / 1e3:.1f}, idle {idle / 1e3:.1f} "
        f"(of it a D2H copy running {od / 1e3:.1f}, an H2D copy {oh / 1e3:.1f}); copies D2H {sum(b - a for a, b in du) / 1e3:.1f} "
        f"H2D {sum(b - a for a, b in hu) / 1e3:.1f} ms; largest gaps (ms at, ms long): "
        + ", ".join(f"{(g[0] - t0) / 1e3:.1f}:{(g[1] - g[0]) / 1e3:.2f}" for g in big),
        flush=True,
    )


if __name__ == "__main__":
    main()
