"""Plain, immutable data the scheduler reads and returns.

Nothing here touches I/O; times are aware UTC datetimes passed in by callers.
"""

from __future__ import annotations

import datetime as dt
import enum
from dataclasses import dataclass


class WaitReason(str, enum.Enum):
    """Why a request waits; codes modelled on Slurm's ``squeue`` reasons.

    - ``Resources``: it is next, but not enough devices are free.
    - ``Priority``: requests ahead of it in the queue go first.
    - ``PoolDrained``: not enough non-drained devices exist on any node.
    """

    resources = "Resources"
    priority = "Priority"
    pool_drained = "PoolDrained"


@dataclass(frozen=True)
class Slot:
    """An allocatable device.

    Attributes:
        uuid: NVML UUID of the device.
        node: node the device is on.
        index: NVML index on that node.
        drained: no new grants (running leases continue).
    """

    uuid: str
    node: str
    index: int
    drained: bool = False


@dataclass(frozen=True)
class Request:
    """A pending lease as the scheduler sees it.

    Attributes:
        lease_id: id of the pending lease.
        user: JupyterHub user name.
        gpus: number of whole devices, >= 1, all on one node.
        created: when it was made (aware UTC); the FIFO order.
    """

    lease_id: int
    user: str
    gpus: int
    created: dt.datetime


@dataclass(frozen=True)
class SchedulerState:
    """Everything one scheduling pass needs.

    Attributes:
        slots: every device of the inventory.
        busy: UUIDs of devices held by active leases.
        pending: pending requests, in any order (the policy sorts them).
    """

    slots: tuple[Slot, ...]
    busy: frozenset[str]
    pending: tuple[Request, ...]


@dataclass(frozen=True)
class Grant:
    """Decision: bind ``devices`` (UUIDs, in index order) to ``lease_id``."""

    lease_id: int
    devices: tuple[str, ...]


@dataclass(frozen=True)
class Wait:
    """Decision: ``lease_id`` keeps waiting.

    Attributes:
        lease_id: the pending lease.
        position: 1-based place in the queue after this pass's grants.
        reason: a :class:`WaitReason` code.
        message: one sentence for the user.
    """

    lease_id: int
    position: int
    reason: WaitReason
    message: str


@dataclass(frozen=True)
class Decisions:
    """The result of one pass: grants first, then every request left waiting."""

    grants: tuple[Grant, ...] = ()
    waits: tuple[Wait, ...] = ()
