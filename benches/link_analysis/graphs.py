"""Build the main job's graphs (F alone, F+B pair, B alone) with the h200 node structure
(4 MoE layers, shared expert; node names as the main job's), and their orders."""
import os
HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.environ.get("LINK_ANALYSIS_OUT", "/tmp/link_analysis")
os.makedirs(OUT, exist_ok=True)
import json, sys
from dataclasses import replace
import sched_lifetime as sl
from sched_lifetime.models import CONFIGS, MoEModel
from sched_lifetime.nodes.graph import _pair_graph, _order_schedule

def chunk():
    cfg = replace(CONFIGS["tiny"], layers=4, experts=8, topk=4, capacity_factor=1.25)  # same node names as h200
    m = MoEModel(cfg)
    return m.chunk()

def graphs(c):
    return {"F": _pair_graph(c, None), "FB": _pair_graph(c, c), "B": _pair_graph(None, c)}

if __name__ == "__main__":
    c = chunk()
    gs = graphs(c)
    out = {}
    for k, g in gs.items():
        out[k] = {"graph": g, "orders": {o: _order_schedule(g, o)["order"] for o in ("ours", "b_then_f", "ours:classic", "ours:ep_budget=2")}}
        print(k, len(g["nodes"]), "nodes")
    json.dump(out, open(os.path.join(OUT, "graphs.json"), "w"), indent=1)
    print(" ".join(out["FB"]["orders"]["ours"]))

def two_graphs(c):
    from sched_lifetime.nodes.graph import _two_graph
    return {"FF": _two_graph(c, "F"), "BB": _two_graph(c, "B")}

def whole_step(c, n=8, ends=False):
    """One graph for the whole step: sources F<i>, B<i>; B<i> after F<i> (its loss), dW of a
    node accumulates in microbatch order (control B<i>.X.dw -> B<i+1>.X.dw)."""
    from sched_lifetime.nodes.graph import _renamed
    f, fc = c._forward_table, c._forward_control
    b, bc = c._backward_table, c._backward_control
    nodes, control, inputs, sources = [], [], [], []
    for i in range(n):
        for tab, ctl, ph in ((f, fc, "F"), (b, bc, "B")):
            nn, cc = _renamed(tab, ctl, ph, f"{ph}{i}")
            nodes += nn; control += cc
            sources.append({"name": f"{ph}{i}", "phase": ph, "microbatch": i})
        inputs += [f"F{i}.{v}" for v in c.inputs] + [f"B{i}.g.{c.loss_output}"]
        control.append([f"F{i}.head", f"B{i}.head"])
        if i:
            for x in b:
                if x["kind"] == "compute" and (x["name"].endswith(".dw") or x["name"] == "B.head"):
                    pass
            for x in c.nodes:
                if x.params:
                    acc = f"B.{x.name}.dw" if c._has_dw_node(x) else f"B.{x.name}"
                    if any(y["name"] == acc for y in b):
                        control.append([f"B{i-1}" + acc[1:], f"B{i}" + acc[1:]])
    return {"sources": sources, "inputs": inputs, "nodes": nodes, "control": control}

def strip(name):
    """F3.L0.attn -> F.L0.attn (the duration's key)."""
    import re
    return re.sub(r"^([FB])\d+\.", r"\1.", name)
