"""Whole-step CUDA graphs: capture an arm's step, and measure an eager step the way a capture's
pool is counted (from the same start, into a private pool) so the two compare like for like."""

from __future__ import annotations

from typing import Any

import torch


def _capture(arm: Any, batches: list) -> None:
    """Capture one whole step (every microbatch's F and B, the lifetime manager's waits and
    releases, the all-to-alls) into one CUDA graph over static inputs. Gradients are written
    by the graph (its first write to each is an assignment), so they are not zeroed again."""
    from ..nodes import train_step

    if arm.model.cfg.capacity_factor is None:
        raise ValueError("capturing a step needs the fixed-capacity dispatch (capacity_factor); counted mode syncs the host")
    arm.static = [{k: v.clone() for k, v in b.items()} for b in batches]
    arm.opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base, base_large = torch.cuda.memory_reserved(), _large_pool_reserved()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        arm.static_losses = train_step(arm.chunk, arm.static, arm.order, arm.lifetime)
    arm.graph_pool = torch.cuda.memory_reserved() - base
    arm.graph_pool_large = _large_pool_reserved() - base_large
    arm.graph = g


def _large_pool_reserved() -> int:
    return torch.cuda.memory_stats().get("reserved_bytes.large_pool.current", 0)


def pool_segments(pool_id: Any) -> list[dict]:
    """The allocator snapshot's segments of one private pool (a graph's or a MemPool's)."""
    return [s for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", ())) == tuple(pool_id)]


def _capture_start(arm: Any) -> None:
    """Where a whole-step capture starts: no gradients, an empty cache, no cuBLAS workspaces."""
    arm.opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()


def eager_step_growth(arm: Any, step: int, microbatches: int) -> dict[str, int]:
    """One eager step of `arm` from where a whole-step capture starts, measured as `_capture`
    counts the graph pool: no gradients (the graph writes them in its pool), an empty cache, and
    the cuBLAS workspaces cleared (each side counts those its own run allocates). Returns the
    peak growth above that start: `pool_large` (large-pool reserved, where the activations
    live), `pool` (all reserved) and `allocated_peak`."""
    _capture_start(arm)
    base, base_large, start = torch.cuda.memory_reserved(), _large_pool_reserved(), torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    arm.step(step, microbatches)
    torch.cuda.synchronize()
    return {
        "pool_large": torch.cuda.memory_stats()["reserved_bytes.large_pool.peak"] - base_large,
        "pool": torch.cuda.max_memory_reserved() - base,
        "allocated_peak": torch.cuda.max_memory_allocated() - start,
    }


def eager_step_pool(arm: Any, step: int, microbatches: int) -> dict[str, int]:
    """One eager step of `arm` with every allocation on the device (any stream, any thread: the
    autograd engine's too) routed into a fresh private pool, as a capture routes its
    allocations into the graph's pool, and from the same start as `eager_step_growth`. Unlike
    the growth of the shared pool, the step cannot use free space left inside segments that
    existed before it (the parameters' segments), so its pool compares like for like with a
    graph pool. Returns the pool's reserved bytes at the end (nothing is released from a pool
    during the step, so that is its peak): `pool_large` (large segments) and `pool`."""
    _capture_start(arm)
    dev = torch.cuda.current_device()
    pool = torch.cuda.MemPool()
    torch._C._cuda_beginAllocateToPool(dev, pool.id)  # every stream, every thread
    try:
        arm.step(step, microbatches)
        torch.cuda.synchronize()
    finally:
        torch._C._cuda_endAllocateToPool(dev, pool.id)
    segs = pool_segments(pool.id)
    out = {
        "pool_large": sum(s["total_size"] for s in segs if s["segment_type"] == "large"),
        "pool": sum(s["total_size"] for s in segs),
    }
    # The step's gradients live in the pool; its segments go back once they are freed.
    torch._C._cuda_releasePool(dev, pool.id)
    return out
