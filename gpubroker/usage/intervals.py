"""The usage ledger's rule, pure: lifecycle events in, interval changes out.

The ledger (:mod:`gpubroker.usage.ledger`) is a projection of the durable
transition log (``lease_events``): it folds the log's entries, in order,
into *intervals*:

* a **wait** interval (``slot_kind`` ``wait``, weight 0) from a request
  (``requested``) to its grant or its end in the queue;
* one **slot** interval per slot a lease holds (a whole device, a MIG
  instance, a share), from its grant to its release, with the slot's
  weight in device units.

A release closes the lease's open intervals with a *cause* read from the
release (:func:`release_cause`); a ``culled`` note records how long the
lease had been idle. :func:`fold` only says what changes; the caller writes
it in one transaction with the mark of the last entry folded, so every
entry is folded exactly once, even across a crash.

Times are UTC seconds since the epoch (floats). Nothing here reads a clock
or a database.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

#: the ``slot_kind`` of a wait in the queue
WAIT = "wait"

#: the causes a release records (its ``released`` event's)
RELEASE_CAUSES = ("release", "cancel", "cull", "preemption", "time-limit", "reconcile")

#: every end cause an interval can carry: a release's, or a wait ended by
#: its grant, an interval the broker's downtime ended, a slot left by a move
CAUSES = (*RELEASE_CAUSES, "granted", "broker-down", "rebound")

#: who decides a release of each cause the broker itself decides
CAUSE_ACTORS = {
    "cull": "culler",
    "preemption": "scheduler",
    "time-limit": "scheduler",
    "reconcile": "reconcile",
}

#: actors whose release reasons are the broker's own words
_SYSTEM = frozenset({"scheduler", "culler", "reconcile", "watchdog", "broker"})


@dataclass(frozen=True)
class Holder:
    """Who holds a lease, as the ledger records it.

    Attributes:
        lease_id: the lease.
        user: its user.
        group: the group it is charged to (``""``: none).
        holder_kind: ``server``, ``external`` (later ``job``).
        holder: the server name or job id (``""``: the default server).
        priority_class: its priority class.
        pool: its pool (``""``: the default placement).
        created_s: when it was requested, UTC epoch seconds.
    """

    lease_id: int
    user: str
    group: str
    holder_kind: str
    holder: str
    priority_class: str
    pool: str
    created_s: float


@dataclass(frozen=True)
class Slot:
    """One slot a lease was granted.

    Attributes:
        kind: ``device``, ``mig`` or ``share``.
        device_uuid: the physical device (``GPU-…``).
        slot_uuid: the MIG device (``MIG-…``), else ``""``.
        profile: the MIG profile (``1g.10gb``), else ``""``.
        model: the device's model name (``NVIDIA H100 80GB HBM3``).
        node: the device's node.
        weight: device units the slot counts for (1 for a whole device).
        pool: the pool of the device.
    """

    kind: str
    device_uuid: str
    slot_uuid: str
    profile: str
    model: str
    node: str
    weight: float
    pool: str = ""


@dataclass(frozen=True)
class LedgerEntry:
    """One entry of the transition log, as the ledger reads it.

    Attributes:
        id: its id in the log (increasing).
        lease_id: the lease.
        kind: the event kind (``requested``, ``granted``, ``released``, a note).
        from_state: the state before (``None`` for ``requested``).
        to_state: the state after.
        reason: the reason in words (the release reason).
        actor: who caused it.
        at_s: when, UTC epoch seconds.
        detail: the event's detail (``idle_seconds`` of a ``culled`` note).
    """

    id: int
    lease_id: int
    kind: str
    from_state: str | None
    to_state: str
    reason: str
    actor: str
    at_s: float
    detail: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Interval:
    """A new interval of the ledger (``end_s`` ``None``: still open)."""

    holder: Holder
    slot: Slot | None  # None: a wait
    start_s: float
    end_s: float | None = None
    end_cause: str = ""
    idle_s: float = 0.0

    @property
    def slot_kind(self) -> str:
        """``wait``, or the slot's kind."""
        return WAIT if self.slot is None else self.slot.kind


@dataclass(frozen=True)
class Close:
    """Close the open intervals of ``lease_id`` stored before this batch:
    its wait (``wait``) or its slots (not ``wait``), at ``end_s``."""

    lease_id: int
    wait: bool
    end_s: float
    cause: str


@dataclass(frozen=True)
class MarkIdle:
    """Record on the open slot intervals of ``lease_id`` stored before this
    batch that it had been idle ``idle_s`` seconds when it was culled."""

    lease_id: int
    idle_s: float


@dataclass
class Changes:
    """What one batch of entries changes: intervals to insert (complete or
    open), and closes and idle marks of intervals stored before the batch."""

    inserts: list[Interval] = field(default_factory=list)
    closes: list[Close] = field(default_factory=list)
    idle: list[MarkIdle] = field(default_factory=list)


