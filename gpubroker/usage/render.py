"""Usage reports written out: an aligned table, CSV, JSON, or an HTML page
with plots (matplotlib, drawn to inline SVG: the page needs no other file).

Every value that came from users (user, group, pool names) is HTML-escaped
in the HTML page.
"""

from __future__ import annotations

import csv
import datetime as dt
import html
import io
import json
import threading
from collections.abc import Sequence
from typing import Any

from .report import COLUMNS, ReportRequest, ReportRow

#: column headings of the table and HTML formats
HEADINGS = {
    "gpu_hours_allocated": "GPU-h allocated",
    "gpu_hours_used": "GPU-h used",
    "efficiency": "efficiency",
    "wait_hours": "wait h",
    "leases": "leases",
    "jobs": "jobs",
    "culls": "culls",
    "preemptions": "preemptions",
    "idle_gpu_hours_culled": "idle GPU-h culled",
    "cost": "cost",
}


def cell(value: Any) -> str:
    """A report value as the table shows it (``-`` for none, 3 decimals)."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 1000 else f"{value:.1f}"
    return str(value)


def header(request: ReportRequest) -> str:
    """One line naming the period, the grouping and the time zone."""
    return (
        f"GPU usage from {request.start.isoformat()} to {request.end.isoformat()} "
        f"by {request.by} (time zone {request.tz})"
    )


def as_table(request: ReportRequest, rows: Sequence[ReportRow]) -> str:
    """An aligned text table with a header line."""
    names = [request.by, *(HEADINGS[c] for c in COLUMNS)]
    cells = [[r.key or "-", *(cell(getattr(r, c)) for c in COLUMNS)] for r in rows]
    widths = [max([len(n)] + [len(row[i]) for row in cells]) for i, n in enumerate(names)]
    lines = [header(request), ""]
    lines.append(
        "  ".join(
            n.ljust(w) if i == 0 else n.rjust(w)
            for i, (n, w) in enumerate(zip(names, widths, strict=True))
        )
    )
    for row in cells:
        lines.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    if not rows:
        lines.append("(no usage in this period)")
    return "\n".join(lines) + "\n"


def _safe_cell(text: str) -> str:
    """A key as a spreadsheet reads it: one beginning with ``=``, ``+``,
    ``-``, ``@`` (a formula) gets a leading ``'``."""
    return "'" + text if text[:1] in ("=", "+", "-", "@", "\t", "\r") else text


def as_csv(request: ReportRequest, rows: Sequence[ReportRow]) -> str:
    """CSV with a header row: the grouping's name, then :data:`COLUMNS`;
    keys that a spreadsheet would read as formulas are quoted with ``'``."""
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow([request.by, *COLUMNS])
    for r in rows:
        cells = ("" if getattr(r, c) is None else getattr(r, c) for c in COLUMNS)
        writer.writerow([_safe_cell(r.key), *cells])
    return out.getvalue()


def _utc(at: dt.datetime) -> str:
    """``at`` (aware) as the API writes times: UTC with microseconds,
    ``2026-11-01T00:00:00.000000Z``."""
    return at.astimezone(dt.timezone.utc).replace(tzinfo=None).isoformat("T", "microseconds") + "Z"


def as_json(request: ReportRequest, rows: Sequence[ReportRow]) -> dict[str, Any]:
    """The report as a JSON object (``UsageReport`` in the OpenAPI document)."""
    return {
        "from": _utc(request.start),
        "to": _utc(request.end),
        "by": request.by,
        "tz": request.tz,
        "columns": list(COLUMNS),
        "rows": [r.as_dict() for r in rows],
    }


def as_html(request: ReportRequest, rows: Sequence[ReportRow], plots: dict[str, Any]) -> str:
    """A self-contained HTML page: the table and three plots (allocated vs
    used GPU-hours per day of the top users, the top users, the
    distribution of waits in the queue), drawn with matplotlib."""
    e = html.escape
    head = "".join(f"<th>{e(h)}</th>" for h in [request.by, *(HEADINGS[c] for c in COLUMNS)])
    body = "".join(
        "<tr>"
        + "".join(f"<td>{e(x)}</td>" for x in [r.key, *(cell(getattr(r, c)) for c in COLUMNS)])
        + "</tr>"
        for r in rows
    )
    drawn = "".join(f"<figure>{svg}</figure>" for svg in figures(plots))
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'>"
        f"<title>gpubroker usage</title><style>{_CSS}</style></head><body>"
        f"<h1>GPU usage</h1><p>{e(header(request))}</p>"
        f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
        f"{drawn}</body></html>"
    )


