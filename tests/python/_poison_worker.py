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
    mgr = sl.LifetimeManager("poison") if arm == "scheduled" else None
    x = torch.full((N,), 1.0, device="cuda")
    if mgr is not None:
        mgr.bind(x, a)
    b.wait_stream(a)
    with torch.cuda.stream(b):
        torch.cuda._sleep(lag)
        out = x.sum()
    addr = x.data_ptr()
    if mgr is not None:
        mgr.retire(x, b, "empty_storage")
        del x
        mgr.acquire(a)
    elif arm == "record_stream":
        x.record_stream(b)
        del x
    else:  # "unsafe": the control, freed with no protection at all
        del x
    poison = torch.full((N,), -7.0, device="cuda")
    reused = poison.data_ptr() == addr
    a.wait_stream(b)
    torch.cuda.synchronize()
    if mgr is not None:
        mgr.finalize()
    return out.item() != float(N), reused


def main() -> None:
    arm, iters, lag = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
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
