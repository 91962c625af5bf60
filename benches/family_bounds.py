"""SIMULATED (CPU, no GPU): how far the scheduler's orders are from what any order could reach,
on the family's shapes (`sl.scenario_graph("family:MEMBER:RATIO")`, their own node costs).

Per shape: the max(compute, comm) bound the GPU bench quotes, and lower bounds that hold for
every order in the simulator's model: the critical path (longest chain of node costs through
the graph's edges; a launch's outputs are usable at its wait), and per stream the one-machine
bound (for any set S of the stream's nodes: the earliest any of them can start, their summed
cost, and the least work that must follow any of them; the max over S). Then the simulated
makespan of ours and of rule `search`; `--anneal S` also runs a seeded simulated annealing for S
seconds on the shapes where search stays > 5% above the lower bound (an order's existence, not
a bound: what a better search could reach).

    PYTHONPATH=torch_ops python benches/family_bounds.py [--ratios 0.5,1.0,2.0] [--anneal 90] [--json F]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "torch_ops"))
import sched_lifetime as sl  # noqa: E402

FAMILY = ["symmetric_4", "router+shared_2", "router+shared_4", "dense1+moe_4", "mtp_3", "F2_with_B4", "F4_with_B2", "three_sources_3", "jittered_shared_4"]


def _value(v) -> str:
    return v if isinstance(v, str) else v["value"]


def graph_preds(g: dict) -> dict[str, set]:
    """Each node's predecessors by name: the producers of its inputs (a launch's output is
    usable at its wait), its launch (for a wait) and its control edges."""
    producer = {_value(o): n["name"] for n in g["nodes"] for o in n.get("outputs", [])}
    wait_of = {n["launch"]: n["name"] for n in g["nodes"] if n.get("launch")}
    preds: dict[str, set] = {n["name"]: set() for n in g["nodes"]}
    for n in g["nodes"]:
        for v in n.get("inputs", []):
            p = producer.get(_value(v))
            if p is not None:
                preds[n["name"]].add(wait_of.get(p, p))
        if n.get("launch"):
            preds[n["name"]].add(n["launch"])
    for a, b in g.get("control", []):
        preds[b].add(a)
    return preds


def heads_tails(g: dict) -> tuple[dict, dict, dict, dict]:
    """Nodes by name, their costs (waits 0), heads (longest chain before a node) and tails
    (longest chain after it)."""
    nodes = {n["name"]: n for n in g["nodes"]}
    preds = graph_preds(g)
    succs: dict[str, set] = {k: set() for k in nodes}
    for b, ps in preds.items():
        for a in ps:
            succs[a].add(b)
    cost = {k: 0.0 if n["kind"].endswith("wait") else float(n.get("cost", 0.0)) for k, n in nodes.items()}
    order = [n["name"] for n in g["nodes"]]
    # Table order is not topological in general: iterate to a fixed point (small graphs).
    head = {k: 0.0 for k in nodes}
    tail = {k: 0.0 for k in nodes}
    for _ in range(len(order)):
        changed = False
        for u in order:
            h = max((head[p] + cost[p] for p in preds[u]), default=0.0)
            t = max((tail[s] + cost[s] for s in succs[u]), default=0.0)
            if h != head[u] or t != tail[u]:
                head[u], tail[u], changed = h, t, True
        if not changed:
            break
    return nodes, cost, head, tail


def one_machine(items: list[tuple[float, float, float]]) -> float:
    """max over S of (min head + sum of costs + min tail), S = items with head >= a, tail >= b."""
    best = 0.0
    for a in sorted({x[0] for x in items}):
        for b in sorted({x[2] for x in items}):
            s = [x for x in items if x[0] >= a and x[2] >= b]
            if s:
                best = max(best, min(x[0] for x in s) + sum(x[1] for x in s) + min(x[2] for x in s))
    return best


def anneal(g: dict, start: list, seconds: float, seed: int = 0) -> float:
    """The shortest simulated makespan a seeded simulated annealing over block moves finds."""
    def cost(o):
        try:
            return sl.simulate_schedule(g, o)["makespan_us"]
        except ValueError:  # not a valid order
            return None

    rng = random.Random(seed)
    cur, cm = list(start), cost(start)
    best, n, t0 = cm, len(start), time.perf_counter()
    while (el := time.perf_counter() - t0) < seconds:
        temp = 300.0 * (1 - el / seconds) + 1
        k = rng.randint(1, 3)
        i, j = rng.randrange(n - k + 1), rng.randrange(n - k + 1)
        if i == j:
            continue
        o = cur[:i] + cur[i + k :]
        o = o[:j] + cur[i : i + k] + o[j:]
        c = cost(o)
        if c is not None and (c <= cm or rng.random() < math.exp(-(c - cm) / temp)):
            cur, cm = o, c
            best = min(best, c)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ratios", default="0.5,1.0,2.0")
    p.add_argument("--anneal", type=float, default=0.0, help="seconds of simulated annealing per shape > 5%% above the lower bound")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    print("SIMULATED (Rust model, the graphs' own costs, EP budget 1; us)")
    print(f"{'member':>18}{'ratio':>6}{'compute':>9}{'comm':>7}{'crit':>7}{'1m comm':>9}{'1m comp':>9}{'LB':>7}{'ours':>7}{'search':>8}{'s/bound':>8}{'s/LB':>7}{'anneal':>8}")
    rows = []
    for ratio in [float(r) for r in args.ratios.split(",")]:
        for m in FAMILY:
            g = sl.scenario_graph(f"family:{m}:{ratio}")["graph"]
            nodes, cost, head, tail = heads_tails(g)
            comp = sum(cost[k] for k, n in nodes.items() if n["kind"] == "compute")
            comm = sum(cost[k] for k, n in nodes.items() if n["kind"] == "comm_launch")
            crit = max(head[u] + cost[u] + tail[u] for u in nodes)
            by = {kind: one_machine([(head[k], cost[k], tail[k]) for k, n in nodes.items() if n["kind"] == kind]) for kind in ("comm_launch", "compute")}
            lb = max(comp, comm, crit, *by.values())
            searched = sl.schedule(g, rules="search")["order"]
            ours, srch = sl.simulate_schedule(g)["makespan_us"], sl.simulate_schedule(g, searched)["makespan_us"]
            ann = anneal(g, searched, args.anneal) if args.anneal and srch > 1.05 * lb else None
            bound = max(comp, comm)
            rows.append(dict(member=m, ratio=ratio, compute=comp, comm=comm, critical_path=crit, one_machine_comm=by["comm_launch"],
                             one_machine_compute=by["compute"], lower_bound=lb, ours=ours, search=srch, anneal=ann))
            print(
                f"{m:>18}{ratio:>6.1f}{comp:>9.0f}{comm:>7.0f}{crit:>7.0f}{by['comm_launch']:>9.0f}{by['compute']:>9.0f}{lb:>7.0f}"
                f"{ours:>7.0f}{srch:>8.0f}{srch / bound:>8.3f}{srch / lb:>7.3f}" + (f"{ann:>8.0f}" if ann is not None else f"{'-':>8}"),
                flush=True,
            )
    within = lambda key: sum(r["search"] <= 1.05 * r[key] for r in rows)  # noqa: E731
    for r in rows:
        r["bound"] = max(r["compute"], r["comm"])
    print(f"search within 5% of max(compute, comm): {within('bound')} of {len(rows)}; of the lower bound: {within('lower_bound')} of {len(rows)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