_CSS = (
    "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
    "td,th{border:1px solid #ccc;padding:.2em .6em;text-align:right}"
    "td:first-child,th:first-child{text-align:left}figure{margin:2em 0}"
)


#: one matplotlib drawing at a time (see :func:`figures`)
_DRAWING = threading.Lock()


def figures(data: dict[str, Any]) -> list[str]:
    """Three SVG figures (strings: ``<svg …>`` elements) from
    :func:`gpubroker.usage.query.series`."""
    import matplotlib

    matplotlib.use("Agg")
    # names come from users: never parsed as mathtext ($...$); pyplot and its
    # settings are global, so one drawing at a time (reports run in threads)
    with _DRAWING, matplotlib.rc_context({"text.parse_math": False}):
        return _draw(data)


def _draw(data: dict[str, Any]) -> list[str]:
    from matplotlib import pyplot as plt

    svgs = []
    days, users = data["days"], data["users"]
    fig, ax = plt.subplots(figsize=(9, 4))
    for name in users:
        # labels never begin with the name: matplotlib hides labels starting with "_"
        line = ax.plot(days, data["allocated"][name], label=f"allocated: {name}")
        ax.plot(
            days,
            data["used"][name],
            linestyle="--",
            color=line[0].get_color(),
            label=f"used: {name}",
        )
    ax.set_title("GPU-hours per day: allocated (solid) and used (dashed)")
    ax.set_ylabel("GPU-hours")
    ax.tick_params(axis="x", labelrotation=60, labelsize=7)
    if users:
        ax.legend(fontsize=7, ncol=2)
    svgs.append(_svg(fig, plt))
    fig, ax = plt.subplots(figsize=(9, 3.5))
    totals = [sum(data["allocated"][u]) for u in users]
    used = [sum(data["used"][u]) for u in users]
    ax.barh(users[::-1], totals[::-1], label="allocated")
    ax.barh(users[::-1], used[::-1], label="used")
    ax.set_title("Top users: GPU-hours allocated and used")
    ax.set_xlabel("GPU-hours")
    if users:
        ax.legend(fontsize=8)
    svgs.append(_svg(fig, plt))
    fig, ax = plt.subplots(figsize=(9, 3.5))
    ax.hist(data["waits"] or [0.0], bins=20)
    ax.set_title(f"Waits in the queue ({len(data['waits'])} requests)")
    ax.set_xlabel("hours waited")
    ax.set_ylabel("requests")
    svgs.append(_svg(fig, plt))
    return svgs


def _svg(fig: Any, plt: Any) -> str:
    out = io.StringIO()
    fig.tight_layout()
    fig.savefig(out, format="svg")
    plt.close(fig)
    text = out.getvalue()
    return text[text.index("<svg") :]


def html_problem(fmt: str) -> str | None:
    """Why ``fmt`` cannot be written here (``html`` needs matplotlib), or ``None``."""
    import importlib.util

    if fmt == "html" and importlib.util.find_spec("matplotlib") is None:
        return "format: html needs matplotlib (pip install 'gpubroker[report]')"
    return None


def render(
    request: ReportRequest, rows: Sequence[ReportRow], plots: dict[str, Any] | None = None
) -> str:
    """The report in ``request.format`` (``html`` needs ``plots``)."""
    if request.format == "csv":
        return as_csv(request, rows)
    if request.format == "json":
        return json.dumps(as_json(request, rows), indent=2) + "\n"
    if request.format == "html":
        return as_html(
            request,
            rows,
            plots or {"days": [], "users": [], "allocated": {}, "used": {}, "waits": []},
        )
    return as_table(request, rows)
