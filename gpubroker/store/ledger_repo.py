"""The usage ledger's reads and writes: every SQL statement of the ledger
and of its reports lives here (:mod:`gpubroker.usage` imports no SQLAlchemy).

Times are UTC seconds since the epoch (floats) in ``usage_intervals`` and
``ledger_mark``; the transition log's aware datetimes are converted here.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import and_, bindparam, case, func, insert, literal, or_, select, update
from sqlalchemy.orm import Session

from ..usage.intervals import WAIT, Changes, Close, Holder, LedgerEntry, Slot
from .models import Allocation, Device, Lease, LeaseEvent, LedgerMark, UsageInterval

_T = UsageInterval.__table__


def read_mark(session: Session) -> tuple[int, float]:
    """(last folded log entry id, last heartbeat in UTC epoch seconds);
    ``(0, 0.0)`` before the ledger's first write."""
    row = session.get(LedgerMark, 1)
    return (0, 0.0) if row is None else (row.event_id, row.heartbeat_s)


def write_mark(session: Session, event_id: int, heartbeat_s: float) -> None:
    """Store the mark (in the caller's transaction)."""
    row = session.get(LedgerMark, 1)
    if row is None:
        session.add(LedgerMark(id=1, event_id=event_id, heartbeat_s=heartbeat_s))
    else:
        row.event_id, row.heartbeat_s = event_id, heartbeat_s


def entries_after(session: Session, event_id: int, limit: int) -> list[LedgerEntry]:
    """At most ``limit`` log entries with an id above ``event_id``, in order."""
    rows = session.execute(
        select(
            LeaseEvent.id,
            LeaseEvent.lease_id,
            LeaseEvent.kind,
            LeaseEvent.from_state,
            LeaseEvent.to_state,
            LeaseEvent.reason,
            LeaseEvent.actor,
            LeaseEvent.at,
            LeaseEvent.detail,
        )
        .where(LeaseEvent.id > event_id)
        .order_by(LeaseEvent.id)
        .limit(limit)
    )
    return [
        LedgerEntry(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7].timestamp(), r[8] or {})
        for r in rows
    ]


def last_event_s(session: Session, before: float) -> float:
    """When the newest log entry stamped before ``before`` was written (UTC
    epoch seconds; 0 if none)."""
    limit = dt.datetime.fromtimestamp(before, dt.timezone.utc)
    at = session.scalar(select(func.max(LeaseEvent.at)).where(LeaseEvent.at < limit))
    return 0.0 if at is None else at.timestamp()


def counted_until(session: Session, now_s: float) -> float:
    """Until when a report read at ``now_s`` (UTC epoch seconds) counts the
    intervals still open: the broker's last sign of life, as the start-up
    catch-up sees it (the later of the ledger's heartbeat and the newest log
    entry stamped before ``now_s``), but never after ``now_s``. So a report
    read while the broker is down does not count the down time; one read
    beside a live broker counts up to the ledger's last write. Returns UTC
    epoch seconds (0 when neither the ledger nor the log ever wrote)."""
    _, heartbeat = read_mark(session)
    return min(now_s, max(heartbeat, last_event_s(session, now_s)))


def holders_and_slots(
    session: Session, lease_ids: Iterable[int], pool_of: Callable[[str], str]
) -> tuple[dict[int, Holder], dict[int, tuple[Slot, ...]]]:
    """The holder of each lease, and the slots of its allocations (every
    one, active or not: a lease is granted once). ``pool_of``: a device's
    pool name."""
    ids = sorted(set(lease_ids))
    holders: dict[int, Holder] = {}
    slots: dict[int, tuple[Slot, ...]] = {}
    for start in range(0, len(ids), 500):
        chunk = ids[start : start + 500]
        for lease in session.scalars(select(Lease).where(Lease.id.in_(chunk))):
            holders[lease.id] = _holder(lease)
            slots[lease.id] = tuple(_slot(a, a.device, pool_of) for a in lease.allocations)
    return holders, slots