def release_cause(reason: str, actor: str, from_state: str | None) -> str:
    """The cause of a release from its reason's first word, for the broker's
    own reasons (``culled: ...``, ``preempted: ...``, ``reclaimed ...``,
    ``time limit of ... reached``, ``reconcile: ...``) when ``actor`` is a
    system actor; anything else is a ``cancel`` (a pending lease) or a
    ``release``. Since migration 0010 every release records its cause in
    its event (:func:`event_cause`); this reads older events, and the
    scheduler's eviction reasons.
    """
    if actor in _SYSTEM:
        text = reason.lower()
        if text.startswith("culled"):
            return "cull"
        if text.startswith(("preempted", "reclaimed")):
            return "preemption"
        if text.startswith("time limit"):
            return "time-limit"
        if actor == "reconcile" or text.startswith("reconcile"):
            return "reconcile"
    return "cancel" if from_state == "pending" else "release"


def event_cause(detail: Mapping[str, Any], reason: str, actor: str, from_state: str | None) -> str:
    """The cause of a ``released`` event: the one it records (never a
    caller's words), else :func:`release_cause`."""
    cause = detail.get("cause")
    if isinstance(cause, str) and cause in RELEASE_CAUSES:
        return cause
    return release_cause(reason, actor, from_state)


def fold(
    entries: Iterable[LedgerEntry],
    holders: Mapping[int, Holder],
    slots: Mapping[int, tuple[Slot, ...]],
) -> Changes:
    """Fold log entries, oldest first, into ledger changes.

    Args:
        entries: the log's entries after the ledger's mark, in id order.
        holders: every lease an entry names (leases not given are skipped:
            a lease the store no longer has).
        slots: the slots of each lease granted or rebound in ``entries``
            (all of its allocations: a lease is granted once; a ``rebound``
            note moves its allocations to the devices its engine bound, and
            its slot intervals close there and open anew on them).

    Returns:
        The changes; intervals opened and closed within the batch come
        back complete, as one insert each.
    """
    changes = Changes()
    opened: dict[tuple[int, bool], list[int]] = {}  # (lease, wait) → insert indices

    def close(lease_id: int, wait: bool, end_s: float, cause: str) -> None:
        mine = opened.pop((lease_id, wait), None)
        if mine is None:
            changes.closes.append(Close(lease_id, wait, end_s, cause))
            return
        for i in mine:
            interval = changes.inserts[i]
            changes.inserts[i] = replace(
                interval, end_s=max(end_s, interval.start_s), end_cause=cause
            )

    def open_(holder: Holder, slot: Slot | None, start_s: float) -> None:
        changes.inserts.append(Interval(holder, slot, start_s))
        opened.setdefault((holder.lease_id, slot is None), []).append(len(changes.inserts) - 1)

    for entry in entries:
        holder = holders.get(entry.lease_id)
        if holder is None:
            continue
        _fold_one(entry, holder, slots.get(entry.lease_id, ()), open_, close, changes, opened)
    return changes


def _fold_one(
    entry: LedgerEntry,
    holder: Holder,
    slots: tuple[Slot, ...],
    open_: Any,
    close: Any,
    changes: Changes,
    opened: Mapping[tuple[int, bool], list[int]],
) -> None:
    kind, at = entry.kind, entry.at_s
    if kind == "requested":
        open_(holder, None, at)
    elif kind == "granted":
        close(holder.lease_id, True, at, "granted")
        for slot in slots:
            open_(holder, slot, at)
    elif kind == "adopted" and entry.to_state in ("pending", "granted"):
        # a lease older than the log: counted from its adoption on
        parts: tuple[Slot | None, ...] = slots if entry.to_state == "granted" else (None,)
        for part in parts:
            open_(holder, part, at)
    elif kind == "rebound" and slots:
        # its engine bound it to other devices (Slurm): charged to them from now
        close(holder.lease_id, False, at, "rebound")
        for slot in slots:
            open_(holder, slot, at)
    elif kind == "released":
        cause = event_cause(entry.detail, entry.reason, entry.actor, entry.from_state)
        close(holder.lease_id, entry.from_state == "pending", at, cause)
    elif kind == "culled":
        idle = _seconds(entry.detail.get("idle_seconds"))
        mine = opened.get((holder.lease_id, False))
        if mine is None:
            changes.idle.append(MarkIdle(holder.lease_id, idle))
        else:
            for i in mine:
                changes.inserts[i] = replace(changes.inserts[i], idle_s=idle)


def _seconds(value: Any) -> float:
    """A non-negative number of seconds from an event's detail (0 if absent or bad)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    return 0.0


def accrue(weight: float, utilization: float | None, seconds: float) -> tuple[float, float]:
    """(used GPU-seconds, sampled seconds) of one sample of a slot.

    Args:
        weight: the slot's device units.
        utilization: the fraction of the sample in which the slot computed,
            0..1 (``None``: not known, nothing is counted).
        seconds: how long the sample stands for.

    Returns:
        ``weight * utilization * seconds`` and ``seconds``; ``(0, 0)`` when
        the utilization is unknown.
    """
    if utilization is None or seconds <= 0:
        return 0.0, 0.0
    return weight * min(max(utilization, 0.0), 1.0) * seconds, seconds
