"""One allocator mode per process (PYTORCH_CUDA_ALLOC_CONF is read once, at CUDA init).

The consumer on stream B is delayed with torch.cuda._sleep; right after the owner stream A
drains, A allocates a block of the same size and writes a poison pattern. If the owner's wait
were missing, the poison would land before B read the tensor. Prints one JSON line."""

import json
import sys

import torch

import sched_lifetime as sl

N = 4 << 20  # 16 MiB of float32: exact sums, a block of its own


def one(arm: str, a: torch.cuda.Stream, b: torch.cuda.Stream, lag: int) -> tuple[bool, bool]:
    mgr = sl.LifetimeManager("poison") if arm in ("scheduled", "release_after") else None
    x = torch.full((N,), 1.0, device="cuda")
    if arm == "scheduled":
        mgr.bind(x, a)
    b.wait_stream(a)
    with torch.cuda.stream(b):
        torch.cuda._sleep(lag)
        out = x.sum()
    addr = x.data_ptr()
    if arm == "scheduled":
        mgr.retire(x, b, "empty_storage")
        del x
        mgr.acquire(a)
    elif arm == "release_after":  # the one-call form: retire with the owner, the owner's acquire
        assert mgr.release_after(x, b, a) == 1
        del x
    elif arm == "record_stream":
        x.record_stream(b)
        del x
    elif arm == "fallback":  # rule 4: an unbound tensor retired through a manager
        fb = sl.LifetimeManager("fallback")
        fb.retire(x, b)
        assert fb.stats()["fallback_record_stream"] == 1
        del x
        fb.finalize()
    else:  # "unsafe": the control, freed with no protection at all
        del x
    poison = torch.full((N,), -7.0, device="cuda")
    reused = poison.data_ptr() == addr
    a.wait_stream(b)
    torch.cuda.synchronize()
    if mgr is not None:
        mgr.finalize()
    return out.item() != float(N), reused


def captured(arm: str, iters: int, lag: int) -> dict:
    """Rule 9: the same hand-over captured in one CUDA graph and replayed `iters` times. The
    consumer stream sleeps, then sums x; right after the owner's drain the owner allocates a
    block of the same size in the graph's pool and writes poison. `capture_scheduled`: the
    manager's wait is a graph edge, so the poison waits for the sum; `capture_unsafe` (the
    control): x is freed with no wait, the poison may take its block and run concurrently."""
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    out = torch.zeros((), device="cuda")
    g = torch.cuda.CUDAGraph()
    reused = False
    with torch.cuda.graph(g, stream=a):
        mgr = sl.LifetimeManager("capture") if arm == "capture_scheduled" else None
        x = torch.full((N,), 1.0, device="cuda")
        if mgr is not None:
            mgr.bind(x, a)
        b.wait_stream(a)
        with torch.cuda.stream(b):
            torch.cuda._sleep(lag)
            out.copy_(x.sum())
        addr = x.data_ptr()
        if mgr is not None:
            mgr.retire(x, b, "empty_storage")
            del x
            mgr.acquire(a)
        else:
            del x
        poison = torch.full((N,), -7.0, device="cuda")
        reused = poison.data_ptr() == addr
        a.wait_stream(b)
        del poison
        if mgr is not None:
            mgr.finalize()
    corrupt = 0
    for _ in range(iters):
        out.zero_()
        g.replay()
        torch.cuda.synchronize()
        corrupt += out.item() != float(N)
    return {"arm": arm, "iterations": iters, "corrupt": corrupt, "reused": int(reused) * iters, "backend": "graph pool"}


def main() -> None:
    arm, iters, lag = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    if arm.startswith("capture_"):
        print(json.dumps(captured(arm, iters, lag)))
        return
    a = torch.cuda.current_stream()
    b = torch.cuda.Stream()
    corrupt = reused = 0
    for _ in range(iters):
        c, r = one(arm, a, b, lag)
        corrupt += c
        reused += r
    backend = torch.cuda.memory.get_allocator_backend()
    print(json.dumps({"arm": arm, "iterations": iters, "corrupt": corrupt, "reused": reused, "backend": backend}))


if __name__ == "__main__":
    main()
