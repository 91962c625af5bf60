"""GPU A/B: the embedded MoE model with EP over 2 GPUs (NCCL, functional collectives),
forward + backward of one microbatch per step: plain eager, torch.compile(backend="aot_eager")
and torch.compile(backend="sched_lifetime") in the same run. Interleaved steps, medians;
parity against plain eager autograd on every step (every loss and gradient, all ranks:
`torch.equal`, or within `reference.tolerance` where the sums cannot be in the same order, the
deviation printed); exposed
communication from one profiled step per arm (NCCL kernel time with no other kernel running);
max reserved. With `--graph-step N`, the same run also times GraphStep (compiled graphs, N
microbatches per step) sequential vs multiplexed vs paired ends, with the same figures, in the
same table, each checked on every step against plain eager autograd over the same N
microbatches. Prints one table (rank 0).

    NCCL_MIN_NCHANNELS=2 NCCL_MAX_NCHANNELS=2 torchrun --standalone --nproc-per-node 2 benches/compile_ab.py

With `--ep-link host[:K]` it runs in one process on one GPU over the EMULATED EP link
(`ep_link.HostLinkAllToAll`: the (K-1)/K share of each all-to-all crosses device -> pinned host
-> device on the copy engines; "comm" is those copies' time, not NCCL's):

    python benches/compile_ab.py --ep-link host:8 --graph-step 4 --steps 4
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
from sched_lifetime.train import exposed_comm_us, median_exposed
from sched_lifetime.train.reference import EXACT, all_ranks, compare, same_order_expected

CFGS = {"tiny": with_overrides(CONFIGS["tiny"], capacity_factor=1.0), "h200": CONFIGS["h200"]}


def transport_of(a, group, dev):
    """The EP transport of every arm: NCCL/gloo functional collectives over `group`, or, with
    `--ep-link`, the emulated link (one process; its copies count as comm)."""
    if a.ep_link:
        from sched_lifetime.ep_link import HostLinkAllToAll

        return HostLinkAllToAll.from_spec(a.ep_link, device=dev)
    return FunctionalAllToAll(group)


def _exposed(prof, a, transport) -> tuple[float, float]:
    """(exposed, total) comm us of one profiled step: NCCL kernels, or the link's copies."""
    return exposed_comm_us(prof, transport if a.ep_link else None)


def graph_step_ab(cfg, group, dev, a, rank, sync, ref_model) -> dict:
    """GraphStep (compiled forward/backward graphs) over N microbatches: sequential, multiplexed
    (order "calibrated", the default: costs measured in step 0), multiplexed in the timing-free
    order "ours", and with paired ends, interleaved steps, medians; every step's losses and gradients checked
    against plain eager autograd (`ref_model`: one loss.backward() per microbatch, not timed),
    all ranks; then one profiled step per arm (exposed communication, max reserved). Returns
    the table's rows."""
    from sched_lifetime.compile import GraphStep

    m = MoEModel(cfg, transport=transport_of(a, group, dev), seed=0, device=dev)
    gs = GraphStep(m, tuple(m.batch(0, 0).values()))  # order "calibrated": step 0 measures the costs
    gs_ours = GraphStep(m, tuple(m.batch(0, 0).values()), order="ours")  # the timing-free order
    times: dict[str, list] = {"sequential": [], "multiplexed": [], "multiplexed_ours": [], "paired_ends": []}
    exact = same_order_expected(2)
    verdicts = {name: EXACT for name in times}
    grads = lambda model: {k: p.grad for k, p in model.named_parameters()}  # noqa: E731

    def batches(step: int) -> list:
        return [tuple(m.batch(step, k).values()) for k in range(a.graph_step)]

    def run(name: str, step: int) -> list:
        for p in m.parameters():
            p.grad = None
        g = gs_ours if name == "multiplexed_ours" else gs
        return g.step(batches(step), multiplexed=name != "sequential", paired_ends=name == "paired_ends")

    for step in range(a.steps + 1):
        ref_model.zero_grad(set_to_none=True)
        want = []
        for mb in batches(step):  # the reference, once per step (same weights: no optimizer)
            loss = ref_model(*mb)
            loss.backward()
            want.append(loss.detach())
        for name in times:
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            losses = run(name, step)
            sync()
            dt = (time.perf_counter() - t0) * 1e3
            v = compare(dict(enumerate(losses)), dict(enumerate(want)), exact).merge(compare(grads(m), grads(ref_model), exact))
            verdicts[name] = verdicts[name].merge(v)
            if step > 0:  # step 0 compiles
                times[name].append(dt)
    verdicts = all_ranks(verdicts, device=dev if dev.type == "cuda" else None)
    rows = {}
    for name in times:
        exposed, total, resv = _profiled(lambda: run(name, 99), sync, dev.type == "cuda", lambda p: _exposed(p, a, m.transport))
        rows[f"GraphStep {name}"] = {
            "parity": verdicts[name].within,
            "parity_label": verdicts[name].label(),
            "parity_steps": a.steps + 1,
            "microbatches": a.graph_step,
            "step_ms": statistics.median(times[name]),
            "exposed_comm_ms": exposed / 1e3,
            "comm_ms": total / 1e3,
            "max_reserved_mib": resv / 2**20,
        }
    return rows


