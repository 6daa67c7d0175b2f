"""The pure scheduling core.

``schedule(state, now) -> Decisions`` reads no clock, database or device: the
live broker and (later) the trace simulator call the same code. See
:mod:`gpubroker.scheduler.types` for the data it works on and
:mod:`gpubroker.scheduler.fifo` for the first policy.
"""

from .fifo import schedule
from .types import Decisions, Grant, Request, SchedulerState, Slot, Wait, WaitReason

__all__ = [
    "Decisions",
    "Grant",
    "Request",
    "SchedulerState",
    "Slot",
    "Wait",
    "WaitReason",
    "schedule",
]
