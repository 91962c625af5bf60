"""The lifetime A/B: `record_stream` against scheduled release on a lagging two-stream
pipeline, measured side by side in one process. Used by `python -m sched_lifetime ab` (the
README's main job), by benches/gpu_lifetime_ab.py and by the GPU tests.

A producer on stream A makes one tensor per node; a consumer on stream B, slowed by
`torch.cuda._sleep`, reads it. With `record_stream` the freed block stays pending until B's
event completes and a later malloc notices, so the host running ahead grows reserved memory;
with the manager, A's next node waits on the plan event and the block is reused at once."""

from __future__ import annotations

import statistics
import time
from typing import Optional

import torch

from .lifetime import LifetimeManager

ARMS = ("record_stream", "scheduled")


def _pending_free_bytes() -> int:
    return sum(
        blk["size"]
        for seg in torch.cuda.memory_snapshot()
        for blk in seg["blocks"]
        if blk["state"] == "active_pending_free"
    )


def _hand_over(
    x: torch.Tensor,
    i: int,
    outs: torch.Tensor,
    mgr: Optional[LifetimeManager],
    a: Optional[torch.Stream],
    b: Optional[torch.Stream],
    lag: int,
) -> None:
    """`x`, made on `a`, is read into `outs[i]` by a consumer on `b` that first sleeps `lag`
    GPU cycles; then it is handed back through the manager (scheduled arm) or with
    `record_stream` (baseline). On CPU there is no `b`: the read is in host order."""
    if mgr is not None:
        mgr.bind(x, a)
    if b is None:
        outs[i] = x.sum(dtype=torch.float64)
    else:
        b.wait_stream(a)
        with torch.cuda.stream(b):
            if lag:
                torch.cuda._sleep(lag)
            outs[i] = x.sum(dtype=torch.float64)
    if mgr is not None:
        mgr.retire(x, b)
    elif b is not None:
        x.record_stream(b)


def pipeline_step(arm: str, outs: torch.Tensor, numel: int, lag: int, b: Optional[torch.Stream], addrs: set) -> int:
    """One step of n nodes; returns the pending-free bytes seen when the host finished enqueueing."""
    cuda = outs.is_cuda
    a = torch.cuda.current_stream() if cuda else None
    mgr = LifetimeManager(arm) if arm == "scheduled" else None
    for i in range(outs.numel()):
        if mgr is not None and a is not None:
            mgr.acquire(a)  # before A's next node: wait on the plan event, then free
        x = torch.full((numel,), float(i + 1), device=outs.device)
        addrs.add(x.data_ptr())
        _hand_over(x, i, outs, mgr, a, b, lag)
        del x
    pending = _pending_free_bytes() if cuda else 0
    if mgr is not None:
        mgr.finalize()
    if cuda:
        a.wait_stream(b)
    return pending


def run_arm(arm: str, n: int, numel: int, lag: int, steps: int, device: torch.device) -> dict:
    cuda = device.type == "cuda"
    b = torch.cuda.Stream(device) if cuda else None
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base_reserved = torch.cuda.memory_reserved() if cuda else 0
    base_alloc = torch.cuda.memory_allocated() if cuda else 0
    outs = torch.zeros(n, device=device, dtype=torch.float64)
    addrs: set = set()
    times, pending_peak, results = [], 0, []
    for _ in range(steps):
        t0 = time.perf_counter()
        pending_peak = max(pending_peak, pipeline_step(arm, outs, numel, lag, b, addrs))
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        results.append(outs.cpu().clone())
    row = {
        "arm": arm,
        "outputs": torch.stack(results),
        "distinct_blocks": len(addrs),
        "step_ms": statistics.median(times[1:] if len(times) > 1 else times),
    }
    if cuda:
        row.update(
            max_reserved=torch.cuda.max_memory_reserved() - base_reserved,
            max_allocated=torch.cuda.max_memory_allocated() - base_alloc,
            pending_free_peak=pending_peak,
        )
    return row


