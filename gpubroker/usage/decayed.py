"""Usage: GPU-seconds of leases, kept for fair share (decayed per user).

A released lease adds its GPU-seconds, decayed to the release time, to its
user's record (see :mod:`gpubroker.scheduler.fairshare` for the formula).

The released leases are the truth; the ``usage`` rows are a checkpoint of
their sum. A release changes the user's record in memory only (no write on
the lease path); the broker writes the records that changed at most every
``Broker.usage_write_interval`` seconds and when it stops. Loading adds to
each stored record the leases of its user released after the record's
``as_of``, in release order, with the same formula: a restart, even after
a crash between two checkpoints, loads exactly the records memory held.
Reports per user and group come with the ledger in a later release.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable

from sqlalchemy import func, insert, or_, select, update
from sqlalchemy.orm import Session

from ..scheduler import UsageRecord
from ..scheduler.fairshare import decay, running_usage
from ..store.models import Allocation, Lease, LeaseState, UsageRow


def add_use(
    record: UsageRecord | None,
    gpus: float,
    granted_at: dt.datetime,
    now: dt.datetime,
    half_life: float,
) -> UsageRecord:
    """``record`` (``None``: no past use) with a lease of ``gpus`` device
    units, granted at ``granted_at`` and released at ``now`` (aware UTC),
    added: the past decayed to ``now`` plus the lease's decayed
    GPU-seconds; ``half_life`` in seconds. The record's ``as_of`` never
    goes back (after a clock step back it stays): it is the mark after
    which loading adds releases again, so no lease is counted twice (a
    release stamped before the mark after such a step, and not yet
    written, is the one a crash can lose)."""
    past = (
        0.0
        if record is None
        else decay(record.gpu_seconds, (now - record.as_of).total_seconds(), half_life)
    )
    as_of = now if record is None else max(now, record.as_of)
    return UsageRecord(past + running_usage(gpus, granted_at, now, half_life), as_of)


def lease_units(lease: Lease) -> float:
    """Device units a lease is charged for: its weight (MIG instances,
    shares), else the number of its allocations (whole devices)."""
    return lease.weight if lease.weight is not None else float(len(lease.allocations))


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
    for user, weight, count, granted_at, released_at in _released_since(session):
        gpus = weight if weight is not None else float(count)
        records[user] = add_use(records.get(user), gpus, granted_at, released_at, half_life)
        behind.add(user)
    return records, stored, behind


def _released_since(
    session: Session,
) -> Iterable[tuple[str, float | None, int, dt.datetime, dt.datetime]]:
    """(user, weight, allocations, granted at, released at) of every lease
    released after its user's stored record (all of a user's without one),
    in release order."""
    stmt = (
        select(
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
