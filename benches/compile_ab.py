"""GPU A/B: the embedded MoE model with EP over 2 GPUs (NCCL, functional collectives),
forward + backward of one microbatch per step: plain eager, torch.compile(backend="aot_eager")
and torch.compile(backend="sched_lifetime") in the same run. Interleaved steps, medians;
parity (torch.equal on every loss and gradient of the first step, all ranks); exposed
communication from one profiled step per arm (NCCL kernel time with no other kernel running);
max reserved. With `--graph-step N`, the same run also times GraphStep (compiled graphs, N
microbatches per step) sequential vs multiplexed vs paired ends, with the same figures, in the
same table. Prints one table (rank 0).

    NCCL_MIN_NCHANNELS=2 NCCL_MAX_NCHANNELS=2 torchrun --standalone --nproc-per-node 2 benches/compile_ab.py

On one GPU, `--ep-link host[:K]` runs the same A/B on the emulated EP link (`ep_link.py`: EP=K,
the crossing rows through pinned host memory; in compiled graphs a launch/wait op pair the
backend schedules like a functional collective); exposed comm is then the link's copies:

    torchrun --standalone --nproc-per-node 1 benches/compile_ab.py --ep-link host:8 --graph-step 4
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
from sched_lifetime.ep import FunctionalAllToAll, HostLinkAllToAll, new_ep_group
from sched_lifetime.models.moe import CONFIGS, MoEModel, deterministic_sdpa, with_overrides
from sched_lifetime.train import exposed_comm_us

CFGS = {"tiny": with_overrides(CONFIGS["tiny"], capacity_factor=1.0), "h200": CONFIGS["h200"]}


def graph_step_ab(cfg, transport, dev, a, rank, sync) -> dict:
    """GraphStep (compiled forward/backward graphs) over N microbatches: sequential, multiplexed
    and with paired ends, interleaved steps, medians, parity of the first step's losses and
    gradients against sequential (all ranks); then one profiled step per arm (exposed
    communication, max reserved). Returns the table's rows."""
    from sched_lifetime.compile import GraphStep

    m = MoEModel(cfg, transport=transport(), seed=0, device=dev)
    link = m.transport if isinstance(m.transport, HostLinkAllToAll) else None
    gs = GraphStep(m, tuple(m.batch(0, 0).values()))
    times: dict[str, list] = {"sequential": [], "multiplexed": [], "paired_ends": []}
    first = {}

    def run(name: str, step: int) -> list:
        for p in m.parameters():
            p.grad = None
        mbs = [tuple(m.batch(step, k).values()) for k in range(a.graph_step)]
        return gs.step(mbs, multiplexed=name != "sequential", paired_ends=name == "paired_ends")

    for step in range(a.steps + 1):
        for name in times:
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            losses = run(name, step)
            sync()
            dt = (time.perf_counter() - t0) * 1e3
            if step == 0:
                first[name] = ([x.clone() for x in losses], [p.grad.clone() for p in m.parameters()])
            else:
                times[name].append(dt)
    la, ga = first["sequential"]
    same = {
        k: all(torch.equal(x, y) for x, y in zip(la, lb)) and all(torch.equal(x, y) for x, y in zip(ga, gb)) for k, (lb, gb) in first.items()
    }
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, same)
    rows = {}
    for name in times:
        exposed, total, resv = _profiled(lambda: run(name, 99), sync, dev.type == "cuda", link)
        rows[f"GraphStep {name}"] = {
            "parity": all(e[name] for e in everyone),
            "microbatches": a.graph_step,
            "step_ms": statistics.median(times[name]),
            "exposed_comm_ms": exposed / 1e3,
            "comm_ms": total / 1e3,
            "max_reserved_mib": resv / 2**20,
        }
    return rows


