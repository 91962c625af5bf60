"""What cost calibration costs a step (issue 31: "calibration adds <= 1% to the calibrated step and
nothing to later steps"), on the node API (`train_step`, the main job's model) and on GraphStep,
each against its timing-free order `ours` in the same run.

Per path, three instances of one model (same weights, same microbatches): order `ours`;
`calibrated` with the search at the calibration step's end (`Calibration(background=False)`);
`calibrated` with the search in a thread beside the next step (`background=True`, the default
since 2026-12-05; the new order from the step after). First a throwaway instance in order `ours` runs one untimed step (kernels and
allocator warm); then the three, each fresh (its first step builds what any first step builds,
and the calibrated ones' is their calibration step), run `--steps` steps each, one instance
after the other (a background search runs beside its own instance's next step), a sync around
each step. The table prints each instance's step 0 (the calibration
step), step 1 (the background search runs beside it), step 2 (its order takes over) and the
median of the later steps, each against `ours`' step of the same index, and the host time of the
calibration step's end (`Calibration.end_ms`: the sync, the costs' agreement, and the search when
not in the background).

    python benches/calibration_cost.py --config h200 --ep-link host:8 --microbatches 8 --steps 6
    python benches/calibration_cost.py --config tiny --microbatches 4 --steps 4    # CPU: checks the script

With `--ep-link host:K` (the default on CUDA: host:8) the EP all-to-alls cross the EMULATED link
(one process, one GPU); on CPU the local transport. Not bit-exactness: the parity suites check that.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import sched_lifetime as sl
from sched_lifetime.calibrate import Calibration
from sched_lifetime.ep import AllToAll
from sched_lifetime.models.moe import CONFIGS, MoEModel, deterministic_sdpa


def transport_of(spec: str, dev: torch.device):
    if spec:
        from sched_lifetime.ep_link import HostLinkAllToAll

        return HostLinkAllToAll.from_spec(spec, device=dev)
    return AllToAll()


def node_path(cfg, spec: str, dev: torch.device, n: int, steps: int, sync) -> dict:
    """train_step on the main job's model: ours, calibrated (foreground), calibrated (background)."""
    from sched_lifetime.train.arms import Arm

    Arm("ours", cfg, transport_of(spec, dev), dev, 1e-3).step(0, n)  # warms the GPU: kernels, allocator
    sync()
    inst = {"ours": Arm("ours", cfg, transport_of(spec, dev), dev, 1e-3)}  # fresh: its first step builds its executors too
    for name, bg in (("calibrated", False), ("calibrated, background", True)):
        inst[name] = Arm("calibrated", cfg, transport_of(spec, dev), dev, 1e-3, Calibration(background=bg))
    return _rounds({k: (lambda s, a=a: a.step(s, n)) for k, a in inst.items()}, {k: a.chunk.calibration for k, a in inst.items()}, steps, sync)


def graph_path(cfg, spec: str, dev: torch.device, n: int, steps: int, sync) -> dict:
    """GraphStep on the same model: ours, calibrated (foreground), calibrated (background)."""
    from dataclasses import replace

    from sched_lifetime.compile import GraphStep

    if cfg.capacity_factor is None:  # GraphStep captures static shapes: fixed-capacity dispatch
        cfg = replace(cfg, capacity_factor=1.0)
    m = MoEModel(cfg, transport_of(spec, dev), seed=0, device=dev)
    example = tuple(m.batch(0, 0).values())

    def run(g):
        def step(s: int) -> None:
            for p in m.parameters():
                p.grad = None
            g.step([tuple(m.batch(s, i).values()) for i in range(n)])

        return step

    run(GraphStep(m, example, order="ours"))(0)  # warms the GPU: kernels, allocator
    sync()
    inst = {"ours": GraphStep(m, example, order="ours")}
    for name, bg in (("calibrated", False), ("calibrated, background", True)):
        g = GraphStep(m, example)
        g.calibration = Calibration(background=bg)
        inst[name] = g
    return _rounds({k: run(g) for k, g in inst.items()}, {k: g.calibration for k, g in inst.items()}, steps, sync)


def _rounds(steps_of: dict, cals: dict, steps: int, sync) -> dict:
    """Each instance's steps in a row (a background search then runs beside its own instance's
    next step, not another's), each step timed alone; whether a search was in flight when the
    instance's step 1 began."""
    out = {}
    for k, step in steps_of.items():
        times, beside = [], None
        for s in range(steps):
            if s == 1:
                beside = cals[k].planning
            sync()
            t0 = time.perf_counter()
            step(s + 1)
            sync()
            times.append((time.perf_counter() - t0) * 1e3)
        cals[k].take_plans(wait=True)  # a search still in flight is joined before the process ends
        out[k] = {"ms": times, "end_ms": list(cals[k].end_ms), "replans": cals[k].replans, "search_beside_step_1": beside}
    return out


def table(title: str, rows: dict) -> str:
    ours = rows["ours"]["ms"]
    out = [title, f"{'instance':<24}{'step 0':>10}{'step 1':>10}{'step 2':>10}{'later':>10}   vs ours: 0 / 1 / 2 / later   end of step 0 (host)"]
    for k, r in rows.items():
        ms = r["ms"]
        later = statistics.median(ms[3:]) if len(ms) > 3 else float("nan")
        later_ours = statistics.median(ours[3:]) if len(ours) > 3 else float("nan")
        rel = " / ".join(f"{a / b:.3f}" for a, b in zip(ms[:3] + [later], ours[:3] + [later_ours]))
        end = f"{r['end_ms'][0]:.1f} ms, {r['replans']} re-plan(s)" if r["end_ms"] else "-"
        if r["search_beside_step_1"]:
            end += ", search in flight at step 1's start"
        out.append(f"{k:<24}" + "".join(f"{x:>10.1f}" for x in ms[:3] + [later]) + f"   {rel:<31}{end}")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="h200", choices=sorted(CONFIGS))
    ap.add_argument("--ep-link", default=None, metavar="host[:K]", help="the EMULATED EP link (default on CUDA: host:8; CPU: the local transport)")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per instance (>= 4: step 0, 1, 2 and the later ones)")
    ap.add_argument("--paths", default="nodes,graph_step")
    ap.add_argument("--json")
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda") if cuda else torch.device("cpu")
    spec = a.ep_link if a.ep_link is not None else ("host:8" if cuda else "")
    cfg = CONFIGS[a.config]
    if cuda:
        import sched_lifetime.models.moe as moe

        torch.use_deterministic_algorithms(True)
        moe.SDPA_BACKENDS = deterministic_sdpa(dev, moe._dtype(cfg))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    link = f"EMULATED EP link {spec}" if spec else "local EP transport"
    out = {"config": a.config, "link": spec, "microbatches": a.microbatches, "device": str(dev), "version": sl.__version__}
    for path in a.paths.split(","):
        fn = {"nodes": node_path, "graph_step": graph_path}[path]
        rows = fn(cfg, spec, dev, a.microbatches, a.steps, sync)
        out[path] = rows
        print(table(f"{path}: config {a.config}, {a.microbatches} microbatches, {link}, {dev.type}; step ms (each step timed alone)", rows), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
