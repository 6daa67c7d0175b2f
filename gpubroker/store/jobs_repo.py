"""Batch jobs' reads and writes (every SQL statement of :mod:`gpubroker.jobs`)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from .models import Job, Lease


def add(session: Session, user: str, kind: str, spec: dict[str, Any], now: dt.datetime) -> Job:
    """A new ``queued`` job (flushed: it has its id)."""
    job = Job(user=user, kind=kind, spec=spec, state="queued", reason="", created=now)
    session.add(job)
    session.flush()
    return job


def get(session: Session, job_id: int) -> Job | None:
    """The job, or ``None``."""
    return session.get(Job, job_id)


def listed(session: Session, user: str | None, limit: int = 500) -> list[Job]:
    """Jobs newest first; only ``user``'s when given."""
    stmt = select(Job).order_by(Job.id.desc()).limit(limit)
    if user is not None:
        stmt = stmt.where(Job.user == user)
    return list(session.scalars(stmt))


def leases(session: Session, ids: set[int]) -> list[Lease]:
    """The leases ``ids`` (any state; an id not stored is left out), read
    500 at a time (SQLite's limit on a statement's parameters)."""
    wanted = sorted(ids)
    found: list[Lease] = []
    for start in range(0, len(wanted), 500):
        chunk = wanted[start : start + 500]
        found += session.scalars(select(Lease).where(Lease.id.in_(chunk)))
    return found


def unfinished(session: Session) -> list[Job]:
    """Queued and running jobs, oldest first."""
    return list(
        session.scalars(select(Job).where(Job.state.in_(("queued", "running"))).order_by(Job.id))
    )


def delete(session: Session, job: Job) -> None:
    """Remove a job that never got a lease."""
    session.delete(job)
