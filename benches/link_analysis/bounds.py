"""Lower bounds (any order) on makespan and exposed comm of one graph, with given node costs.
makespan >= max(compute, link+min head+min tail (EP one-machine), critical path);
exposed >= link - overlap, overlap <= min(C - min_anc - min_desc,  sum_c min(d_c, indep(c)))
where anc/desc = summed compute of a launch's ancestors/descendants (one compute stream) and
indep(c) = compute neither before nor after launch c (only that can run under c)."""
import os
HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.environ.get("LINK_ANALYSIS_OUT", "/tmp/link_analysis")
os.makedirs(OUT, exist_ok=True)
import sys
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from family_bounds import graph_preds, heads_tails, one_machine

def closure(nodes, g):
    """ancestors per node (names), launches' waits folded into the launch."""
    preds = graph_preds(g)
    anc = {}
    def A(u):
        if u not in anc:
            s = set()
            for p in preds[u]:
                s.add(p); s |= A(p)
            anc[u] = s
        return anc[u]
    sys.setrecursionlimit(100000)
    for u in nodes: A(u)
    desc = {k: set() for k in nodes}
    for u, s in anc.items():
        for a in s: desc[a].add(u)
    return anc, desc

def bounds(g, costs):
    g = dict(g, nodes=[dict(n, cost=costs.get(n["name"], 0.0)) for n in g["nodes"]])
    nodes, cost, head, tail = heads_tails(g)
    comp_nodes = [k for k, n in nodes.items() if n["kind"] == "compute"]
    comm_nodes = [k for k, n in nodes.items() if n["kind"] == "comm_launch"]
    C = sum(cost[k] for k in comp_nodes); L = sum(cost[k] for k in comm_nodes)
    anc, desc = closure(nodes, g)
    csum = lambda s: sum(cost[x] for x in s if nodes[x]["kind"] == "compute")
    min_anc = min(csum(anc[c]) for c in comm_nodes)
    min_desc = min(csum(desc[c]) for c in comm_nodes)
    indep = {c: C - csum(anc[c]) - csum(desc[c]) for c in comm_nodes}
    ov = min(C - min_anc - min_desc, sum(min(cost[c], indep[c]) for c in comm_nodes))
    crit = max(head[u] + cost[u] + tail[u] for u in nodes)
    om_ep = one_machine([(head[k], cost[k], tail[k]) for k in comm_nodes])
    # EP one-machine with work-based heads/tails (the compute before/after is on one stream)
    om_ep2 = min_anc + L + min_desc
    M = max(C, crit, om_ep, om_ep2, C + (L - ov))
    # FIFO streams, no host/launch latency: the GPU never has both streams idle while work
    # remains (a stream head waits only on a node issued before it), so exposed = M - C.
    return {"compute": C, "link": L, "crit": crit, "ep_1m": max(om_ep, om_ep2), "makespan_lb": M, "exposed_lb": max(L - ov, M - C),
            "min_anc": min_anc, "min_desc": min_desc, "indep_sum": sum(min(cost[c], indep[c]) for c in comm_nodes)}
