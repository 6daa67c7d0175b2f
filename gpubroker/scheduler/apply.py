"""Apply one pass's :class:`~gpubroker.scheduler.Decisions` to the state, purely.

``apply(state, decisions, now) -> Applied`` is what the live broker's
:func:`gpubroker.passes.apply_decisions` does to its rows, done to a
:class:`~gpubroker.scheduler.SchedulerState` instead, so that the trace
simulator and the broker follow the same rules. In the order
``apply_decisions`` follows:

1. evictions: the lease leaves ``running`` (``granted`` -> ``released``);
   its GPU-seconds, decayed, are charged to its user's usage record (as
   :func:`gpubroker.usage.record_usage` does at a release);
2. withdrawn preemptions: the lease's ``preempt_deadline`` and ``preempted_for`` are cleared;
3. grants: the request leaves ``pending`` and becomes a
   :class:`~gpubroker.scheduler.Running` lease (``pending`` -> ``granted``)
   holding the granted whole devices, or the granted ``parts`` (MIG
   instances, shares; its weight is then the parts' weights summed), with
   ``started`` = now and ``ends`` = now + its time limit;
4. preemptions: the victim's ``preempt_deadline`` and ``preempted_for`` are set (a ``preempting``
   note); it keeps running until an eviction ends it;
5. waits: each waiting request takes the wait's earmarked devices (the
   devices being reclaimed for it); a ``waiting`` note is given when its
   reason changed (only when the previous reasons are passed in);
6. reclaimable: the granted whole-device leases among
   ``decisions.reclaimable`` (fractional leases are never reclaimed).

Each change is also returned as a :class:`LeaseEvent` in the vocabulary of
:mod:`gpubroker.model.lifecycle` (its transitions table and note kinds), so
that the broker can publish them as its events.

Pure: no clock (``now`` is an argument), no I/O; the input state is never
changed (every type is frozen; a new state is built). Times are aware UTC
datetimes, durations seconds, amounts device units.
"""

from __future__ import annotations

import datetime as dt
import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from ..model.lifecycle import GRANTED, PENDING, RELEASED, Event, transition_kind
from .fairshare import decay, running_usage
from .types import (
    Decisions,
    Part,
    Request,
    Running,
    SchedulerState,
    SlotKind,
    UsageRecord,
    Wait,
    WaitReason,
)

#: the actor of every event the scheduler's decisions cause
ACTOR = "scheduler"

#: ``detail["cause"]`` of a ``released`` event: its time limit ran out
CAUSE_TIME_LIMIT = "time-limit"
#: ``detail["cause"]`` of a ``released`` event: its preemption grace is over
CAUSE_PREEMPTED = "preempted"


class ApplyError(ValueError):
    """The decisions do not fit the state (a scheduler bug, never user input):
    a grant of a lease that is not pending or of a busy slot, an eviction
    or a preemption of a lease that is not running."""


