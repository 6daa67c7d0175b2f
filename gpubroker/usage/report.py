"""Usage reports, pure: the parameters, the periods and the columns.

A report sums the ledger's intervals over a period, grouped by ``user``,
``group``, ``pool``, ``model`` (of the device) or ``day`` (calendar days
of a time zone). The columns, for each group:

===========================  =================================================
column                       formula
===========================  =================================================
``gpu_hours_allocated``      Σ weight * hours held, within the period
``gpu_hours_used``           Σ weight * utilization * hours (sampled), the
                             part within the period (pro rata of an interval)
``efficiency``               used / allocated (``None`` when nothing was held)
``wait_hours``               hours requests waited in the queue, within the
                             period (a wait, not a use)
``leases``                   leases that held a slot within the period
``jobs``                     those of them held by batch jobs
``culls``                    leases culled (ended) within the period
``preemptions``              leases preempted or reclaimed within the period
``idle_gpu_hours_culled``    Σ weight * hours a culled lease had been idle
                             when it was culled
``cost``                     Σ allocated GPU-hours * the price per GPU-hour
                             of the device's model (``None`` without prices)
===========================  =================================================

*Weight* is what a slot counts for in device units: 1 for a whole device,
compute slices / the device's slices for a MIG instance (a ``1g.10gb`` of an
H100 is 1/7), memory / the device's memory for a share (20 GiB of 80 GiB is
1/4). The ledger is in UTC; only ``--by day`` and dates without a time use
the report's time zone, so a day across a daylight-saving change has 23 or
25 hours.

Nothing here reads a clock or a database.
"""

from __future__ import annotations

import datetime as dt
import functools
import math
import zoneinfo
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from ..model.echo import echo

#: what a report may be grouped by
BY = ("user", "group", "pool", "model", "day")
#: the formats a report may be written in
FORMATS = ("table", "csv", "json", "html")
#: the columns of a report row, in order
COLUMNS = (
    "gpu_hours_allocated",
    "gpu_hours_used",
    "efficiency",
    "wait_hours",
    "leases",
    "jobs",
    "culls",
    "preemptions",
    "idle_gpu_hours_culled",
    "cost",
)
#: the longest period one report may cover, days
MAX_DAYS = 3660
#: the longest period of a report by day, or of an HTML report (its plots
#: are per day), days
MAX_DAILY_DAYS = 400
#: the years a report's times may be in
YEARS = (1970, 9000)


