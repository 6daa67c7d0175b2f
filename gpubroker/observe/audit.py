"""The audit log: who did what, when and why.

It lists every admin action (a quota set or removed, a device drained or
undrained, a MIG mode asked for, a lease of another user released,
preempted or re-prioritised) and every policy action (a grant, a
preemption and its grace period, a reclaim, a cull warning and a cull, a
time-limit stop, a server stopped), each with its actor (an admin's name or
``scheduler``, ``culler``, ``reconcile``), time (UTC), reason and target.

Actions on leases are read from the transition log (nothing is written
twice): an event counts when someone other than the lease's own user
caused it (nor the broker's own service, through which the hub's spawner
acts for the user). Actions on quotas and devices are recorded in
``audit_entries`` in the same transaction as the change.

Each entry's ``action`` is the event kind (``granted``, ``preempting``,
``culled``, ...; ``released`` with its ``cause``: ``cull``,
``preemption``, ``time-limit``, ``reconcile``, ``cancel``, ``release``) or
the admin action (``quota-set``, ``quota-deleted``, ``device-drained``,
``device-undrained``, ``device-mig``, ``lease-preempted``).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from ..store import audit_repo
from ..usage.intervals import CAUSES, event_cause

#: the most entries one query returns
MAX_LIMIT = 10000


def _iso(at: dt.datetime) -> str:
    """``at`` (aware) as ISO 8601 UTC with microseconds, ``…T09:12:04.000000Z``:
    one width for every entry, so the text sorts as the times do."""
    utc = at.astimezone(dt.timezone.utc).replace(tzinfo=None)
    return utc.isoformat(timespec="microseconds") + "Z"


def check_period(since: dt.datetime | None, until: dt.datetime | None) -> None:
    """Refuse a period that ends before it begins (the report refuses it
    too; an empty answer would read as "nothing happened").

    Raises:
        ValueError: ``since: must be before until (… is not before …)``.
    """
    if since is not None and until is not None and since >= until:
        raise ValueError(f"since: must be before until ({_iso(since)} is not before {_iso(until)})")


def query(
    session_factory: Any,
    since: dt.datetime | None = None,
    until: dt.datetime | None = None,
    user: str | None = None,
    kind: str | None = None,
    limit: int = 500,
    on_behalf: tuple[str, ...] = (),
) -> list[dict[str, Any]]:
    """Audit entries, newest first.

    Args:
        session_factory: the store's sessions.
        since, until: aware UTC bounds (``until`` exclusive); ``None``: open.
        user: only entries about this user or by them.
        kind: only entries whose ``action`` or ``cause`` is this.
        limit: most entries (1..:data:`MAX_LIMIT`).
        on_behalf: actors that act for a lease's own user (the broker's
            own service name, which the hub's spawner calls with): their
            changes of that user's leases are the user's, not audited.

    Returns:
        dicts with ``at``, ``actor``, ``action``, ``cause`` (releases),
        ``target`` (``lease 12 of ann``, ``user:ann``, a device UUID),
        ``lease_id``, ``user``, ``reason``, ``stimulus``, ``detail``.
    """
    # only a release cause is filtered here, after the store's limit: then
    # read up to MAX_LIMIT; else the store's newest ``limit`` are the answer
    fetch = MAX_LIMIT if kind in CAUSES else limit
    with session_factory() as session:
        admin, leases = audit_repo.entries(session, since, until, user, fetch, on_behalf, kind)
        timed = [(a.at, _admin(a)) for a in admin] + [(e.at, _lease(e, u)) for e, u in leases]
    if kind is not None:
        timed = [(at, f) for at, f in timed if kind in (f["action"], f["cause"])]
    timed.sort(key=lambda pair: pair[0], reverse=True)  # the times, not their text
    return [f for _at, f in timed[:limit]]


async def read(
    session_factory: Any,
    since: dt.datetime | None,
    until: dt.datetime | None,
    user: str | None,
    kind: str | None,
    limit: int,
    on_behalf: tuple[str, ...] = (),
) -> list[dict[str, Any]]:
    """:func:`query` in a worker thread (it may read 10,000s of rows), for
    handlers on the event loop; same arguments and answer."""
    import asyncio

    return await asyncio.get_running_loop().run_in_executor(
        None, lambda: query(session_factory, since, until, user, kind, limit, on_behalf)
    )


def _admin(entry: Any) -> dict[str, Any]:
    target = entry.target
    return {
        "at": _iso(entry.at),
        "actor": entry.actor,
        "action": entry.action,
        "cause": None,
        "target": target,
        "lease_id": None,
        "user": target[5:] if target.startswith("user:") else None,
        "reason": entry.reason,
        "stimulus": entry.stimulus,
        "detail": entry.detail or {},
    }


def _lease(event: Any, user: str) -> dict[str, Any]:
    cause = None
    if event.kind == "released":
        cause = event_cause(event.detail or {}, event.reason, event.actor, event.from_state)
    return {
        "at": _iso(event.at),
        "actor": event.actor,
        "action": event.kind,
        "cause": cause,
        "target": f"lease {event.lease_id} of {user}",
        "lease_id": event.lease_id,
        "user": user,
        "reason": event.reason,
        "stimulus": event.stimulus,
        "detail": event.detail or {},
    }
