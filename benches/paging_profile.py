"""Where the Pager's step time goes (one GPU): host issue time and wall time of a step with
and without `sl.Pager(FRACTION)` (timed; `untimed` as a second argument for the budget-only
plan) on the `h200` config, torch.profiler tables of both, and a gzipped Chrome trace of the
paged step in $OUT. Usage: OUT=dir python3 benches/paging_profile.py 1.0 [untimed]"""
import os, sys, time, gzip, shutil, torch
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "torch_ops"))
import sched_lifetime as sl
from sched_lifetime.models import moe as moe_mod
from sched_lifetime.models.moe import CONFIGS, MoEModel
torch.use_deterministic_algorithms(True)
dev = torch.device("cuda")
moe_mod.deterministic_sdpa(dev, torch.bfloat16)
m = MoEModel(CONFIGS["h200"], device=dev)
b = m.batch(0, 0)
def step(ctx):
    for p in m.parameters(): p.grad = None
    torch.cuda.synchronize(); t0 = time.perf_counter()
    with ctx():
        m(**b).backward()
    t1 = time.perf_counter(); torch.cuda.synchronize(); t2 = time.perf_counter()
    return (t1 - t0) * 1e3, (t2 - t0) * 1e3
import contextlib
timed = sys.argv[2:3] != ["untimed"]
pager = sl.Pager(float(sys.argv[1]), prefetch=64, drain_distance=16, timed=timed)
arms = {"off": contextlib.nullcontext, "pager": pager.step}
for a in arms: step(arms[a]); step(arms[a])
for r in range(3):
    for a in arms:
        h, w = step(arms[a]); print(f"{a}: host issue {h:.1f} ms, wall {w:.1f} ms")
n_out = sum(1 for _ in pager.plan["page"]); print("paged tensors", n_out, "bytes", pager.plan["bytes_paged"])
print("\n".join(l for l in pager.plan["explain"] if "released at" in l or "cannot" in l))
def split(ctx):  # forward and backward wall times, a sync at the boundary
    for p in m.parameters(): p.grad = None
    torch.cuda.synchronize(); t0 = time.perf_counter()
    with ctx():
        loss = m(**b); t1 = time.perf_counter(); torch.cuda.synchronize(); t2 = time.perf_counter()
        loss.backward(); t3 = time.perf_counter()
    torch.cuda.synchronize(); t4 = time.perf_counter()
    return f"fwd host {1e3*(t1-t0):.1f} wall {1e3*(t2-t0):.1f} | bwd host {1e3*(t3-t2):.1f} wall {1e3*(t4-t2):.1f} ms"
for r in range(2):
    for a in arms: print(a, split(arms[a]))
for a in arms:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        step(arms[a])
    print("==", a)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
    if a == "pager":
        path = os.path.join(os.environ.get("OUT", "."), "trace_pager.json")
        prof.export_chrome_trace(path)
        with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as g: shutil.copyfileobj(f, g)
        os.remove(path)
