"""Lower bounds (any order within each run) for the step's structures, with the H200 node times."""
import os
HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.environ.get("LINK_ANALYSIS_OUT", "/tmp/link_analysis")
os.makedirs(OUT, exist_ok=True)
import json, sys
sys.path.insert(0, HERE)
from bounds import bounds
from des import true_durations
from graphs import strip
G = json.load(open(os.path.join(OUT, "graphs.json"))); G.update(json.load(open(os.path.join(OUT, "graphs_two.json"))))
W = json.load(open(os.path.join(OUT, "whole_step.json")))
T = true_durations()
def costs(g): return {n["name"]: T.get(strip(n["name"]), 0.0) for n in g["nodes"]}
B = {}
for k in ("F", "FB", "B", "FF", "BB"):
    b = B[k] = bounds(G[k]["graph"], costs(G[k]["graph"]))
    print(f"{k:3s}", " ".join(f"{x}={v/1e3:.2f}" for x, v in b.items()))
def total(parts):
    m = sum(mult * B[k]["makespan_lb"] for k, mult in parts); e = sum(mult * B[k]["exposed_lb"] for k, mult in parts)
    return m / 1e3, e / 1e3
for label, parts in (("current: F0 | 7 x F(i+1)+B(i) | B7", [("F", 1), ("FB", 7), ("B", 1)]),
                     ("paired ends: F0+F1 | 6 x F(i+2)+B(i) | B6+B7", [("FF", 1), ("FB", 6), ("BB", 1)])):
    m, e = total(parts)
    print(f"{label:48s} step >= {m:6.1f} ms, exposed >= {e:5.1f} ms ({100*e/836.8:.1f}% of 836.8 ms link)")
b = bounds(W, costs(W))
print("whole step, one graph, no run barriers, any order:", " ".join(f"{x}={v/1e3:.2f}" for x, v in b.items()))
