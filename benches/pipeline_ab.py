"""GPU A/B: ScheduleDualPipeV on 2 ranks (NCCL), the embedded MoE model as 4 stages (2 per
rank, V mapping), with our OVERLAP_F_B handler (NodeStage stages) vs the same schedule with
no handler (plain stage modules: torch's own pipelining and plain autograd, none of our
code: the reference). Interleaved steps, medians; parity checked against the reference on every
step (every loss and gradient, all ranks: torch.equal, or within `reference.tolerance` where the
sums cannot be in the same order). Prints one table (rank 0).

    torchrun --standalone --nproc-per-node 2 benches/pipeline_ab.py [--config pp_h200] [--steps 6]
    torchrun --standalone --nproc-per-node 4 benches/pipeline_ab.py --ep 2   # PP=2 x EP=2

With `--ep 1` (2 ranks) EP inside a stage is local: dispatch and combine are copies, so the
overlap has no EP transfer to hide; the figure measures the handler's cost and whatever
compute/copy concurrency the multiplexed order finds. With `--ep N` (2N ranks) pipeline rank =
rank % 2 and the N ranks of a pipeline rank form an EP group (NCCL, high-priority streams;
functional all-to-all, so the plain reference differentiates through it): the comm-heavy case
the handler is for. EP ranks see different tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from sched_lifetime.ep import AllToAll, FunctionalAllToAll, new_ep_group
from sched_lifetime.models.moe import CONFIGS, MoEModel, MoEStage, deterministic_sdpa, stage_io, with_overrides
from sched_lifetime.pipelining import NodeStage, enable_overlap
from sched_lifetime.train import _is_kernel
from sched_lifetime.train.reference import EXACT, all_ranks, compare

CONFIGS_PP = {
    "pp_tiny": with_overrides(CONFIGS["tiny"], layers=4, batch=1),
    # One MoE layer per stage, bf16, hidden 2048, 4096 tokens per microbatch.
    "pp_h200": with_overrides(CONFIGS["h200"], layers=4, hidden=2048, heads=16, seq=2048, batch=2, vocab=8192),
}


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels.reshape(-1))


def compute_busy_ms(prof) -> float:
    """GPU time with at least one non-NCCL kernel running (union of intervals), ms."""
    iv = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if _is_kernel(e) and "nccl" not in e.name.lower()
    )
    busy, cur = 0.0, None
    for s, t in iv:
        if cur and s <= cur[1]:
            cur[1] = max(cur[1], t)
        else:
            if cur:
                busy += cur[1] - cur[0]
            cur = [s, t]
    if cur:
        busy += cur[1] - cur[0]
    return busy / 1e3


def build(cfg, rank: int, dev: torch.device, handler: bool, n_mb: int, lifetime: str = "scheduled", pp_group=None, ep_group=None, dw_nodes: bool = True):
    """DualPipeV over 4 stages on pipeline rank `rank` (stages rank and 3 - rank)."""
    from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV

    transport = AllToAll(local=True) if ep_group is None else FunctionalAllToAll(ep_group)
    model = MoEModel(cfg, transport=transport, seed=0, device=dev)
    mods, stages = [], []
    for k in (rank, 3 - rank):
        m = MoEStage(model, k, k + 1)
        m = NodeStage(m, device=dev, lifetime=lifetime, dw_nodes=dw_nodes) if handler else m
        inp, out = stage_io(cfg, k, 4, dev)
        mods.append(m)
        stages.append(PipelineStage(m, k, 4, dev, input_args=inp, output_args=out, group=pp_group))
    sched = ScheduleDualPipeV(stages, n_mb, loss_fn=loss_fn)
    if handler and not enable_overlap(sched):
        raise RuntimeError("DualPipeV emitted no OVERLAP_F_B")
    return mods, sched


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="pp_h200", choices=sorted(CONFIGS_PP))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--out", default=None)
    ap.add_argument("--ep", type=int, default=1, help="EP ranks per pipeline rank (world = 2 x EP)")
    ap.add_argument("--cprofile", default=None, help="rank 0 writes a cProfile of 5 more steps of --cprofile-arm here")
    ap.add_argument("--cprofile-arm", default="ours")
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    world = dist.get_world_size()
    if world != 2 * a.ep:
        raise SystemExit(f"--ep {a.ep} needs {2 * a.ep} ranks (PP=2 x EP={a.ep}), got {world}")
    pp_group = ep_group = None
    if a.ep > 1:
        # Every rank creates every group, in the same order.
        pp_groups = [dist.new_group([2 * e, 2 * e + 1]) for e in range(a.ep)]
        ep_groups = [new_ep_group(list(range(r, world, 2))) for r in range(2)]
        pp_group, ep_group = pp_groups[rank // 2], ep_groups[rank % 2]
    prank = rank % 2  # pipeline rank
    ep_rank = rank // 2
    if cuda:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(dev)
    else:  # a smoke run: gloo cannot send to its own rank (V mapping), drop those warm-up ops
        from torch.distributed.pipelining.stage import _PipelineStageBase

        dev, orig = torch.device("cpu"), getattr(_PipelineStageBase, "_get_init_p2p_neighbors_ops", None)
        if orig is not None:  # torch >= 2.15 has no warm-up exchange
            _PipelineStageBase._get_init_p2p_neighbors_ops = lambda self: [o for o in orig(self) if o.peer != rank]
        torch.cuda.synchronize = torch.cuda.reset_peak_memory_stats = lambda *x: None
        torch.cuda.max_memory_allocated = lambda *x: 0
        torch.cuda.get_device_name = lambda *x: "CPU (smoke run, no figures)"
    torch.use_deterministic_algorithms(True)
    cfg = CONFIGS_PP[a.config]
    import sched_lifetime.models.moe as moe

    moe.SDPA_BACKENDS = deterministic_sdpa(dev, moe._dtype(cfg))
    arms = {
        "no handler": build(cfg, prank, dev, False, a.microbatches, pp_group=pp_group, ep_group=ep_group),
        "ours": build(cfg, prank, dev, True, a.microbatches, pp_group=pp_group, ep_group=ep_group),
        "ours+record": build(cfg, prank, dev, True, a.microbatches, "record_stream", pp_group=pp_group, ep_group=ep_group),
        # dW computed with dI in one autograd call per node (NodeStage(dw_nodes=False)).
        "ours+fused_dw": build(cfg, prank, dev, True, a.microbatches, pp_group=pp_group, ep_group=ep_group, dw_nodes=False),
    }
    g = torch.Generator().manual_seed(7 + 1000 * ep_rank)
    tok = torch.randint(0, cfg.vocab, (a.microbatches * cfg.batch, cfg.seq), generator=g).to(dev)
    lab = torch.randint(0, cfg.vocab, (a.microbatches * cfg.batch, cfg.seq), generator=g).to(dev)
    times: dict[str, list[float]] = {k: [] for k in arms}
    peaks: dict[str, int] = {k: 0 for k in arms}
    # Parity on every step against "no handler": each arm's losses and gradients after the
    # round, in place (an arm's gradients live until its next step).
    exact = True  # no all-reduce in these arms: the same sums in the same order (reference.same_order_expected)
    verdicts = {k: EXACT for k in arms}

    def grads(mods: list) -> dict:
        # By position: a NodeStage's parameters are its wrapped module's, named "module.<name>".
        return {f"stage{i}.param{j}": p.grad for i, m in enumerate(mods) for j, p in enumerate(m.parameters()) if p.grad is not None}

    for step in range(a.steps + 1):  # step 0 warms up
        round_losses: dict[str, list] = {}
        for name, (mods, sched) in arms.items():
            for m in mods:
                m.zero_grad(set_to_none=True)
            losses: list = []
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            dist.barrier()
            t0 = time.perf_counter()
            sched.step(tok, target=lab, losses=losses) if prank == 0 else sched.step()
            torch.cuda.synchronize()
            dt = (time.perf_counter() - t0) * 1e3
            peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated())
            round_losses[name] = [x.detach() for x in losses]
            if step > 0:
                times[name].append(dt)
        ref_mods = arms["no handler"][0]
        for name, (mods, _) in arms.items():
            la, lb = dict(enumerate(round_losses[name])), dict(enumerate(round_losses["no handler"]))
            verdicts[name] = verdicts[name].merge(compare(la, lb, exact).merge(compare(grads(mods), grads(ref_mods), exact)))
    if a.cprofile:  # the host path of our handler, after the timed steps
        import cProfile

        mods, sched = arms[a.cprofile_arm]
        prof = cProfile.Profile()
        for _ in range(5):
            for m in mods:
                m.zero_grad(set_to_none=True)
            dist.barrier()
            prof.enable()
            sched.step(tok, target=lab, losses=[]) if prank == 0 else sched.step()
            prof.disable()
        if rank == 0:
            prof.dump_stats(a.cprofile)
    # One more step per arm, measured alone: pending-free peak (sampled after every
    # OVERLAP_F_B action), and a profile (GPU compute busy time vs the step's wall time).
    from torch.distributed.pipelining.schedules import OVERLAP_F_B

    pending: dict[str, int] = {}
    busy: dict[str, float] = {}
    wall: dict[str, float] = {}
    cpu_top: dict[str, list] = {}
    kern: dict[str, list] = {}
    for name, (mods, sched) in arms.items():
        peak = [0]
        fmap = sched._comp_type_to_function_map if hasattr(sched, "_comp_type_to_function_map") else {}
        orig = fmap.get(OVERLAP_F_B)
        if cuda and orig is not None:
            from sched_lifetime.ab import _pending_free_bytes

            def sampled(act, ctx, f=orig, p=peak):
                f(act, ctx)
                p[0] = max(p[0], _pending_free_bytes())

            fmap[OVERLAP_F_B] = sampled
        for m in mods:
            m.zero_grad(set_to_none=True)
        sched.step(tok, target=lab, losses=[]) if prank == 0 else sched.step()
        torch.cuda.synchronize()
        if orig is not None:
            fmap[OVERLAP_F_B] = orig
        pending[name] = peak[0]
        if cuda:
            from torch.profiler import ProfilerActivity, profile

            for m in mods:
                m.zero_grad(set_to_none=True)
            dist.barrier()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                t0 = time.perf_counter()
                sched.step(tok, target=lab, losses=[]) if prank == 0 else sched.step()
                torch.cuda.synchronize()
                wall[name] = (time.perf_counter() - t0) * 1e3
            busy[name] = compute_busy_ms(prof)
            from sched_lifetime.train import top_kernels

            kern[name] = top_kernels(prof, 10)
            cpu_top[name] = [(e.key[:40], round(e.self_cpu_time_total / 1e3, 1)) for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:6]]
    if cuda:
        # Host syncs in our path (each synchronizing call site warns once, with its location).
        import warnings

        mods, sched = arms["ours"]
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sched.step(tok, target=lab, losses=[]) if prank == 0 else sched.step()
        torch.cuda.set_sync_debug_mode(0)
        sites = sorted({f"{w.filename.split('site-packages/')[-1]}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)})
        if rank == 0:
            print(f"host syncs in one 'ours' step: {len([w for w in caught if 'synchroniz' in str(w.message)])} at {sites[:8]}")
    verdicts = all_ranks(verdicts, device=dev if cuda else None)
    eq = {k: v.label() for k, v in verdicts.items()}
    overlaps = [m.overlapped for m in arms["ours"][0]]
    med = {k: statistics.median(v) for k, v in times.items()}
    if rank == 0:
        rows = [
            f"DualPipeV, PP=2 x EP={a.ep} on {world} x {torch.cuda.get_device_name(dev)}, config {a.config}, {a.microbatches} microbatches, "
            f"medians of {a.steps} interleaved steps; parity against no handler on all {a.steps + 1} steps, all ranks "
            f"(exact, the worst deviation within tolerance, or DIFFER): {eq}; overlapped forwards on rank 0: {overlaps}",
            "| arm | step ms | speed-up | max alloc MiB (rank 0) | pending-free peak MiB | profiled step: wall ms / GPU compute busy ms |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for k in arms:
            prof_col = f"{wall[k]:.1f} / {busy[k]:.1f}" if k in wall else "-"
            rows.append(f"| {k} | {med[k]:.1f} | {med['no handler'] / med[k]:.3f} | {peaks[k] / 2**20:.0f} | {pending[k] / 2**20:.0f} | {prof_col} |")
        print("\n".join(rows))
        for k, top in cpu_top.items():
            print(f"{k}: top self-CPU ops (ms): {top}")
        for k, top in kern.items():
            print(f"{k}: top kernels (ms): {[(n, round(ms, 1)) for n, ms in top]}")
        if a.out:
            with open(os.path.join(a.out, "pipeline_ab.json"), "w") as f:
                json.dump({"config": a.config, "ep": a.ep, "times_ms": times, "median_ms": med, "parity": eq, "peak_alloc": peaks, "overlaps": overlaps,
                           "pending_free_peak": pending, "profiled_wall_ms": wall, "gpu_compute_busy_ms": busy, "cpu_top": cpu_top, "top_kernels": kern}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
