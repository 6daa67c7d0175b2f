"""Usage reports read from the store: the sums of
:func:`gpubroker.store.ledger_repo.aggregate` made into report rows
(:mod:`gpubroker.usage.report`), and the series the HTML report plots."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from ..store import ledger_repo as repo
from .intervals import WAIT
from .report import ReportRequest, ReportRow, buckets, combine

#: how an empty key is shown, per grouping
_EMPTY = {"group": "(none)", "pool": "(default)", "model": "(none)"}


def build_report(
    session_factory: Any,
    request: ReportRequest,
    now: dt.datetime,
    prices: Mapping[str, float],
    user: str | None = None,
) -> list[ReportRow]:
    """The rows of ``request``: one per key (``by`` user, group, pool,
    model), or one per day, days without use included.

    Args:
        session_factory: the store's sessions.
        request: the checked request.
        now: aware UTC; open intervals count up to it, or up to the
            broker's last sign of life when that is earlier (a broker that
            is down: :func:`gpubroker.store.ledger_repo.counted_until`).
        prices: price per GPU-hour by model.
        user: only this user's intervals (a user reading their own usage).
    """
    rows: list[ReportRow] = []
    with session_factory() as session:
        upto = repo.counted_until(session, now.timestamp())
        for label, lo, hi in buckets(request):
            key = None if request.by == "day" else request.by
            span = (lo.timestamp(), hi.timestamp(), upto, key, user)
            sums = repo.aggregate(session, *span)
            counted = repo.counts(session, *span)
            if request.by == "day":
                day = {label: counted.get("all", {})}
                rows.extend(combine([(label, s) for s in sums], prices, day) or [_empty(label)])
            else:
                empty = _EMPTY.get(request.by, "")
                named = _merged(counted, empty)
                rows.extend(combine([(s["key"] or empty, s) for s in sums], prices, named))
    return rows


def _merged(counted: dict[Any, dict[str, int]], empty: str) -> dict[str, dict[str, int]]:
    """``counted`` with no key (no group, the default pool) named ``empty``,
    its counts added to those of a key that is named so (a group called
    ``(none)``), as the GPU-hours of both are added up in one row."""
    named: dict[str, dict[str, int]] = {}
    for key, values in counted.items():
        into = named.setdefault(key or empty, {})
        for name, value in values.items():
            into[name] = into.get(name, 0) + value
    return named


def _empty(key: str) -> ReportRow:
    return ReportRow(key, 0.0, 0.0, None, 0.0, 0, 0, 0, 0, 0.0, None)


def series(
    session_factory: Any,
    request: ReportRequest,
    now: dt.datetime,
    user: str | None = None,
    top: int = 8,
) -> dict[str, Any]:
    """What the HTML report plots. ``now``: aware UTC; open intervals
    count up to it or to the broker's last sign of life, as in
    :func:`build_report`.

    Returns:
        ``days`` (labels), ``users`` (the ``top`` users by allocated
        GPU-hours), ``allocated`` and ``used`` (user → GPU-hours per day),
        ``waits`` (hours of each wait that ended or is open in the period).
    """
    daily = ReportRequest(request.start, request.end, "day", request.tz, request.format)
    days: list[str] = []
    allocated: dict[str, list[float]] = {}
    used: dict[str, list[float]] = {}
    totals: dict[str, float] = {}
    with session_factory() as session:
        upto = repo.counted_until(session, now.timestamp())  # as build_report
        per_day = []
        for label, lo, hi in buckets(daily):
            days.append(label)
            sums = repo.aggregate(session, lo.timestamp(), hi.timestamp(), upto, "user", user)
            per_day.append(combine([(s["key"], s) for s in sums], {}, {}))  # no counts plotted
            for row in per_day[-1]:
                totals[row.key] = totals.get(row.key, 0.0) + row.gpu_hours_allocated
        users = sorted(totals, key=lambda u: (-totals[u], u))[:top]
        for name in users:
            allocated[name] = []
            used[name] = []
        for rows in per_day:
            by_user = {r.key: r for r in rows}
            for name in users:
                row = by_user.get(name)
                allocated[name].append(row.gpu_hours_allocated if row else 0.0)
                used[name].append(row.gpu_hours_used if row else 0.0)
        waits = [
            ((r["end_s"] or upto) - r["start_s"]) / 3600
            for r in repo.interval_rows(
                session, request.start.timestamp(), request.end.timestamp(), user
            )
            if r["slot_kind"] == WAIT
        ]
    return {"days": days, "users": users, "allocated": allocated, "used": used, "waits": waits}
