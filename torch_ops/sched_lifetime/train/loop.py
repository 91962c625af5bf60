"""The main job's loop: each rank builds every arm and the plain-autograd `Reference`, runs a
warm-up and interleaved timed steps, checks parity against the first arm and against the
reference, then measures each arm alone (memory, profiler) and returns the table and its
figures."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import replace
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .arms import Arm, same_grads
from .reference import Reference, Verdict, all_ranks, compare, same_order_expected
from .figures import (
    allocator_timeline,
    exposed_comm_us,
    exposed_page_us,
    median_exposed,
    format_table,
    plot_allocator,
    simulate_memory,
    top_kernels,
)


def say(args: argparse.Namespace, msg: str) -> None:
    """A progress line on rank 0 (unless `--quiet`), with the seconds since the command started:
    long work (spawn, model build, warm-up, capture) is never silent."""
    if not getattr(args, "progress", True) or (dist.is_initialized() and dist.get_rank() != 0):
        return
    start = getattr(args, "started", None)
    print(f"[{time.time() - start:6.1f} s] {msg}" if start is not None else msg, flush=True)


def worker(rank: int, world: int, args: argparse.Namespace, port: Optional[int]) -> None:
    """One rank of the main job: device and process group set up, `run`, rank 0 prints."""
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
        from ..models import moe as moe_mod

        moe_mod.deterministic_sdpa(torch.device("cuda", torch.cuda.current_device()), torch.bfloat16)
    if world > 1 or ("RANK" in os.environ and _link_spec(args) is None):
        dist.init_process_group("nccl" if use_cuda else "gloo", device_id=torch.device("cuda", torch.cuda.current_device()) if use_cuda else None)
    say(args, f"{world} rank(s) up ({'NCCL' if use_cuda else 'gloo'})" if world > 1 else "running on one process")
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


def config_of(args: argparse.Namespace) -> Any:
    """The model config the job runs: `--config`, with `--layers` when given."""
    from ..models import CONFIGS

    cfg = CONFIGS[args.config]
    return replace(cfg, layers=args.layers) if getattr(args, "layers", 0) else cfg


def run(args: argparse.Namespace, use_cuda: bool) -> dict:
    """Every arm of `args.arms` on this rank, side by side; rank 0 gets {"table", "json"}."""
    from .. import ep as ep_mod

    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    cfg = config_of(args)
    spec = _link_spec(args)
    if spec is not None:  # one process emulating EP=K over host memory (`ep_link`)
        group = None
        transport: Any = ep_mod.HostLinkAllToAll.from_spec(spec, device=device)
    else:
        group = ep_mod.new_ep_group() if dist.is_initialized() else None
        transport = ep_mod.AllToAll(group)
    rank0 = transport.rank == 0
    say(args, f"building {len(args.arms.split(','))} arms on config {args.config} ({cfg.layers} layers, {cfg.experts} experts)")
    arms = build_arms(args, cfg, transport, device, rank0)
    first = next(iter(arms.values()))
    # Every rank must issue the same collectives in the same order.
    ep_mod.check_rank_identical("schedule (graph, order, budgets) and model config", ep_mod.digest(_schedules(arms), cfg.as_dict()), group)

    def sync() -> None:
        if use_cuda:
            torch.cuda.synchronize()

    # Plain autograd over the same steps: what every arm must equal (shares no step code).
    reference = Reference(cfg, group, device, args.lr)
    vs_ref: dict[str, Verdict] = {}
    # Parity with the first arm is bit-exact where the sums run in one order (two ranks at most).
    args.parity_exact = same_order_expected(transport.world)
    grads_ok, failed = _warm_up(arms, first, args.microbatches, sync, reference, vs_ref, args)
    say(args, f"timed steps: {args.steps} round(s), every arm one step a round")
    _timed_steps(arms, first, grads_ok, args, sync, rank0, reference, vs_ref)
    parity = _parity(arms, first, grads_ok, device, args.parity_exact)
    vs_ref = _against_reference(arms, reference, vs_ref, group, device)
    del reference  # its weights and gradients are no part of the memory figures below
    rows: dict[str, dict] = {
        a: {"parity": parity[a], "parity_exact": args.parity_exact, "ref": vs_ref[a].label(), "ref_within": vs_ref[a].within, "ref_worst": vs_ref[a].worst, "step_ms": statistics.median(arm.times)}
        for a, arm in arms.items()
    }
    for a, arm in arms.items():
        if arm.order == "calibrated":
            rows[a]["calibration"] = {**arm.chunk.calibration.summary(), "describe": arm.chunk.calibration.describe()}
    if use_cuda:
        say(args, "each arm measured alone: memory, then a profiled step")
    histories = _measure_alone(arms, rows, args, sync, device, rank0) if use_cuda else {}
    for a, why in failed.items():
        rows[a] = {"parity": False, "step_ms": float("nan"), "failed": why}
    if histories:
        # The data behind the plot, for scripts/figures.py (`import-run`): per arm, one step's
        # (ms, allocated bytes, freed-but-pending bytes) after each allocator event.
        with open(os.path.join(args.out, "memory_over_time.json"), "w") as f:
            json.dump({a: [[round(t, 3), x, p] for t, x, p in tl] for a, tl in histories.items()}, f)
        try:
            plot_allocator(histories, os.path.join(args.out, "memory_over_time.png"))
        except Exception as e:  # a plot never costs the run
            print(f"memory plot skipped: {type(e).__name__}: {e}")
    _node_times(arms, args, rank0)
    _calibrated_orders(arms, args, rank0)
    plot = os.path.join(args.out, "memory_over_time_simulated.png") if args.out and rank0 else None
    simulated = simulate_memory(arms, args.microbatches, args.steps + 4, plot) if not use_cuda else None
    link = transport.describe() if spec is not None else None
    table = format_table(rows, cfg, args, use_cuda, transport.world, link) + (simulated or "")
    return {"table": table, "json": {"config": cfg.as_dict(), "world": transport.world, "ep_link": spec or "nccl", "link": link, "rows": rows}} if rank0 else None


def _link_spec(args: argparse.Namespace) -> Optional[str]:
    """The emulated link's setting (`--ep-link host[:K]`), or None for the real EP group."""
    spec = getattr(args, "ep_link", None)
    return spec if spec not in (None, "nccl") else None


