"""GPU suite (marker `cuda`): real streams, the caching allocator, CUDA graph capture.

Run on the GPU machine: PYTHONPATH=torch_ops python3 -m pytest -q tests/python -m cuda"""

import json
import os
import subprocess
import sys

import pytest
import torch

import sched_lifetime as sl
from sched_lifetime import ab

pytestmark = pytest.mark.cuda

HERE = os.path.dirname(os.path.abspath(__file__))
ALLOC_MODES = ["", "expandable_segments:True", "backend:cudaMallocAsync"]
LAG = 2_000_000  # ~1 ms of GPU sleep: the consumer lags well behind the host


def _worker(arm: str, mode: str, iters: int = 200) -> dict:
    env = dict(os.environ)
    env["PYTORCH_CUDA_ALLOC_CONF"] = mode
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(HERE, "..", "..", "torch_ops"), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, os.path.join(HERE, "_poison_worker.py"), arm, str(iters), str(LAG)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("arm", ["scheduled", "release_after"])
@pytest.mark.parametrize("mode", ALLOC_MODES, ids=["default", "expandable", "cudaMallocAsync"])
def test_poison_scheduled_release_is_intact(mode, arm):
    r = _worker(arm, mode)
    print("poison", arm, mode or "default", r)
    assert r["corrupt"] == 0, r
    # The test only proves something if the poison really took the released block.
    assert r["reused"] >= r["iterations"] // 2, r


@pytest.mark.parametrize("mode", ALLOC_MODES, ids=["default", "expandable", "cudaMallocAsync"])
def test_poison_control_unprotected_free_is_caught(mode):
    # The same harness without the owner's wait must see corruption: the test can fail.
    r = _worker("unsafe", mode, iters=50)
    print("control", mode or "default", r)
    assert r["corrupt"] > 0, r


def test_rule4_fallback_with_a_lagging_consumer_is_intact():
    # An unbound tensor retired through the manager takes record_stream; with the consumer
    # lagging and a poison block allocated at once, nothing is corrupted (the control above,
    # the same harness with no protection, is).
    r = _worker("fallback", "")
    print("fallback", r)
    assert r["corrupt"] == 0, r


def test_rule9_capture_with_a_lagging_consumer_is_intact_and_the_control_corrupts():
    ok = _worker("capture_scheduled", "")
    bad = _worker("capture_unsafe", "")
    print("capture", ok, bad)
    assert bad["reused"] > 0 and bad["corrupt"] > 0, bad  # the harness can see a missing wait
    assert ok["reused"] > 0, ok  # the poison took the released block inside the graph, too
    assert ok["corrupt"] == 0, ok


def test_memory_ab_scheduled_beats_record_stream():
    res = ab.run_ab(n=16, mib=64, lag=LAG, steps=3, device="cuda")
    print(ab.format_table(res))
    rs, sc = res["rows"]["record_stream"], res["rows"]["scheduled"]
    assert res["outputs_equal"]
    assert sc["max_reserved"] < rs["max_reserved"]
    assert sc["distinct_blocks"] < rs["distinct_blocks"]
    assert sc["pending_free_peak"] == 0 < rs["pending_free_peak"]


def _eager_peak(n: int, numel: int) -> int:
    """Large-pool reserved peak of one eager step (the 64 MiB tensors live there; small
    allocations may land in cached small segments in eager but not in a graph's own pool)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_stats()["reserved_bytes.large_pool.current"]
    outs = torch.zeros(n, device="cuda", dtype=torch.float64)
    ab.pipeline_step("scheduled", outs, numel, 0, torch.cuda.Stream(), set())
    torch.cuda.synchronize()
    return torch.cuda.memory_stats()["reserved_bytes.large_pool.peak"] - base


def test_cuda_graph_capture_replays_correctly_and_pool_not_larger_than_eager():
    n, numel = 8, 16 << 20
    eager = _eager_peak(n, numel)
    pool_s, res_s = ab.captured_pool("scheduled", n, numel, large_pool=True)
    pool_r, res_r = ab.captured_pool("record_stream", n, numel, large_pool=True)
    print({"eager_peak": eager, "pool_scheduled": pool_s, "pool_record_stream": pool_r})
    for r, (got_s, got_r) in enumerate(zip(res_s, res_r)):
        want = torch.tensor([float(numel) * (i + 1) * (r + 2) for i in range(n)], dtype=torch.float64)
        assert torch.equal(got_s, want), (r, got_s, want)
        assert torch.equal(got_r, want)
    assert pool_s <= eager, (pool_s, eager)
    assert pool_r > pool_s, "record_stream under capture should inflate the pool"


def test_two_managers_on_one_owner_stream_do_not_drain_each_other():
    a, b = torch.cuda.current_stream(), torch.cuda.Stream()
    f, bw = sl.LifetimeManager("F1"), sl.LifetimeManager("B0")
    xf = torch.ones(1 << 20, device="cuda")
    xb = torch.ones(1 << 20, device="cuda")
    f.bind(xf, a)
    bw.bind(xb, a)
    b.wait_stream(a)
    with torch.cuda.stream(b):
        torch.cuda._sleep(LAG)
        sf, sb = xf.sum(), xb.sum()
    f.retire(xf, b)
    bw.retire(xb, b, "drop_reference")
    assert f.acquire(a) == 1
    assert xb.untyped_storage().nbytes() == 4 << 20 and xf.untyped_storage().nbytes() == 0
    assert bw.stats()["pending_count"] == 1 and f.stats()["waits"] == 1 and bw.stats()["waits"] == 0
    assert bw.acquire(a) == 1
    torch.cuda.synchronize()
    assert sf.item() == sb.item() == float(1 << 20)
    f.finalize()
    bw.finalize()


def test_unbound_cuda_tensor_takes_record_stream_fallback():
    a, b = torch.cuda.current_stream(), torch.cuda.Stream()
    m = sl.LifetimeManager()
    x = torch.ones(1 << 20, device="cuda")
    b.wait_stream(a)
    with torch.cuda.stream(b):
        s = x.sum()
    m.retire(x, b)
    assert m.stats()["fallback_record_stream"] == 1
    del x
    torch.cuda.synchronize()
    assert s.item() == float(1 << 20)
    m.finalize()


def test_direct_entry_keys_every_stream_right_past_its_cache():
    """The eager entry caches stream keys by object identity in four slots: cycling through six
    streams twice, each retire parks on its own owner, and only that owner's acquire frees it."""
    dev = torch.device("cuda")
    streams = [torch.cuda.Stream(dev) for _ in range(6)]
    m = sl.LifetimeManager("stream-cache")
    for _ in range(2):
        for k, owner in enumerate(streams):
            consumer = streams[(k + 1) % len(streams)]
            with torch.cuda.stream(owner):
                t = torch.empty(256, device=dev)
            m.retire(t, consumer, owner_stream=owner)
            assert m.acquire(consumer) == 0, k
            assert m.acquire(owner) == 1, k
            assert t.untyped_storage().nbytes() == 0
    st = m.finalize()
    assert (st["bound"], st["drained"], st["pending_count"]) == (12, 12, 0), st
