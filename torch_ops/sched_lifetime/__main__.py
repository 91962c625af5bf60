"""Command line (`python -m sched_lifetime --help`, or `sched-lifetime` once installed):

    python -m sched_lifetime train [options]     the main job: train the embedded MoE model under
                                                 several arms side by side and print one table
                                                 (`train --help`; docs/main-job.md)
    python -m sched_lifetime demo [options]      the lifetime A/B, then the simulated memory of the
                                                 same pipeline and of the Megatron hero case
    python -m sched_lifetime ab [options]        the lifetime A/B alone: record_stream vs scheduled
                                                 release on a lagging two-stream pipeline
    python -m sched_lifetime simulate PLAN       a simulator program (JSON or scenario:NAME) under
                                                 both policies, SIMULATED
    python -m sched_lifetime simulate-schedule GRAPH
                                                 a scheduler graph under our order or a given one,
                                                 SIMULATED
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _ab(args: argparse.Namespace) -> int:
    from . import ab as ab_mod

    res = ab_mod.run_ab(n=args.n, mib=args.mib, lag=args.lag, steps=args.steps, device=args.device)
    print(ab_mod.format_table(res))
    if args.json:
        rows = {k: {kk: vv for kk, vv in v.items() if kk != "outputs"} for k, v in res["rows"].items()}
        with open(args.json, "w") as f:
            json.dump({**{k: v for k, v in res.items() if k != "rows"}, "rows": rows}, f, indent=1)
    if not res["outputs_equal"]:
        print("error: the two arms produced different outputs", file=sys.stderr)
        return 1
    return 0


def _load_plan(src: str) -> tuple[str, dict]:
    from .sim import scenario_program

    if src.startswith("scenario:"):
        name = src.split(":", 1)[1]
        return name, scenario_program(name)
    try:
        with open(src) as f:
            return src, json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"error: cannot read plan {src}: {e}")


def _simulate(args: argparse.Namespace) -> int:
    from . import sim

    name, plan = _load_plan(args.plan)
    if args.durations:
        try:
            with open(args.durations) as f:
                plan = sim.with_durations(plan, json.load(f))
        except (OSError, json.JSONDecodeError) as e:
            raise SystemExit(f"error: cannot read durations {args.durations}: {e}")
    want_trace = bool(args.trace or args.plot)
    res = sim.compare(plan, trace=want_trace)
    print(sim.format_compare(name, res))
    if args.trace:
        with open(args.trace, "w") as f:
            json.dump(sim.chrome_trace(res), f)
        print(f"trace (Chrome/Perfetto) written to {args.trace}")
    if args.plot:
        sim.plot_memory(res, args.plot, title=f"{name} (simulated)")
        print(f"memory plot written to {args.plot}")
    if args.json:
        for rep in res.values():
            rep.pop("trace", None)
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


def _simulate_schedule(args: argparse.Namespace) -> int:
    from .schedule import simulate_schedule
    from .sim import scenario_graph

    def load(path: str | None, what: str):
        if path is None:
            return None
        try:
            with open(path) as f:
                return json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise SystemExit(f"error: cannot read {what} {path}: {e}")

    graph = scenario_graph(args.graph.split(":", 1)[1])["graph"] if args.graph.startswith("scenario:") else load(args.graph, "graph")
    rep = simulate_schedule(graph, load(args.order, "order"), load(args.costs, "costs"), args.policy)
    print(
        f"SIMULATED ({args.policy}): makespan {rep['makespan_us'] / 1e3:.3f} ms, exposed comm {rep['exposed_comm_us'] / 1e3:.3f} ms, "
        f"max reserved {rep['reserved_peak']['bytes'] / (1 << 20):.1f} MiB, hazards {len(rep['hazards'])}"
    )
    return 0


def _demo(args: argparse.Namespace) -> int:
    from . import sim

    rc = _ab(args)
    print()
    for name in ("lagging_pipeline", "megatron_hero"):
        print(sim.format_compare(name, sim.compare(sim.scenario_program(name))))
        print()
    return rc


def parser() -> argparse.ArgumentParser:
    """The top-level command line and its subcommands (`train` has its own parser,
    `sched_lifetime.train.cli.parser`: `main` hands it everything after `train`)."""
    p = argparse.ArgumentParser(
        prog="python -m sched_lifetime",
        description="sched_lifetime: scheduled cross-stream tensor lifetime and F/B multiplexing for MoE training",
        epilog="guides: docs/ in the repository (docs/main-job.md for `train`)",
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("train", help="the main job: train the embedded MoE model under several arms side by side (see `train --help`)")
    for cmd, helptext in (
        ("ab", "record_stream vs scheduled release on a lagging two-stream pipeline"),
        ("demo", "the A/B plus the simulated memory of the same pipeline and the Megatron hero case"),
    ):
        ab = sub.add_parser(cmd, help=helptext, description=helptext)
        ab.add_argument("--n", type=int, default=16, help="tensors per step (default 16)")
        ab.add_argument("--mib", type=int, default=64, help="MiB per tensor (default 64)")
        ab.add_argument("--lag", type=int, default=2_000_000, help="consumer delay in GPU cycles (default 2e6, ~1 ms)")
        ab.add_argument("--steps", type=int, default=5, help="steps per arm, interleaved (default 5)")
        ab.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
        ab.add_argument("--json", default=None, help="also write the A/B figures here")
    s = sub.add_parser(
        "simulate", help="simulate a plan (JSON file or scenario:NAME) under both policies",
        description="SIMULATED: a simulator program under record_stream and under the lifetime manager",
    )
    s.add_argument("plan", help="plan JSON file, or scenario:megatron_hero|lagging_pipeline|random:SEED|chain:N")
    s.add_argument("--trace", default=None, help="write a Chrome trace (open in Perfetto)")
    s.add_argument("--plot", default=None, help="write a memory-over-time PNG (matplotlib)")
    s.add_argument("--json", default=None, help="write both reports")
    s.add_argument("--durations", default=None, help='JSON {"node": us} overriding node durations (e.g. measured on a GPU)')
    ss = sub.add_parser(
        "simulate-schedule", help="SIMULATED makespan and memory of a graph under our order or a given one",
        description="SIMULATED: makespan, exposed comm and max reserved of a scheduler graph under our order or a given one",
    )
    ss.add_argument("graph", help="graph JSON file, or scenario:moe_chunk:LAYERS:RATIO")
    ss.add_argument("--order", default=None, help="JSON list of node names (default: our schedule)")
    ss.add_argument("--costs", default=None, help='JSON {"node": us} (default: graph costs, else per-kind)')
    ss.add_argument("--policy", default="scheduled", choices=("scheduled", "record_stream"), help="scheduled (the lifetime manager, default) or record_stream")
    return p


def _check_device(p: argparse.ArgumentParser, device: str | None) -> None:
    """`--device`: a device torch knows, and a GPU when it names one."""
    if device is None:
        return
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError:
        p.error(f"--device {device!r} is not a device; use cuda, cuda:N or cpu")
    if dev.type not in ("cuda", "cpu"):
        p.error(f"--device {device!r}: the A/B runs on cuda or cpu")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            p.error(f"--device {device}: no CUDA GPU is available here (torch.cuda.is_available() is False); use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            p.error(f"--device {device}: this machine has {torch.cuda.device_count()} GPU(s)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train"]:
        from . import train

        return train.main(argv[1:])
    p = parser()
    args = p.parse_args(argv)
    for name in ("json", "trace", "plot"):  # an output file whose folder does not exist: said now, not after the run
        path = getattr(args, name, None)
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            p.error(f"--{name} {path!r}: its folder {os.path.dirname(os.path.abspath(path))!r} does not exist")
    if args.cmd in ("ab", "demo"):
        for name in ("n", "mib", "steps"):
            if getattr(args, name) < 1:
                p.error(f"--{name} must be at least 1")
        if args.lag < 0:
            p.error("--lag must be >= 0")
        _check_device(p, args.device)
        return _ab(args) if args.cmd == "ab" else _demo(args)
    try:  # a bad scenario, order, costs or program: the library's message, not a traceback
        return _simulate_schedule(args) if args.cmd == "simulate-schedule" else _simulate(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