def captured_pool(arm: str, n: int, numel: int, replays: int = 3, large_pool: bool = False) -> tuple[int, list[torch.Tensor]]:
    """Capture one step into a CUDA graph; returns (graph pool bytes, outputs of each replay).
    Replay r feeds an input of value r + 2, so output i must be numel * (i + 1) * (r + 2).
    `large_pool`: count the large pool only (what an eager step's large-pool peak compares to)."""

    def reserved() -> int:
        return torch.cuda.memory_stats()["reserved_bytes.large_pool.current"] if large_pool else torch.cuda.memory_reserved()

    b = torch.cuda.Stream()
    static_in = torch.ones(numel, device="cuda")
    outs = torch.zeros(n, device="cuda", dtype=torch.float64)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = reserved()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        a = torch.cuda.current_stream()
        mgr = LifetimeManager("captured") if arm == "scheduled" else None
        for i in range(n):
            if mgr is not None:
                mgr.acquire(a)
            x = static_in * float(i + 1)
            _hand_over(x, i, outs, mgr, a, b, 0)
            del x
        if mgr is not None:
            mgr.finalize()
        a.wait_stream(b)
    pool = reserved() - base
    results = []
    for r in range(replays):
        static_in.fill_(float(r + 2))
        g.replay()
        torch.cuda.synchronize()
        results.append(outs.cpu().clone())
    del g
    return pool, results


def run_ab(n: int = 16, mib: int = 64, lag: int = 2_000_000, steps: int = 5, device: Optional[str] = None) -> dict:
    """Both arms, same process, same inputs. Returns rows plus whether outputs are equal."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    numel = mib * (1 << 20) // 4
    rows = {arm: run_arm(arm, n, numel, lag, steps, dev) for arm in ARMS}
    equal = torch.equal(rows["record_stream"]["outputs"], rows["scheduled"]["outputs"])
    out = {"device": str(dev), "n": n, "mib": mib, "lag_cycles": lag, "steps": steps, "rows": rows, "outputs_equal": equal}
    if dev.type == "cuda":
        out["graph_pool"] = {arm: captured_pool(arm, n // 2 or 1, numel)[0] for arm in ARMS}
    return out


def format_table(res: dict) -> str:
    mib = 1 << 20
    rs, sc = res["rows"]["record_stream"], res["rows"]["scheduled"]
    lines = [
        f"lifetime A/B on {res['device']}: {res['n']} tensors x {res['mib']} MiB per step, "
        f"consumer lag {res['lag_cycles']} cycles, {res['steps']} steps; outputs equal: {res['outputs_equal']}",
        f"{'metric':<28}{'record_stream':>16}{'scheduled':>16}{'ratio':>10}",
    ]

    def row(name: str, a: float, b: float, unit: str, scale: float = 1.0) -> None:
        ratio = f"{b / a:.3f}" if a else "-"
        lines.append(f"{name:<28}{a / scale:>13.1f} {unit:<2}{b / scale:>13.1f} {unit:<2}{ratio:>10}")

    if "max_reserved" in rs:
        row("max reserved", rs["max_reserved"], sc["max_reserved"], "MiB", mib)
        row("max allocated", rs["max_allocated"], sc["max_allocated"], "MiB", mib)
        row("pending-free peak", rs["pending_free_peak"], sc["pending_free_peak"], "MiB", mib)
    row("distinct blocks", rs["distinct_blocks"], sc["distinct_blocks"], "")
    row("step time (median)", rs["step_ms"], sc["step_ms"], "ms")
    if "graph_pool" in res:
        gp = res["graph_pool"]
        row("CUDA graph pool", gp["record_stream"], gp["scheduled"], "MiB", mib)
    else:
        lines.append("memory figures need a GPU: on CPU every stream is host-ordered, so both arms free at once")
    return "\n".join(lines)