def unknown_costs(costs: dict, known: list[str]) -> list[str]:
    """The names of `costs` (a second microbatch's, `F2.`, as the first's) that are no node of
    the step graph whose node names are `known`."""
    from ..calibrate import fold_name

    names = set(known)
    return sorted(k for k in costs if fold_name(str(k)) not in names)


def costs_refusal(args: argparse.Namespace, unknown: list[str], known: list[str]) -> str:
    """Why `--costs` is refused when it names nodes the config's step graph lacks."""
    return (
        f"--costs {args.costs!r}: {len(unknown)} name(s) are not nodes of config {args.config!r}'s step graph, "
        f"e.g. {unknown[:5]}; its nodes are named like {known[:3]} (a durations.json of a run of the same config)"
    )


def build_arms(args: argparse.Namespace, cfg: Any, transport: Any, device: torch.device, rank0: bool) -> dict[str, Arm]:
    """The arms of `args.arms`, same weights, with `--costs` and the paged arms' page plans."""
    from ..calibrate import Calibration

    names = [a for a in args.arms.split(",") if a]
    steps, smoothing = getattr(args, "calibrate_steps", 1), getattr(args, "calibrate_smoothing", 0.5)
    # The search at the calibration step's end (the warm-up), so every timed step runs the
    # calibrated order (train_step's default searches in the background, a step later).
    arms = {a: Arm(a, cfg, transport, device, args.lr, Calibration(steps, smoothing, background=False)) for a in names}
    if args.costs:
        with open(args.costs) as f:
            costs = {str(k): float(v) for k, v in json.load(f).items()}
        known = sorted(n["name"] for n in next(iter(arms.values())).chunk.graph(True, True)["nodes"])
        unknown = unknown_costs(costs, known)
        if unknown:  # a typo or another config's file would leave those nodes at cost 0, silently
            raise SystemExit(costs_refusal(args, unknown, known))
        for arm in arms.values():
            arm.chunk.costs = costs
    for a, arm in arms.items():
        if not arm.spec.paged:
            continue
        # Calibration runs a forward (with EP, its collectives): every rank, same order.
        how = {"nodes": args.page_nodes.split(",")} if args.page_nodes else {"budget": args.page_budget}
        plan = arm.chunk.enable_paging(arm.model.batch(0, 0), prefetch=args.page_prefetch or None, release=args.page_release or None, **how)
        if rank0 and args.progress:
            print(f"{a}: paging {len(plan['page'])} nodes, {plan['bytes_paged'] / 2**20:.0f} of {plan['bytes_live'] / 2**20:.0f} MiB saved per microbatch: {plan['page']}", flush=True)
    return arms


def _schedules(arms: dict[str, Arm]) -> dict:
    """Every arm's schedule tables (and the paired ends' two-forward / two-backward ones)."""
    from .. import nodes as nodes_mod

    tables: dict = {a: arm.chunk.order_schedule(True, True, arm.order) for a, arm in arms.items()}
    for a, arm in arms.items():
        if arm.spec.paired_ends:
            tables[a + ":ends"] = [nodes_mod.two_schedule(arm.chunk, phase, arm.order) for phase in ("F", "B")]
    return tables


