"""GPU A/B: activation paging on the embedded MoE model, one GPU, one process: paging off,
`sl.Pager` untimed (`pager:FRACTION:PREFETCH[:DRAIN]`: the budget alone, counted drain and
prefetch) and timed (`timed:FRACTION[:SLACK]`: the calibration's timeline places every copy,
only what hides is paged), each two-way (page-ins on their own stream beside the page-outs, the
default) or with the prefix `1s-` on one page stream (`1s-timed:1.0`: `Pager(two_way=False)`,
the baseline), and `torch.autograd.graph.save_on_cpu(pin_memory=True)`, one model shared by
every arm (no optimizer step, so every arm computes the same gradients), steps interleaved
across arms, medians. Per arm: step time, peak allocated above the step's start (the
activations' high-water mark), bytes paged, and parity (torch.equal on every gradient against
paging off, every step). The link's rates are printed too: each way alone and both at once.

    PYTHONPATH=torch_ops python3 benches/paging_ab.py --config h200 --steps 5 --json OUT/paging.json
    PYTHONPATH=torch_ops python3 benches/paging_ab.py --config h200 --set seq=65536,batch=1 --steps 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from typing import Callable, Optional

import torch

import sched_lifetime as sl
from sched_lifetime.models import moe as moe_mod
from sched_lifetime.models.moe import CONFIGS, MoEModel, with_overrides
from sched_lifetime.paging import link_rates


def arms(spec: str) -> dict:
    """'off,pager:0.5:4,1s-timed:1.0,save_on_cpu' -> {name: (its Pager or None, the per-step
    context)}; one Pager per arm, kept across steps (its first step calibrates); `1s-`: one page
    stream for page-outs and page-ins (`two_way=False`)."""
    out = {}
    for a in spec.split(","):
        two_way = not a.startswith("1s-")
        kind = a.removeprefix("1s-")
        if a == "off":
            out[a] = (None, contextlib.nullcontext)
        elif a == "save_on_cpu":
            out[a] = (None, lambda: torch.autograd.graph.save_on_cpu(pin_memory=True))
        elif kind.startswith("pager:"):  # untimed: the budget alone, counted drain and prefetch
            _, frac, pf, drain = (kind.split(":") + ["16"])[:4]
            pager = sl.Pager(float(frac), prefetch=int(pf), drain_distance=int(drain), timed=False, two_way=two_way)
            out[a] = (pager, pager.step)
        elif kind.startswith("timed:"):  # calibrated timeline: only what hides, placed
            _, frac, slack = (kind.split(":") + ["1.25"])[:3]
            pager = sl.Pager(float(frac), slack=float(slack), two_way=two_way)
            out[a] = (pager, pager.step)
        else:
            raise SystemExit(f"unknown arm {a!r}: off, save_on_cpu, [1s-]pager:FRACTION:PREFETCH[:DRAIN], [1s-]timed:FRACTION[:SLACK]")
    return out


def interleaved(prepare: dict[str, Callable[[int], Callable[[], list]]], steps: int, dev: torch.device) -> dict:
    """Steps 0..steps+1, every arm once per step in order; steps 0 and 1 warm up (or calibrate)
    and are not timed. `prepare[arm](step)` sets the step up (untimed) and returns the timed run, which
    returns the tensors to compare. Per arm: step ms, peak allocated above the step's start,
    and parity (torch.equal against the first arm, every step)."""
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rows: dict = {n: {"ms": [], "peak": [], "parity": True} for n in prepare}
    for step in range(steps + 2):
        ref = None
        for name, setup in prepare.items():
            run = setup(step)
            sync()
            base = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            t0 = time.perf_counter()
            got = run()
            sync()
            ms = (time.perf_counter() - t0) * 1e3
            peak = (torch.cuda.max_memory_allocated(dev) - base) if dev.type == "cuda" else 0
            if ref is None:
                ref = [t.clone() for t in got]
            elif not all(torch.equal(x, y) for x, y in zip(ref, got)):
                rows[name]["parity"] = False
            if step > 1:  # steps 0 and 1 warm up (a timed Pager calibrates over two)
                rows[name]["ms"].append(ms)
                rows[name]["peak"].append(peak)
    return rows


def table(rows: dict, paged: dict[str, Optional[int]], paged_label: str) -> dict:
    """Print one line per arm against the first (medians; peak = max over steps); returns the
    figures per arm."""
    off = next(iter(rows))
    base_ms, base_peak = statistics.median(rows[off]["ms"]), max(rows[off]["peak"])
    print(f"{'arm':<16}{'step ms':>9}{'vs ' + off:>9}{'peak MiB':>10}{'saved':>8}{paged_label:>14}{'parity':>8}")
    out = {}
    for name, r in rows.items():
        ms, peak, p = statistics.median(r["ms"]), max(r["peak"]), paged.get(name)
        out[name] = {"ms": ms, "peak_bytes": peak, "parity": r["parity"], "all_ms": r["ms"]}
        print(
            f"{name:<16}{ms:>9.1f}{ms / base_ms:>8.3f}x{peak / 2**20:>10.0f}{(1 - peak / base_peak) if base_peak else 0:>8.1%}"
            f"{'' if p is None else f'{p / 2**20:.0f}':>14}{str(r['parity']):>8}"
        )
    return out


def phases(model: MoEModel, batch: dict, ctx: Callable, dev: torch.device) -> dict:
    """One untimed step: the forward's peak, what is still allocated at the forward -> backward
    boundary, and the backward's peak, MiB above the step's start (allocator bookkeeping is on
    the host: no sync needed, and none is made, so releases happen where they do in a timed
    step)."""
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    with ctx():
        loss = model(**batch)
        fwd_peak = torch.cuda.max_memory_allocated(dev) - base
        boundary = torch.cuda.memory_allocated(dev) - base
        torch.cuda.reset_peak_memory_stats(dev)
        loss.backward()
        bwd_peak = torch.cuda.max_memory_allocated(dev) - base
    torch.cuda.synchronize(dev)
    return {"fwd_peak": fwd_peak / 2**20, "boundary": boundary / 2**20, "bwd_peak": bwd_peak / 2**20}


def forward_ms(model: MoEModel, batch: dict, sync) -> float:
    """Median of 3 forwards with autograd on (what a page-out has to hide under)."""
    ts = []
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        loss = model(**batch)
        sync()
        ts.append((time.perf_counter() - t0) * 1e3)
        del loss
    return statistics.median(ts)


def bench_config(name: str, overrides: str, dev: torch.device):
    """CONFIGS[name] with `overrides` ("seq=8192,batch=1"), fixed-capacity routing (counted
    routing changes saved shapes every step and reads split sizes on the host), and on CUDA
    deterministic kernels, so that arms compare bit-exact (as in the main job)."""
    cfg = CONFIGS[name]
    for kv in filter(None, overrides.split(",")):
        k, v = kv.split("=")
        cfg = with_overrides(cfg, **{k: type(getattr(cfg, k))(v)})
    if cfg.capacity_factor is None:
        cfg = with_overrides(cfg, capacity_factor=1.0)
        print(f"config {name}: capacity_factor set to 1.0 (the same saved shapes every step)")
    if dev.type == "cuda":
        torch.use_deterministic_algorithms(True)
        moe_mod.deterministic_sdpa(dev, torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32)
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="h200", choices=sorted(CONFIGS))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--arms", default="off,1s-timed:1.0,timed:1.0,save_on_cpu")
    ap.add_argument("--set", default="", help="config overrides, e.g. seq=8192,batch=1")
    ap.add_argument("--json")
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = bench_config(a.config, a.set, dev)
    model = MoEModel(cfg, device=dev)  # one model for every arm: the same gradients
    params = list(model.parameters())
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    setups = arms(a.arms)

    def prepare(ctx: Callable) -> Callable[[int], Callable[[], list]]:
        def setup(step: int) -> Callable[[], list]:
            for p in params:
                p.grad = None
            batch = model.batch(step, 0)

            def run() -> list:
                with ctx():
                    model(**batch).backward()
                return [p.grad for p in params]

            return run

        return setup

    rows = interleaved({name: prepare(ctx) for name, (_, ctx) in setups.items()}, a.steps, dev)
    if dev.type == "cuda":
        d2h, h2d, both = (r / 1e3 for r in link_rates(dev, mib=1024, reps=3))  # GB/s
        fwd = forward_ms(model, model.batch(0, 0), sync)
        print(
            f"link: device->host {d2h:.1f} GB/s, host->device {h2d:.1f} GB/s, both at once on two streams {both:.1f} GB/s; "
            f"forward {fwd:.1f} ms: at most {d2h * fwd / 1e3 * 1e9 / 2**20:.0f} MiB can be paged out under the forward (copies fully hidden)"
        )
    print(f"paging A/B, config {a.config} {a.set}, {dev}, medians of {a.steps} interleaved steps (one fwd+bwd each)")
    paged = {name: pager.plan["bytes_paged"] for name, (pager, _) in setups.items() if pager is not None and pager.plan}
    out = table(rows, paged, "paged MiB")
    if dev.type == "cuda":
        print(f"{'arm':<16}{'fwd peak':>10}{'boundary':>10}{'bwd peak':>10}  (MiB above the step's start, one untimed step)")
        for name, (_, ctx) in setups.items():
            for p in params:
                p.grad = None
            ph = phases(model, model.batch(0, 0), ctx, dev)
            out[name]["phases"] = ph
            print(f"{name:<16}{ph['fwd_peak']:>10.0f}{ph['boundary']:>10.0f}{ph['bwd_peak']:>10.0f}")
    for name, (pager, _) in setups.items():
        out[name]["paged_bytes"] = paged.get(name)
        if pager is not None:
            out[name]["stats"] = pager.stats()
            out[name]["explain"] = text = pager.explain()  # Rust's reasons, one line per candidate
            out[name]["calibration"] = pager.calibration  # Rust's inputs (timed: the timeline too)
            print(f"{name}: {text.splitlines()[0]}")
            timing = (pager.calibration or {}).get("timing") or {}
            if timing:  # the rates the plan used: the calibration's own link measurement, beside the line above
                rates = ", ".join(f"{k.removesuffix('_bytes_per_us')} {timing[k] / 1e3:.1f}" for k in ("d2h_bytes_per_us", "h2d_bytes_per_us", "both_bytes_per_us") if k in timing)
                print(f"{name}: planned with the link at {rates} GB/s, {timing.get('page_host_us', 0):.1f} us of host per paged tensor")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": a.config, "device": str(dev), "arms": out}, f, indent=1)


if __name__ == "__main__":
    main()
