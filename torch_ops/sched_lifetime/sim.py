"""The simulator from Python: a *program* (the simulator's issue list over named streams; dict
or JSON text, format in the README; derived from a graph and a schedule, or written by hand)
in, a report dict out. Everything it returns is simulated by the Rust model
(sched_lifetime::sim), never measured; reports say so in their "simulated" key.

Scenarios built in Rust come in two kinds: `scenario_graph(name)` gives a scheduler graph (the
one format `sl.schedule` takes) with baseline orders; `scenario_program(name)` gives a program."""

from __future__ import annotations

import json
from typing import Any, Optional, Union

from ._ops import INFO, json_text, ops

POLICIES: tuple[str, ...] = tuple(INFO["policies"])
#: A simulator program: dict or JSON text.
Program = Union[dict, str]


def with_durations(plan: Program, durations: dict[str, float]) -> dict:
    """The program with node durations (us) replaced, e.g. by ones measured on a GPU and saved as
    JSON `{"node name": us}`. A name that is not a node is an error."""
    p = json.loads(json_text(plan, "plan"))
    names = {n["name"]: n for n in p.get("nodes", [])}
    unknown = sorted(set(durations) - set(names))
    if unknown:
        raise ValueError(f"durations name nodes that are not in the plan: {unknown[:5]}")
    for name, us in durations.items():
        names[name]["us"] = us
    return p


def simulate(
    plan: Program,
    policy: str = "scheduled",
    mode: str = "caching",
    trace: bool = False,
    durations: Optional[dict[str, float]] = None,
) -> dict[str, Any]:
    """SIMULATED: run the program `plan` (dict or JSON text; format in docs/scheduler.md)
    through the Rust model of streams, events and the caching allocator, under `policy`
    (`"scheduled"`: the lifetime manager; `"record_stream"`), with the caching allocator
    (`mode="caching"`) or without it (`"no_caching"`: the liveness lower bound). `durations`
    overrides node durations (us) by name, e.g. ones measured on a GPU. `trace=True` adds a
    memory timeline and Chrome trace events. The report: makespan, exposed comm, allocated /
    reserved / pending-free / parked peaks, hazards (races the checker found), with
    `"simulated": True`.

    Example (a 1 GiB tensor consumed on a lagging side stream, 16 times):

        >>> import sched_lifetime as sl
        >>> program = sl.scenario_program("lagging_pipeline")
        >>> rs = sl.simulate(program, policy="record_stream")
        >>> sc = sl.simulate(program, policy="scheduled")
        >>> rs["reserved_peak"]["bytes"] >> 20, sc["reserved_peak"]["bytes"] >> 20
        (1026, 66)
        >>> len(rs["hazards"]), len(sc["hazards"]), sc["simulated"]
        (0, 0, True)
    """
    if durations:
        plan = with_durations(plan, durations)
    report = json.loads(ops.simulate(json_text(plan, "plan"), policy, mode, trace))
    report["simulated"] = True
    return report


def compare(plan: Program, trace: bool = False) -> dict[str, dict[str, Any]]:
    """SIMULATED: both policies on the same program: `{"record_stream": report, "scheduled":
    report}` (see `simulate`).

    Example:

        >>> import sched_lifetime as sl
        >>> both = sl.compare(sl.scenario_program("megatron_hero"))
        >>> hero = {p: round(r["reserved_peak"]["bytes"] / 2**30, 2) for p, r in both.items()}
        >>> hero
        {'record_stream': 35.12, 'scheduled': 5.6}
    """
    text = json_text(plan, "plan")
    return {p: simulate(text, p, trace=trace) for p in POLICIES}


def _scenario(name: str, kind: str, key: str) -> Any:
    out = json.loads(ops.scenario(name))
    if out.get("kind") != kind:
        other = "scenario_graph" if kind == "program" else "scenario_program"
        raise ValueError(f"scenario {name!r} is a {out.get('kind')}, not a {kind}; use sl.{other}")
    return out[key] if key else {k: v for k, v in out.items() if k != "kind"}


def scenario_program(name: str) -> dict:
    """A simulator program built in Rust: `megatron_hero` (DeepSeek-V3-width combined 1F1B,
    illustrative durations), `lagging_pipeline` (the GPU A/B's pipeline), `random:SEED`,
    `chain:N`. A graph scenario's name raises ValueError saying to use `scenario_graph`.

    Example:

        >>> import sched_lifetime as sl
        >>> p = sl.scenario_program("chain:3")
        >>> [n["name"] for n in p["nodes"]], sl.simulate(p)["makespan_us"]
        (['n0', 'n1', 'n2'], 23.0)
    """
    return _scenario(name, "program", "program")


