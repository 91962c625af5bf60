"""The main job's command line: `python -m sched_lifetime train`'s options, their checks, and
the launch (2 ranks spawned over NCCL or gloo, one under torchrun, or one process on the
emulated EP link: `--ep-link host[:K]`, the default on a machine with one GPU)."""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import time
from typing import Any, Optional

import torch

from ..calibrate import fold_name
from .arms import arms_help, check_arms, default_arms
from .loop import config_of, costs_refusal, say, unknown_costs, worker


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
    p.add_argument("--config", default=None, help="tiny (CPU default), tiny_dense, h200 (GPU default)")  # checked in `check_args`
    p.add_argument("--layers", type=int, default=0, help="override the config's layer count (0: the config's)")
    p.add_argument("--steps", type=int, default=3, help="timed optimizer steps per arm, interleaved across arms (after one warm-up step)")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per step (gradient accumulation; the steady state multiplexes F(i+1) with B(i))")
    p.add_argument("--arms", default=default_arms(), help=arms_help())
    p.add_argument("--lr", type=float, default=1e-3, help="SGD learning rate")
    p.add_argument("--world", type=int, default=2, help="EP ranks to spawn when not under torchrun (default 2; one GPU runs EP=1)")
    p.add_argument("--cpu", action="store_true", help="run on CPU (gloo) even with a GPU")
    p.add_argument("--profile-steps", type=int, default=5, help="GPU: steps profiled per arm, each alone; exposed comm is their median (>= 1)")
    p.add_argument("--no-traces", dest="traces", action="store_false", help="with --out: no Chrome traces (writing one of a large step takes minutes)")
    p.add_argument("--out", default=None, help="directory for train.json, durations.json, traces and the memory plot")
    p.add_argument("--nccl-channels", type=int, default=0, help="limit NCCL to this many channels (0: NCCL's choice)")
    p.add_argument("--quiet", dest="progress", action="store_false", help="no progress line per step")
    p.add_argument("--page-budget", type=float, default=0.5, help="arm ours+page: fraction of a microbatch's saved activations to page")
    p.add_argument("--page-nodes", default="", help="arm ours+page: page these compute nodes (comma-separated, e.g. L1.experts,L2.experts) instead of --page-budget's choice")
    p.add_argument("--page-prefetch", type=int, default=2, help="arm ours+page: a page-in may start this many backward nodes before its consumer (0: at once)")
    p.add_argument("--page-release", type=int, default=4, help="arm ours+page: the forward compute node this many nodes after a paged one waits for its page-out and releases its storage (0: only when a query finds the copy done)")
    p.add_argument("--calibrate-steps", type=int, default=1, help="arm calibrated: the first N steps (the warm-up is step 0) time every node and re-plan")
    p.add_argument("--calibrate-smoothing", type=float, default=0.5, help="arm calibrated: weight of a calibration step's times against the earlier ones', in (0, 1]")
    p.add_argument("--costs", default=None, help='JSON {"node": us} (e.g. a previous run\'s durations.json) for arm ours+search')
    p.add_argument(
        "--ep-link", default=None, metavar="nccl|host[:K]",
        help="EP transport: nccl (all-to-all over torch.distributed, NCCL on GPUs or gloo on CPU; the default with 2+ GPUs or "
        "on CPU) or host[:K] (one process emulating EP=K, default 8: the (K-1)/K share of each all-to-all crosses device -> "
        "pinned host -> device on the copy engines; the default on a machine with exactly one GPU; with --cpu, numerics only)",
    )
    return p