def _holder(lease: Lease) -> Holder:
    return Holder(
        lease_id=lease.id,
        user=lease.user,
        group=lease.group_name or "",
        holder_kind=lease.holder_kind,
        holder=lease.server_name,
        priority_class=lease.priority_class,
        pool=lease.pool or "",
        created_s=lease.created.timestamp(),
    )


def _slot(allocation: Allocation, device: Device, pool_of: Callable[[str], str]) -> Slot:
    return Slot(
        kind=allocation.kind,
        device_uuid=allocation.device_uuid,
        slot_uuid=allocation.instance_uuid or "",
        profile=allocation.profile or "",
        model=device.name,
        node=device.node,
        weight=allocation.weight,
        pool=pool_of(allocation.device_uuid),
    )


def apply_changes(session: Session, changes: Changes) -> None:
    """Write one batch's changes (in the caller's transaction): idle marks
    and closes of stored intervals first, then the batch's intervals."""
    if changes.idle:
        session.execute(
            update(_T)
            .where(and_(_T.c.lease_id == bindparam("lid"), _T.c.end_s.is_(None)))
            .where(_T.c.slot_kind != WAIT)
            .values(idle_s=bindparam("idle")),
            [{"lid": m.lease_id, "idle": m.idle_s} for m in changes.idle],
        )
    close_stored(session, changes.closes)
    if changes.inserts:
        session.execute(insert(_T), [_row(i) for i in changes.inserts])


def close_stored(session: Session, closes: Sequence[Close]) -> None:
    """Close stored open intervals; an end is never before its start."""
    waits = [c for c in closes if c.wait]
    slots = [c for c in closes if not c.wait]
    for batch, wait in ((waits, True), (slots, False)):
        if not batch:
            continue
        kind_test = _T.c.slot_kind == WAIT if wait else _T.c.slot_kind != WAIT
        end = bindparam("end")
        session.execute(
            update(_T)
            .where(and_(_T.c.lease_id == bindparam("lid"), _T.c.end_s.is_(None), kind_test))
            .values(
                end_s=case((_T.c.start_s > end, _T.c.start_s), else_=end),
                end_cause=bindparam("cause"),
            ),
            [{"lid": c.lease_id, "end": c.end_s, "cause": c.cause} for c in batch],
        )


def _row(interval: Any) -> dict[str, Any]:
    holder, slot = interval.holder, interval.slot
    return {
        "lease_id": holder.lease_id,
        "user": holder.user,
        "group_name": holder.group,
        "holder_kind": holder.holder_kind,
        "holder": holder.holder,
        "priority_class": holder.priority_class,
        "pool": slot.pool if slot is not None and slot.pool else holder.pool,
        "slot_kind": interval.slot_kind,
        "device_uuid": slot.device_uuid if slot else "",
        "slot_uuid": slot.slot_uuid if slot else "",
        "profile": slot.profile if slot else "",
        "model": slot.model if slot else "",
        "node": slot.node if slot else "",
        "weight": slot.weight if slot else 0.0,
        "start_s": interval.start_s,
        "end_s": interval.end_s,
        "end_cause": interval.end_cause,
        "used_gpu_seconds": 0.0,
        "sampled_s": 0.0,
        "idle_s": interval.idle_s,
    }