@dataclass(frozen=True)
class LeaseEvent:
    """One change :func:`apply` made to a lease (lifecycle vocabulary).

    Attributes:
        lease_id: the lease.
        kind: ``granted`` or ``released`` (transitions, see
            :data:`gpubroker.model.lifecycle.TRANSITIONS`), or a note kind
            (:data:`gpubroker.model.lifecycle.NOTES`): ``preempting`` (a
            grace period started), ``preemption-withdrawn``, ``waiting``
            (the wait reason changed).
        from_state: state before (``pending`` or ``granted``); for a note,
            the state it happened in.
        to_state: state after; for a note, the same as ``from_state``.
        reason: why, in words: the eviction's reason, the preemption's
            reason, the wait's message; ``granted`` for a grant.
        at: the pass's time (aware UTC).
        detail: what else a reader needs (JSON-able values):

            - ``granted``: ``slots`` (device UUIDs, or for parts the MIG
              instance UUID when known, else the device UUID), ``kind``
              (``gpus``, ``mig`` or ``share``), ``weight`` (device units
              held), ``ends`` (ISO time, or ``None`` without a time limit);
            - ``released``: ``cause`` (:data:`CAUSE_TIME_LIMIT` or
              :data:`CAUSE_PREEMPTED`), ``slots``;
            - ``preempting``: ``for_lease``, ``deadline`` (ISO time),
              ``devices`` (those going to ``for_lease``);
            - ``waiting``: ``reason`` (the :class:`WaitReason` code),
              ``position``.
    """

    lease_id: int
    kind: str
    from_state: str
    to_state: str
    reason: str
    at: dt.datetime
    detail: Mapping[str, object] = field(default_factory=dict)

    @property
    def is_transition(self) -> bool:
        """Whether the lease changed state (``granted``, ``released``)."""
        return self.from_state != self.to_state

    def event(self, stimulus: str, actor: str = ACTOR) -> Event:
        """This change as a :class:`gpubroker.model.lifecycle.Event` of ``stimulus``."""
        return Event(
            self.lease_id,
            self.kind,
            self.from_state,
            self.to_state,
            self.reason,
            actor,
            stimulus,
            self.at,
            dict(self.detail),
        )


@dataclass(frozen=True)
class Applied:
    """The outcome of :func:`apply`.

    Attributes:
        before: the state the decisions were applied to (unchanged).
        events: every change, in the order made (see the module doc).
        granted: the new leases, in grant order.
        evicted: the leases ended by an eviction, as they were (with the
            ``preempt_deadline`` they had).
        marked: running leases whose ``preempt_deadline`` was set or
            cleared, as they are now.
        earmarked: pending requests whose ``earmarked`` devices changed, as
            they are now.
        usage: the usage records after the evictions' charges.
        waits: the decisions' waits (position, reason, message, ETA), kept
            as data for the caller to show.
        reclaimable: ids of granted whole-device leases (old and new) that
            are borrowed above guarantees.
    """

    before: SchedulerState
    events: tuple[LeaseEvent, ...]
    granted: tuple[Running, ...]
    evicted: tuple[Running, ...]
    marked: tuple[Running, ...]
    earmarked: tuple[Request, ...]
    usage: Mapping[str, UsageRecord]
    waits: tuple[Wait, ...]
    reclaimable: frozenset[int]

    @functools.cached_property
    def state(self) -> SchedulerState:
        """The next state: ``running`` less the evicted leases (marks
        updated) plus the granted ones, ``pending`` less the granted
        requests (earmarks updated), ``usage`` charged; the rest as before.
        Built on first use (a caller keeping its own indexes need not)."""
        gone = {lease.lease_id for lease in self.evicted}
        marks = {lease.lease_id: lease for lease in self.marked}
        running = tuple(
            marks.get(lease.lease_id, lease)
            for lease in self.before.running
            if lease.lease_id not in gone
        )
        taken = {lease.lease_id for lease in self.granted}
        marked_requests = {r.lease_id: r for r in self.earmarked}
        pending = tuple(
            marked_requests.get(r.lease_id, r)
            for r in self.before.pending
            if r.lease_id not in taken
        )
        return replace(
            self.before, running=running + self.granted, pending=pending, usage=self.usage
        )


def charge(
    usage: Mapping[str, UsageRecord], lease: Running, now: dt.datetime, half_life: float
) -> dict[str, UsageRecord]:
    """``usage`` with the decayed GPU-seconds of ``lease``, held from its
    start until ``now``, added to its user's record (as of ``now``);
    ``half_life`` in seconds. The input mapping is not changed."""
    old = usage.get(lease.user)
    past = (
        0.0 if old is None else decay(old.gpu_seconds, (now - old.as_of).total_seconds(), half_life)
    )
    start = lease.held_since or lease.started
    total = past + running_usage(lease.gpus, start, now, half_life)
    before = lease.held_before
    if before is not None:  # held before a broker restart (the ledger's figure)
        total += decay(before.gpu_seconds, (now - before.as_of).total_seconds(), half_life)
    return {**usage, lease.user: UsageRecord(total, now)}


