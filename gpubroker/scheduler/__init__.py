"""The pure scheduling core.

``schedule(state, now) -> Decisions`` reads no clock, database or device: the
live broker and the trace simulator call the same code.
:mod:`~gpubroker.scheduler.policy` is the broker's policy;
:mod:`~gpubroker.scheduler.fifo` the FIFO baseline.
"""

from .apply import Applied, ApplyError, LeaseEvent, apply, release
from .fifo import schedule as fifo_schedule
from .policy import queue_order, schedule
from .types import (
    DEFAULT_CLASSES,
    INTERACTIVE_POOLS,
    Decisions,
    Eviction,
    Grant,
    Instance,
    Part,
    Policy,
    PoolMode,
    Preemption,
    PriorityClass,
    Quota,
    Request,
    Running,
    SchedulerState,
    Slot,
    SlotKind,
    Topology,
    UsageRecord,
    Wait,
    WaitReason,
    in_pool,
)

__all__ = [
    "DEFAULT_CLASSES",
    "INTERACTIVE_POOLS",
    "Applied",
    "ApplyError",
    "Decisions",
    "Eviction",
    "Grant",
    "Instance",
    "LeaseEvent",
    "Part",
    "Policy",
    "PoolMode",
    "Preemption",
    "PriorityClass",
    "Quota",
    "Request",
    "Running",
    "SchedulerState",
    "Slot",
    "SlotKind",
    "Topology",
    "UsageRecord",
    "Wait",
    "WaitReason",
    "apply",
    "fifo_schedule",
    "in_pool",
    "queue_order",
    "release",
    "schedule",
]
