"""Fair share's usage records in the store: the checkpoint rows, and what
a restart loads (the checkpoint plus the leases released after it, charged
from the usage ledger's intervals: :mod:`gpubroker.usage.decayed`).

A release changes its user's record in memory only (no write on the lease
path); the broker writes the records that changed at most every
``Broker.usage_write_interval`` seconds and when it stops. Loading adds to
each stored record the leases of its user released after the record's
``as_of``, in release order, with the same rule as memory: a restart, even
after a crash between two checkpoints, loads exactly the records memory
held.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable

from sqlalchemy import func, insert, or_, select, update
from sqlalchemy.orm import Session

from ..scheduler import UsageRecord
from ..usage.decayed import Segment, add_charge, held_usage, lease_segments
from ..usage.intervals import WAIT
from .models import Allocation, Lease, LeaseState, UsageInterval, UsageRow


def lease_units(lease: Lease) -> float:
    """Device units a lease is charged for: its weight (MIG instances,
    shares), else the number of its allocations (whole devices)."""
    return lease.weight if lease.weight is not None else float(len(lease.allocations))


def ledger_segments(session: Session, lease_ids: Iterable[int]) -> dict[int, list[Segment]]:
    """The usage ledger's slot intervals (weight, start, end or ``None``;
    UTC epoch seconds) of each lease, by lease id (leases the ledger holds
    none of are left out)."""
    ids = sorted(set(lease_ids))
    found: dict[int, list[Segment]] = {}
    t = UsageInterval
    for start in range(0, len(ids), 500):
        rows = session.execute(
            select(t.lease_id, t.weight, t.start_s, t.end_s)
            .where(t.lease_id.in_(ids[start : start + 500]), t.slot_kind != WAIT)
            .order_by(t.lease_id, t.start_s, t.id)
        )
        for lease_id, weight, start_s, end_s in rows:
            found.setdefault(lease_id, []).append((weight, start_s, end_s))
    return found


def lease_charge(
    session: Session,
    lease: Lease,
    now: dt.datetime,
    half_life: float,
    from_ledger: bool,
) -> float:
    """Decayed GPU-seconds, as of ``now`` (its release, aware UTC), that
    granted ``lease`` is charged; ``from_ledger``: read the ledger's
    intervals of it (needed only for a lease granted before this broker
    started: one granted since holds one run of intervals from its grant,
    which the lease's own weight and grant time give without a query)."""
    assert lease.granted_at is not None
    ledger = ledger_segments(session, [lease.id]).get(lease.id, []) if from_ledger else []
    segments = lease_segments(ledger, lease_units(lease), lease.granted_at.timestamp())
    return held_usage(segments, now.timestamp(), half_life)


def load_usage(
    session: Session, half_life: float
) -> tuple[dict[str, UsageRecord], set[str], set[str]]:
    """Every user's record: the stored checkpoint plus the leases released
    after it (``half_life`` in seconds). Returns the records, the users
    with a stored row, and the users whose row is behind (to be written at
    the next checkpoint)."""
    records = {
        user: UsageRecord(seconds, as_of)
        for user, seconds, as_of in session.execute(
            select(UsageRow.user, UsageRow.gpu_seconds, UsageRow.as_of)
        )
    }
    stored = set(records)
    behind: set[str] = set()
    released = _released_since(session)
    ledger = ledger_segments(session, [r[0] for r in released])
    for lease_id, user, weight, count, granted_at, released_at in released:
        units = weight if weight is not None else float(count)
        segments = lease_segments(ledger.get(lease_id, []), units, granted_at.timestamp())
        charge = held_usage(segments, released_at.timestamp(), half_life)
        records[user] = add_charge(records.get(user), charge, released_at, half_life)
        behind.add(user)
    return records, stored, behind


def _released_since(
    session: Session,
) -> list[tuple[int, str, float | None, int, dt.datetime, dt.datetime]]:
    """(lease id, user, weight, allocations, granted at, released at) of
    every lease released after its user's stored record (all of a user's
    without one), in release order."""
    stmt = (
        select(
            Lease.id,
            Lease.user,
            Lease.weight,
            func.count(Allocation.id),
            Lease.granted_at,
            Lease.released_at,
        )
        .outerjoin(Allocation, Allocation.lease_id == Lease.id)
        .outerjoin(UsageRow, UsageRow.user == Lease.user)
        .where(
            Lease.state == LeaseState.released.value,
            Lease.granted_at.is_not(None),
            Lease.released_at.is_not(None),
            or_(UsageRow.user.is_(None), Lease.released_at > UsageRow.as_of),
        )
        .group_by(Lease.id)
        .order_by(Lease.released_at, Lease.id)
    )
    return [tuple(row) for row in session.execute(stmt)]  # type: ignore[misc]


def write_usage(
    session: Session, records: dict[str, UsageRecord], users: Iterable[str], stored: set[str]
) -> None:
    """Write the records of ``users`` (a checkpoint), in ``session``'s
    transaction; ``stored``: the users that have a row (updated in place)."""
    for user in sorted(users):
        record = records[user]
        values = {"gpu_seconds": record.gpu_seconds, "as_of": record.as_of}
        if user in stored:
            session.execute(update(UsageRow).where(UsageRow.user == user).values(**values))
        else:
            session.execute(insert(UsageRow).values(user=user, **values))
            stored.add(user)
