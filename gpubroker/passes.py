"""The glue between the store and the pure scheduler: build its state from
rows, and write its decisions back, all inside the caller's transaction."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from sqlalchemy import inspect
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value

from . import scheduler
from .broker.world import World
from .pools import PoolSpec
from .scheduler import (
    Decisions,
    Instance,
    Part,
    Policy,
    PoolMode,
    SchedulerState,
    UsageRecord,
)
from .store.models import Allocation, Device, Lease, LeaseState
from .transitions import Recorder

#: the MIG instances present on each device: parent UUID -> instances
MigInventory = Mapping[str, Sequence[Instance]]


def _part(allocation: Allocation) -> Part:
    return Part(
        device=allocation.device_uuid,
        kind=allocation.kind,
        weight=allocation.weight,
        profile=allocation.profile or "",
        start=allocation.placement_start or 0,
        size=allocation.placement_size or 0,
        memory_mib=allocation.memory_mib or 0,
        instance=allocation.instance_uuid or "",
    )


def _cached(cache: dict[int, tuple[Any, Any]], lease: Lease, key: Any, build: Any) -> Any:
    """``build(lease)``, reused while ``key`` (what it depends on that can
    change) stays the same."""
    hit = cache.get(lease.id)
    if hit is not None and hit[0] == key:
        return hit[1]
    value = build(lease)
    cache[lease.id] = (key, value)
    return value


def _running(lease: Lease) -> scheduler.Running:
    assert lease.granted_at is not None
    active = [a for a in lease.allocations if a.active]
    return scheduler.Running(
        lease_id=lease.id,
        user=lease.user,
        devices=tuple(a.device_uuid for a in active if a.kind == "device"),
        started=lease.granted_at,
        group=lease.group_name,
        priority_class=lease.priority_class,
        ends=lease.ends_at,
        preempt_deadline=lease.preempt_deadline,
        parts=tuple(_part(a) for a in active if a.kind != "device"),
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
        kind=lease.kind,
        mig_profile=lease.mig_profile or "",
        memory_mib=lease.memory_mib or 0,
        pool=lease.pool,
        weight=lease.weight,
        prefer=tuple(lease.prefer_devices or ()),
    )


def _slot(
    device: Device, spec: PoolSpec | None, instances: Sequence[Instance], held: set[str]
) -> scheduler.Slot:
    """A device as the scheduler sees it. A ``mig`` device whose MIG mode is
    off, a device of another pool whose MIG mode is on (never granted whole
    or shared, whatever the pools say), or one whose mode change an admin
    asked for, takes no new grants."""
    mode = spec.mode if spec else PoolMode.exclusive.value
    drained = device.drained or device.mig_target is not None
    if mode != PoolMode.mig.value and device.mig_enabled:
        drained = True
    mig_static = spec is not None and mode == PoolMode.mig.value and spec.mig_layout == "static"
    static: tuple[Instance, ...] = ()
    foreign: tuple[Instance, ...] = ()
    if mode == PoolMode.mig.value:
        drained = drained or not device.mig_enabled
        if mig_static:
            static = tuple(instances)
        else:
            foreign = tuple(i for i in instances if i.uuid not in held)
    return scheduler.Slot(
        device.uuid,
        device.node,
        device.index,
        drained,
        pool=spec.name if spec else "default",
        mode=mode,
        model=device.name,
        memory_mib=device.memory_total_mib,
        reserve_mib=spec.reserve_mib if spec else 0,
        static=static,
        foreign=foreign,
        mig_static=mig_static,
    )


def build_state(
    world: World,
    policy: Policy,
    topology: Mapping[str, scheduler.Topology],
    pools: Mapping[str, PoolSpec] | None = None,
    mig_instances: MigInventory | None = None,
    sharing_strategy: str = "least-fragmentation",
    skip: Collection[int] = (),
) -> tuple[SchedulerState, dict[int, Lease]]:
    """The scheduler's view of the broker's memory (no database read), and
    the active leases by id.

    Args:
        world: the broker's in-memory state.
        pools: the pool of each device by UUID (default: all exclusive).
        mig_instances: MIG instances present per device (from the backend),
            and those being made (they occupy their slices).
        skip: pending leases the scheduler is not to see (their grant is
            being made off the event loop).
    """
    devices = world.present_devices()
    active = world.active()
    held = {
        a.instance_uuid
        for x in active
        for a in x.allocations
        if a.active and a.instance_uuid is not None
    }
    pools = pools or {}
    mig_instances = mig_instances or {}
    # a lease's scheduler value changes only with these (the rest is fixed
    # at creation or grant): reuse the values of the previous pass
    cache, world.scheduled = world.scheduled, {}
    running, pending = [], []
    for x in active:
        if x.id in skip:
            continue
        if x.state == LeaseState.granted.value:
            running.append(_cached(cache, x, ("granted", x.version), _running))
        else:
            key = ("pending", x.priority_class, tuple(x.earmarked or ()))
            pending.append(_cached(cache, x, key, _request))
        world.scheduled[x.id] = cache[x.id]
    state = SchedulerState(
        slots=tuple(
            _slot(d, pools.get(d.uuid), mig_instances.get(d.uuid, ()), held) for d in devices
        ),
        running=tuple(running),
        pending=tuple(pending),
        policy=policy,
        usage={u.user: UsageRecord(u.gpu_seconds, u.as_of) for u in world.usage.values()},
        topology=topology,
        sharing_strategy=sharing_strategy,
    )
    return state, {x.id: x for x in active}


def _bump(lease: Lease) -> None:
    lease.version += 1


#: the wait reason of a grant whose MIG instances are being made
PREPARING = "Preparing"

#: makes a grant's fractional parts real (creates MIG instances); returns
#: the parts with their instance UUIDs; ``None`` when they are being made
#: off the event loop (it set the wait: reason :data:`PREPARING`) or a
#: failed try's backoff is not over (the failure stays the wait); or raises
#: with a message for the user
Realize = Callable[[Lease, tuple[Part, ...]], tuple[Part, ...] | None]


def apply_decisions(
    session: Session,
    decisions: Decisions,
    leases: Mapping[int, Lease],
    now: dt.datetime,
    evict: Callable[[Lease, str], bool],
    realize: Realize | None = None,
    rec: Recorder | None = None,
) -> list[Lease]:
    """Write ``decisions`` to the rows; return the leases ended by eviction.

    ``evict(lease, reason)`` ends a lease or starts ending it (stopping its
    server first); it returns whether the lease is released now.
    ``realize(lease, parts)`` creates what a fractional grant needs; when it
    raises ``RuntimeError`` the lease stays pending with the error as its
    reason's message (the next pass tries again).

    ``rec`` logs each grant, each change of wait reason and each preemption
    notice as an event (:mod:`gpubroker.transitions`); without it (the
    simulator's own use) nothing is logged.
    """
    rec = rec or _Silent()
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
        rec.note(lease, "preemption-withdrawn", "no longer needed for another request")
    for grant in decisions.grants:
        lease = leases[grant.lease_id]
        if grant.parts:
            try:
                made = realize(lease, grant.parts) if realize else grant.parts
            except RuntimeError as err:
                # nothing is left half-made (realize undoes what it made); the
                # request waits on, and the next pass tries again
                rec.note(lease, "grant-failed", str(err), {"parts": len(grant.parts)})
                failed = scheduler.Wait(
                    lease.id, 1, scheduler.WaitReason.resources, f"waiting: {err}"
                )
                _wait(lease, failed, rec)
                continue
            if made is None:  # made off the event loop (granted when done), or backing off
                if lease.queue_reason == PREPARING:
                    rec.note(
                        lease, "preparing", lease.queue_message or "", {"parts": len(grant.parts)}
                    )
                continue
            grant_parts(session, lease, made, now, rec)
            continue
        _grant(session, lease, grant.devices, now, rec)
    for preemption in decisions.preemptions:
        victim = leases[preemption.lease_id]
        victim.preempted_for = preemption.for_lease
        victim.preempt_deadline = preemption.deadline
        victim.preempt_reason = preemption.reason
        _bump(victim)
        detail = {"for_lease": preemption.for_lease, "deadline": preemption.deadline.isoformat()}
        rec.note(victim, "preempting", preemption.reason, detail)
    for wait in decisions.waits:
        _wait(leases[wait.lease_id], wait, rec)
    for lease in leases.values():
        if lease.state == LeaseState.granted.value:
            # only whole devices are ever reclaimed (fractional leases are not victims)
            flag = lease.id in decisions.reclaimable and lease.kind == "gpus"
            if lease.reclaimable != flag:
                lease.reclaimable = flag
                _bump(lease)
    return evicted


def _grant(
    session: Session, lease: Lease, uuids: tuple[str, ...], now: dt.datetime, rec: Any
) -> None:
    lease.granted_at = now
    if lease.time_limit is not None:
        lease.ends_at = now + dt.timedelta(seconds=lease.time_limit)
    lease.queue_position = lease.queue_reason = lease.queue_message = None
    lease.queue_eta = None
    lease.earmarked = None
    for uuid in uuids:
        device = session.get(Device, uuid)  # in memory: no query
        session.add(
            Allocation(
                lease=lease, device_uuid=uuid, device=device, active=True, kind="device", weight=1.0
            )
        )
    slots = [a.instance_uuid or a.device_uuid for a in lease.allocations if a.active]
    rec.transition(lease, LeaseState.granted.value, "granted", {"slots": slots})


def grant_parts(
    session: Session, lease: Lease, parts: tuple[Part, ...], now: dt.datetime, rec: Any
) -> None:
    """Grant ``lease`` its fractional ``parts`` (MIG instances made, shares):
    one allocation each, the lease's weight their sum, then the ``granted``
    transition (``rec``) at ``now``."""
    for part in parts:
        session.add(
            Allocation(
                lease=lease,
                device_uuid=part.device,
                device=session.get(Device, part.device),
                active=True,
                kind=part.kind,
                instance_uuid=part.instance or None,
                profile=part.profile or None,
                placement_start=part.start if part.kind == "mig" else None,
                placement_size=part.size if part.kind == "mig" else None,
                memory_mib=part.memory_mib,
                weight=part.weight,
            )
        )
    lease.weight = sum(part.weight for part in parts)
    _grant(session, lease, (), now, rec)


def _wait(lease: Lease, wait: scheduler.Wait, rec: Any) -> None:
    verdict = (wait.position, wait.reason.value, wait.message, wait.eta, list(wait.earmarked))
    current = (
        lease.queue_position,
        lease.queue_reason,
        lease.queue_message,
        lease.queue_eta,
        list(lease.earmarked or ()),
    )
    if current != verdict:
        if lease.queue_reason != wait.reason.value:  # the story: why it waits now
            rec.note(lease, "waiting", wait.message, {"reason": wait.reason.value})
        set_wait(
            lease,
            wait.reason.value,
            wait.message,
            wait.position,
            wait.eta,
            list(wait.earmarked) or None,
        )


def set_wait(
    lease: Lease,
    reason: str,
    message: str,
    position: int | None = 1,
    eta: dt.datetime | None = None,
    earmarked: list[str] | None = None,
) -> None:
    """Set why ``lease`` waits and bump its version, in memory only: served
    from there, never written (a pass writes nothing for the requests that
    only wait); the first pass after a restart computes it again.

    Args:
        reason: the reason code (``WaitReason`` values, or ``Preparing``).
        message: the sentence for the user.
        position: place in the queue, from 1.
        eta: estimated start, aware UTC.
        earmarked: devices held back for it (a reservation).
    """
    changes = inspect(lease).attrs
    for name, value in (
        ("queue_position", position),
        ("queue_reason", reason),
        ("queue_message", message),
        ("queue_eta", eta),
        ("earmarked", earmarked),
        ("version", lease.version + 1),
    ):
        if changes[name].history.has_changes():  # a change of this command: keep it one
            setattr(lease, name, value)
        else:
            set_committed_value(lease, name, value)


class _Silent:
    """A recorder that only changes states (no log), for callers without one."""

    def transition(self, lease: Lease, to_state: str, reason: str, detail: Any = None) -> None:
        lease.state = to_state
        lease.version += 1

    def note(self, lease: Lease, kind: str, reason: str, detail: Any = None) -> None:
        """Nothing to log."""
