"""sched_lifetime: schedule-aware cross-stream tensor lifetime for PyTorch (torch.ops.sched_lifetime).

    import sched_lifetime as sl
    mgr = sl.LifetimeManager("mb0")
"""

from ._ops import INFO, LIBRARY, STATS_FIELDS, ops
from .lifetime import ACTIONS, LifetimeManager, current_stream
from .executor import Executor, SideStreams
from .compile import backend as compile_backend  # registers torch.compile(backend="sched_lifetime")
from .paging import HostPool, Pager, page_plan
from .schedule import lower, schedule, schedule_order, simulate_schedule, validate
from .sim import compare, scenario_graph, scenario_program, simulate

__all__ = [
    "ACTIONS",
    "Executor",
    "INFO",
    "LIBRARY",
    "LifetimeManager",
    "HostPool",
    "Pager",
    "STATS_FIELDS",
    "SideStreams",
    "compare",
    "compile_backend",
    "current_stream",
    "ops",
    "page_plan",
    "scenario_graph",
    "scenario_program",
    "lower",
    "schedule",
    "schedule_order",
    "simulate",
    "simulate_schedule",
    "validate",
]
__version__ = "0.1.0"
