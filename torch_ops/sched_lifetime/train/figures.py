"""What the main job measures and shows: profiler intervals (exposed communication and page
copies, top kernels), the allocator's timeline and its plot, the simulated memory on CPU, and
the printed table."""

from __future__ import annotations

import argparse
from typing import Any, Optional

import torch


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


def _is_pinned_copy(e: Any) -> bool:
    """A device<->pinned host copy (the emulated link's, the pager's): not a loss's `.cpu()`."""
    return _is_page_copy(e) and "Pinned" in e.name


def link_copy_ids(prof: Any) -> set:
    """Ids of the device copies the emulated EP link queued in a profile: the CUDA runtime
    calls made inside its `LINK_RANGE` ranges (same thread), whose device activity carries the
    same correlation id. Empty when nothing ran eagerly on the link (a graph replay)."""
    from ..ep_link import LINK_RANGE

    ranges: dict[int, list] = {}
    calls = []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CPU:
            continue
        if e.name == LINK_RANGE:
            ranges.setdefault(e.thread, []).append((e.time_range.start, e.time_range.end))
        elif e.name.startswith("cudaMemcpy"):
            calls.append(e)
    return {c.id for c in calls if any(s <= c.time_range.start and c.time_range.end <= t for s, t in ranges.get(c.thread, ()))}


def _link_split(prof: Any, paged: bool) -> tuple[Any, Any]:
    """(is a link copy, is a page copy) for the emulated link's profile. Without page nodes
    every pinned copy is the link's; with them, the link's are told by `link_copy_ids` (a
    captured step has no page nodes)."""
    if not paged:
        return _is_pinned_copy, lambda e: False
    ids = link_copy_ids(prof)
    return (lambda e: _is_pinned_copy(e) and e.id in ids), (lambda e: _is_pinned_copy(e) and e.id not in ids)


def exposed_comm_us(prof: Any, link: Any = None, paged: bool = False) -> tuple[float, float]:
    """(exposed, total) NCCL kernel time in us from a profiler's CUDA kernel events. With
    `link` (the emulated EP link), its device<->pinned host copies instead (page copies, when
    `paged`, are neither comm nor compute)."""
    if link is None:
        return _exposed_us(prof, _is_nccl, lambda e: False)
    is_link, is_page = _link_split(prof, paged)
    return _exposed_us(prof, is_link, is_page)


def exposed_page_us(prof: Any, link: Any = None) -> tuple[float, float]:
    """(exposed, total) device<->host copy time in us: copy time with no compute kernel running
    (NCCL kernels, or the emulated `link`'s copies, are not compute here: a page copy under an
    all-to-all alone is exposed)."""
    if link is None:
        return _exposed_us(prof, _is_page_copy, _is_nccl)
    is_link, is_page = _link_split(prof, True)
    return _exposed_us(prof, is_page, is_link)


