"""Activation paging to pinned host memory: one module a noun, every name re-exported here.

    plan       Rust's plan: the budget, the measured timing it is made with, its explanation
    paged      which saved tensors can be paged, and what a page-out keeps of one (`Paged`)
    groups     how a node's saved tensors share one host buffer (`group_plan`)
    slots      host buffers allocated once and their FIFO freelist (`HostSlots`)
    slot_order the freelist's rule across the page streams: a buffer's copies in order (`SlotOrder`)
    streams    the page streams, reached cheaply: switches, waits, copy-done events
    release    when a page-out's device storage is released (`Releases`)
    pool       the pinned host pool: the page copies themselves (`HostPool`)
    calibrate  what the calibration steps record (`Calibration`)
    pager      the eager pager through `saved_tensors_hooks` (`Pager`)

Each imports only from those above it. Import from `sched_lifetime.paging`, not from the
modules: the split is this package's business.
"""

from .calibrate import Calibration, forget_measurements
from .groups import GROUP_ALIGN, GroupPlan, _contiguous, _dense, _extent, group_plan
from .paged import Paged, _check_restorable, is_weight, restorable
from .pager import Pager
from .plan import Budget, LinkRates, _budget_text, explain_plan, link_rates, page_plan
from .pool import HostPool, wait_us
from .release import Releases
from .slot_order import SlotOrder
from .slots import HostSlots
from .streams import PageStreams

__all__ = [
    "Budget",
    "Calibration",
    "GROUP_ALIGN",
    "GroupPlan",
    "HostPool",
    "HostSlots",
    "LinkRates",
    "PageStreams",
    "Paged",
    "Pager",
    "Releases",
    "SlotOrder",
    "explain_plan",
    "forget_measurements",
    "group_plan",
    "is_weight",
    "link_rates",
    "page_plan",
    "restorable",
    "wait_us",
]
