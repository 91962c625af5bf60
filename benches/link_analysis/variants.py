"""SIMULATED variants of the step (DES of des.py, true link times), exposed comm and step time."""
import os
HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.environ.get("LINK_ANALYSIS_OUT", "/tmp/link_analysis")
os.makedirs(OUT, exist_ok=True)
import json, sys
sys.path.insert(0, HERE)
import sched_lifetime as sl
from des import Step, true_durations
from graphs import strip
from sched_lifetime.nodes.graph import _order_schedule

G = json.load(open(os.path.join(OUT, "graphs.json"))); G.update(json.load(open(os.path.join(OUT, "graphs_two.json"))))
T = true_durations()
def D(g): return {n["name"]: T.get(strip(n["name"]), 0.0) for n in g["nodes"]}
_cache = {}
def sched(k, order, budget=None):
    key = (k, json.dumps(order) if isinstance(order, list) else order, budget)
    if key not in _cache:
        g = G[k]["graph"]
        _cache[key] = sl.schedule_order(g, order, ep_budget=budget) if isinstance(order, list) else _order_schedule(g, order)
    return _cache[key]

def run_step(orders, falsedep=True, barrier=True, ends=False, n=8, lifetime="tensors"):
    """orders: {"F": o, "FB": o, "B": o} (or FF/BB with ends)."""
    st = Step(falsedep, barrier, lifetime)
    if ends:
        st.run("F0F1", G["FF"]["graph"], sched("FF", *orders["FF"]), D(G["FF"]["graph"]))
        for i in range(n - 2):
            st.run(f"F{i+2}B{i}", G["FB"]["graph"], sched("FB", *orders["FB"]), D(G["FB"]["graph"]))
        st.run("B6B7", G["BB"]["graph"], sched("BB", *orders["BB"]), D(G["BB"]["graph"]))
    else:
        st.run("F0", G["F"]["graph"], sched("F", *orders["F"]), D(G["F"]["graph"]))
        for i in range(n - 1):
            st.run(f"F{i+1}B{i}", G["FB"]["graph"], sched("FB", *orders["FB"]), D(G["FB"]["graph"]))
        st.run("B7", G["B"]["graph"], sched("B", *orders["B"]), D(G["B"]["graph"]))
    return st

def show(label, st):
    r = st.report()
    print(f"{label:70s} step {r['makespan_ms']:7.1f} ms  exposed {r['exposed_ms']:6.1f} ms ({100*r['exposed_ms']/r['comm_ms']:4.1f}%)", flush=True)
    return r

if __name__ == "__main__":
    ours = {k: ("ours",) for k in ("F", "FB", "B", "FF", "BB")}
    seq_b = {k: ([n["name"] for n in G[k]["graph"]["nodes"]],) for k in ("F", "FB", "B")}
    for fd, lt, tag in ((True, "tensors", "GPU-like: data + drains of tensors + EP waits issued compute"),
                        (False, True, "Rust sim model: data + drains of every value"),
                        (False, "tensors", "GPU-like without the EP wait on issued compute")):
        print("--", tag)
        show("b_then_f", run_step(seq_b, fd, lifetime=lt))
        show("ours", run_step(ours, fd, lifetime=lt))
        show("ours+ends", run_step(ours, fd, ends=True, lifetime=lt))
