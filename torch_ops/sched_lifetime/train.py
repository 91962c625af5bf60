"""The main job: train the embedded MoE model for a few steps under several arms, side by side
in one process per rank, and print one table.

Arms (same initial weights, same tokens):
  sequential       F then B per microbatch, each comm waited at once (the serial reference)
  b_then_f         F(i+1) and B(i) multiplexed as every B node then every F node
  ours             F(i+1) and B(i) in the scheduler's order
  ours+record      ours, with `record_stream` instead of the lifetime manager
  ours+ends        (opt-in) ours, with the warm-up and cool-down multiplexed too: F(0) with
                   F(1), B(n-2) with B(n-1); one more microbatch's activations live
Columns: loss and gradient parity against `sequential` (torch.equal on every loss, gradient and
updated weight), step time (median of interleaved steps), exposed communication (profiler
kernel intervals: NCCL time with no compute kernel running), max allocated, max reserved,
pending-free peak (allocator snapshot).

Launch: with 2+ GPUs it spawns 2 ranks over NCCL itself (or run it under
`torchrun --standalone --nproc-per-node 2 -m sched_lifetime train`); on CPU it spawns 2 gloo
ranks (real numerics; memory figures simulated by the Rust model and labelled so); with one
GPU it runs EP=1 and says what it cannot show.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from dataclasses import replace
from typing import Any, Optional

import torch
import torch.distributed as dist

ARMS = {
    "sequential": ("sequential", "scheduled"),
    "b_then_f": ("b_then_f", "scheduled"),
    "ours": ("ours", "scheduled"),
    "ours+record": ("ours", "record_stream"),
}
#: Arms that capture the whole step in one CUDA graph (GPU, fixed-capacity dispatch only);
#: `ours+graph+record` uses `record_stream`, whose frees on other streams wait for the capture's end.
GRAPH_ARMS = {"ours+graph": ("ours", "scheduled"), "ours+graph+record": ("ours", "record_stream")}
#: Arms not in the default list, for A/Bs: `ours+classic`, the `classic` scheduler rules (the
#: default before `ready_first`); `ours+ep2`, two EP launches in flight (the default before
#: budget 1: on 2 x H200, h200 config, 8 microbatches, budget 1 ran 1054 ms against 1147 ms).
#: `ours+search`, rule `search` (the order the simulator rates shortest with the node costs of
#: `--costs`, e.g. a previous run's durations.json).
EXTRA_ARMS = {
    "ours+classic": ("ours:classic", "scheduled"),
    "ours+ep2": ("ours:ep_budget=2", "scheduled"),
    "ours+search": ("ours:search", "scheduled"),
    "ours+ends": ("ours", "scheduled"),
    "ours+page": ("ours:page_budget=8", "scheduled"),
    "ours+reduce_after": ("ours", "scheduled"),
}
#: Arms whose data-parallel gradient all-reduce runs after the step, at once (`ours+reduce_after`:
#: the A/B of `ours`, which starts each node's reduce in the last backward, as
#: `Chunk.enable_grad_reduce` does; baselines reduce after the step either way).
REDUCE_AFTER = {"ours+reduce_after"}
#: Arms whose warm-up and cool-down are multiplexed too (`train_step(..., paired_ends=True)`:
#: F(0) with F(1), B(n-2) with B(n-1)), at the cost of one more microbatch's activations.
PAIRED_ENDS = {"ours+ends"}
#: Arms with page nodes (`chunk.enable_paging(budget=--page-budget)`): saved activations of the
#: chosen nodes go to pinned host memory on the page stream and come back before their backward.
PAGED = {"ours+page"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _is_kernel(e: Any) -> bool:
    """A GPU kernel or copy of a profile, not a user annotation (record_function ranges, such
    as the executor's node labels or c10d's `nccl:*`, also appear on the GPU timeline)."""
    return e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)


def _is_nccl(e: Any) -> bool:
    return "nccl" in e.name.lower()


def _is_page_copy(e: Any) -> bool:
    """A device<->host copy (the pager's page-outs and page-ins run on pinned host memory)."""
    n = e.name
    return n.startswith("Memcpy") and ("DtoH" in n or "HtoD" in n)


def exposed_comm_us(prof: Any) -> tuple[float, float]:
    """(exposed, total) NCCL kernel time in us from a profiler's CUDA kernel events."""
    return _exposed_us(prof, _is_nccl, lambda e: False)


def exposed_page_us(prof: Any) -> tuple[float, float]:
    """(exposed, total) device<->host copy time in us: copy time with no compute kernel running
    (NCCL kernels are not compute here: a page copy under an all-to-all alone is exposed)."""
    return _exposed_us(prof, _is_page_copy, _is_nccl)


def union(iv: list) -> list:
    """The union of (start, end) intervals: disjoint [start, end] lists, sorted."""
    out: list = []
    for s, t in sorted(iv):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], t)
        else:
            out.append([s, t])
    return out