class ReportError(ValueError):
    """A bad report parameter; ``param`` names it (``from``, ``to``, ``by``,
    ``tz``, ``format``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class ReportRequest:
    """A checked report request.

    Attributes:
        start: the period's start, aware UTC (inclusive).
        end: its end, aware UTC (exclusive).
        by: one of :data:`BY`.
        tz: the time-zone name (IANA, e.g. ``Europe/Berlin``).
        format: one of :data:`FORMATS`.
    """

    start: dt.datetime
    end: dt.datetime
    by: str
    tz: str
    format: str = "table"


def parse_request(
    start: str | None,
    end: str | None,
    by: str | None,
    tz: str | None,
    fmt: str | None,
    now: dt.datetime,
) -> ReportRequest:
    """Check report parameters.

    Args:
        start, end: ``YYYY-MM-DD`` (midnight in ``tz``) or an ISO 8601 time
            (without an offset: in ``tz``). Defaults: the first day of
            ``now``'s month in ``tz``, and ``now``.
        by: one of :data:`BY` (default ``user``).
        tz: an IANA time-zone name (default ``UTC``).
        fmt: one of :data:`FORMATS` (default ``table``).
        now: aware UTC.

    Raises:
        ReportError: naming the bad parameter: an unknown ``by``, ``tz`` or
            ``format``; a time that does not parse; ``from`` not before
            ``to``; a period over :data:`MAX_DAYS` days.
    """
    by = by or "user"
    if by not in BY:
        raise ReportError("by", f"must be one of {', '.join(BY)}, not {echo(by)}")
    fmt = fmt or "table"
    if fmt not in FORMATS:
        raise ReportError("format", f"must be one of {', '.join(FORMATS)}, not {echo(fmt)}")
    zone = zone_of(tz or "UTC")
    local_now = now.astimezone(zone)
    first = dt.datetime(local_now.year, local_now.month, 1, tzinfo=zone)
    utc = dt.timezone.utc
    # compared as instants: two times of one zone compare by wall clock,
    # which a daylight-saving gap or fold turns around
    lo = (parse_time("from", start, zone) if start else first).astimezone(utc)
    hi = (parse_time("to", end, zone) if end else now).astimezone(utc)
    if lo >= hi:
        if not start:  # the default start (this month's first) is after the end given
            raise ReportError(
                "to",
                f"must be after from, which defaults to the 1st of this month ({_iso(lo)});"
                f" give from for a period that ends earlier (to is {_iso(hi)})",
            )
        raise ReportError("from", f"must be before to ({_iso(lo)} is not before {_iso(hi)})")
    if hi - lo > dt.timedelta(days=MAX_DAYS):
        raise ReportError("to", f"the period may be at most {MAX_DAYS} days")
    daily = by == "day" or fmt == "html"
    if daily and hi - lo > dt.timedelta(days=MAX_DAILY_DAYS):
        raise ReportError(
            "to", f"a report by day or in HTML may cover at most {MAX_DAILY_DAYS} days"
        )
    return ReportRequest(lo, hi, by, tz or "UTC", fmt)


def zone_of(name: str) -> ZoneInfo:
    """The time zone ``name``.

    Raises:
        ReportError: (``tz``) not an IANA time-zone name.
    """
    try:
        if name not in _iana_names():
            raise ZoneInfoNotFoundError(name)
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, TypeError, OSError):
        raise ReportError(
            "tz", f"unknown time zone {echo(name)} (use an IANA name such as Europe/Berlin)"
        ) from None


@functools.cache
def _iana_names() -> frozenset[str]:
    """The IANA time-zone names of this host's tz database, without the
    files that are not zones of a place: ``localtime`` (the host's own
    setting, so a report would differ between hosts), ``posixrules``,
    ``Factory`` and the ``posix/`` and ``right/`` copies."""
    return frozenset(
        name
        for name in zoneinfo.available_timezones()
        if name not in {"localtime", "posixrules", "Factory"}
        and not name.startswith(("posix/", "right/"))
    )


def parse_time(param: str, text: str, zone: dt.tzinfo) -> dt.datetime:
    """``YYYY-MM-DD`` or ISO 8601 as an aware time (no offset: in ``zone``).

    Raises:
        ReportError: (``param``) the text does not parse.
    """
    raw = text.strip()
    try:
        value = dt.datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        why = f"not a date (YYYY-MM-DD) or ISO 8601 time: {echo(text)}"
        raise ReportError(param, why) from None
    if value.tzinfo is None:
        value = value.replace(tzinfo=zone)
    lo, hi = YEARS
    if not lo <= value.year <= hi:  # the year as written (1 January 1970 in any zone)
        raise ReportError(param, f"must be between the years {lo} and {hi}, got {echo(text)}")
    return value


def _iso(value: dt.datetime) -> str:
    return value.isoformat()


def buckets(request: ReportRequest) -> list[tuple[str, dt.datetime, dt.datetime]]:
    """The report's periods: one per calendar day of ``request.tz`` for
    ``by`` ``day`` (labelled ``YYYY-MM-DD``; the first and last clipped to
    the request), else the whole request (labelled ``""``). Day boundaries
    are local midnights, so a day has 23, 24 or 25 hours."""
    if request.by != "day":
        return [("", request.start, request.end)]
    zone = zone_of(request.tz)
    utc = dt.timezone.utc
    day = request.start.astimezone(zone).date()
    result: list[tuple[str, dt.datetime, dt.datetime]] = []
    while True:
        lo = dt.datetime.combine(day, dt.time(), zone).astimezone(utc)
        nxt = day + dt.timedelta(days=1)
        hi = dt.datetime.combine(nxt, dt.time(), zone).astimezone(utc)
        if lo >= request.end:
            return result
        result.append((day.isoformat(), max(lo, request.start), min(hi, request.end)))
        day = nxt


@dataclass(frozen=True)
class ReportRow:
    """One group of a report (see the module's table for the columns)."""

    key: str
    gpu_hours_allocated: float
    gpu_hours_used: float
    efficiency: float | None
    wait_hours: float
    leases: int
    jobs: int
    culls: int
    preemptions: int
    idle_gpu_hours_culled: float
    cost: float | None

    def as_dict(self) -> dict[str, Any]:
        """The row as JSON: ``key`` and every column."""
        return {"key": self.key} | {c: getattr(self, c) for c in COLUMNS}


def price_of(model: str, prices: Mapping[str, float]) -> float | None:
    """The price per GPU-hour of ``model``: its own, else ``*``'s, else ``None``."""
    if model in prices:
        return float(prices[model])
    if "*" in prices:
        return float(prices["*"])
    return None


def combine(
    sums: Iterable[tuple[str, Mapping[str, Any]]],
    prices: Mapping[str, float],
    counts: Mapping[str, Mapping[str, int]],
) -> list[ReportRow]:
    """Report rows from the store's sums.

    Args:
        sums: (key, sums) pairs, a key appearing once per device model; the
            sums as :func:`gpubroker.store.ledger_repo.aggregate` gives them
            (``model``, ``allocated``, ``used``, ``sampled``, ``wait`` in
            seconds and GPU-seconds; ``idle_culled`` GPU-seconds).
        prices: price per GPU-hour by model name (``*``: any other model).
        counts: ``leases``, ``jobs``, ``culls``, ``preemptions`` per key,
            each lease once (:func:`gpubroker.store.ledger_repo.counts`); a
            key missing: 0.

    Returns:
        One row per key, sorted by allocated GPU-hours (most first), then
        key. ``efficiency`` is used ÷ the allocated GPU-hours whose use was
        sampled (``None`` when none was: no GPU use is known). ``cost`` is
        ``None`` unless every allocated GPU-hour of the row is on a model
        with a price (its own or ``*``'s) and the sum is a finite number.
    """
    acc: dict[str, dict[str, float]] = {}
    priced: dict[str, bool] = {}
    for key, s in sums:
        a = acc.setdefault(
            key, dict.fromkeys(("alloc", "used", "sampled", "wait", "idle", "cost"), 0.0)
        )
        hours = float(s["allocated"] or 0) / 3600
        a["alloc"] += hours
        a["used"] += float(s["used"] or 0) / 3600
        a["sampled"] += float(s["sampled"] or 0) / 3600
        a["wait"] += float(s["wait"] or 0) / 3600
        a["idle"] += float(s["idle_culled"] or 0) / 3600
        price = price_of(str(s["model"] or ""), prices) if hours > 0 else None
        if price is not None:
            a["cost"] += hours * price
            priced.setdefault(key, True)
        elif hours > 0:  # a part without a price: no cost that covers only the rest
            priced[key] = False
    rows = [
        ReportRow(
            key=key,
            gpu_hours_allocated=round(a["alloc"], 6),
            gpu_hours_used=round(a["used"], 6),
            efficiency=_efficiency(a["used"], a["sampled"]),
            wait_hours=round(a["wait"], 6),
            leases=counts.get(key, {}).get("leases", 0),
            jobs=counts.get(key, {}).get("jobs", 0),
            culls=counts.get(key, {}).get("culls", 0),
            preemptions=counts.get(key, {}).get("preemptions", 0),
            idle_gpu_hours_culled=round(a["idle"], 6),
            # a price near the float range times the hours overflows: no
            # cost, never an Infinity that is not JSON
            cost=round(a["cost"], 2) if priced.get(key) and math.isfinite(a["cost"]) else None,
        )
        for key, a in acc.items()
    ]
    return sorted(rows, key=lambda r: (-r.gpu_hours_allocated, r.key))


def _efficiency(used: float, sampled: float) -> float | None:
    """Used ÷ sampled GPU-hours; ``None`` when nothing was sampled."""
    if sampled <= 1e-9:
        return None
    return round(used / sampled, 6)