def _warm_up(
    arms: dict[str, Arm],
    first: Arm,
    microbatches: int,
    sync: Callable[[], None],
    reference: Optional[Reference] = None,
    vs_ref: Optional[dict[str, Verdict]] = None,
    args: Optional[argparse.Namespace] = None,
) -> tuple[dict[str, bool], dict[str, str]]:
    """Step 0 on every arm (not timed) and on the reference (each arm's gradients against it
    go into `vs_ref`), then the captured arms' capture step. Returns the gradient parity so far
    and the arms dropped (a capture failure drops the arm, not the run)."""
    for a, arm in arms.items():
        if args is not None:
            say(args, f"warm-up step (not timed): {a}")
        arm.step(0, microbatches)
    sync()
    exact = getattr(args, "parity_exact", True)
    grads_ok = {a: same_grads(arm, first, exact) for a, arm in arms.items()}
    if reference is not None and vs_ref is not None:
        reference.step(0, microbatches)
        vs_ref.update({a: reference.check_grads(arm.model) for a, arm in arms.items()})
    failed: dict[str, str] = {}
    for a, arm in list(arms.items()):
        if arm.captured:
            try:
                if args is not None:
                    say(args, f"capturing the step of {a} in a CUDA graph")
                arm.step(1, microbatches)  # captures, then replays
                arm.losses.pop()
                arm.model.load_state_dict(first.model.state_dict())  # back in step with the others
            except Exception as e:
                failed[a] = f"{type(e).__name__}: {e}"[:300]
                del arms[a]
    return grads_ok, failed


def _timed_steps(
    arms: dict[str, Arm],
    first: Arm,
    grads_ok: dict[str, bool],
    args: argparse.Namespace,
    sync: Callable[[], None],
    rank0: bool,
    reference: Optional[Reference] = None,
    vs_ref: Optional[dict[str, Verdict]] = None,
) -> None:
    """`args.steps` rounds, every arm one step per round (interleaved), each timed alone, then
    the reference's step (not timed); gradients are compared with the first arm's and the
    reference's after every round."""
    for step in range(1, args.steps + 1):
        for a, arm in arms.items():
            sync()
            t0 = time.perf_counter()
            arm.step(step, args.microbatches)
            sync()
            arm.times.append((time.perf_counter() - t0) * 1e3)
            if rank0 and args.progress:
                print(f"step {step} {a:<12} loss {arm.losses[-1].sum().item():.5f}  {arm.times[-1]:.2f} ms", flush=True)
        if reference is not None:
            reference.step(step, args.microbatches)
        for a, arm in arms.items():
            grads_ok[a] = grads_ok[a] and same_grads(arm, first, getattr(args, "parity_exact", True))
            if reference is not None and vs_ref is not None:
                vs_ref[a] = vs_ref[a].merge(reference.check_grads(arm.model))


