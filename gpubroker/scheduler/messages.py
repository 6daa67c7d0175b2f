"""Sentences for people: why a request waits and when it may start."""

from __future__ import annotations

import datetime as dt
import functools

from .types import INTERACTIVE_POOLS, WaitReason


@functools.lru_cache(maxsize=65536)
def ordinal(n: int) -> str:
    """1 -> '1st', 2 -> '2nd', 11 -> '11th'."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def clock(at: dt.datetime, now: dt.datetime) -> str:
    """'14:20 UTC', with the date in front when ``at`` is not on ``now``'s day."""
    at = at.astimezone(dt.timezone.utc)
    fmt = (
        "%H:%M UTC" if at.date() == now.astimezone(dt.timezone.utc).date() else "%Y-%m-%d %H:%M UTC"
    )
    return at.strftime(fmt)


def when(eta: dt.datetime | None, now: dt.datetime) -> str:
    """'estimated start 14:20 UTC', or 'estimated start unknown'."""
    if eta is None:
        return "estimated start unknown"
    return f"estimated start {clock(eta, now)}"


def gpus(n: float) -> str:
    """'1 GPU', '2 GPUs', '1.5 GPUs'."""
    text = f"{n:g}"
    return f"{text} GPU" if text == "1" else f"{text} GPUs"


def wait_message(
    reason: WaitReason,
    position: int,
    eta: dt.datetime | None,
    now: dt.datetime,
    detail: str = "",
    why: str = "",
) -> str:
    """One sentence: what blocks the request, its place, its estimated start.

    Args:
        reason: why it waits.
        position: its 1-based place in the queue.
        eta: its estimated start (aware UTC), ``None`` when unknown.
        now: the pass's time (aware UTC), to tell whether ``eta`` is today.
        detail: said instead of the reason's usual words when given.
        why: why the estimated start is unknown (:data:`UNTIMED`,
            :func:`unplanned`), said after it only when ``eta`` is ``None``;
            ``""``: nothing is said (it is not known why, or there is no
            plan for this kind of request, e.g. MIG instances and shares).

    Returns:
        ``waiting: <what>; you are <position> in the queue; estimated start
        <when>[ (<why>)]``."""
    head, tail = wait_parts(reason, eta, now, detail, why)
    return f"{head}{ordinal(position)}{tail}"


_LEAD = {
    WaitReason.resources: "not enough free GPUs on one node",
    WaitReason.priority: "requests of higher priority or fair share go first",
    WaitReason.reserved: "the free GPUs are reserved for a request ahead of yours",
    WaitReason.preempting: "GPUs are being reclaimed for you",
    WaitReason.quota_user: "you are at your GPU limit",
    WaitReason.quota_group: "your group is at its GPU limit",
    WaitReason.over_guarantee: "this priority class only runs within guarantees",
    WaitReason.pool_drained: "no node has that many GPUs in service",
    WaitReason.fragmented: "the free MIG slices are scattered by other instances",
}

#: ``why`` of a wait whose planned GPUs include one held by a lease without
#: a time limit (so nobody can tell when it frees up)
UNTIMED = " (GPUs are held without a time limit)"


def unplanned(limit: int) -> str:
    """``why`` of a wait that got no reservation because ``limit``
    (``Policy.max_reservations``) blocked requests ahead of it have one."""
    if limit <= 0:
        return " (blocked requests get no estimate)"
    if limit == 1:
        return " (only the first blocked request gets an estimate)"
    return f" (only the first {limit} blocked requests get an estimate)"


def drained(gpus: int, pool: str | None, largest: int) -> str:
    """The ``PoolDrained`` detail of a request for ``gpus`` whole devices of
    ``pool`` (a pool's name, :data:`INTERACTIVE_POOLS` or ``None``: any),
    where the node with the most devices in service it may use has ``largest``."""
    if pool is None:
        where = f"no node has {gpus} GPUs in service"
    elif pool == INTERACTIVE_POOLS:
        where = f"no node has {gpus} GPUs in service outside batch pools"
    else:
        where = f"no node of pool {pool} has {gpus} GPUs in service"
    return f"{where} (largest: {largest})"


def wait_parts(
    reason: WaitReason,
    eta: dt.datetime | None,
    now: dt.datetime,
    detail: str = "",
    why: str = "",
) -> tuple[str, str]:
    """:func:`wait_message` around the ordinal of the position: ``(head,
    tail)``, so that a pass builds them once for the many requests that
    wait for the same reason (``head + ordinal(position) + tail``)."""
    text = detail or _LEAD[reason]
    note = why if eta is None else ""
    return f"waiting: {text}; you are ", f" in the queue; {when(eta, now)}{note}"
