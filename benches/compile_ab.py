"""GPU A/B: the embedded MoE model with EP over 2 GPUs (NCCL, functional collectives),
forward + backward of one microbatch per step: plain eager, torch.compile(backend="aot_eager")
and torch.compile(backend="sched_lifetime") in the same run. Interleaved steps, medians;
parity (torch.equal on every loss and gradient of the first step, all ranks); exposed
communication from one profiled step per arm (NCCL kernel time with no other kernel running);
max reserved. Prints one table (rank 0).

    NCCL_MIN_NCHANNELS=2 NCCL_MAX_NCHANNELS=2 torchrun --standalone --nproc-per-node 2 benches/compile_ab.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

import sched_lifetime
from sched_lifetime.ep import FunctionalAllToAll, new_ep_group
from sched_lifetime.models.moe import CONFIGS, MoEModel, deterministic_sdpa, with_overrides
from sched_lifetime.train import exposed_comm_us

CFGS = {"tiny": with_overrides(CONFIGS["tiny"], capacity_factor=1.0), "h200": CONFIGS["h200"]}


def graph_step_ab(cfg, group, dev, a, rank, sync) -> None:
    """GraphStep (compiled forward/backward graphs) over N microbatches: multiplexed, with paired
    ends, and sequential, interleaved steps, medians, parity of the first step's losses and
    gradients against sequential."""
    from sched_lifetime.compile import GraphStep

    m = MoEModel(cfg, transport=FunctionalAllToAll(group), seed=0, device=dev)
    gs = GraphStep(m, tuple(m.batch(0, 0).values()))
    times: dict[str, list] = {"sequential": [], "multiplexed": [], "paired_ends": []}
    first = {}
    for step in range(a.steps + 1):
        mbs = [tuple(m.batch(step, k).values()) for k in range(a.graph_step)]
        for name in times:
            for p in m.parameters():
                p.grad = None
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            losses = gs.step(mbs, multiplexed=name != "sequential", paired_ends=name == "paired_ends")
            sync()
            dt = (time.perf_counter() - t0) * 1e3
            if step == 0:
                first[name] = ([x.clone() for x in losses], [p.grad.clone() for p in m.parameters()])
            else:
                times[name].append(dt)
    la, ga = first["sequential"]
    same = all(
        all(torch.equal(x, y) for x, y in zip(la, lb)) and all(torch.equal(x, y) for x, y in zip(ga, gb)) for lb, gb in first.values()
    )
    everyone = [None, None]
    dist.all_gather_object(everyone, same)
    if rank == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"GraphStep, EP=2, config {a.config}, {a.graph_step} microbatches, medians of {a.steps} interleaved steps; parity {everyone}")
        print("| arm | step ms | vs sequential |")
        print("|---|---:|---:|")
        for k, v in med.items():
            print(f"| {k} | {v:.1f} | {med['sequential'] / v:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="h200", choices=sorted(CFGS))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", default=None)
    ap.add_argument("--graph-step", type=int, default=0, metavar="N",
                    help="instead: N microbatches per step on compiled graphs, multiplexed F(i+1)+B(i) vs F(i) then B(i)")
    a = ap.parse_args()
    assert "sched_lifetime" in torch._dynamo.list_backends(), sched_lifetime.__version__
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    torch.use_deterministic_algorithms(True)
    cfg = CFGS[a.config]
    import sched_lifetime.models.moe as moe

    moe.SDPA_BACKENDS = deterministic_sdpa(dev, moe._dtype(cfg)) if cuda else None
    group = new_ep_group()
    arms = {}
    for name, backend in (("eager", None), ("aot_eager", "aot_eager"), ("sched_lifetime", "sched_lifetime")):
        m = MoEModel(cfg, transport=FunctionalAllToAll(group), seed=0, device=dev)
        arms[name] = (m, m if backend is None else torch.compile(m, backend=backend))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if a.graph_step:
        graph_step_ab(cfg, group, dev, a, rank, sync)
        dist.destroy_process_group()
        return
    times: dict[str, list] = {k: [] for k in arms}
    first: dict[str, tuple] = {}
    for step in range(a.steps + 1):
        for name, (m, run) in arms.items():
            m.zero_grad(set_to_none=True)
            b = m.batch(step, 0)
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            loss = run(**b)
            loss.backward()
            sync()
            dt = (time.perf_counter() - t0) * 1e3
            if step == 0:  # compiles, and is the parity step
                first[name] = (loss.detach().clone(), [p.grad.clone() for p in m.parameters()])
            else:
                times[name].append(dt)
    ref = first["eager"]
    parity = {k: torch.equal(v[0], ref[0]) and all(torch.equal(x, y) for x, y in zip(v[1], ref[1])) for k, v in first.items()}
    everyone = [None, None]
    dist.all_gather_object(everyone, parity)
    rows = {}
    for name, (m, run) in arms.items():
        exposed = total = 0.0
        resv = 0
        if cuda:
            from torch.profiler import ProfilerActivity, profile

            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            m.zero_grad(set_to_none=True)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                run(**m.batch(99, 0)).backward()
                sync()
            exposed, total = exposed_comm_us(prof)
            resv = torch.cuda.max_memory_reserved()
        rows[name] = {
            "parity": all(p[name] for p in everyone),
            "step_ms": statistics.median(times[name]),
            "exposed_comm_ms": exposed / 1e3,
            "comm_ms": total / 1e3,
            "max_reserved_mib": resv / 2**20,
        }
    if rank == 0:
        where = f"2 x {torch.cuda.get_device_name(dev)}" if cuda else "CPU smoke run (no figures)"
        print(f"EP=2 {where}, config {a.config}, one microbatch F+B per step, medians of {a.steps} interleaved steps, NCCL channels {os.environ.get('NCCL_MAX_NCHANNELS', 'default')}")
        print("| arm | parity | step ms | vs aot_eager | exposed comm ms | comm ms | max reserved MiB (rank 0, own step) |")
        print("|---|---|---:|---:|---:|---:|---:|")
        base = rows["aot_eager"]["step_ms"]
        for k, r in rows.items():
            print(f"| {k} | {'=' if r['parity'] else 'DIFF'} | {r['step_ms']:.1f} | {base / r['step_ms']:.3f} | {r['exposed_comm_ms']:.1f} | {r['comm_ms']:.1f} | {r['max_reserved_mib']:.0f} |")
        if a.out:
            with open(os.path.join(a.out, "compile_ab.json"), "w") as f:
                json.dump({"config": a.config, "rows": rows, "times_ms": times}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
