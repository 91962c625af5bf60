"""Cross-rank agreement (issue 30) on 2 gloo ranks (CPU, in CI): ranks that disagree on what
decides a step's collectives (microbatch count, schedule, paging plan) raise on both ranks,
with the same message, within seconds, instead of one rank aborting inside gloo while the other
waits in a collective. One spawn runs every case in turn (each rank writes what it saw)."""

import datetime
import json
import os
import socket
import time
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: A hang (a guard removed) fails in this many seconds instead of gloo's 30 minutes.
TIMEOUT_S = 20


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Loss(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x).square().sum()


def _cases(rank: int) -> dict:
    """name -> what the rank runs (rank 1 differs from rank 0 where the case says so)."""
    from sched_lifetime import ep
    from sched_lifetime.compile import GraphStep
    from sched_lifetime.models import CONFIGS, MoEModel
    from sched_lifetime.nodes import combined_step, train_step, MicrobatchState

    cfg = replace(CONFIGS["tiny"], capacity_factor=1.0)
    t = ep.AllToAll(ep.new_ep_group())

    def model(c=cfg):
        m = MoEModel(c, t, seed=0, device=torch.device("cpu"))
        return m, m.chunk(torch.device("cpu"))

    def microbatches():  # rank 1 brings one microbatch more
        m, c = model()
        train_step(c, [m.batch(0, i) for i in range(2 + rank)])

    def graph():  # rank 1 has one layer more
        m, c = model(cfg if rank == 0 else replace(cfg, layers=cfg.layers + 1))
        train_step(c, [m.batch(0, i) for i in range(2)])

    def paging():  # rank 0 pages, rank 1 does not (calibration runs EP collectives: both)
        m, c = model()
        c.enable_paging(m.batch(0, 0), budget=0.5 if rank == 0 else 0.0, min_bytes=1024)
        train_step(c, [m.batch(0, i) for i in range(2)])

    def combined():  # combined_step in a user's own loop: the ranks multiplex in two orders
        m, c = model()
        st0, st1 = MicrobatchState(0), MicrobatchState(1)
        c.run((st0, m.batch(0, 0)))  # the same warm-up forward on both
        combined_step(c, (st1, m.batch(0, 1)), st0, order="ours" if rank == 0 else "b_then_f")

    def every_step():  # agree on step 1 (a real step), then rank 1 changes its count alone
        m, c = model()
        c.rank_check = "every_step"
        train_step(c, [m.batch(0, i) for i in range(2)])
        train_step(c, [m.batch(0, i) for i in range(2 + rank)])

    def graph_step():
        gs = GraphStep(_Loss(), (torch.randn(3, 4),))
        gs.step([(torch.randn(3, 4),) for _ in range(2 + rank)])

    def agree_once():  # same facts: one check for two steps, then none (the timing-free order:
        # the calibrated one adds its step-0 agreement on costs and orders, test_calibrate.py)
        m, c = model()
        calls = []
        orig = dist.all_gather_object
        dist.all_gather_object = lambda *a, **k: (calls.append(1), orig(*a, **k))[1]
        try:
            for _ in range(2):
                train_step(c, [m.batch(0, i) for i in range(2)], order="ours")
        finally:
            dist.all_gather_object = orig
        return f"checks: {len(calls)}"

    return {f.__name__: f for f in (agree_once, microbatches, graph, paging, combined, every_step, graph_step)}


def _worker(rank: int, port: int, out: str) -> None:
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "torch_ops"))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    res = {}
    for name, case in _cases(rank).items():
        start = time.monotonic()
        try:
            msg = case() or "no error"
        except RuntimeError as e:
            msg = str(e)
        res[name] = {"msg": msg, "seconds": time.monotonic() - start}
        with open(f"{out}.{rank}", "w") as f:  # written after each case: a hang still leaves the rest
            json.dump(res, f)
    dist.destroy_process_group()


def test_ranks_that_disagree_raise_on_both_ranks_with_one_message_within_seconds(tmp_path):
    out = str(tmp_path / "agree")
    mp.spawn(_worker, args=(_port(), out), nprocs=2, join=True)
    got = []
    for rank in range(2):
        with open(f"{out}.{rank}") as f:
            got.append(json.load(f))
    want = {
        "microbatches": "train_step: the ranks disagree on microbatch count (by rank: [2, 3])",
        "graph": "train_step: the ranks disagree on schedule",
        "paging": "train_step: the ranks disagree on paging plan",
        "combined": "combined_step: the ranks disagree on order (by rank: ['ours', 'b_then_f'])",
        "every_step": "train_step: the ranks disagree on microbatch count (by rank: [2, 3])",
        "graph_step": "GraphStep.step: the ranks disagree on microbatch count (by rank: [2, 3])",
    }
    assert got[0]["agree_once"]["msg"] == got[1]["agree_once"]["msg"] == "checks: 1", got
    for case, start in want.items():
        msgs = [g[case]["msg"] for g in got]
        assert msgs[0] == msgs[1] and msgs[0].startswith(start), (case, msgs)
        assert "no step is run" in msgs[0], msgs
        assert all(g[case]["seconds"] < 10 for g in got), (case, got)
