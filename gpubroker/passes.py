"""The glue between the store and the pure scheduler: build its state from
rows, and write its decisions back, all inside the caller's transaction."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Mapping

from sqlalchemy import select
from sqlalchemy.orm import Session

from . import scheduler
from .scheduler import Decisions, Policy, SchedulerState
from .store.models import Allocation, Device, Lease, LeaseState
from .usage import usage_records


def _running(lease: Lease) -> scheduler.Running:
    assert lease.granted_at is not None
    return scheduler.Running(
        lease_id=lease.id,
        user=lease.user,
        devices=tuple(a.device_uuid for a in lease.allocations if a.active),
        started=lease.granted_at,
        group=lease.group_name,
        priority_class=lease.priority_class,
        ends=lease.ends_at,
        preempt_deadline=lease.preempt_deadline,
    )


def _request(lease: Lease) -> scheduler.Request:
    return scheduler.Request(
        lease_id=lease.id,
        user=lease.user,
        gpus=lease.gpus,
        created=lease.created,
        group=lease.group_name,
        priority_class=lease.priority_class,
        time_limit=lease.time_limit,
        earmarked=tuple(lease.earmarked or ()),
    )


def build_state(
    session: Session,
    policy: Policy,
    topology: Mapping[str, scheduler.Topology],
) -> tuple[SchedulerState, dict[int, Lease]]:
    """The scheduler's view of the store, and the active leases by id."""
    devices = session.scalars(select(Device).where(Device.present))
    active = list(
        session.scalars(select(Lease).where(Lease.state.in_((LeaseState.pending.value, "granted"))))
    )
    state = SchedulerState(
        slots=tuple(scheduler.Slot(d.uuid, d.node, d.index, d.drained) for d in devices),
        running=tuple(_running(x) for x in active if x.state == LeaseState.granted.value),
        pending=tuple(_request(x) for x in active if x.state == LeaseState.pending.value),
        policy=policy,
        usage=usage_records(session),
        topology=topology,
    )
    return state, {x.id: x for x in active}


def _bump(lease: Lease) -> None:
    lease.version += 1


def apply_decisions(
    session: Session,
    decisions: Decisions,
    leases: Mapping[int, Lease],
    now: dt.datetime,
    evict: Callable[[Lease, str], bool],
) -> list[Lease]:
    """Write ``decisions`` to the rows; return the leases ended by eviction.

    ``evict(lease, reason)`` ends a lease or starts ending it (stopping its
    server first); it returns whether the lease is released now.
    """
    evicted = []
    for eviction in decisions.evictions:
        lease = leases[eviction.lease_id]
        reason = eviction.reason
        if lease.preempt_reason and reason.startswith("preempted"):
            reason = f"preempted: {lease.preempt_reason}"
        elif lease.time_limit is not None and reason.startswith("time limit"):
            reason = f"time limit of {lease.time_limit:g} s reached"
        if evict(lease, reason):
            evicted.append(lease)
    for lease_id in decisions.withdrawn:
        lease = leases[lease_id]
        lease.preempted_for = lease.preempt_deadline = lease.preempt_reason = None
        _bump(lease)
    for grant in decisions.grants:
        _grant(session, leases[grant.lease_id], grant.devices, now)
    for preemption in decisions.preemptions:
        victim = leases[preemption.lease_id]
        victim.preempted_for = preemption.for_lease
        victim.preempt_deadline = preemption.deadline
        victim.preempt_reason = preemption.reason
        _bump(victim)
    for wait in decisions.waits:
        _wait(leases[wait.lease_id], wait)
    for lease in leases.values():
        if lease.state == LeaseState.granted.value:
            flag = lease.id in decisions.reclaimable
            if lease.reclaimable != flag:
                lease.reclaimable = flag
                _bump(lease)
    return evicted


def _grant(session: Session, lease: Lease, uuids: tuple[str, ...], now: dt.datetime) -> None:
    lease.state = LeaseState.granted.value
    lease.granted_at = now
    if lease.time_limit is not None:
        lease.ends_at = now + dt.timedelta(seconds=lease.time_limit)
    lease.queue_position = lease.queue_reason = lease.queue_message = None
    lease.queue_eta = None
    lease.earmarked = None
    for uuid in uuids:
        session.add(Allocation(lease=lease, device_uuid=uuid, active=True))
    session.flush()
    _bump(lease)


def _wait(lease: Lease, wait: scheduler.Wait) -> None:
    verdict = (wait.position, wait.reason.value, wait.message, wait.eta, list(wait.earmarked))
    current = (
        lease.queue_position,
        lease.queue_reason,
        lease.queue_message,
        lease.queue_eta,
        list(lease.earmarked or ()),
    )
    if current != verdict:
        lease.queue_position, lease.queue_reason, lease.queue_message = verdict[:3]
        lease.queue_eta = wait.eta
        lease.earmarked = list(wait.earmarked) or None
        _bump(lease)