def release(state: SchedulerState, lease_id: int, now: dt.datetime) -> SchedulerState:
    """``state`` after running lease ``lease_id`` ended by itself at ``now``
    (completed, released, culled): it leaves ``running`` and its usage is
    charged. Not a scheduler decision, so no event: the caller logs its own.

    Raises:
        ApplyError: the lease is not running.
    """
    for lease in state.running:
        if lease.lease_id == lease_id:
            break
    else:
        raise ApplyError(f"released lease {lease_id} is not running")
    return replace(
        state,
        running=tuple(x for x in state.running if x.lease_id != lease_id),
        usage=charge(state.usage, lease, now, state.policy.half_life),
    )


def _slots(lease: Running) -> list[str]:
    return [*lease.devices, *(p.instance or p.device for p in lease.parts)]


def _eviction_reason(lease: Running, reason: str) -> tuple[str, str]:
    """(cause, reason in words), as ``apply_decisions`` words them."""
    if reason.startswith("time limit"):
        if lease.ends is not None:
            limit = (lease.ends - lease.started).total_seconds()
            reason = f"time limit of {limit:g} s reached"
        return CAUSE_TIME_LIMIT, reason
    return CAUSE_PREEMPTED, reason


class _Holdings:
    """What the running leases hold, to check each grant against."""

    def __init__(self, state: SchedulerState, running: Iterable[Running]) -> None:
        leases = list(running)
        self.slots = {s.uuid: s for s in state.slots}
        self.whole: set[str] = {uuid for lease in leases for uuid in lease.devices}
        self.parted: set[str] = set()
        self.mig: dict[str, list[tuple[int, int]]] = {}
        self.shared_mib: dict[str, int] = {}
        for lease in leases:
            if lease.parts:
                self.take((), lease.parts)

    def take(self, devices: tuple[str, ...], parts: tuple[Part, ...]) -> None:
        self.whole.update(devices)
        for part in parts:
            self.parted.add(part.device)
            if part.kind == SlotKind.mig.value:
                self.mig.setdefault(part.device, []).append((part.start, part.start + part.size))
            else:
                self.shared_mib[part.device] = self.shared_mib.get(part.device, 0) + part.memory_mib

    def check(self, lease_id: int, devices: tuple[str, ...], parts: tuple[Part, ...]) -> None:
        """Check one grant's slots against what is held, the grant's own
        earlier slots included (a grant naming one device twice, or whose
        shares together overfill a device's memory, is refused as one that
        collides with another lease's slot would be). Changes nothing: the
        caller :meth:`take` s the grant once it passes.

        Args:
            lease_id: the granted lease (for the message).
            devices: the whole devices granted (UUIDs).
            parts: the MIG instances or shares granted.

        Raises:
            ApplyError: a slot is unknown, already held (by a running lease
                or by an earlier slot of this grant), a MIG placement
                overlaps one in use, or shares would hold more MiB than the
                device's memory less its reserve.
        """
        mine: set[str] = set()
        for uuid in devices:
            if uuid not in self.slots or uuid in self.whole or uuid in self.parted or uuid in mine:
                raise ApplyError(f"grant of lease {lease_id}: device {uuid} is unknown or busy")
            mine.add(uuid)
        mig: dict[str, list[tuple[int, int]]] = {}
        shared_mib: dict[str, int] = {}
        for part in parts:
            slot = self.slots.get(part.device)
            if slot is None or part.device in self.whole or part.device in mine:
                raise ApplyError(
                    f"grant of lease {lease_id}: device {part.device} is unknown or held whole"
                )
            if part.kind == SlotKind.mig.value:
                end = part.start + part.size
                used_slices = (*self.mig.get(part.device, ()), *mig.get(part.device, ()))
                for start, stop in used_slices:
                    if part.start < stop and start < end:
                        raise ApplyError(
                            f"grant of lease {lease_id}: MIG slices {part.start}-{end} of "
                            f"{part.device} overlap an instance in use"
                        )
                mig.setdefault(part.device, []).append((part.start, end))
            else:
                held = self.shared_mib.get(part.device, 0) + shared_mib.get(part.device, 0)
                used = held + part.memory_mib
                shared_mib[part.device] = shared_mib.get(part.device, 0) + part.memory_mib
                if slot.memory_mib and used > slot.memory_mib - slot.reserve_mib:
                    raise ApplyError(
                        f"grant of lease {lease_id}: shares of {part.device} would hold "
                        f"{used} MiB, more than its {slot.memory_mib - slot.reserve_mib}"
                    )


