"""The embedded model on one GPU (EP=1): the whole step captured in one CUDA graph replays
bit-exact against the same step run eagerly, and the graph pool is no larger than the eager
step's reserved peak with the lifetime manager in the loop."""

from dataclasses import replace

import pytest
import torch


@pytest.mark.cuda
def test_whole_step_captured_in_one_graph_replays_bit_exact_and_pool_within_eager_peak():
    from sched_lifetime import ep
    from sched_lifetime.models import CONFIGS
    from sched_lifetime.models import moe as moe_mod
    from sched_lifetime.train import Arm

    torch.use_deterministic_algorithms(True)
    try:
        dev = torch.device("cuda", torch.cuda.current_device())
        moe_mod.deterministic_sdpa(dev, torch.float32)
        cfg = replace(CONFIGS["tiny"], capacity_factor=1.0, hidden=256, expert_ffn=512, shared_ffn=256, seq=128, batch=4)
        t = ep.AllToAll(None)
        eager, graph = Arm("ours", cfg, t, dev, 0.05), Arm("ours+graph", cfg, t, dev, 0.05)
        n = 3
        for step in range(4):
            eager.step(step, n)
            graph.step(step, n)  # step 0 eager (warm-up), step 1 captures, then replays
        torch.cuda.synchronize()
        assert graph.graph is not None
        for a, b in zip(eager.losses, graph.losses):
            assert torch.equal(a, b)
        for g, h in zip(eager.grads, graph.grads):
            assert set(g) == set(h) and all(torch.equal(g[k], h[k]) for k in g)
        assert all(torch.equal(p, q) for p, q in zip(eager.model.parameters(), graph.model.parameters()))
        # Eager peak of one step, measured the same way as the graph pool (reserved growth).
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_reserved()
        torch.cuda.reset_peak_memory_stats()
        eager.step(9, n)
        torch.cuda.synchronize()
        eager_peak = torch.cuda.max_memory_reserved() - base
        print({"graph_pool": graph.graph_pool, "eager_peak": eager_peak})
        assert 0 < graph.graph_pool <= eager_peak, (graph.graph_pool, eager_peak)
    finally:
        torch.use_deterministic_algorithms(False)
        moe_mod.SDPA_BACKENDS = None
