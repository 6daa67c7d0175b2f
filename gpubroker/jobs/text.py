"""Jobs in text tables (``%gpu_jobs``, ``gpubroker jobs list``): one line
per job, whatever the stored spec holds (a ``%%gpu_job`` cell has many
lines; the spec itself is never changed)."""

from __future__ import annotations

import shlex
from collections.abc import Iterable, Mapping
from typing import Any

from ..oneline import one_line as printable

#: most characters of a job's notebook or command, and of its reason, in a
#: table's row
WHAT_WIDTH = 80

#: what ends a text cut to its width
CUT = "..."


def one_line(text: str, width: int | None = WHAT_WIDTH) -> str:
    """``text`` on one line of at most ``width`` characters (``None``: no
    limit): a character that is not printable (a newline, a tab, a
    terminal's escape) is shown as Python writes it in a string (``\\n``,
    ``\\t``, ``\\x1b``), and a longer text is cut, ending in ``...``."""
    shown = printable(text)
    if width is None or len(shown) <= width:
        return shown
    return shown[: max(width - len(CUT), 0)] + CUT


def job_what(job: Mapping[str, Any], width: int | None = WHAT_WIDTH) -> str:
    """A job view's notebook, or its command as a shell would read it
    (``shlex.join``), on one line of at most ``width`` characters
    (:func:`one_line`); ``""`` when its spec has neither."""
    spec = job.get("spec") or {}
    what = spec.get("notebook") or shlex.join(spec.get("command") or [])
    return one_line(str(what), width)


def job_cells(job: Mapping[str, Any]) -> dict[str, str]:
    """A job view's cells of a table, each on one line: ``what``
    (:func:`job_what`), ``devices`` (its lease's device UUIDs, ``, ``
    between them; ``""``: none) and ``reason`` (while its lease waits, the
    queue's reason, such as ``Resources``; then the job's own reason, ``; ``
    between them; a running job its engine has not started yet says so,
    ``held by its engine: PENDING (Resources)``; at most
    :data:`WHAT_WIDTH` characters)."""
    queue = job.get("queue") or {}
    held = job.get("engine_wait")
    reasons = (
        queue.get("reason"),
        f"held by its engine: {held}" if held else None,
        job.get("reason"),
    )
    return {
        "what": job_what(job),
        "devices": ", ".join(str(d) for d in job.get("devices") or []),
        "reason": one_line("; ".join(str(r) for r in reasons if r)),
    }


def text_table(rows: Iterable[Mapping[str, Any]], columns: tuple[str, ...]) -> str:
    """``rows`` as a text table: a header of ``columns``, then one line per
    row, the columns two spaces apart; every cell on one line
    (:func:`one_line`, not cut) and a missing one empty."""
    text = [columns] + [tuple(one_line(str(r.get(c, "")), None) for c in columns) for r in rows]
    widths = [max(len(row[i]) for row in text) for i in range(len(columns))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in text
    )