def resolve_ep_link(args: argparse.Namespace, use_cuda: bool) -> str:
    """`--ep-link` resolved ("nccl" or "host[:K]", default by the machine) and checked against
    the config's experts; SystemExit naming the setting when it cannot run."""
    from ..ep_link import HostLinkAllToAll
    from ..models import CONFIGS

    link = args.ep_link
    if link is None:
        one_gpu = use_cuda and torch.cuda.device_count() == 1 and "RANK" not in os.environ
        link = "host" if one_gpu else "nccl"
    if link == "nccl":
        return link
    try:
        cfg = CONFIGS.get(args.config)
        HostLinkAllToAll.from_spec(link, device="cpu", num_experts=cfg.experts if cfg is not None else None)
    except ValueError as e:
        raise SystemExit(f"--ep-link {link}: {e}") from None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise SystemExit(f"--ep-link {link} emulates EP in one process; run it without torchrun (or with one process), not WORLD_SIZE={os.environ['WORLD_SIZE']}")
    return link


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every option checked here, before any process is spawned (`p.error`: the usage and the
    message, exit status 2), so a mistake never surfaces as a traceback from inside a rank."""
    from ..models import CONFIGS

    if args.config not in CONFIGS:
        p.error(f"--config {args.config!r} is not a config; valid: {', '.join(CONFIGS)}")
    for name, lo in (("steps", 1), ("microbatches", 1), ("profile_steps", 1), ("world", 1), ("layers", 0), ("nccl_channels", 0), ("page_prefetch", 0), ("page_release", 0)):
        if getattr(args, name) < lo:
            p.error(f"--{name.replace('_', '-')} must be at least {lo}, got {getattr(args, name)}")
    if not 0 < args.lr < math.inf:
        p.error(f"--lr must be > 0 and finite, got {args.lr}")
    if not [a for a in args.arms.split(",") if a]:
        p.error(f"--arms names no arm (got {args.arms!r}); e.g. --arms sequential,ours")

    if args.calibrate_steps < 1:
        p.error(f"--calibrate-steps must be at least 1 (to time nothing, run arm ours), got {args.calibrate_steps}")
    if not 0 < args.calibrate_smoothing <= 1:
        p.error(f"--calibrate-smoothing is the new times' weight, in (0, 1]; got {args.calibrate_smoothing}")
    if not 0 <= args.page_budget <= 1:
        p.error(f"--page-budget is a fraction of the saved activations, in [0, 1]; got {args.page_budget}")
    if args.page_nodes:
        names = args.page_nodes.split(",")
        valid = pageable_nodes_of(args)
        unknown = [x for x in names if x not in valid]
        if unknown:
            p.error(f"--page-nodes {args.page_nodes!r}: {unknown} are not compute nodes of config {args.config!r} "
                    f"with a backward; valid: {','.join(valid)}")
    if args.costs:
        if not os.path.isfile(args.costs):
            p.error(f"--costs {args.costs!r}: no such file")
        try:
            with open(args.costs) as f:
                costs = json.load(f)
        except (OSError, ValueError) as e:
            p.error(f"--costs {args.costs!r}: not a JSON file of node costs ({e})")
        if not isinstance(costs, dict) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in costs.values()):
            p.error(f"--costs {args.costs!r}: expected a JSON object {{\"node\": us, ...}} (a run's durations.json)")
        bad = sorted(k for k, v in costs.items() if not math.isfinite(v) or v < 0)
        if bad:
            p.error(f"--costs {args.costs!r}: a node's cost is microseconds, finite and >= 0; {len(bad)} are not, e.g. {bad[:3]}")
        if not costs:
            p.error(f"--costs {args.costs!r}: names no node (an empty object); a run's durations.json has every node's time")
        known = sorted(n["name"] for n in meta_chunk(args).graph(True, True)["nodes"])
        unknown = unknown_costs(costs, known)
        if unknown:  # a typo or another config's file would leave those nodes at cost 0, silently
            p.error(costs_refusal(args, unknown, known))
        covered = {fold_name(str(k)) for k in costs}
        left = [k for k in known if k not in covered and fold_name(k) == k]
        if left:  # rule search would take them as free: said, not refused (a file may time only some nodes on purpose)
            print(f"note: --costs {args.costs!r} has no cost for {len(left)} of config {args.config!r}'s {len(known)} nodes "
                  f"(e.g. {left[:3]}); rule search takes them as free", file=sys.stderr)
    if args.out:
        try:
            os.makedirs(args.out, exist_ok=True)
        except OSError as e:
            p.error(f"--out {args.out!r}: cannot make that directory ({e.strerror})")


def meta_chunk(args: argparse.Namespace) -> Any:
    """`--config`'s (and `--layers`') model as a chunk, built on the meta device (no memory, no
    ranks): what the options that name its nodes are checked against."""
    from ..models import MoEModel

    with torch.device("meta"):
        return MoEModel(config_of(args), device="meta").chunk()


def pageable_nodes_of(args: argparse.Namespace) -> list[str]:
    """The nodes `--page-nodes` may name (`nodes.page_hooks.pageable_nodes` of `meta_chunk`)."""
    from ..nodes.page_hooks import pageable_nodes

    return pageable_nodes(meta_chunk(args))


def check_world(p: argparse.ArgumentParser, args: argparse.Namespace, use_cuda: bool) -> None:
    """EP over ranks (not the emulated link): the config's experts must shard over the ranks
    that will run (torchrun's WORLD_SIZE, else --world; one GPU runs EP=1)."""
    from ..models import CONFIGS

    if args.ep_link != "nccl":
        return
    if "RANK" in os.environ and os.environ.get("WORLD_SIZE", "").isdigit():
        ranks = int(os.environ["WORLD_SIZE"])
    else:
        ranks = 1 if use_cuda and torch.cuda.device_count() < args.world else args.world
    experts = CONFIGS[args.config].experts
    if ranks > 1 and experts % ranks:
        divisors = [d for d in range(1, experts + 1) if experts % d == 0]
        p.error(f"--world {ranks}: config {args.config!r}'s {experts} experts do not shard over {ranks} EP ranks; use one of {divisors}")


def spawned_worker(rank: int, world: int, args: argparse.Namespace, port: Optional[int]) -> None:
    """`worker` in a rank this command spawned. Once it has returned (its table printed, its
    group torn down) the process ends at once, without finalizing the interpreter: a spawned
    gloo rank that finalized normally aborted now and then beside torch's gloo threads
    ("terminate called without an active exception", seen in CI), failing a run whose work was
    done. A rank that raises keeps its traceback (mp.spawn reports it)."""
    worker(rank, world, args, port)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv: Optional[list[str]] = None) -> int:
    """Parse, check the options and the arms, set the environment, and run every rank."""
    p = parser()
    args = p.parse_args(argv)
    args.started = time.time()  # progress lines count from here (the ranks get it too)
    use_cuda = torch.cuda.is_available() and not args.cpu
    if args.config is None:
        args.config = "h200" if use_cuda else "tiny"
    check_args(p, args)
    check_arms([a for a in args.arms.split(",") if a], use_cuda, bool(args.costs))
    args.ep_link = resolve_ep_link(args, use_cuda)
    check_world(p, args, use_cuda)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    # Deterministic cuBLAS (must be set before the first cuBLAS call).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if args.nccl_channels:
        # Fewer NCCL channels: a slower, inter-node-like link (and fewer SMs taken from compute).
        os.environ["NCCL_MIN_NCHANNELS"] = os.environ["NCCL_MAX_NCHANNELS"] = str(args.nccl_channels)
    if args.ep_link != "nccl":  # the emulated link: one process, no group
        worker(0, 1, args, None)
        return 0
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

    say(args, f"starting {world} {'NCCL' if use_cuda else 'gloo'} ranks (each imports torch, then builds the arms: several seconds)")
    mp.spawn(spawned_worker, args=(world, args, _free_port()), nprocs=world, join=True)
    return 0