def _exposed_us(prof: Any, pick: Any, ignore: Any) -> tuple[float, float]:
    """(exposed, total) time in us of the kernels `pick` selects: their union, less what the
    union of the other kernels (all but `pick` and `ignore`) covers."""
    comm, comp = [], []
    for e in prof.events():
        if not _is_kernel(e) or (ignore(e) and not pick(e)):
            continue
        start = e.time_range.start
        end = e.time_range.end
        (comm if pick(e) else comp).append((start, end))

    cu, pu = union(comm), union(comp)
    total = sum(t - s for s, t in cu)
    covered, j = 0.0, 0
    for s, t in cu:
        while j < len(pu) and pu[j][1] <= s:
            j += 1
        k = j
        while k < len(pu) and pu[k][0] < t:
            covered += max(0.0, min(t, pu[k][1]) - max(s, pu[k][0]))
            k += 1
    return total - covered, total


def top_kernels(prof: Any, n: int = 8) -> list:
    """The `n` kernels with the most GPU time in a profile: [(name, ms)]."""
    agg: dict[str, float] = {}
    for e in prof.events():
        if _is_kernel(e):
            agg[e.name[:70]] = agg.get(e.name[:70], 0.0) + (e.time_range.end - e.time_range.start) / 1e3
    return sorted(agg.items(), key=lambda kv: -kv[1])[:n]


class Arm:
    """One arm's model, optimizer and results."""

    def __init__(self, name: str, cfg: Any, transport: Any, device: torch.device, lr: float) -> None:
        from .models import MoEModel
        from .nodes import GradReduce

        self.name = name
        self.order, self.lifetime = {**ARMS, **GRAPH_ARMS, **EXTRA_ARMS}[name]
        self.captured = name in GRAPH_ARMS
        self.graph: Any = None
        self.graph_pool = 0
        self.graph_pool_large = 0
        self.static: list = []
        self.static_losses: list = []
        self.model = MoEModel(cfg, transport, seed=0, device=device)
        self.chunk = self.model.chunk(device)
        # Data parallel over the EP ranks for everything but the experts: in train_step, or
        # after the step (the captured arms: after the replay; `ours+reduce_after`).
        self.reduce_after: Any = None
        if dist.is_initialized() and dist.get_world_size() > 1:
            if self.captured or name in REDUCE_AFTER:
                self.reduce_after = GradReduce(self.model.dense_parameters())
            else:
                self.chunk.enable_grad_reduce(self.model.dense_parameters())
        self.opt = torch.optim.SGD(self.model.parameters(), lr=lr)
        self.losses: list[torch.Tensor] = []
        self.times: list[float] = []

    def step(self, step: int, microbatches: int, on_run: Any = None) -> None:
        from .nodes import train_step

        m = self.model
        batches = [m.batch(step, i) for i in range(microbatches)]
        if self.captured and step > 0:
            losses = self._replay(batches)
        else:
            self.opt.zero_grad(set_to_none=True)
            losses = train_step(self.chunk, batches, self.order, self.lifetime, on_run, paired_ends=self.name in PAIRED_ENDS)
        if self.reduce_after is not None:  # every gradient at once, after the step
            self.reduce_after.launch(m.dense_parameters())
            self.reduce_after.finish()
        self.opt.step()
        self.losses.append(torch.stack([x.float() for x in losses]).detach().cpu())

    def _replay(self, batches: list) -> list:
        if self.graph is None:
            _capture(self, batches)
        for s, b in zip(self.static, batches):
            for k in s:
                s[k].copy_(b[k])
        self.graph.replay()
        return [x.clone() for x in self.static_losses]


def same_grads(arm: "Arm", ref: "Arm") -> bool:
    """Every gradient of `arm` equals `ref`'s after the same step, compared in place: no copy
    is kept, so the memory figures carry no history of earlier steps."""
    mine = {k: p.grad for k, p in arm.model.named_parameters() if p.grad is not None}
    theirs = {k: p.grad for k, p in ref.model.named_parameters() if p.grad is not None}
    return set(mine) == set(theirs) and all(torch.equal(mine[k], theirs[k]) for k in theirs)