def reopen(session: Session, end_s: float, start_s: float) -> tuple[int, int]:
    """Close every open interval at ``end_s`` (``broker-down``; never before
    its start) and open a copy of it, with the same facts (its idle seconds
    of a cull included), from ``start_s`` (both UTC epoch seconds). Returns
    (closed, opened)."""
    c = _T.c
    copied = [
        c.lease_id,
        c.user,
        c.group_name,
        c.holder_kind,
        c.holder,
        c.priority_class,
        c.pool,
        c.slot_kind,
        c.device_uuid,
        c.slot_uuid,
        c.profile,
        c.model,
        c.node,
        c.weight,
        c.idle_s,  # a cull noted before the stop: only the cull-ended copy is summed
    ]
    rows = [dict(r._mapping) for r in session.execute(select(*copied).where(c.end_s.is_(None)))]
    if not rows:
        return 0, 0
    session.execute(
        update(_T)
        .where(c.end_s.is_(None))
        .values(
            end_s=case((c.start_s > literal(end_s), c.start_s), else_=literal(end_s)),
            end_cause="broker-down",
        )
    )
    fresh = {"start_s": start_s, "end_s": None, "end_cause": "", "used_gpu_seconds": 0.0}
    fresh |= {"sampled_s": 0.0}
    session.execute(insert(_T), [row | fresh for row in rows])
    return len(rows), len(rows)


def open_slots(
    session: Session, since: float
) -> list[tuple[int, str, str, str, float, float, float | None]]:
    """Slot intervals open, or closed after ``since`` (UTC epoch seconds):
    (id, kind, device UUID, slot UUID, weight, start, end)."""
    rows = session.execute(
        select(
            _T.c.id,
            _T.c.slot_kind,
            _T.c.device_uuid,
            _T.c.slot_uuid,
            _T.c.weight,
            _T.c.start_s,
            _T.c.end_s,
        ).where(and_(or_(_T.c.end_s.is_(None), _T.c.end_s > since), _T.c.slot_kind != WAIT))
    )
    return [tuple(r) for r in rows]  # type: ignore[misc]


def add_used(session: Session, used: Mapping[int, tuple[float, float]]) -> None:
    """Add (used GPU-seconds, sampled seconds) to intervals by id."""
    if not used:
        return
    session.execute(
        update(_T)
        .where(_T.c.id == bindparam("iid"))
        .values(
            used_gpu_seconds=_T.c.used_gpu_seconds + bindparam("du"),
            sampled_s=_T.c.sampled_s + bindparam("ds"),
        ),
        [{"iid": k, "du": du, "ds": ds} for k, (du, ds) in sorted(used.items())],
    )


# --- reports -------------------------------------------------------------------

#: the columns a report may group by
KEYS = {
    "user": _T.c.user,
    "group": _T.c.group_name,
    "pool": _T.c.pool,
    "model": _T.c.model,
}


def aggregate(
    session: Session,
    start_s: float,
    end_s: float,
    now_s: float,
    key: str | None,
    user: str | None = None,
) -> list[dict[str, Any]]:
    """Sums over the intervals that overlap ``[start_s, end_s)``, clipped to
    it, grouped by ``key`` (a :data:`KEYS` name; ``None``: one group) and the
    device model. An open interval counts up to ``now_s`` (the caller passes
    :func:`counted_until`). An interval that ends exactly at ``start_s`` is
    read (it adds no time) so that its cull or preemption counts in the
    range where its end falls: ``start_s <= end < end_s``. All in UTC epoch
    seconds.

    Each row: ``key``, ``model``, ``allocated`` (GPU-seconds: weight *
    overlap), ``used`` (GPU-seconds, pro rata of the overlap),
    ``sampled`` (the GPU-seconds of ``allocated`` whose use was sampled,
    pro rata as ``used``: the base of an efficiency), ``wait`` (seconds
    waited in the queue), ``idle_culled`` (GPU-seconds: weight * idle
    seconds of the culled). The counts of leases are per key alone, not
    per model: :func:`counts`.
    """
    c = _T.c
    r = _Range(start_s, end_s, now_s)
    group_key = KEYS[key] if key else literal("all")
    pro_rata = and_(r.is_slot, r.length > 0)
    columns = [
        group_key.label("key"),
        c.model.label("model"),
        func.sum(case((r.is_slot, c.weight * r.overlap), else_=0.0)).label("allocated"),
        func.sum(case((pro_rata, c.used_gpu_seconds * r.overlap / r.length), else_=0.0)).label(
            "used"
        ),
        func.sum(case((pro_rata, c.weight * c.sampled_s * r.overlap / r.length), else_=0.0)).label(
            "sampled"
        ),
        func.sum(case((r.is_slot, 0.0), else_=r.overlap)).label("wait"),
        func.sum(
            case(
                (and_(r.is_slot, r.ended_here, c.end_cause == "cull"), c.weight * c.idle_s),
                else_=0.0,
            )
        ).label("idle_culled"),
    ]
    stmt = select(*columns).where(r.touches).group_by(group_key, c.model)
    if user is not None:
        stmt = stmt.where(c.user == user)
    return [dict(row._mapping) for row in session.execute(stmt)]


