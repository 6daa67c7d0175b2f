"""The audit log's reads and writes: admin actions on quotas and devices
(``audit_entries``) and the policy and admin actions on leases, read from
the transition log (``lease_events``). Every SQL statement of the audit log
lives here."""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import and_, literal, or_, select
from sqlalchemy.orm import Session

from ..model.lifecycle import caller_actor
from ..usage.intervals import CAUSES
from .models import AuditEntry, Lease, LeaseEvent
from .repository import Repository, session_of

#: event kinds of the transition log that are actions worth auditing (when
#: someone other than the lease's own user caused them)
LEASE_ACTIONS = (
    "requested",
    "granted",
    "released",
    "preempting",
    "preemption-withdrawn",
    "stopping",
    "cull-warning",
    "cull-withdrawn",
    "culled",
    "priority-changed",
    "grant-failed",
    "server-recorded",
)


def record(
    session: Session | Repository,
    at: dt.datetime,
    actor: str,
    action: str,
    target: str,
    detail: dict[str, Any],
    stimulus: str = "",
    reason: str = "",
) -> None:
    """Append one admin action (in the caller's transaction).

    ``actor`` is cut to 255 characters (a hub name has at most that many)
    and ``reason`` to 4000; ``target`` is kept whole, so that the
    ``user`` filter of :func:`entries` finds it.
    """
    session_of(session).add(
        AuditEntry(
            at=at,
            actor=actor[:255],
            action=action,
            target=target,
            reason=reason[:4000],
            stimulus=stimulus,
            detail=detail or None,
        )
    )


def entries(
    session: Session,
    since: dt.datetime | None,
    until: dt.datetime | None,
    user: str | None,
    limit: int,
    on_behalf: tuple[str, ...] = (),
    kind: str | None = None,
) -> tuple[list[AuditEntry], list[tuple[LeaseEvent, str]]]:
    """The newest ``limit`` admin entries and lease actions (with the
    lease's user) in ``[since, until)``; ``user``: only entries about that
    user (a lease of theirs, their quota) or by them. ``on_behalf``: actors
    that act for a lease's own user (the hub's spawner calls with the
    broker's service token), left out like the user. ``kind``: only admin
    entries of that action and lease events of that kind (a release
    cause, e.g. ``cull``: ``released`` events too, of which the caller keeps
    those of that cause; ``granted`` is both)."""
    admin = select(AuditEntry).order_by(AuditEntry.at.desc(), AuditEntry.id.desc()).limit(limit)
    lease = (
        select(LeaseEvent, Lease.user)
        .join(Lease, Lease.id == LeaseEvent.lease_id)
        .where(LeaseEvent.kind.in_(LEASE_ACTIONS), LeaseEvent.actor != Lease.user)
        # a user named like a system actor acts as user/NAME (caller_actor)
        .where(LeaseEvent.actor != literal("user/") + Lease.user)
        .where(LeaseEvent.actor.not_in(on_behalf))
        .order_by(LeaseEvent.at.desc(), LeaseEvent.id.desc())
        .limit(limit)
    )
    if since is not None:
        admin = admin.where(AuditEntry.at >= since)
        lease = lease.where(LeaseEvent.at >= since)
    if until is not None:
        admin = admin.where(AuditEntry.at < until)
        lease = lease.where(LeaseEvent.at < until)
    if kind is not None:
        admin = admin.where(AuditEntry.action == kind)
        if kind in CAUSES:
            # a release cause: the releases that record it (or record none the
            # caller can read: it keeps those of that cause), here, before the
            # limit cuts them; a name may also be an event kind ("granted")
            cause = LeaseEvent.detail["cause"].as_string()
            recorded = or_(cause == kind, cause.is_(None), cause.not_in(CAUSES))
            lease = lease.where(
                or_(LeaseEvent.kind == kind, and_(LeaseEvent.kind == "released", recorded))
            )
        else:
            lease = lease.where(LeaseEvent.kind == kind)
    if user is not None:
        actor = caller_actor(user)
        admin = admin.where(or_(AuditEntry.actor == actor, AuditEntry.target == f"user:{user}"))
        lease = lease.where(or_(Lease.user == user, LeaseEvent.actor == actor))
    return list(session.scalars(admin)), [(e, u) for e, u in session.execute(lease)]