def _capture(arm: "Arm", batches: list) -> None:
    """Capture one whole step (every microbatch's F and B, the lifetime manager's waits and
    releases, the all-to-alls) into one CUDA graph over static inputs. Gradients are written
    by the graph (its first write to each is an assignment), so they are not zeroed again."""
    from .nodes import train_step

    if arm.model.cfg.capacity_factor is None:
        raise ValueError("capturing a step needs the fixed-capacity dispatch (capacity_factor); counted mode syncs the host")
    arm.static = [{k: v.clone() for k, v in b.items()} for b in batches]
    arm.opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base, base_large = torch.cuda.memory_reserved(), _large_pool_reserved()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        arm.static_losses = train_step(arm.chunk, arm.static, arm.order, arm.lifetime)
    arm.graph_pool = torch.cuda.memory_reserved() - base
    arm.graph_pool_large = _large_pool_reserved() - base_large
    arm.graph = g


def _large_pool_reserved() -> int:
    return torch.cuda.memory_stats().get("reserved_bytes.large_pool.current", 0)


def pool_segments(pool_id: Any) -> list[dict]:
    """The allocator snapshot's segments of one private pool (a graph's or a MemPool's)."""
    return [s for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", ())) == tuple(pool_id)]


def _capture_start(arm: "Arm") -> None:
    """Where a whole-step capture starts: no gradients, an empty cache, no cuBLAS workspaces."""
    arm.opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()


def eager_step_growth(arm: "Arm", step: int, microbatches: int) -> dict[str, int]:
    """One eager step of `arm` from where a whole-step capture starts, measured as `_capture`
    counts the graph pool: no gradients (the graph writes them in its pool), an empty cache, and
    the cuBLAS workspaces cleared (each side counts those its own run allocates). Returns the
    peak growth above that start: `pool_large` (large-pool reserved, where the activations
    live), `pool` (all reserved) and `allocated_peak`."""
    _capture_start(arm)
    base, base_large, start = torch.cuda.memory_reserved(), _large_pool_reserved(), torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    arm.step(step, microbatches)
    torch.cuda.synchronize()
    return {
        "pool_large": torch.cuda.memory_stats()["reserved_bytes.large_pool.peak"] - base_large,
        "pool": torch.cuda.max_memory_reserved() - base,
        "allocated_peak": torch.cuda.max_memory_allocated() - start,
    }


def eager_step_pool(arm: "Arm", step: int, microbatches: int) -> dict[str, int]:
    """One eager step of `arm` with every allocation on the device (any stream, any thread: the
    autograd engine's too) routed into a fresh private pool, as a capture routes its
    allocations into the graph's pool, and from the same start as `eager_step_growth`. Unlike
    the growth of the shared pool, the step cannot use free space left inside segments that
    existed before it (the parameters' segments), so its pool compares like for like with a
    graph pool. Returns the pool's reserved bytes at the end (nothing is released from a pool
    during the step, so that is its peak): `pool_large` (large segments) and `pool`."""
    _capture_start(arm)
    dev = torch.cuda.current_device()
    pool = torch.cuda.MemPool()
    torch._C._cuda_beginAllocateToPool(dev, pool.id)  # every stream, every thread
    try:
        arm.step(step, microbatches)
        torch.cuda.synchronize()
    finally:
        torch._C._cuda_endAllocateToPool(dev, pool.id)
    segs = pool_segments(pool.id)
    out = {
        "pool_large": sum(s["total_size"] for s in segs if s["segment_type"] == "large"),
        "pool": sum(s["total_size"] for s in segs),
    }
    # The step's gradients live in the pool; its segments go back once they are freed.
    torch._C._cuda_releasePool(dev, pool.id)
    return out


def worker(rank: int, world: int, args: argparse.Namespace, port: Optional[int]) -> None:
    use_cuda = torch.cuda.is_available() and not args.cpu
    if port is not None:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(port)
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)
    if use_cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
        # Arms must compare bit-exact: deterministic kernels, and an attention backend whose
        # backward is (probed, not assumed).
        torch.use_deterministic_algorithms(True)
        from .models import moe as moe_mod

        moe_mod.deterministic_sdpa(torch.device("cuda", torch.cuda.current_device()), torch.bfloat16)
    if world > 1 or "RANK" in os.environ:
        dist.init_process_group("nccl" if use_cuda else "gloo", device_id=torch.device("cuda", torch.cuda.current_device()) if use_cuda else None)
    try:
        out = run(args, use_cuda)
        if (not dist.is_initialized() or dist.get_rank() == 0) and out is not None:
            print(out["table"])
            if args.out:
                with open(os.path.join(args.out, "train.json"), "w") as f:
                    json.dump(out["json"], f, indent=1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run(args: argparse.Namespace, use_cuda: bool) -> dict:
    from . import ep as ep_mod
    from . import nodes as nodes_mod
    from .ab import _pending_free_bytes
    from .models import CONFIGS

    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    cfg = CONFIGS[args.config]
    if args.layers:
        cfg = replace(cfg, layers=args.layers)
    group = ep_mod.new_ep_group() if dist.is_initialized() else None
    transport = ep_mod.AllToAll(group)
    rank0 = transport.rank == 0
    names = [a for a in args.arms.split(",") if a]
    arms = {a: Arm(a, cfg, transport, device, args.lr) for a in names}
    if args.costs:
        with open(args.costs) as f:
            costs = {str(k): float(v) for k, v in json.load(f).items()}
        for arm in arms.values():
            arm.chunk.costs = costs
    for a in PAGED & set(arms):
        # Calibration runs a forward (with EP, its collectives): every rank, same order.
        how = {"nodes": args.page_nodes.split(",")} if args.page_nodes else {"budget": args.page_budget}
        plan = arms[a].chunk.enable_paging(arms[a].model.batch(0, 0), prefetch=args.page_prefetch or None, release=args.page_release or None, **how)
        if rank0 and args.progress:
            print(f"{a}: paging {len(plan['page'])} nodes, {plan['bytes_paged'] / 2**20:.0f} of {plan['bytes_live'] / 2**20:.0f} MiB saved per microbatch: {plan['page']}", flush=True)
    first = next(iter(arms.values()))
    failed: dict[str, str] = {}
    # Every rank must issue the same collectives in the same order.
    tables = {a: arm.chunk.order_schedule(True, True, arm.order) for a, arm in arms.items()}
    for a in PAIRED_ENDS & set(arms):
        tables[a + ":ends"] = [nodes_mod.two_schedule(arms[a].chunk, phase, arms[a].order) for phase in ("F", "B")]
    ep_mod.check_rank_identical("schedule (graph, order, budgets) and model config", ep_mod.digest(tables, cfg.as_dict()), group)

    def sync() -> None:
        if use_cuda:
            torch.cuda.synchronize()

    # Warm-up step (not timed), then interleaved timed steps; gradients are compared with the
    # first arm's after every round in which all arms ran the same step.
    grads_ok = {a: True for a in arms}

    def compare_grads() -> None:
        for a, arm in arms.items():
            grads_ok[a] = grads_ok[a] and same_grads(arm, first)

    for a, arm in arms.items():
        arm.step(0, args.microbatches)
    sync()
    compare_grads()
    for a, arm in list(arms.items()):
        if arm.captured:
            try:
                arm.step(1, args.microbatches)  # captures, then replays
                arm.losses.pop()
                arm.model.load_state_dict(first.model.state_dict())  # back in step with the others
            except Exception as e:  # a capture failure drops the arm, never the run
                failed[a] = f"{type(e).__name__}: {e}"[:300]
                del arms[a]
    for step in range(1, args.steps + 1):
        for a, arm in arms.items():
            sync()
            t0 = time.perf_counter()
            arm.step(step, args.microbatches)
            sync()
            arm.times.append((time.perf_counter() - t0) * 1e3)
            if rank0 and args.progress:
                print(f"step {step} {a:<12} loss {arm.losses[-1].sum().item():.5f}  {arm.times[-1]:.2f} ms", flush=True)
        compare_grads()
    # Parity against the first arm: losses, every gradient, every updated weight.
    ref = first
    parity: dict[str, bool] = {}
    for a, arm in arms.items():
        ok = all(torch.equal(x, y) for x, y in zip(arm.losses, ref.losses)) and grads_ok[a]
        ok &= all(torch.equal(p, q) for p, q in zip(arm.model.parameters(), ref.model.parameters()))
        parity[a] = ok
    if dist.is_initialized():
        flags = torch.tensor([int(parity[a]) for a in arms], device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        parity = {a: bool(f) for a, f in zip(arms, flags.tolist())}
    rows: dict[str, dict] = {a: {"parity": parity[a], "step_ms": statistics.median(arm.times)} for a, arm in arms.items()}
    # Memory and exposed communication: one more step per arm, measured alone.
    histories: dict[str, list] = {}
    for a, arm in arms.items():
        if use_cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            pend = [0]

            def sample(p: list = pend) -> None:
                p[0] = max(p[0], _pending_free_bytes())

            record = bool(args.out and rank0)
            if record:
                torch.cuda.memory._record_memory_history(max_entries=500_000)
            arm.step(args.steps + 1, args.microbatches, on_run=sample)
            sync()
            if record:
                try:
                    histories[a] = allocator_timeline(torch.cuda.memory._snapshot(), device)
                finally:
                    torch.cuda.memory._record_memory_history(enabled=None)
            rows[a].update(
                max_allocated=torch.cuda.max_memory_allocated(), max_reserved=torch.cuda.max_memory_reserved(), pending_free_peak=pend[0]
            )
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                arm.step(args.steps + 2, args.microbatches)
                sync()
            exp, tot = exposed_comm_us(prof)
            rows[a].update(exposed_comm_us=exp, comm_us=tot, top_kernels_ms=top_kernels(prof))
            if a in PAGED:
                pexp, ptot = exposed_page_us(prof)
                rows[a].update(exposed_page_us=pexp, page_us=ptot, page_stats=dict(arm.chunk.page_stats))
            if args.out and rank0 and (a == "ours" or a in PAGED):
                prof.export_chrome_trace(os.path.join(args.out, f"trace_{a.replace('+', '_')}.json"))
            if arm.captured:
                rows[a]["graph_pool"] = arm.graph_pool
    for a, why in failed.items():
        rows[a] = {"parity": False, "step_ms": float("nan"), "failed": why}
    if histories:
        try:
            plot_allocator(histories, os.path.join(args.out, "memory_over_time.png"))
        except Exception as e:  # a plot never costs the run
            print(f"memory plot skipped: {type(e).__name__}: {e}")
    # Per-node times, measured one node at a time (the sequential order), by graph node name:
    # the `durations` of `sl.simulate(sl.lower(graph, order))`, so predictions use them.
    if args.out and "sequential" in arms:
        seq = arms["sequential"]
        seq.chunk.timing = True  # every rank runs the step: it issues collectives
        seq.step(args.steps + 3, args.microbatches)
        seq.chunk.timing = False
    if args.out and rank0 and "sequential" in arms:
        with open(os.path.join(args.out, "durations.json"), "w") as f:
            json.dump({k: round(v, 2) for k, v in seq.chunk.node_times_us().items()}, f, indent=1)
    plot = os.path.join(args.out, "memory_over_time_simulated.png") if args.out and rank0 else None
    simulated = simulate_memory(arms, args.microbatches, args.steps + 4, plot) if not use_cuda else None
    return {"table": format_table(rows, cfg, args, use_cuda, transport.world) + (simulated or ""), "json": {"config": cfg.as_dict(), "world": transport.world, "rows": rows}} if rank0 else None


def allocator_timeline(snapshot: dict, device: torch.device) -> list:
    """(time ms, allocated bytes, freed-but-pending bytes) after each allocator event of one
    step, from the caching allocator's history (`free_requested` .. `free_completed` is the
    time a block waits for the streams that used it: record_stream's pending frees)."""
    traces = snapshot.get("device_traces", [])
    events = traces[device.index or 0] if len(traces) > (device.index or 0) else []
    alloc = pend = 0
    out = []
    t0 = None
    for i, e in enumerate(events):
        act, size = e.get("action"), int(e.get("size", 0))
        if act == "alloc":
            alloc += size
        elif act == "free_requested":
            alloc -= size
            pend += size
        elif act == "free_completed":
            pend -= size
        else:
            continue
        t = e.get("time_us", i)
        t0 = t if t0 is None else t0
        out.append(((t - t0) / 1e3, alloc, pend))
    return out


def plot_allocator(histories: dict, path: str) -> None:
    """Allocated and pending-free bytes over one step, one panel per arm (measured)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(histories), figsize=(5 * len(histories), 3.5), sharey=True, squeeze=False)
    for ax, (arm, tl) in zip(axes[0], histories.items()):
        t = [p[0] for p in tl]
        base = min((p[1] for p in tl), default=0)
        ax.step(t, [(p[1] - base) / (1 << 30) for p in tl], where="post", label="allocated (above step start)")
        ax.step(t, [p[2] / (1 << 30) for p in tl], where="post", label="freed, pending (record_stream)")
        ax.set_title(arm)
        ax.set_xlabel("ms in the step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("GiB")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("MEASURED: caching allocator history, one training step per arm")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def simulate_memory(arms: dict, microbatches: int, step: int, plot: Optional[str] = None) -> Optional[str]:
    """CPU: what the Rust model predicts for one multiplexed F+B run of `ours` on a GPU, with
    each value's bytes as measured here: record_stream vs the lifetime manager (SIMULATED)."""
    from . import executor as ex_mod
    from .schedule import lower
    from .sim import simulate

    arm = arms.get("ours")
    if arm is None or microbatches < 2:
        return None
    arm.chunk.timing = True
    ex = arm.chunk.executor(True, True, arm.order, arm.lifetime)
    ex.value_bytes = {}
    arm.step(step, microbatches)  # every rank: it issues collectives
    arm.chunk.timing = False
    graph = ex_mod.sized_graph(arm.chunk.graph(True, True), ex.value_bytes)
    ex.value_bytes = None
    program = lower(graph, arm.chunk.order_schedule(True, True, arm.order)["order"])
    names = {n["name"] for n in program["nodes"]}
    durations = {k: v for k, v in arm.chunk.node_times_us().items() if k in names}
    res = {p: simulate(program, p, durations=durations, trace=plot is not None) for p in ("record_stream", "scheduled")}
    if plot is not None:
        from .sim import plot_memory

        try:
            plot_memory(res, plot, title="one F(i+1)+B(i) run of ours, SIMULATED with this run's sizes and node times")
        except Exception as e:  # matplotlib missing, etc.: say so, lose nothing else
            print(f"memory plot skipped: {type(e).__name__}: {e}")
    mib = float(1 << 20)
    rs, sc = res["record_stream"], res["scheduled"]
    return (
        "\nSIMULATED (Rust model, not measured), one F(i+1)+B(i) run of ours with this run's tensor sizes and node times:"
        f"\n  max reserved {rs['reserved_peak']['bytes'] / mib:.2f} MiB record_stream vs {sc['reserved_peak']['bytes'] / mib:.2f} MiB scheduled;"
        f" pending-free peak {rs['pending_free_peak']['bytes'] / mib:.2f} vs {sc['pending_free_peak']['bytes'] / mib:.2f} MiB;"
        f" hazards {len(rs['hazards'])} / {len(sc['hazards'])}"
    )


def format_table(rows: dict, cfg: Any, args: argparse.Namespace, use_cuda: bool, world: int) -> str:
    mib = float(1 << 20)
    nccl = f", NCCL channels {args.nccl_channels}" if args.nccl_channels else ""
    where = f"{'CUDA' if use_cuda else 'CPU'}, EP={world}, config {args.config}, {args.microbatches} microbatches, {args.steps} timed steps{nccl}"
    lines = [f"MEASURED ({where})", f"{'arm':<13}{'parity':>8}{'step ms':>10}{'vs seq':>8}{'exposed comm ms':>17}{'comm ms':>9}{'max alloc MiB':>15}{'max resv MiB':>14}{'pending MiB':>13}"]
    base = rows.get("sequential", next(iter(rows.values())))["step_ms"]
    for a, r in rows.items():
        if "failed" in r:
            lines.append(f"{a:<13}  FAILED: {r['failed']}")
            continue
        mem = (
            f"{r['max_allocated'] / mib:>15.0f}{r['max_reserved'] / mib:>14.0f}{r['pending_free_peak'] / mib:>13.0f}"
            if "max_allocated" in r
            else f"{'(GPU only)':>15}{'':>14}{'':>13}"
        )
        comm = f"{r['exposed_comm_us'] / 1e3:>17.2f}{r['comm_us'] / 1e3:>9.2f}" if "comm_us" in r else f"{'(GPU only)':>17}{'':>9}"
        lines.append(f"{a:<13}{'equal' if r['parity'] else 'DIFFER':>8}{r['step_ms']:>10.2f}{base / r['step_ms']:>8.3f}{comm}{mem}")
    for a, r in rows.items():
        if "page_us" in r:
            lines.append(
                f"{a}: page copies {r['page_us'] / 1e3:.2f} ms in one step, {r['exposed_page_us'] / 1e3:.2f} ms of it with no compute kernel running"
            )
        if "graph_pool" in r:
            eager = rows.get("ours", {}).get("max_reserved")
            ratio = f" ({r['graph_pool'] / eager:.3f} of ours' eager max reserved)" if eager else ""
            lines.append(f"{a}: whole step captured in one CUDA graph, graph pool {r['graph_pool'] / mib:.0f} MiB{ratio}")
    if use_cuda:
        from .models import moe as moe_mod

        lines.append(f"attention backend (probed deterministic): {moe_mod.SDPA_BACKENDS or 'torch default'}")
        if "ours" in rows and "top_kernels_ms" in rows["ours"]:
            lines.append("ours, top kernels in one step: " + "; ".join(f"{k} {v:.1f} ms" for k, v in rows["ours"]["top_kernels_ms"]))
    if not use_cuda:
        lines.append("CPU: step times are host times of real numerics; stream overlap, exposed comm and allocator figures need a GPU.")
    elif world == 1:
        lines.append("One GPU: EP=1, the all-to-all is a local copy; overlap of NCCL traffic needs 2 GPUs (torchrun --standalone --nproc-per-node 2 -m sched_lifetime train).")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sched_lifetime train", description="train the embedded MoE model under several arms")
    p.add_argument("--config", default=None, help="tiny (CPU default), tiny_dense, h200 (GPU default)")
    p.add_argument("--layers", type=int, default=0)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--world", type=int, default=2, help="EP ranks to spawn when not under torchrun")
    p.add_argument("--cpu", action="store_true", help="run on CPU (gloo) even with a GPU")
    p.add_argument("--out", default=None, help="directory for train.json and the trace")
    p.add_argument("--nccl-channels", type=int, default=0, help="limit NCCL to this many channels (0: NCCL's choice)")
    p.add_argument("--quiet", dest="progress", action="store_false", help="no progress line per step")
    p.add_argument("--page-budget", type=float, default=0.5, help="arm ours+page: fraction of a microbatch's saved activations to page")
    p.add_argument("--page-nodes", default="", help="arm ours+page: page these compute nodes (comma-separated, e.g. L1.experts,L2.experts) instead of --page-budget's choice")
    p.add_argument("--page-prefetch", type=int, default=2, help="arm ours+page: a page-in may start this many backward nodes before its consumer (0: at once)")
    p.add_argument("--page-release", type=int, default=4, help="arm ours+page: the forward compute node this many nodes after a paged one waits for its page-out and releases its storage (0: only when a query finds the copy done)")
    p.add_argument("--costs", default=None, help='JSON {"node": us} (e.g. a previous run\'s durations.json) for arm ours+search')
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = parser().parse_args(argv)
    use_cuda = torch.cuda.is_available() and not args.cpu
    if args.config is None:
        args.config = "h200" if use_cuda else "tiny"
    for a in [a for a in args.arms.split(",") if a]:
        if a not in ARMS and a not in GRAPH_ARMS and a not in EXTRA_ARMS:
            raise SystemExit(f"unknown arm {a!r}; expected some of {sorted(ARMS) + sorted(GRAPH_ARMS) + sorted(EXTRA_ARMS)}")
        if a in GRAPH_ARMS and not use_cuda:
            raise SystemExit(f"arm {a!r} captures a CUDA graph: it needs a GPU")
        if a == "ours+search" and not args.costs:
            raise SystemExit("arm 'ours+search' needs --costs (node costs in us, e.g. a previous run's durations.json)")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    # Deterministic cuBLAS (must be set before the first cuBLAS call).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if args.nccl_channels:
        # Fewer NCCL channels: a slower, inter-node-like link (and fewer SMs taken from compute).
        os.environ["NCCL_MIN_NCHANNELS"] = os.environ["NCCL_MAX_NCHANNELS"] = str(args.nccl_channels)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, None)
        return 0
    world = args.world
    if use_cuda and torch.cuda.device_count() < world:
        print(f"{torch.cuda.device_count()} GPU(s): running EP=1; for EP over NCCL run on {world} GPUs "
              f"(torchrun --standalone --nproc-per-node {world} -m sched_lifetime train)", file=sys.stderr)
        world = 1
    if world == 1:
        worker(0, 1, args, None)
        return 0
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(world, args, _free_port()), nprocs=world, join=True)
    return 0
