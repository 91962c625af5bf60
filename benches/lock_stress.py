"""The registry lock rule under stress (issue 35): 1,000 two-thread runs in one process, each
thread making managers that hold the last reference to retired tensors (the default
empty_storage retire keeps the emptied object until finalize). A library that releases a tensor
under the registry lock deadlocks here (the process never prints; run it under `timeout`).

    PYTHONPATH=torch_ops timeout 120 python benches/lock_stress.py [RUNS]
"""

import sys
import threading
import time

import torch

import sched_lifetime as sl

S = sl.current_stream(torch.device("cpu"))


def work(k: int) -> None:
    for _ in range(40):
        m = sl.LifetimeManager(f"t{k}")
        for _ in range(4):
            t = torch.empty(256)
            m.retire(t, S, owner_stream=S)
            del t
        m.finalize()
        m.close()


def main() -> int:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    t0 = time.time()
    for r in range(runs):
        threads = [threading.Thread(target=work, args=(k,), daemon=True) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        if any(t.is_alive() for t in threads):
            print(f"deadlock in run {r}")
            return 1
    print(f"{runs} two-thread runs, no deadlock, {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
