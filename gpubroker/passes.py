"""The glue between the store and the pure scheduler: build its state from
rows, and write its decisions back, all inside the caller's transaction."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import replace
from typing import Any

from . import scheduler
from .broker import world
from .broker.inputs import SchedulerInputs
from .broker.world import World
from .pools import PoolSpec
from .scheduler import (
    Decisions,
    Grant,
    Instance,
    Part,
    Policy,
    PoolMode,
    SchedulerState,
)
from .scheduler.apply import apply
from .store.models import Allocation, Device, Lease, LeaseState
from .store.repository import Repository, set_in_memory
from .transitions import Recorder

#: the MIG instances present on each device: parent UUID -> instances
MigInventory = Mapping[str, Sequence[Instance]]


def _slot(
    device: Device,
    spec: PoolSpec | None,
    instances: Sequence[Instance],
    held: Collection[str],
    outside: bool = False,
) -> scheduler.Slot:
    """A device as the scheduler sees it. A ``mig`` device whose MIG mode is
    off, a device of another pool whose MIG mode is on (never granted whole
    or shared, whatever the pools say), one whose mode change an admin
    asked for, or one its engine takes no new work on (``outside``: a node
    drained in Slurm, a Slurm job from outside the broker), takes no new
    grants."""
    mode = spec.mode if spec else PoolMode.exclusive.value
    drained = device.drained or device.mig_target is not None or outside
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
        batch=spec is not None and spec.purpose == "batch",
    )


def build_state(
    world: World,
    policy: Policy,
    topology: Mapping[str, scheduler.Topology],
    pools: Mapping[str, PoolSpec] | None = None,
    mig_instances: MigInventory | None = None,
    sharing_strategy: str = "least-fragmentation",
    skip: Collection[int] = (),
    share_placement: str = "packing",
    share_sizes: tuple[int, ...] = (),
) -> tuple[SchedulerState, Mapping[int, Lease]]:
    """The scheduler's view of the broker's memory (no database read), and
    the active leases by id. The leases' values are kept between passes
    and built again only for the leases that changed
    (:class:`~gpubroker.broker.inputs.SchedulerInputs`).

    Args:
        world: the broker's in-memory state.
        pools: the pool of each device by UUID (default: all exclusive).
        mig_instances: MIG instances present per device (from the backend),
            and those being made (they occupy their slices).
        skip: pending leases the scheduler is not to see (their grant is
            being made off the event loop).
        share_placement, share_sizes: where shares go and the sizes (MiB)
            always counted in the share mix (``SchedulerState``).
    """
    devices = world.present_devices()
    inputs = world.refresh_inputs()
    held = inputs.held_instances()
    pools = pools or {}
    mig_instances = mig_instances or {}
    state = SchedulerState(
        slots=tuple(
            _slot(
                d, pools.get(d.uuid), mig_instances.get(d.uuid, ()), held, d.uuid in world.outside
            )
            for d in devices
        ),
        running=inputs.running_values(skip),
        pending=inputs.pending_values(skip),
        policy=policy,
        usage=dict(world.usage),
        topology=topology,
        sharing_strategy=sharing_strategy,
        share_placement=share_placement,
        share_sizes=share_sizes,
    )
    return state, world.leases


def _bump(lease: Lease) -> None:
    lease.version += 1


#: the wait reason of a grant whose MIG instances are being made
PREPARING = "Preparing"

#: the wait reason of a request no pass has covered yet (passes are
#: coalesced: the next one, a few ms later, gives its place and reason);
#: set on the new lease, so it is also the value its first INSERT stores
#: (defined beside the world, which also gives it after a rollback)
QUEUED, QUEUED_MESSAGE = world.QUEUED, world.QUEUED_MESSAGE

#: makes a grant's fractional parts real (creates MIG instances); returns
#: the parts with their instance UUIDs; ``None`` when they are being made
#: off the event loop (it set the wait: reason :data:`PREPARING`) or a
#: failed try's backoff is not over (the failure stays the wait); or raises
#: with a message for the user
Realize = Callable[[Lease, tuple[Part, ...]], tuple[Part, ...] | None]


def apply_decisions(
    repo: Repository,
    decisions: Decisions,
    leases: Mapping[int, Lease],
    now: dt.datetime,
    evict: Callable[[Lease, str], bool],
    realize: Realize | None = None,
    rec: Recorder | None = None,
    inputs: SchedulerInputs | None = None,
    state: SchedulerState | None = None,
) -> list[Lease]:
    """Write ``decisions`` to the rows; return the leases ended by eviction.

    ``state``: the state the decisions were made from. With it (the
    broker's use), the decisions are first applied to it with the pure
    :func:`gpubroker.scheduler.apply`, the code the trace simulator and the
    packing experiment apply theirs with: a decision that does not fit the
    state (a grant of a busy slot or of more than was asked, an eviction of
    a lease that is not running) raises :class:`~gpubroker.scheduler.apply.ApplyError`
    before any row changes. The rows then get the grants as it applied them
    (their slots), its waits and the reclaimable set it kept (granted
    whole-device leases only); evictions, withdrawals and preemptions, which
    it checked, are written as decided (reasons worded from the rows).

    ``inputs``: the scheduler values the decisions were made from (the
    broker's); with them, a wait equal to the one the lease holds is passed
    over without reading the row, and only granted leases are looked at
    for the reclaimable flag.

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
    reclaimable: frozenset[int] | None = None
    if state is not None:
        applied = apply(state, decisions, now)
        # the slots apply() granted (the same leases, in the same order)
        grants = tuple(
            Grant(g.lease_id, lease.devices, lease.parts)
            for g, lease in zip(decisions.grants, applied.granted, strict=True)
        )
        decisions = replace(decisions, grants=grants, waits=applied.waits)
        reclaimable = applied.reclaimable
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
                _wait(lease, failed, rec, inputs)
                continue
            if made is None:  # made off the event loop (granted when done), or backing off
                if lease.queue_reason == PREPARING:
                    rec.note(
                        lease, "preparing", lease.queue_message or "", {"parts": len(grant.parts)}
                    )
                continue
            grant_parts(repo, lease, made, now, rec)
            continue
        _grant(repo, lease, grant.devices, now, rec)
    for preemption in decisions.preemptions:
        victim = leases[preemption.lease_id]
        victim.preempted_for = preemption.for_lease
        victim.preempt_deadline = preemption.deadline
        victim.preempt_reason = preemption.reason
        _bump(victim)
        detail = {"for_lease": preemption.for_lease, "deadline": preemption.deadline.isoformat()}
        rec.note(victim, "preempting", preemption.reason, detail)
    held = inputs.waits if inputs is not None else {}
    for wait in decisions.waits:
        if held.get(wait.lease_id) != wait:
            _wait(leases[wait.lease_id], wait, rec, inputs)
    # the leases granted before this pass and those it granted (both get
    # the flag: a lease borrowed above guarantees is reclaimable at once)
    granted = (
        [
            leases[i]
            for i in dict.fromkeys([*inputs.running, *(g.lease_id for g in decisions.grants)])
            if i in leases
        ]
        if inputs is not None
        else list(leases.values())
    )
    for lease in granted:
        if lease.state == LeaseState.granted.value:
            # only whole devices are ever reclaimed (fractional leases are not victims)
            if reclaimable is not None:
                flag = lease.id in reclaimable
            else:
                flag = lease.id in decisions.reclaimable and lease.kind == "gpus"
            if lease.reclaimable != flag:
                lease.reclaimable = flag
                _bump(lease)
    return evicted


def _grant(
    repo: Repository, lease: Lease, uuids: tuple[str, ...], now: dt.datetime, rec: Any
) -> None:
    lease.granted_at = now
    if lease.time_limit is not None:
        lease.ends_at = now + dt.timedelta(seconds=lease.time_limit)
    lease.queue_position = lease.queue_reason = lease.queue_message = None
    lease.queue_eta = None
    lease.earmarked = None
    for uuid in uuids:
        device = repo.device(uuid)  # in memory: no query
        repo.add(
            Allocation(
                lease=lease, device_uuid=uuid, device=device, active=True, kind="device", weight=1.0
            )
        )
    slots = [a.instance_uuid or a.device_uuid for a in lease.allocations if a.active]
    waited = round(max((now - lease.created).total_seconds(), 0.0), 3)
    detail = {"slots": slots, "waited_s": waited, "priority_class": lease.priority_class}
    rec.transition(lease, LeaseState.granted.value, "granted", detail)


def grant_parts(
    repo: Repository, lease: Lease, parts: tuple[Part, ...], now: dt.datetime, rec: Any
) -> None:
    """Grant ``lease`` its fractional ``parts`` (MIG instances made, shares):
    one allocation each, the lease's weight their sum, then the ``granted``
    transition (``rec``) at ``now``."""
    for part in parts:
        repo.add(
            Allocation(
                lease=lease,
                device_uuid=part.device,
                device=repo.device(part.device),
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
    _grant(repo, lease, (), now, rec)


def _wait(
    lease: Lease, wait: scheduler.Wait, rec: Any, inputs: SchedulerInputs | None = None
) -> None:
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
            inputs,
        )
    if inputs is not None:
        inputs.waits[lease.id] = wait


def set_wait(
    lease: Lease,
    reason: str,
    message: str,
    position: int | None = 1,
    eta: dt.datetime | None = None,
    earmarked: list[str] | None = None,
    inputs: SchedulerInputs | None = None,
) -> None:
    """Set why ``lease`` waits and bump its version, in memory only: served
    from there, never written (a pass writes nothing for the requests that
    only wait); the first pass after a restart computes it again. The
    earmark is the exception: it is an input of the next pass (the devices
    a preemption frees go to it), so a change of it is written, or a
    restart would load the earmark the request had at its INSERT and wait
    on devices no one frees for it any more. ``inputs``: the broker's
    scheduler values, told that the lease changed (its earmark is part of
    its request).

    Args:
        reason: the reason code (``WaitReason`` values, or ``Preparing``).
        message: the sentence for the user.
        position: place in the queue, from 1.
        eta: estimated start, aware UTC.
        earmarked: devices held back for it (a reservation).
    """
    if (earmarked or None) != (lease.earmarked or None):
        lease.earmarked = earmarked  # written (rare: a preemption began or moved)
    for name, value in (
        ("queue_position", position),
        ("queue_reason", reason),
        ("queue_message", message),
        ("queue_eta", eta),
        ("earmarked", earmarked),
        ("version", lease.version + 1),
    ):
        set_in_memory(lease, name, value)  # a change of this command stays one
    if inputs is not None:
        inputs.changed(lease.id)
        inputs.waits.pop(lease.id, None)


class _Silent:
    """A recorder that only changes states (no log), for callers without one."""

    def transition(self, lease: Lease, to_state: str, reason: str, detail: Any = None) -> None:
        lease.state = to_state
        lease.version += 1

    def note(self, lease: Lease, kind: str, reason: str, detail: Any = None) -> None:
        """Nothing to log."""