def _granted(
    request: Request, devices: tuple[str, ...], parts: tuple[Part, ...], now: dt.datetime
) -> Running:
    ends = None if request.time_limit is None else now + dt.timedelta(seconds=request.time_limit)
    return Running(
        lease_id=request.lease_id,
        user=request.user,
        devices=devices,
        started=now,
        group=request.group,
        priority_class=request.priority_class,
        ends=ends,
        parts=parts,
    )


def apply(
    state: SchedulerState,
    decisions: Decisions,
    now: dt.datetime,
    reasons: Mapping[int, WaitReason | None] | None = None,
) -> Applied:
    """Apply ``decisions`` (of a pass over ``state`` at ``now``) to ``state``.

    Args:
        state: the state the pass saw. Pending requests the decisions do
            not grant or re-earmark are kept as they are, so it may hold more
            (a pass over part of the queue) or fewer (only those the
            decisions name; :attr:`Applied.state` then lacks the others too).
        decisions: the pass's outcome. A grant with ``parts`` (MIG
            instances, shares) gives those parts; the broker passes the
            parts it made real (with their instance UUIDs).
        now: the pass's time (aware UTC).
        reasons: the wait reason each pending lease had before (the
            broker's ``queue_reason``; ``None`` or absent: none), to give a
            ``waiting`` note where it changed; ``None`` (the default): no
            ``waiting`` notes at all (the simulator's use: they cost a note
            per waiting request per pass).

    Returns:
        :class:`Applied`: the changes, the events and (lazily) the next state.

    Raises:
        ApplyError: a decision names a lease in the wrong state or a busy slot.
    """
    events: list[LeaseEvent] = []
    detail: dict[str, object]
    changes = decisions.evictions or decisions.withdrawn or decisions.preemptions
    running = {lease.lease_id: lease for lease in state.running} if changes else {}
    usage: Mapping[str, UsageRecord] = state.usage
    evicted: list[Running] = []
    for eviction in decisions.evictions:
        lease = running.pop(eviction.lease_id, None)
        if lease is None:
            raise ApplyError(f"evicted lease {eviction.lease_id} is not running")
        cause, why = _eviction_reason(lease, eviction.reason)
        usage = charge(usage, lease, now, state.policy.half_life)
        evicted.append(lease)
        kind = transition_kind(GRANTED, RELEASED)
        detail = {"cause": cause, "slots": _slots(lease)}
        events.append(LeaseEvent(lease.lease_id, kind, GRANTED, RELEASED, why, now, detail))
    marked: dict[int, Running] = {}
    for lease_id in decisions.withdrawn:
        lease = running.get(lease_id)
        if lease is None:
            raise ApplyError(f"withdrawn preemption of lease {lease_id}, which is not running")
        if lease.preempt_deadline is not None:
            lease = marked[lease_id] = running[lease_id] = replace(
                lease, preempt_deadline=None, preempted_for=None
            )
        why = "no longer needed for another request"
        events.append(LeaseEvent(lease_id, "preemption-withdrawn", GRANTED, GRANTED, why, now))
    granted: list[Running] = []
    if decisions.grants:
        pending = {r.lease_id: r for r in state.pending}
        holdings = _Holdings(state, running.values() if changes else state.running)
        for grant in decisions.grants:
            request = pending.pop(grant.lease_id, None)
            if request is None:
                raise ApplyError(f"granted lease {grant.lease_id} is not pending")
            _check_size(request, grant.devices, grant.parts)
            holdings.check(grant.lease_id, grant.devices, grant.parts)
            holdings.take(grant.devices, grant.parts)
            lease = _granted(request, grant.devices, grant.parts, now)
            granted.append(lease)
            detail = {
                "slots": _slots(lease),
                "kind": request.kind,
                "weight": lease.gpus,
                "ends": None if lease.ends is None else lease.ends.isoformat(),
            }
            kind = transition_kind(PENDING, GRANTED)
            events.append(
                LeaseEvent(lease.lease_id, kind, PENDING, GRANTED, "granted", now, detail)
            )
    for preemption in decisions.preemptions:
        victim = running.get(preemption.lease_id)
        if victim is None:
            raise ApplyError(f"preempted lease {preemption.lease_id} is not running")
        victim = marked[victim.lease_id] = running[victim.lease_id] = replace(
            victim, preempt_deadline=preemption.deadline, preempted_for=preemption.for_lease
        )
        detail = {
            "for_lease": preemption.for_lease,
            "deadline": preemption.deadline.isoformat(),
            "devices": list(preemption.devices),
        }
        events.append(
            LeaseEvent(
                victim.lease_id, "preempting", GRANTED, GRANTED, preemption.reason, now, detail
            )
        )
    earmarked = _earmark(state, decisions)
    if reasons is not None:
        for wait in decisions.waits:
            if reasons.get(wait.lease_id) != wait.reason:
                detail = {"reason": wait.reason.value, "position": wait.position}
                events.append(
                    LeaseEvent(
                        wait.lease_id, "waiting", PENDING, PENDING, wait.message, now, detail
                    )
                )
    reclaimable: frozenset[int] = frozenset()
    if decisions.reclaimable:
        kept = running.values() if changes else state.running
        whole = {lease.lease_id for lease in (*kept, *granted) if not lease.parts}
        reclaimable = decisions.reclaimable & whole
    return Applied(
        before=state,
        events=tuple(events),
        granted=tuple(granted),
        evicted=tuple(evicted),
        marked=tuple(marked.values()),
        earmarked=earmarked,
        usage=usage,
        waits=decisions.waits,
        reclaimable=reclaimable,
    )


