"""Sentences for people: why a request waits and when it may start."""

from __future__ import annotations

import datetime as dt
import functools

from .types import WaitReason


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
    planned: bool = True,
) -> str:
    """One sentence: what blocks the request, its place, its estimated start.

    ``planned``: whether the request could have had an ETA (whole GPUs);
    when it has none because GPUs are held without a time limit, say so.
    MIG and share requests are never planned, so nothing is added."""
    head, tail = wait_parts(reason, eta, now, detail, planned)
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
_UNPLANNED = (WaitReason.resources, WaitReason.priority, WaitReason.reserved)


def wait_parts(
    reason: WaitReason,
    eta: dt.datetime | None,
    now: dt.datetime,
    detail: str = "",
    planned: bool = True,
) -> tuple[str, str]:
    """:func:`wait_message` around the ordinal of the position: ``(head,
    tail)``, so that a pass builds them once for the many requests that
    wait for the same reason (``head + ordinal(position) + tail``)."""
    text = detail or _LEAD[reason]
    why = ""
    if planned and eta is None and reason in _UNPLANNED:
        why = " (GPUs are held without a time limit)"
    return f"waiting: {text}; you are ", f" in the queue; {when(eta, now)}{why}"
