import os, sys, time, collections, torch, contextlib
import sched_lifetime as sl
from sched_lifetime import paging
from sched_lifetime.models import moe as moe_mod
from sched_lifetime.models.moe import CONFIGS, MoEModel
torch.use_deterministic_algorithms(True)
dev = torch.device("cuda")
moe_mod.deterministic_sdpa(dev, torch.bfloat16)
m = MoEModel(CONFIGS["h200"], device=dev)
b = m.batch(0, 0)
acc = collections.defaultdict(float); cnt = collections.Counter()
def wrap(cls, name):
    f = getattr(cls, name)
    def g(*a, **k):
        t0 = time.perf_counter()
        try: return f(*a, **k)
        finally: acc[name] += time.perf_counter() - t0; cnt[name] += 1
    setattr(cls, name, g)
for n in ["_pack", "_unpack", "_launch_in"]: wrap(paging.Pager, n)
for n in ["page_out", "release_done", "release_until", "_drain_one", "_after", "page_in_launch", "view", "take"]: wrap(paging.HostPool, n)
from sched_lifetime.lifetime import LifetimeManager
for n in ["bind", "retire", "acquire", "finalize", "close", "__init__"]: wrap(LifetimeManager, n)
pager = sl.Pager(1.0)
def step(ctx):
    for p in m.parameters(): p.grad = None
    torch.cuda.synchronize(); t0 = time.perf_counter()
    with ctx():
        loss = m(**b); t1 = time.perf_counter()
        loss.backward()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e3
for _ in range(3): step(pager.step); step(contextlib.nullcontext)
acc.clear(); cnt.clear()
fw = [step(pager.step) for _ in range(3)]
fo = [step(contextlib.nullcontext) for _ in range(3)]
print("fwd host ms paged", fw, "off", fo)
for k in sorted(acc, key=lambda k: -acc[k]):
    print(f"{k:16s} calls/step {cnt[k]/3:7.0f}  ms/step {acc[k]/3*1e3:7.2f}  us/call {acc[k]/cnt[k]*1e6:7.1f}")
# a bare copy loop: cost of one non_blocking D2H on a side stream from python
x = torch.empty(8 << 20, device=dev, dtype=torch.uint8); h = torch.empty(8 << 20, dtype=torch.uint8, pin_memory=True)
s = torch.cuda.Stream()
torch.cuda.synchronize(); t0 = time.perf_counter()
for _ in range(200):
    with torch.cuda.stream(s):
        h.copy_(x, non_blocking=True)
t1 = time.perf_counter(); torch.cuda.synchronize()
print(f"bare copy_ in stream ctx us/call {(t1-t0)/200*1e6:.1f}")
t0 = time.perf_counter()
for _ in range(200):
    e = torch.cuda.Event(); e.record(s)
t1 = time.perf_counter(); print(f"Event()+record us {(t1-t0)/200*1e6:.1f}")