PROFILE_STEPS = 5


def _profiled(step, sync, cuda: bool, exposed) -> tuple[float, float, int]:
    """PROFILE_STEPS steps, each alone under the profiler, from an empty cache: the median
    step's (exposed comm us, comm us) and the max reserved over all of them."""
    if not cuda:
        step()
        return 0.0, 0.0, 0
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    steps = []
    for _ in range(PROFILE_STEPS):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            sync()
        steps.append(exposed(prof))
    m = median_exposed(steps, "comm")
    return m["exposed_comm_us"], m["comm_us"], torch.cuda.max_memory_reserved()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="h200", choices=sorted(CFGS))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", default=None)
    ap.add_argument("--graph-step", type=int, default=0, metavar="N",
                    help="also: N microbatches per step on compiled graphs (GraphStep), sequential vs multiplexed F(i+1)+B(i) vs paired ends, in the same table")
    ap.add_argument("--ep-link", default=None, metavar="host[:K]",
                    help="one process on one GPU over the EMULATED EP link (K emulated ranks, default 8) instead of torchrun + NCCL")
    a = ap.parse_args()
    if a.ep_link:  # a world of one: the barriers and the parity all-reduce still work
        from sched_lifetime.train.cli import _free_port

        for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(_free_port()))):
            os.environ.setdefault(k, v)
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
        m = MoEModel(cfg, transport=transport_of(a, group, dev), seed=0, device=dev)
        arms[name] = (m, m if backend is None else torch.compile(m, backend=backend))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times: dict[str, list] = {k: [] for k in arms}
    # Parity on every step against plain eager autograd (the "eager" arm): each arm's loss and
    # gradients after the round, in place (an arm's gradients live until its next step).
    exact = same_order_expected(2)
    verdicts = {k: EXACT for k in arms}
    grads = lambda model: {k: p.grad for k, p in model.named_parameters()}  # noqa: E731
    for step in range(a.steps + 1):
        losses = {}
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
            losses[name] = loss.detach()
            if step > 0:  # step 0 compiles
                times[name].append(dt)
        ref = arms["eager"][0]
        for name, (m, _) in arms.items():
            v = compare({"loss": losses[name]}, {"loss": losses["eager"]}, exact).merge(compare(grads(m), grads(ref), exact))
            verdicts[name] = verdicts[name].merge(v)
    verdicts = all_ranks(verdicts, device=dev if cuda else None)
    rows = {}
    for name, (m, run) in arms.items():
        m.zero_grad(set_to_none=True)
        exposed, total, resv = _profiled(lambda: run(**m.batch(99, 0)).backward(), sync, cuda, lambda p, m=m: _exposed(p, a, m.transport))
        rows[name] = {
            "parity": verdicts[name].within,
            "parity_label": verdicts[name].label(),
            "parity_steps": a.steps + 1,
            "microbatches": 1,
            "step_ms": statistics.median(times[name]),
            "exposed_comm_ms": exposed / 1e3,
            "comm_ms": total / 1e3,
            "max_reserved_mib": resv / 2**20,
        }
    if a.graph_step:
        rows.update(graph_step_ab(cfg, group, dev, a, rank, sync, arms["eager"][0]))
    if rank == 0:
        where = f"{dist.get_world_size()} x {torch.cuda.get_device_name(dev)}" if cuda else "CPU smoke run (no figures)"
        ep = f"EMULATED EP ({arms['eager'][0].transport.describe()}):" if a.ep_link else f"EP={dist.get_world_size()}"
        print(f"{ep} {where}, config {a.config}, medians of {a.steps} interleaved steps, NCCL channels {os.environ.get('NCCL_MAX_NCHANNELS', 'default')}")
        print("backend rows: one microbatch F+B per step, vs aot_eager; GraphStep rows: N microbatches per step, vs GraphStep sequential")
        print(f"parity: every loss and gradient of all {a.steps + 1} steps against plain eager autograd, all ranks "
              "(= bit-exact, a number: the worst deviation within tolerance, DIFF: beyond it)")
        print("| arm | parity | microbatches | step ms | vs | exposed comm ms | comm ms | max reserved MiB (rank 0, own step) |")
        print("|---|---|---:|---:|---:|---:|---:|---:|")
        for k, r in rows.items():
            base = rows["GraphStep sequential" if k.startswith("GraphStep") else "aot_eager"]["step_ms"]
            print(
                f"| {k} | {'=' if r['parity_label'] == 'exact' else r['parity_label'] if r['parity'] else 'DIFF'} | {r['microbatches']} | {r['step_ms']:.1f} | {base / r['step_ms']:.3f} | "
                f"{r['exposed_comm_ms']:.1f} | {r['comm_ms']:.1f} | {r['max_reserved_mib']:.0f} |"
            )
        if a.out:
            with open(os.path.join(a.out, "compile_ab.json"), "w") as f:
                json.dump({"config": a.config, "rows": rows, "times_ms": times}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