def median_exposed(steps: list, what: str) -> dict:
    """The figures of several profiled steps, each an (exposed, total) pair in us: the median
    step's (by exposed time; the lower middle one for an even count) as `exposed_{what}_us` and
    `{what}_us`, every step's pair as `exposed_{what}_steps`. Empty `steps` is an error: a
    figure needs a measurement."""
    if not steps:
        raise ValueError(f"exposed {what}: no profiled step (profile at least one)")
    ranked = sorted(steps, key=lambda p: p[0])
    exp, tot = ranked[(len(ranked) - 1) // 2]
    return {f"exposed_{what}_us": exp, f"{what}_us": tot, f"exposed_{what}_steps": [list(p) for p in steps]}


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
    from .. import executor as ex_mod
    from ..schedule import lower
    from ..sim import simulate

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
        from ..sim import plot_memory

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


def format_table(rows: dict, cfg: Any, args: argparse.Namespace, use_cuda: bool, world: int, link: Optional[str] = None) -> str:
    """The main job's table: one line per arm (parity, step time, comm, memory), then notes.
    `link`: the emulated EP link's description (`HostLinkAllToAll.describe`), said in the header."""
    mib = float(1 << 20)
    nccl = f", NCCL channels {args.nccl_channels}" if args.nccl_channels and link is None else ""
    ep = f"EP={world}" if link is None else link
    where = f"{'CUDA' if use_cuda else 'CPU'}, {ep}, config {args.config}, {args.microbatches} microbatches, {args.steps} timed steps{nccl}"
    w = max(13, *(len(a) + 1 for a in rows))  # the arm column fits the longest name (ours+reduce_after)
    lines = [f"MEASURED ({where})", f"{'arm':<{w}}{'parity':>8}{'vs ref':>8}{'step ms':>10}{'vs seq':>8}{'exposed comm ms':>17}{'comm ms':>9}{'max alloc MiB':>15}{'max resv MiB':>14}{'pending MiB':>13}"]
    base = rows.get("sequential", next(iter(rows.values())))["step_ms"]
    first = next(iter(rows), None)  # the arm the others' parity is taken against
    for a, r in rows.items():
        if "failed" in r:
            lines.append(f"{a:<{w}}  FAILED: {r['failed']}")
            continue
        mem = (
            f"{r['max_allocated'] / mib:>15.0f}{r['max_reserved'] / mib:>14.0f}{r['pending_free_peak'] / mib:>13.0f}"
            if "max_allocated" in r
            else f"{'(GPU only)':>15}{'':>14}{'':>13}"
        )
        comm = f"{r['exposed_comm_us'] / 1e3:>17.2f}{r['comm_us'] / 1e3:>9.2f}" if "comm_us" in r else f"{'(GPU only)':>17}{'':>9}"
        parity = "base" if a == first else ("equal" if r.get("parity_exact", True) else "~equal") if r["parity"] else "DIFFER"
        lines.append(f"{a:<{w}}{parity:>8}{r.get('ref', '-'):>8}{r['step_ms']:>10.2f}{base / r['step_ms']:>8.3f}{comm}{mem}")
    if any("comm_us" in r for r in rows.values()):
        lines.append(f"exposed comm: the median of {args.profile_steps} profiled steps (each profiled alone); comm ms: that step's")
    lines.append(
        f"parity: torch.equal with the first arm, {first} (base: every loss, every gradient after every step, the weights; ~equal: within "
        "tolerance, over more than two ranks, where the arms' gradient all-reduces sum the ranks in another order); vs ref: the same "
        "against plain autograd (loss.backward() per microbatch, no node API): exact, the worst deviation within tolerance, or DIFFER"
    )
    for a, r in rows.items():
        if "calibration" in r:
            c = r["calibration"]
            took = f"; calibration's step-end work {', '.join(f'{x:.1f}' for x in c['end_ms'])} ms (sync, agreement, search)" if c["end_ms"] else ""
            lines.append(f"{a}: {c['describe']}, costs of {c['nodes']} nodes, max over the ranks{took}")
        if "link_bytes_each_way" in r and r.get("comm_us"):
            b = r["link_bytes_each_way"]
            lines.append(f"{a}: the link moved {b / mib:.0f} MiB each way in one step, {b / r['comm_us'] / 1e3:.1f} GB/s over its copy time")
        if "page_us" in r:
            lines.append(
                f"{a}: page copies {r['page_us'] / 1e3:.2f} ms in one step, {r['exposed_page_us'] / 1e3:.2f} ms of it with no compute kernel running"
                " (the median profiled step)"
            )
        if "graph_pool" in r:
            eager = rows.get("ours", {}).get("max_reserved")
            ratio = f" ({r['graph_pool'] / eager:.3f} of ours' eager max reserved)" if eager else ""
            lines.append(f"{a}: whole step captured in one CUDA graph, graph pool {r['graph_pool'] / mib:.0f} MiB{ratio}")
    if use_cuda:
        from ..models import moe as moe_mod

        lines.append(f"attention backend (probed deterministic): {moe_mod.SDPA_BACKENDS or 'torch default'}")
        if "ours" in rows and "top_kernels_ms" in rows["ours"]:
            lines.append("ours, top kernels in one step: " + "; ".join(f"{k} {v:.1f} ms" for k, v in rows["ours"]["top_kernels_ms"]))
    if not use_cuda:
        lines.append("CPU: step times are host times of real numerics; stream overlap, exposed comm and allocator figures need a GPU.")
    if link is not None:
        lines.append(
            "EMULATED EP: one process, all experts computed here; each all-to-all's crossing rows go device -> pinned host -> device "
            "(copy engines) with the bytes rank 0 of that EP group would send; 'comm' is those copies' time, not NCCL's"
            if use_cuda
            else "EMULATED EP on CPU: the crossing rows are copied through host buffers (numerics only)"
        )
    elif use_cuda and world == 1:
        lines.append("One GPU: EP=1, the all-to-all is a local copy; overlap of NCCL traffic needs 2 GPUs (torchrun --standalone --nproc-per-node 2 -m sched_lifetime train).")
    return "\n".join(lines)

