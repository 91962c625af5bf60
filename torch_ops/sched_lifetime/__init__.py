"""sched_lifetime: schedule-aware cross-stream tensor lifetime for PyTorch (torch.ops.sched_lifetime).

    import sched_lifetime as sl
    mgr = sl.LifetimeManager("mb0")
"""

from ._ops import LIBRARY, STATS_FIELDS, ops
from .lifetime import ACTIONS, LifetimeManager, current_stream
from .schedule import schedule, validate
from .sim import compare, scenario, simulate

__all__ = [
    "ACTIONS",
    "LIBRARY",
    "LifetimeManager",
    "STATS_FIELDS",
    "compare",
    "current_stream",
    "ops",
    "scenario",
    "schedule",
    "simulate",
    "validate",
]
__version__ = "0.1.0"
