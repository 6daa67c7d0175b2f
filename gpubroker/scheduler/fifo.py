"""The baseline: first in, first out, without backfill or preemption.

Requests are served strictly in arrival order: when the head of the queue does
not fit, everything behind it waits too (Slurm's ``sched/builtin`` without
backfill). Used for comparison in benchmarks and the simulator; the broker
runs :mod:`gpubroker.scheduler.policy`.
"""

from __future__ import annotations

import datetime as dt

from .messages import wait_message
from .placement import NEVER, Pool
from .types import Decisions, Grant, SchedulerState, Wait, WaitReason


def schedule(state: SchedulerState, now: dt.datetime) -> Decisions:
    """One FIFO pass over ``state`` at ``now`` (aware UTC).

    Returns:
        :class:`Decisions` with a grant for every request served in order
        until the first that does not fit, and a :class:`Wait` for the rest.
    """
    busy = {uuid: NEVER for lease in state.running for uuid in lease.devices}
    pool = Pool.build(state.slots, busy, (), state.topology, now)
    grants: list[Grant] = []
    waits: list[Wait] = []
    for request in sorted(state.pending, key=lambda r: (r.created, r.lease_id)):
        devices = None if waits else pool.place(request.gpus, NEVER)
        if devices is not None:
            pool.take(devices, NEVER)
            grants.append(Grant(request.lease_id, devices))
            continue
        position = len(waits) + 1
        reason = WaitReason.priority if waits else WaitReason.resources
        if request.gpus > pool.largest_node():
            reason = WaitReason.pool_drained
        message = wait_message(reason, position, None, now)
        waits.append(Wait(request.lease_id, position, reason, message))
    return Decisions(tuple(grants), waits=tuple(waits))