def counts(
    session: Session,
    start_s: float,
    end_s: float,
    now_s: float,
    key: str | None,
    user: str | None = None,
) -> dict[Any, dict[str, int]]:
    """Distinct leases per ``key`` (as :func:`aggregate`'s, over the same
    intervals): ``leases`` (with a slot interval in the range), ``jobs``
    (those held by batch jobs), ``culls`` and ``preemptions`` (ends in the
    range). A lease on devices of two models counts once. All in UTC
    epoch seconds.

    Returns:
        key value (``"all"`` for ``key`` ``None``) -> the four counts.
    """
    c = _T.c
    r = _Range(start_s, end_s, now_s)
    group_key = KEYS[key] if key else literal("all")

    def distinct(*when: Any) -> Any:
        return func.count(func.distinct(case((and_(r.is_slot, *when), c.lease_id))))

    stmt = (
        select(
            group_key.label("key"),
            distinct(r.overlap > 0).label("leases"),
            distinct(r.overlap > 0, c.holder_kind == "job").label("jobs"),
            distinct(r.ended_here, c.end_cause == "cull").label("culls"),
            distinct(r.ended_here, c.end_cause == "preemption").label("preemptions"),
        )
        .where(r.touches)
        .group_by(group_key)
    )
    if user is not None:
        stmt = stmt.where(c.user == user)
    return {
        row.key: {n: int(row._mapping[n]) for n in ("leases", "jobs", "culls", "preemptions")}
        for row in session.execute(stmt)
    }


class _Range:
    """SQL expressions of the intervals against ``[start_s, end_s)``, an
    open interval counting up to ``now_s`` (UTC epoch seconds)."""

    def __init__(self, start_s: float, end_s: float, now_s: float) -> None:
        c = _T.c
        lo, hi = literal(start_s), literal(end_s)
        end = func.coalesce(c.end_s, literal(now_s))
        a = case((c.start_s > lo, c.start_s), else_=lo)
        b = case((end < hi, end), else_=hi)
        #: seconds of the interval within the range
        self.overlap = case((b > a, b - a), else_=literal(0.0))
        #: the interval's length, seconds
        self.length = case((end > c.start_s, end - c.start_s), else_=literal(0.0))
        self.is_slot = c.slot_kind != WAIT
        #: it ended within the range
        self.ended_here = and_(c.end_s.is_not(None), c.end_s >= lo, c.end_s < hi)
        #: the intervals read: overlapping, or ending exactly at ``start_s``
        #: (an open one ends at ``now_s``: a range after it touches nothing)
        self.touches = and_(c.start_s < hi, end >= lo)


def interval_rows(
    session: Session, start_s: float, end_s: float, user: str | None = None
) -> list[dict[str, Any]]:
    """The intervals overlapping ``[start_s, end_s)`` as plain rows (for
    the plots of the HTML report)."""
    c = _T.c
    stmt = select(
        c.lease_id, c.user, c.slot_kind, c.weight, c.start_s, c.end_s, c.used_gpu_seconds
    ).where(and_(c.start_s < end_s, or_(c.end_s.is_(None), c.end_s > start_s)))
    if user is not None:
        stmt = stmt.where(c.user == user)
    return [dict(r._mapping) for r in session.execute(stmt)]
