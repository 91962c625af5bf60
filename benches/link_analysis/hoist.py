"""A timing-free order change: each EP launch issued as soon as its producers are issued (with
EP budget 1: the previous launch's wait moved up with it), so that on the GPU, where a launch
waits for every compute op issued before it (ep.consumer_output's wait_stream), the link does
not wait for unrelated compute (wgrad fill). Applied to ours' order."""
import os
HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.environ.get("LINK_ANALYSIS_OUT", "/tmp/link_analysis")
os.makedirs(OUT, exist_ok=True)
import json, sys
sys.path.insert(0, HERE)
import sched_lifetime as sl

def preds_of(g):
    producer = {}
    for n in g["nodes"]:
        for o in n.get("outputs", []):
            producer[o if isinstance(o, str) else o["value"]] = n["name"]
    wait_of = {n["launch"]: n["name"] for n in g["nodes"] if n.get("launch")}
    P = {n["name"]: set() for n in g["nodes"]}
    for n in g["nodes"]:
        for v in n.get("inputs", []):
            p = producer.get(v if isinstance(v, str) else v["value"])
            if p: P[n["name"]].add(wait_of.get(p, p))
        if n.get("launch"): P[n["name"]].add(n["launch"])
    for a, b in g.get("control", []): P[b].add(a)
    return P, wait_of

def hoist(g, order, budget=1, move_wait=True):
    kinds = {n["name"]: n["kind"] for n in g["nodes"]}
    P, wait_of = preds_of(g)
    o = list(order)
    launches = [x for x in o if kinds[x] == "comm_launch"]
    for k, L in enumerate(launches):
        pos = {x: i for i, x in enumerate(o)}
        lo = max([pos[p] for p in P[L]] + [pos[launches[k - 1]] if k else -1])
        moved = [L]
        if k >= budget:
            w = wait_of[launches[k - budget]]
            if pos[w] > lo:
                if not move_wait:
                    continue
                moved = [w, L]
            else:
                lo = max(lo, pos[w])
        if pos[L] <= lo + len(moved):
            continue
        rest = [x for x in o if x not in moved]
        i = rest.index(o[lo]) + 1
        o = rest[:i] + moved + rest[i:]
    return o
