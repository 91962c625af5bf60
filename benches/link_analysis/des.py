"""A small transparent discrete-event model of the main job's step on the GPU (SIMULATED):
compute stream + EP stream, FIFO, host ahead of the GPU; one executor run after another.
Per run (Executor.run): the EP stream first waits for the compute stream (wait_stream), at the end
the compute stream waits for the EP stream. A launch starts after its data producers' events
(the schedule's syncs) and its EP-stream predecessor; with `falsedep=True` also after every
compute-stream op issued before it (ep.consumer_output: EP.wait_stream(compute) with
alloc_stream=compute, what the GPU really does). A comm_wait is a 0-us compute-stream op that
waits for its launch."""
import os
HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.environ.get("LINK_ANALYSIS_OUT", "/tmp/link_analysis")
os.makedirs(OUT, exist_ok=True)
import json

DUR = json.load(open(os.path.join(os.path.dirname(HERE), "data", "2026-12-02_h200_s2_final", "link_durations.json")))

def true_durations(d=DUR):
    """Measured durations with the comm nodes' own link time: a dispatch was timed from its
    start mark, before consumer_output's EP.wait_stream(compute), so it includes the compute
    issued between its producer and it in the sequential order (F: L.shared, B: L.experts.dw)."""
    t = dict(d)
    for L in range(4):
        t[f"F.L{L}.dispatch"] = d[f"F.L{L}.dispatch"] - d[f"F.L{L}.shared"]
        t[f"B.L{L}.dispatch"] = d[f"B.L{L}.dispatch"] - d[f"B.L{L}.experts.dw"]
    return t

def rename(name, tag):
    return tag + ":" + name

class Step:
    def __init__(self, falsedep=True, barrier=True, lifetime="tensors"):
        self.falsedep, self.barrier, self.lifetime = falsedep, barrier, lifetime
        self.t = {"compute": 0.0, "ep": 0.0}
        self.iv = {"compute": [], "ep": []}  # busy intervals
        self.log = []  # (run tag, node, stream, start, end)

    def run(self, tag, graph, sched, dur):
        nodes = {n["name"]: n for n in graph["nodes"]}
        role = dict(sched["streams"])
        syncs = {}
        for p, c, *_ in sched["syncs"]:
            syncs.setdefault(c, []).append(p)
        end = {}
        # Lifetime manager (lifetime="scheduled"): a retire records the plan's event on the
        # consumer stream after the last consumer; the owner stream waits on it at the drain
        # point (drain_before) or at the run's end.
        retire_after, drain_before = {}, {}
        producer = {}
        for n in graph["nodes"]:
            for o in n.get("outputs", []):
                producer[o if isinstance(o, str) else o["value"]] = n["name"]
        for r in sched["retires"]:
            plan = nodes[producer[r["value"]]]["source"]
            if r["consumer_stream"] == r["owner"]:
                continue
            if self.lifetime == "tensors" and r["value"].endswith(("meta", "rmeta")):
                continue  # Routing / Received objects: the executor retires tensors only
            retire_after.setdefault(r["last_consumer"], []).append((plan, r["consumer_stream"], r["owner"]))
            if r["drain_before"] is not None:
                drain_before.setdefault(r["drain_before"], set()).add((plan, r["owner"]))
        ev, queue = {}, {}
        if self.barrier:
            self.t["ep"] = max(self.t["ep"], self.t["compute"])
        for name in sched["order"]:
            n = nodes[name]; s = role[name]
            if s not in self.t:
                raise ValueError(s)
            if self.lifetime:
                for plan, owner in drain_before.get(name, ()):
                    for cs in queue.pop((plan, owner), set()):
                        self.t[owner] = max(self.t[owner], ev[(plan, cs)])
            start = max([self.t[s]] + [end[p] for p in syncs.get(name, [])])
            kind = n["kind"]
            if kind == "comm_wait":
                start = max(start, end[n["launch"]]); d = 0.0
            else:
                d = float(dur[name])
            if kind == "comm_launch" and self.falsedep:
                start = max(start, self.t["compute"])
            end[name] = start + d
            self.t[s] = start + d
            if d > 0:
                self.iv[s].append((start, start + d))
            self.log.append((tag, name, s, start, start + d))
            for plan, cs, owner in retire_after.get(name, ()):
                ev[(plan, cs)] = self.t[cs]
                queue.setdefault((plan, owner), set()).add(cs)
        if self.barrier:
            self.t["compute"] = max(self.t["compute"], self.t["ep"])
        return self

    def report(self, lo=None, hi=None):
        mk = max(self.t.values())
        comm = union(self.iv["ep"], lo, hi); comp = union(self.iv["compute"], lo, hi)
        exposed = measure(subtract(comm, comp))
        return {"makespan_ms": mk / 1e3, "comm_ms": measure(comm) / 1e3, "exposed_ms": exposed / 1e3, "compute_ms": measure(comp) / 1e3}

def union(iv, lo=None, hi=None):
    out = []
    for a, b in sorted(iv):
        if lo is not None: a = max(a, lo)
        if hi is not None: b = min(b, hi)
        if b <= a: continue
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out

def subtract(A, B):
    out = []
    j = 0
    for a, b in A:
        cur = a
        for c, d in B:
            if d <= cur or c >= b: continue
            if c > cur: out.append((cur, c))
            cur = max(cur, d)
            if cur >= b: break
        if cur < b: out.append((cur, b))
    return out

def measure(iv):
    return sum(b - a for a, b in iv)
