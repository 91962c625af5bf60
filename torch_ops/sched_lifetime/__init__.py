"""sched_lifetime: schedule-aware cross-stream tensor lifetime and forward/backward multiplexing
for PyTorch MoE training, as `torch.ops.sched_lifetime` (a Rust core behind thin C++).

`__all__` is the supported surface; every entry has a docstring with an example
(`help(sched_lifetime.X)`). The ways in, each with a guide under docs/:

- Lifetime (docs/lifetime.md): `LifetimeManager` (instead of `Tensor.record_stream`),
  `ACTIONS`, `current_stream`, the raw `ops`.
- torch.compile (docs/compile.md): `torch.compile(model, backend="sched_lifetime")`
  (`compile_backend`).
- Paging (docs/paging.md): `Pager` (eager, `saved_tensors_hooks`), `Chunk.enable_paging`
  (page nodes), `HostPool`, `page_plan`.
- Multiplexed steps (docs/nodes.md): `NodeDef`, `Chunk`, `MicrobatchState`,
  `combined_step`, `train_step`; `GraphStep` on compiled graphs; `Executor`, `SideStreams`.
- Pipelines (docs/pipelining.md): `NodeStage`, `GraphStage`, `enable_overlap` (OVERLAP_F_B,
  DualPipeV, DualPipe).
- Scheduler and simulator (docs/scheduler.md): `schedule`, `schedule_order`, `validate`,
  `lower`, `simulate_schedule`, `simulate`, `compare`, `scenario_graph`,
  `scenario_program`; `INFO`, `STATS_FIELDS`.

Submodules stay importable as before (`sched_lifetime.nodes`, `.paging`, `.compile`,
`.pipelining`, `.train`, `.ep`, `.models`).

    >>> import torch, sched_lifetime as sl
    >>> mgr = sl.LifetimeManager("mb0")
    >>> mgr.bind(x := torch.ones(4))
    >>> mgr.retire(x)
    >>> mgr.finalize()["immediate"]
    1
"""

from ._ops import INFO, LIBRARY, STATS_FIELDS, ops
from .lifetime import ACTIONS, LifetimeManager, current_stream
from .executor import Executor, SideStreams
from .compile import backend as compile_backend  # registers torch.compile(backend="sched_lifetime")
from .compile import GraphStep
from .paging import HostPool, Pager, page_plan
from .schedule import lower, schedule, schedule_order, simulate_schedule, validate
from .calibrate import Calibration
from .sim import compare, scenario_graph, scenario_program, simulate
from .nodes import Chunk, MicrobatchState, NodeDef, combined_step, train_step
from .pipelining import GraphStage, NodeStage, enable_overlap

__all__ = [
    # lifetime
    "ACTIONS",
    "LifetimeManager",
    "current_stream",
    "ops",
    # torch.compile
    "compile_backend",
    # paging
    "HostPool",
    "Pager",
    "page_plan",
    # multiplexed steps: the node API, GraphStep, the executor
    "Chunk",
    "MicrobatchState",
    "NodeDef",
    "combined_step",
    "train_step",
    "GraphStep",
    "Executor",
    "SideStreams",
    # pipelines
    "GraphStage",
    "NodeStage",
    "enable_overlap",
    # scheduler and simulator
    "Calibration",
    "INFO",
    "STATS_FIELDS",
    "compare",
    "lower",
    "scenario_graph",
    "scenario_program",
    "schedule",
    "schedule_order",
    "simulate",
    "simulate_schedule",
    "validate",
]
__version__ = "0.1.0"
