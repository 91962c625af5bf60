import os
HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.environ.get("LINK_ANALYSIS_OUT", "/tmp/link_analysis")
os.makedirs(OUT, exist_ok=True)
import json, sys
sys.path.insert(0, HERE)
from graphs import chunk, two_graphs, whole_step
from sched_lifetime.nodes.graph import _order_schedule
c = chunk()
out = {k: {"graph": g, "orders": {"ours": _order_schedule(g, "ours")["order"]}} for k, g in two_graphs(c).items()}
json.dump(out, open(os.path.join(OUT, "graphs_two.json"), "w"))
w = whole_step(c)
json.dump(w, open(os.path.join(OUT, "whole_step.json"), "w"))
print(len(w["nodes"]), "nodes in the whole step")