def scenario_graph(name: str) -> dict:
    """A scheduler graph built in Rust, `moe_chunk:LAYERS:RATIO` (LAYERS MoE layers, each a2a
    RATIO x 500 us against 400 us attention and 600 us MLP) or `family:MEMBER:RATIO` (router,
    shared expert, dense first layer, MTP, unequal lengths, three sources): `{"graph": <graph
    table>, "orders": {...}}` (baseline orders such as `megatron` / `b_then_f`, each with its
    record/wait edges and drains, in `sl.schedule`'s output format).

    Example:

        >>> import sched_lifetime as sl
        >>> sc = sl.scenario_graph("moe_chunk:2:0.5")
        >>> sorted(sc["orders"]), len(sc["graph"]["nodes"])
        (['b_then_f', 'megatron'], 28)
    """
    return _scenario(name, "graph", "")


def format_compare(name: str, res: dict[str, dict[str, Any]]) -> str:
    gib = float(1 << 30)
    rs, sc = res["record_stream"], res["scheduled"]
    lines = [
        f"SIMULATED (model, not measured): {name}, {rs['nodes']} nodes",
        f"{'metric':<34}{'record_stream':>15}{'scheduled':>15}{'ratio':>9}",
    ]

    def row(label: str, a: float, b: float, fmt: str) -> None:
        ratio = f"{b / a:.3f}" if a else "-"
        lines.append(f"{label:<34}{fmt.format(a):>15}{fmt.format(b):>15}{ratio:>9}")

    row("max reserved (GiB)", rs["reserved_peak"]["bytes"] / gib, sc["reserved_peak"]["bytes"] / gib, "{:.2f}")
    row("max allocated (GiB)", rs["allocated_peak"]["bytes"] / gib, sc["allocated_peak"]["bytes"] / gib, "{:.2f}")
    row("pending-free peak (GiB)", rs["pending_free_peak"]["bytes"] / gib, sc["pending_free_peak"]["bytes"] / gib, "{:.2f}")
    row("pending-free peak (blocks)", rs["pending_free_peak_blocks"], sc["pending_free_peak_blocks"], "{:.0f}")
    row("parked by manager, peak (blocks)", rs["parked_peak_blocks"], sc["parked_peak_blocks"], "{:.0f}")
    row("pending + parked peak (GiB)", rs["unusable_peak"]["bytes"] / gib, sc["unusable_peak"]["bytes"] / gib, "{:.2f}")
    row("makespan (ms)", rs["makespan_us"] / 1e3, sc["makespan_us"] / 1e3, "{:.2f}")
    row("exposed comm (ms)", rs["exposed_comm_us"] / 1e3, sc["exposed_comm_us"] / 1e3, "{:.2f}")
    lines.append(
        f"liveness lower bound {sc['liveness_lower_bound_bytes'] / gib:.2f} GiB; "
        f"hazards: record_stream {len(rs['hazards'])}, scheduled {len(sc['hazards'])}"
    )
    return "\n".join(lines)


def chrome_trace(res: dict[str, dict[str, Any]]) -> dict:
    """One Chrome/Perfetto trace with a process per policy (needs reports made with trace=True)."""
    events = []
    for i, (policy, rep) in enumerate(res.items()):
        for e in rep["trace"]["traceEvents"]:
            e = dict(e, pid=e.get("pid", 0) + 10 * i)
            events.append(e)
        for pid, what in ((0, "streams"), (1, "memory")):
            events.append({"ph": "M", "name": "process_name", "pid": pid + 10 * i, "args": {"name": f"{policy}: {what}"}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def plot_memory(res: dict[str, dict[str, Any]], path: str, title: str = "") -> None:
    """Memory over host time for both policies (needs trace=True reports and matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(res), figsize=(6 * len(res), 4), sharey=True)
    for ax, (policy, rep) in zip(axes, res.items()):
        tl = rep["memory_timeline"]
        t = [p[0] / 1e3 for p in tl]
        for k, label in ((2, "reserved"), (1, "allocated"), (3, "pending-free + parked")):
            ax.step(t, [p[k] / (1 << 30) for p in tl], where="post", label=label)
        ax.set_title(f"{policy} (simulated)")
        ax.set_xlabel("host time (ms)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("GiB")
    axes[0].legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
