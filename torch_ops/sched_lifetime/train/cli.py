"""The main job's command line: `python -m sched_lifetime train`'s options, their checks, and
the launch (2 ranks spawned over NCCL or gloo, one under torchrun, or EP=1 on one GPU)."""

from __future__ import annotations

import argparse
import os
import socket
import sys
from typing import Optional

import torch

from .arms import arms_help, check_arms, default_arms
from .loop import worker


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's default, except that a newline in a help text starts a new line, whose
    continuation lines are indented (the `--arms` help lists one arm a line)."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        if "\n" not in text:
            return super()._split_lines(text, width)
        out: list[str] = []
        for line in text.splitlines():
            first, *rest = super()._split_lines(line, width - 2) or [""]
            out += [first] + ["  " + w for w in rest]
        return out


def parser() -> argparse.ArgumentParser:
    """The options of `python -m sched_lifetime train`."""
    p = argparse.ArgumentParser(
        prog="sched_lifetime train",
        description=(
            "the main job: train the embedded MoE model under several arms side by side (same weights, same tokens), "
            "then print one table: parity against sequential, step time, exposed communication, memory"
        ),
        epilog="guide: docs/main-job.md",
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--config", default=None, help="tiny (CPU default), tiny_dense, h200 (GPU default)")
    p.add_argument("--layers", type=int, default=0, help="override the config's layer count (0: the config's)")
    p.add_argument("--steps", type=int, default=3, help="timed optimizer steps per arm, interleaved across arms (after one warm-up step)")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per step (gradient accumulation; the steady state multiplexes F(i+1) with B(i))")
    p.add_argument("--arms", default=default_arms(), help=arms_help())
    p.add_argument("--lr", type=float, default=1e-3, help="SGD learning rate")
    p.add_argument("--world", type=int, default=2, help="EP ranks to spawn when not under torchrun (default 2; one GPU runs EP=1)")
    p.add_argument("--cpu", action="store_true", help="run on CPU (gloo) even with a GPU")
    p.add_argument("--out", default=None, help="directory for train.json, durations.json, traces and the memory plot")
    p.add_argument("--nccl-channels", type=int, default=0, help="limit NCCL to this many channels (0: NCCL's choice)")
    p.add_argument("--quiet", dest="progress", action="store_false", help="no progress line per step")
    p.add_argument("--page-budget", type=float, default=0.5, help="arm ours+page: fraction of a microbatch's saved activations to page")
    p.add_argument("--page-nodes", default="", help="arm ours+page: page these compute nodes (comma-separated, e.g. L1.experts,L2.experts) instead of --page-budget's choice")
    p.add_argument("--page-prefetch", type=int, default=2, help="arm ours+page: a page-in may start this many backward nodes before its consumer (0: at once)")
    p.add_argument("--page-release", type=int, default=4, help="arm ours+page: the forward compute node this many nodes after a paged one waits for its page-out and releases its storage (0: only when a query finds the copy done)")
    p.add_argument("--costs", default=None, help='JSON {"node": us} (e.g. a previous run\'s durations.json) for arm ours+search')
    return p


def main(argv: Optional[list[str]] = None) -> int:
    """Parse, check the arms, set the environment, and run every rank."""
    args = parser().parse_args(argv)
    use_cuda = torch.cuda.is_available() and not args.cpu
    if args.config is None:
        args.config = "h200" if use_cuda else "tiny"
    check_arms([a for a in args.arms.split(",") if a], use_cuda, bool(args.costs))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    # Deterministic cuBLAS (must be set before the first cuBLAS call).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if args.nccl_channels:
        # Fewer NCCL channels: a slower, inter-node-like link (and fewer SMs taken from compute).
        os.environ["NCCL_MIN_NCHANNELS"] = os.environ["NCCL_MAX_NCHANNELS"] = str(args.nccl_channels)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, None)
        return 0
    world = args.world
    if use_cuda and torch.cuda.device_count() < world:
        print(f"{torch.cuda.device_count()} GPU(s): running EP=1; for EP over NCCL run on {world} GPUs "
              f"(torchrun --standalone --nproc-per-node {world} -m sched_lifetime train)", file=sys.stderr)
        world = 1
    if world == 1:
        worker(0, 1, args, None)
        return 0
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(world, args, _free_port()), nprocs=world, join=True)
    return 0