def _profiled(step, sync, cuda: bool, link=None) -> tuple[float, float, int]:
    """One step under the profiler, from an empty cache: (exposed comm us, comm us, max reserved).
    With the emulated `link`, comm is its copies."""
    if not cuda:
        step()
        return 0.0, 0.0, 0
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        sync()
    exposed, total = exposed_comm_us(prof, link)
    return exposed, total, torch.cuda.max_memory_reserved()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="h200", choices=sorted(CFGS))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", default=None)
    ap.add_argument("--graph-step", type=int, default=0, metavar="N",
                    help="also: N microbatches per step on compiled graphs (GraphStep), sequential vs multiplexed F(i+1)+B(i) vs paired ends, in the same table")
    ap.add_argument("--ep-link", default="nccl", metavar="nccl|host[:K]",
                    help="EP transport: nccl (functional collectives over the ranks) or host[:K] (one process: the emulated EP link of K ranks)")
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
    link = None
    if a.ep_link != "nccl":
        if dist.get_world_size() != 1:
            raise SystemExit(f"--ep-link {a.ep_link} emulates EP in one process: run under torchrun --nproc-per-node 1")
        link = HostLinkAllToAll.from_spec(a.ep_link, device=dev, num_experts=cfg.experts)
        transport = lambda: link  # noqa: E731  (one link, its host buffers shared by the arms)
    else:
        group = new_ep_group()
        transport = lambda: FunctionalAllToAll(group)  # noqa: E731
    arms = {}
    for name, backend in (("eager", None), ("aot_eager", "aot_eager"), ("sched_lifetime", "sched_lifetime")):
        m = MoEModel(cfg, transport=transport(), seed=0, device=dev)
        arms[name] = (m, m if backend is None else torch.compile(m, backend=backend))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
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
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, parity)
    rows = {}
    for name, (m, run) in arms.items():
        m.zero_grad(set_to_none=True)
        exposed, total, resv = _profiled(lambda: run(**m.batch(99, 0)).backward(), sync, cuda, link)
        rows[name] = {
            "parity": all(p[name] for p in everyone),
            "microbatches": 1,
            "step_ms": statistics.median(times[name]),
            "exposed_comm_ms": exposed / 1e3,
            "comm_ms": total / 1e3,
            "max_reserved_mib": resv / 2**20,
        }
    if a.graph_step:
        rows.update(graph_step_ab(cfg, transport, dev, a, rank, sync))
    if rank == 0:
        world = dist.get_world_size()
        where = f"{world} x {torch.cuda.get_device_name(dev)}" if cuda else "CPU smoke run (no figures)"
        if link is not None:
            print(f"EMULATED: {link.describe()}, 1 process, {where}, config {a.config}, medians of {a.steps} interleaved steps; comm = the link's copies")
        else:
            print(f"EP={world} {where}, config {a.config}, medians of {a.steps} interleaved steps, NCCL channels {os.environ.get('NCCL_MAX_NCHANNELS', 'default')}")
        print("backend rows: one microbatch F+B per step, vs aot_eager; GraphStep rows: N microbatches per step, vs GraphStep sequential")
        print("| arm | parity | microbatches | step ms | vs | exposed comm ms | comm ms | max reserved MiB (rank 0, own step) |")
        print("|---|---|---:|---:|---:|---:|---:|---:|")
        for k, r in rows.items():
            base = rows["GraphStep sequential" if k.startswith("GraphStep") else "aot_eager"]["step_ms"]
            print(
                f"| {k} | {'=' if r['parity'] else 'DIFF'} | {r['microbatches']} | {r['step_ms']:.1f} | {base / r['step_ms']:.3f} | "
                f"{r['exposed_comm_ms']:.1f} | {r['comm_ms']:.1f} | {r['max_reserved_mib']:.0f} |"
            )
        if a.out:
            with open(os.path.join(a.out, "compile_ab.json"), "w") as f:
                json.dump({"config": a.config, "ep_link": a.ep_link, "rows": rows, "times_ms": times}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