def _parity(arms: dict[str, Arm], ref: Arm, grads_ok: dict[str, bool], device: torch.device, exact: bool = True) -> dict[str, bool]:
    """Parity against `ref` on every rank together: losses, every gradient, every updated weight;
    `exact=False` (more than two ranks: the in-step gradient buckets and the after-step one sum
    the ranks in another order, `reference.same_order_expected`): within tolerance."""
    parity: dict[str, bool] = {}
    for a, arm in arms.items():
        if exact:
            ok = all(torch.equal(x, y) for x, y in zip(arm.losses, ref.losses)) and grads_ok[a]
            ok &= all(torch.equal(p, q) for p, q in zip(arm.model.parameters(), ref.model.parameters()))
        else:
            ok = grads_ok[a] and bool(compare({str(i): x for i, x in enumerate(arm.losses)}, {str(i): y for i, y in enumerate(ref.losses)}, exact=False))
            ok = ok and bool(compare(dict(arm.model.named_parameters()), dict(ref.model.named_parameters()), exact=False))
        parity[a] = ok
    if dist.is_initialized():
        flags = torch.tensor([int(parity[a]) for a in arms], device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        parity = {a: bool(f) for a, f in zip(arms, flags.tolist())}
    return parity


def _against_reference(arms: dict[str, Arm], reference: Reference, vs_ref: dict[str, Verdict], group: Any, device: torch.device) -> dict[str, Verdict]:
    """Each arm against the plain-autograd reference on every rank together: the gradients
    after every step (`vs_ref` so far), every step's losses, the final weights."""
    mine = {a: vs_ref[a].merge(reference.check_end(arm.model, arm.losses)) for a, arm in arms.items()}
    return all_ranks(mine, group, device)


def _measure_alone(arms: dict[str, Arm], rows: dict, args: argparse.Namespace, sync: Callable[[], None], device: torch.device, rank0: bool) -> dict[str, list]:
    """GPU: one more step per arm, measured alone, for memory (allocator peaks, pending frees,
    the allocator's history on rank 0 with `--out`), then `--profile-steps` steps, each profiled
    alone, for exposed communication (and page copies): the median step's figures, with every
    step's kept (`exposed_comm_steps`). Fills `rows`; returns the allocator histories."""
    from ..ab import _pending_free_bytes

    histories: dict[str, list] = {}
    for a, arm in arms.items():
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
        rows[a].update(max_allocated=torch.cuda.max_memory_allocated(), max_reserved=torch.cuda.max_memory_reserved(), pending_free_peak=pend[0])
        link = arm.model.transport if getattr(arm.model.transport, "emulated_ranks", None) else None
        comm, page = [], []
        for i in range(args.profile_steps):
            if link is not None:
                link.reset_moved()
            host = arm.spec.paged or bool(args.out and args.traces and i == 0)
            prof = _profiled(lambda i=i: arm.step(args.steps + 2 + i, args.microbatches), sync, host)
            comm.append(exposed_comm_us(prof, link, arm.spec.paged))
            if arm.spec.paged:
                page.append(exposed_page_us(prof, link))
            if i == 0:
                rows[a]["top_kernels_ms"] = top_kernels(prof)
                if link is not None and not arm.captured:  # a replay runs no Python: nothing counted
                    rows[a]["link_bytes_each_way"] = link.moved().d2h
                if args.out and args.traces and rank0 and (a in ("ours", "sequential") or arm.spec.paged):
                    prof.export_chrome_trace(os.path.join(args.out, f"trace_{a.replace('+', '_')}.json"))
        rows[a].update(median_exposed(comm, "comm"))
        if arm.spec.paged:
            rows[a].update(median_exposed(page, "page"), page_stats=dict(arm.chunk.page_stats))
        if arm.captured:
            rows[a]["graph_pool"] = arm.graph_pool
    return histories


def _profiled(step: Callable[[], None], sync: Callable[[], None], host: bool) -> Any:
    """One step under the profiler, synced before it ends: CUDA activity, and the host's only
    with `host` (the link's page/link split needs its runtime calls; a large step's host
    events take the profiler many seconds to process)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if host else [ProfilerActivity.CUDA]
    with profile(activities=acts) as prof:
        step()
        sync()
    return prof


def _calibrated_orders(arms: dict[str, Arm], args: argparse.Namespace, rank0: bool) -> None:
    """With `--out`, per calibrated arm: `calibrated_<arm>.json` (what the calibration agreed:
    its summary, the costs, the F+B order) and `calibrated_<arm>.txt` (that order, each node's
    stream and measured cost, then what each launch ran under, with costs)."""
    from ..calibrate import format_costs
    from ..schedule import format_explain, schedule_order

    if not args.out or not rank0:
        return
    for a, arm in arms.items():
        if arm.order != "calibrated":
            continue
        cal = arm.chunk.calibration
        graph = arm.chunk.graph(True, True)
        s = schedule_order(graph, arm.chunk.executor(True, True, arm.order, arm.lifetime)._order)
        stem = os.path.join(args.out, f"calibrated_{a.replace('+', '_')}")
        with open(stem + ".json", "w") as f:
            json.dump({**cal.summary(), "describe": cal.describe(), "costs_us": cal.costs, "order": s["order"]}, f, indent=1)
        with open(stem + ".txt", "w") as f:
            f.write(f"{cal.describe()}\n\n{format_costs(s, cal.costs)}\n\n{format_explain(s, cal.costs)}\n")


def _node_times(arms: dict[str, Arm], args: argparse.Namespace, rank0: bool) -> None:
    """With `--out`: per-node times, measured one node at a time (the sequential order), by
    graph node name, written to durations.json: the `durations` of
    `sl.simulate(sl.lower(graph, order))`, so predictions use them."""
    seq = arms.get("sequential")
    if not args.out or seq is None:
        return
    seq.chunk.timing = True  # every rank runs the step: it issues collectives
    seq.step(args.steps + 3, args.microbatches)
    seq.chunk.timing = False
    if rank0:
        with open(os.path.join(args.out, "durations.json"), "w") as f:
            json.dump({k: round(v, 2) for k, v in seq.chunk.node_times_us().items()}, f, indent=1)
