"""What every rank that a test spawns (`torch.multiprocessing.spawn`) does at its start and at
its end.

A gloo rank aborted now and then in CI ("terminate called without an active exception", SIGABRT,
no Python traceback; once rank 0, once rank 1 of `test_train_dist.py`'s parity test, which passes
every other time). torch's own reports tie that message to gloo's threads while the interpreter
finalizes (pytorch/pytorch#190489, #179291); a barrier before tearing the groups down made it
rarer, not gone. Hence:

`start()`: Python's fault handler on, so a rank that aborts (at exit or mid-work) prints every
thread's stack into the test's captured output.

`leave()`: once the rank has written its results, both ranks meet, tear their process groups
down, and the process ends at once (`os._exit(0)`) without finalizing the interpreter. Call it
only on the success path: a rank that raises keeps its traceback."""

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
