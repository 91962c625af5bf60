#!/usr/bin/env python3
"""The pictures of README.md and docs/results.md, drawn from data kept in the repository.

    python scripts/figures.py                      # redraw every picture into docs/figures/
    python scripts/figures.py --out DIR            # ... into DIR instead
    python scripts/figures.py import-run RUN_DIR   # keep a main-job run's data under benches/data/

Pictures (each from JSON under benches/data/; a missing input skips its picture with a message
saying which run produces it, and the command still succeeds):

  memory_over_time_h200.png          MEASURED  h200_memory_over_time.json: the caching allocator's
                                               history of one main-job step per arm
  step_timeline_h200.png             MEASURED  h200_step_timeline.json: kernel intervals per stream
                                               of one main-job step, sequential against ours
  pair_timeline_simulated.png        SIMULATED h200_main_job_durations.json: one F(i+1)+B(i) pair
                                               of the main job's chunk, node times measured alone
  megatron_hero_memory_simulated.png SIMULATED the Rust scenario megatron_hero (no input file)

`import-run RUN_DIR` reads what `python -m sched_lifetime train --out RUN_DIR` wrote on a GPU
(`memory_over_time.json`, `trace_sequential.json`, `trace_ours.json`, `train.json`) and writes
the compact h200_memory_over_time.json and h200_step_timeline.json (kernel intervals only), the
files to commit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "torch_ops"))

DATA = os.path.join(ROOT, "benches", "data")
OUT = os.path.join(ROOT, "docs", "figures")
MEMORY = "h200_memory_over_time.json"
TIMELINE = "h200_step_timeline.json"
DURATIONS = "h200_main_job_durations.json"
#: How to make each input on the GPU machine (said when it is missing).
HOW = (
    "run the main job on 2 GPUs with --out (benches/main_job_2gpu.sh OUT --nccl-channels 4 "
    "--arms sequential,ours,ours+record), then `python scripts/figures.py import-run OUT`"
)


class Missing(Exception):
    """An input of a picture is not in the repository."""


def _load(data: str, name: str, how: str) -> Any:
    path = os.path.join(data, name)
    if not os.path.exists(path):
        raise Missing(f"no {os.path.relpath(path, ROOT)}: {how}")
    with open(path) as f:
        return json.load(f)


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams["svg.hashsalt"] = "sched_lifetime"
    return plt


# -- measured ----------------------------------------------------------------------------------


def memory_over_time(data: str, out: str) -> str:
    """MEASURED: allocated and freed-but-pending bytes over one main-job step, per arm."""
    from sched_lifetime.train.figures import plot_allocator

    d = _load(data, MEMORY, HOW)
    histories = {arm: [tuple(p) for p in pts] for arm, pts in d["arms"].items()}
    path = os.path.join(out, "memory_over_time_h200.png")
    plot_allocator(histories, path)
    return path


_KIND_COLOR = {"compute": "tab:blue", "nccl": "tab:orange", "copy": "tab:green"}


def step_timeline(data: str, out: str) -> str:
    """MEASURED: one main-job step per arm, kernel intervals per stream (compute, NCCL, copies)."""
    d = _load(data, TIMELINE, HOW)
    plt = _plt()
    arms = [a for a in ("sequential", "ours") if a in d["arms"]] or list(d["arms"])
    fig, axes = plt.subplots(len(arms), 1, figsize=(12, 1.6 + 1.2 * len(arms)), squeeze=False, sharex=True)
    for ax, arm in zip(axes[:, 0], arms):
        events = d["arms"][arm]["events"]
        lanes = sorted({e[1] for e in events})
        for kind, stream, ts, dur in events:
            ax.broken_barh([(ts / 1e3, dur / 1e3)], (lanes.index(stream) - 0.4, 0.8), color=_KIND_COLOR.get(kind, "grey"))
        ax.set_yticks(range(len(lanes)))
        ax.set_yticklabels([f"stream {s}" for s in lanes])
        exposed, total = d["arms"][arm].get("exposed_comm_ms"), d["arms"][arm].get("comm_ms")
        extra = f": comm {total:.0f} ms, {exposed:.0f} ms with no compute kernel" if total is not None else ""
        ax.set_title(f"{arm}{extra}", fontsize=9)
        ax.grid(alpha=0.3, axis="x")
    axes[-1, 0].set_xlabel("ms in the step")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _KIND_COLOR.values()]
    fig.legend(handles, ["compute kernels", "NCCL (all-to-all, all-reduce)", "device<->host copies"], fontsize=8, loc="lower center", ncol=3)
    fig.suptitle(f"MEASURED: one main-job step, kernels per stream ({d.get('label', '')})", fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    path = os.path.join(out, "step_timeline_h200.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# -- simulated ---------------------------------------------------------------------------------


def _main_job_chunk() -> Any:
    """The main job's chunk with the h200 config's structure (4 MoE layers, shared expert) at a
    tiny width: the graph's node names are the config's, its tensors small."""
    from sched_lifetime.models import CONFIGS, MoEModel
    from sched_lifetime.models.moe import with_overrides

    cfg = with_overrides(
        CONFIGS["h200"], vocab=64, hidden=16, heads=2, expert_ffn=16, shared_ffn=16, dense_ffn=16, seq=4, batch=2, dtype="float32"
    )
    return MoEModel(cfg).chunk()


def pair_timeline(data: str, out: str) -> str:
    """SIMULATED with measured node times: one F(i+1)+B(i) pair, each all-to-all waited at once
    (the order `sequential` and `b_then_f` give a pair) against ours."""
    import sched_lifetime as sl

    durations = _load(data, DURATIONS, "the main job's durations.json (written with --out) on 2 GPUs")
    chunk = _main_job_chunk()
    graph = chunk.graph(True, True)
    plt = _plt()
    orders = [("backward then forward, each all-to-all waited at once", "b_then_f"), ("ours (the scheduler's order, EP budget 1)", "ours")]
    fig, axes = plt.subplots(len(orders), 1, figsize=(12, 4.2), sharex=True)
    colors = {("F", 0): "tab:blue", ("B", 0): "tab:green", ("F", 1): "tab:orange", ("B", 1): "tab:red"}
    for ax, (label, order) in zip(axes, orders):
        program = sl.lower(graph, chunk.order_schedule(True, True, order)["order"])
        names = {n["name"] for n in program["nodes"]}
        rep = sl.simulate(program, durations={k: v for k, v in durations.items() if k in names}, trace=True)
        lanes = {e["tid"]: e["args"]["name"] for e in rep["trace"]["traceEvents"] if e.get("ph") == "M" and e.get("pid") == 0}
        used = sorted({e["tid"] for e in rep["trace"]["traceEvents"] if e.get("ph") == "X"})
        for e in rep["trace"]["traceEvents"]:
            if e.get("ph") != "X":
                continue
            src = "F" if str(e.get("cat", "")).startswith("F") else "B"
            ax.broken_barh([(e["ts"] / 1e3, e["dur"] / 1e3)], (used.index(e["tid"]) - 0.4, 0.8), color=colors[(src, int(lanes[e["tid"]] != "compute"))])
        ax.set_yticks(range(len(used)))
        ax.set_yticklabels([lanes[t] for t in used])
        ax.set_title(f"{label}: {rep['makespan_us'] / 1e3:.1f} ms, exposed comm {rep['exposed_comm_us'] / 1e3:.1f} ms", fontsize=9)
        ax.grid(alpha=0.3, axis="x")
    axes[-1].set_xlabel("ms (simulated)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend(handles, ["F(i+1) compute", "B(i) compute", "F(i+1) all-to-all", "B(i) all-to-all"], fontsize=8, loc="lower center", ncol=4)
    fig.suptitle("SIMULATED: one F(i+1)+B(i) pair of the main job's chunk (h200 config), node times measured alone on 2 x H200", fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    path = os.path.join(out, "pair_timeline_simulated.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def hero_memory(data: str, out: str) -> str:
    """SIMULATED: memory over the Megatron hero case, record_stream against the lifetime manager."""
    import sched_lifetime as sl
    from sched_lifetime.sim import plot_memory

    _plt()
    path = os.path.join(out, "megatron_hero_memory_simulated.png")
    plot_memory(sl.compare(sl.scenario_program("megatron_hero"), trace=True), path, title="megatron_hero (SIMULATED, illustrative durations)")
    return path


FIGURES: list[tuple[str, Callable[[str, str], str]]] = [
    ("memory_over_time_h200.png", memory_over_time),
    ("step_timeline_h200.png", step_timeline),
    ("pair_timeline_simulated.png", pair_timeline),
    ("megatron_hero_memory_simulated.png", hero_memory),
]


def draw(data: str, out: str) -> dict[str, Optional[str]]:
    """Every picture: name -> the path written, or None when an input is missing (said)."""
    os.makedirs(out, exist_ok=True)
    done: dict[str, Optional[str]] = {}
    for name, fn in FIGURES:
        try:
            done[name] = fn(data, out)
            print(f"wrote {os.path.relpath(done[name], ROOT)}")
        except Missing as e:
            done[name] = None
            print(f"skipped {name}: {e}")
    return done


# -- import-run --------------------------------------------------------------------------------


def _kind(e: dict) -> Optional[str]:
    """A trace event's kind: a compute kernel, an NCCL kernel, a device<->host copy, or None
    (not a GPU interval: host ops, user annotations such as the executor's node labels)."""
    cat = str(e.get("cat", "")).lower()
    if e.get("ph") != "X" or cat not in ("kernel", "gpu_memcpy"):
        return None
    if "nccl" in e.get("name", "").lower():
        return "nccl"
    return "copy" if cat == "gpu_memcpy" else "compute"


def _intervals(trace: dict) -> list[list]:
    events = [(k, e) for e in trace.get("traceEvents", []) for k in [_kind(e)] if k is not None]
    if not events:
        raise ValueError("the trace has no kernel events (was it profiled with ProfilerActivity.CUDA?)")
    t0 = min(float(e["ts"]) for _, e in events)
    return [[k, int(e.get("args", {}).get("stream", e.get("tid", 0))), round(float(e["ts"]) - t0, 2), round(float(e["dur"]), 2)] for k, e in events]


def import_run(run: str, data: str, label: str) -> list[str]:
    """Compact JSON from a main-job run directory; returns the files written."""
    written = []
    meta: dict = {}
    if os.path.exists(os.path.join(run, "train.json")):
        with open(os.path.join(run, "train.json")) as f:
            train = json.load(f)
        meta = {"config": train.get("config"), "world": train.get("world")}
        rows = train.get("rows", {})
    else:
        rows = {}
    os.makedirs(data, exist_ok=True)
    mem = os.path.join(run, "memory_over_time.json")
    if os.path.exists(mem):
        with open(mem) as f:
            arms = json.load(f)
        path = os.path.join(data, MEMORY)
        with open(path, "w") as f:
            json.dump({"label": label, **meta, "arms": arms}, f)
        written.append(path)
    timeline: dict = {}
    for arm in ("sequential", "ours", "ours+record", "ours+page"):
        tpath = os.path.join(run, f"trace_{arm.replace('+', '_')}.json")
        if not os.path.exists(tpath):
            continue
        with open(tpath) as f:
            entry: dict = {"events": _intervals(json.load(f))}
        r = rows.get(arm, {})
        if "comm_us" in r:
            entry.update(comm_ms=r["comm_us"] / 1e3, exposed_comm_ms=r["exposed_comm_us"] / 1e3, step_ms=r.get("step_ms"))
        timeline[arm] = entry
    if timeline:
        path = os.path.join(data, TIMELINE)
        with open(path, "w") as f:
            json.dump({"label": label, **meta, "arms": timeline}, f)
        written.append(path)
    if not written:
        raise SystemExit(f"error: {run} has neither memory_over_time.json nor trace_*.json (run the main job with --out on a GPU)")
    return written


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["import-run"]:
        p = argparse.ArgumentParser(prog="scripts/figures.py import-run", description="keep a main-job run's data under benches/data/")
        p.add_argument("run", help="the directory the main job wrote with --out")
        p.add_argument("--data", default=DATA, help="where to write the JSON (default benches/data)")
        p.add_argument("--label", default="", help='machine and date for the pictures\' titles, e.g. "2 x H200, 2026-12-03"')
        a = p.parse_args(argv[1:])
        for path in import_run(a.run, a.data, a.label):
            print(f"wrote {path}")
        return 0
    p = argparse.ArgumentParser(prog="scripts/figures.py", description="redraw the docs' pictures from JSON kept in the repository")
    p.add_argument("--data", default=DATA, help="where the JSON is (default benches/data)")
    p.add_argument("--out", default=OUT, help="where the PNGs go (default docs/figures)")
    a = p.parse_args(argv)
    draw(a.data, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