def _check_size(request: Request, devices: tuple[str, ...], parts: tuple[Part, ...]) -> None:
    """A grant gives what was asked: ``gpus`` whole devices, one MIG
    instance, or ``gpus`` shares."""
    if request.kind == SlotKind.gpus.value:
        ok = len(devices) == request.gpus and not parts
    elif request.kind == SlotKind.mig.value:
        ok = not devices and len(parts) == 1 and parts[0].kind == SlotKind.mig.value
    else:
        ok = (
            not devices
            and len(parts) == request.gpus
            and all(p.kind == SlotKind.share.value for p in parts)
        )
    if not ok:
        raise ApplyError(
            f"grant of lease {request.lease_id} ({request.kind}, {request.gpus}): "
            f"devices {devices}, parts {parts} are not what it asked for"
        )


def _earmark(state: SchedulerState, decisions: Decisions) -> tuple[Request, ...]:
    """Pending requests whose earmarked devices the waits change, changed."""
    if not decisions.preemptions and not any(r.earmarked for r in state.pending):
        return ()  # no wait can name or drop an earmark
    pending = {r.lease_id: r for r in state.pending}
    out = []
    for wait in decisions.waits:
        request = pending.get(wait.lease_id)
        if request is not None and request.earmarked != wait.earmarked:
            out.append(replace(request, earmarked=wait.earmarked))
    return tuple(out)
