"""What each collective's launch..wait spans in torchtitan's traced step: torchtitan's own pass
pipeline against ours (sched_lifetime.integrations.torchtitan), on its DeepSeek-V3 and Qwen3
debug models (2 layers, SDPA, EP=2, 2 gloo ranks on CPU). Structural, not timed: per collective
kind, how many there are, how many compute nodes run between launch and wait, and how many
have none (exposed whatever the link's speed). Needs torchtitan 0.3.0 (torch 2.15 here).

    PYTHONPATH=torch_ops python benches/torchtitan_spans.py
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))


def spans(gm: fx.GraphModule) -> dict:
    order = [n for n in gm.graph.nodes if n.op == "call_function"]
    pos = {n: i for i, n in enumerate(order)}

    def is_comm(n: fx.Node) -> bool:
        return str(n.target).startswith("_c10d_functional.")

    def is_wait(n: fx.Node) -> bool:
        return str(n.target).startswith("_c10d_functional.wait_tensor")

    out: dict = {}
    for n in order:
        launch = n.args[0] if is_wait(n) and n.args else None
        if isinstance(launch, fx.Node) and launch in pos and not is_wait(launch):
            kind = "ep all_to_all" if "all_to_all" in str(launch.target) else str(launch.target).split(".")[1]
            under = [m for m in order[pos[launch] + 1 : pos[n]] if not is_comm(m) and "view" not in str(m.target) and "getitem" not in str(m.target)]
            out.setdefault(kind, []).append(len(under))
    return {k: {"count": len(v), "compute under": sum(v), "none under": sum(1 for x in v if x == 0)} for k, v in out.items()}


def _worker(rank: int, port: int, model: str) -> None:
    sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))
    sys.path.insert(0, os.path.join(HERE, "..", "torch_ops"))
    import test_torchtitan as T

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    import torchtitan.distributed.parallel_dims as pdm

    pdm.device_type = "cpu"
    T.STEPS = 1
    _, _, ref = T._run(model, "default", rank, 2)
    _, _, ours = T._run(model, "sched_lifetime", rank, 2)
    if rank == 0:
        print(f"{model}:")
        for name, gm in (("torchtitan", ref), ("ours", ours)):
            for kind, s in sorted(spans(gm).items()):
                print(f"  {name:10s} {kind:28s} {s['count']:3d} collectives, {s['compute under']:5d} compute nodes under them, {s['none under']:3d} with none")
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))
    import test_torchtitan as T

    for m in T.MODELS:
        mp.spawn(_worker, args=(T._port(), m), nprocs=2, join=True)
