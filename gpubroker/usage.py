"""Usage: GPU-seconds of leases, kept for fair share (decayed per user).

A released lease adds its GPU-seconds, decayed to the release time, to its
user's record (see :mod:`gpubroker.scheduler.fairshare` for the formula).
Reports per user and group come with the ledger in a later release.
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import select
from sqlalchemy.orm import Session

from .scheduler import UsageRecord
from .scheduler.fairshare import decay, running_usage
from .store.models import Lease, UsageRow


def record_usage(session: Session, lease: Lease, now: dt.datetime, half_life: float) -> None:
    """Add the decayed GPU-seconds of ``lease`` (granted until ``now``) to its user."""
    if lease.granted_at is None:
        return
    gpus = lease.weight if lease.weight is not None else float(len(lease.allocations))
    row = session.get(UsageRow, lease.user)
    if row is None:
        row = UsageRow(user=lease.user, gpu_seconds=0.0, as_of=now)
        session.add(row)
    past = decay(row.gpu_seconds, (now - row.as_of).total_seconds(), half_life)
    row.gpu_seconds = past + running_usage(gpus, lease.granted_at, now, half_life)
    row.as_of = now


def usage_records(session: Session) -> dict[str, UsageRecord]:
    """Every user's record, for the scheduler."""
    return {
        row.user: UsageRecord(row.gpu_seconds, row.as_of)
        for row in session.scalars(select(UsageRow))
    }
