"""What every rank that a test spawns (`torch.multiprocessing.spawn`) does at its start and at
its end.

`start()`: Python's fault handler on, so a rank that aborts prints every thread's stack into the
test's captured output instead of dying silently.

`leave()`: once the rank has written its results, both ranks meet, tear their process groups
down, and the process ends at once (`os._exit(0)`) without finalizing the interpreter. A rank
that returned normally aborted now and then in CI ("terminate called without an active
exception", SIGABRT) after its work and its file were done, while the interpreter finalized
beside torch's gloo threads; the parity it had checked was never in question, but the test
failed. Call it only on the success path: a rank that raises keeps its traceback."""

import faulthandler
import os
import sys


def start() -> None:
    faulthandler.enable(all_threads=True)


def leave() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
