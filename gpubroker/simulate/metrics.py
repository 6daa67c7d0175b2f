"""Figures of one replay: queueing delay, JCT, allocation, preemption, fairness.

Definitions (times in seconds after the first submission):

- queueing delay: first start - submit, over jobs that started;
- JCT (job completion time): finish - submit, over jobs that finished;
- allocation ratio: allocated GPUs / cluster GPUs, time-weighted over
  ``[0, end]`` (``end``: the last completion, or ``--until``);
- fractional traces: *capacity allocated* is requested GPUs (from the
  milli-GPUs asked for) / cluster GPUs, time-weighted; *fragmentation rate*
  is the share of allocated GPU-seconds that nobody asked for (a fractional
  request holds a whole device: 1 - requested / allocated);
- fairness: Jain's index ``(sum x)^2 / (n sum x^2)`` over users of their
  normalised service ``x = min(received / demanded, 1)`` within the arrival
  window ``[0, H]`` (``H``: the last submission, or ``--until`` if earlier):
  ``received`` is the GPU-seconds the user's leases held in the window,
  ``demanded`` the GPU-seconds (GPUs x run time) of the jobs they submitted
  in it. 1 is perfectly even; ``1/n`` is one user served alone.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from .engine import RunResult

#: points of the allocation series in metrics.json
SERIES_POINTS = 500


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation; NaN if empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = q / 100.0 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summary(values: Sequence[float]) -> dict[str, float | None]:
    """Mean, median and p95 (seconds); ``None`` when there are no values."""
    if not values:
        return {"mean": None, "median": None, "p95": None}
    return {
        "mean": sum(values) / len(values),
        "median": percentile(values, 50),
        "p95": percentile(values, 95),
    }


def integrate(series: Sequence[tuple[float, float, float]], end: float) -> tuple[float, float]:
    """(allocated, requested) GPU-seconds over ``[0, end]`` of a step series."""
    allocated = requested = 0.0
    for (t, held, asked), nxt in zip(series, [*series[1:], (end, 0, 0.0)], strict=True):
        span = max(min(nxt[0], end) - t, 0.0)
        allocated += held * span
        requested += asked * span
    return allocated, requested


def binned(
    series: Sequence[tuple[float, float, float]],
    end: float,
    total: int,
    points: int = SERIES_POINTS,
) -> dict[str, list[float]]:
    """The allocation ratio as ``points`` time-weighted bin means over ``[0, end]``."""
    if end <= 0 or total <= 0:
        return {"t_s": [], "ratio": []}
    width = end / points
    sums = [0.0] * points
    for (t, held, _), nxt in zip(series, [*series[1:], (end, 0, 0.0)], strict=True):
        start, stop = t, min(nxt[0], end)
        while start < stop:
            b = min(int(start / width), points - 1)
            edge = stop if b == points - 1 else min(stop, (b + 1) * width)
            if edge <= start:  # float rounding at a bin edge
                b += 1
                edge = stop if b == points - 1 else min(stop, (b + 1) * width)
            sums[b] += held * (edge - start)
            start = edge
    return {
        "t_s": [round((b + 0.5) * width, 3) for b in range(points)],
        "ratio": [round(s / (width * total), 6) for s in sums],
    }


def _fairness(result: RunResult, horizon: float) -> dict[str, Any]:
    demanded: dict[str, float] = defaultdict(float)
    received: dict[str, float] = defaultdict(float)
    jobs: dict[str, int] = defaultdict(int)
    delays: dict[str, list[float]] = defaultdict(list)
    for job, record in zip(result.jobs, result.records, strict=True):
        if job.submit <= horizon:
            # what the job could have held within the window at most: its
            # run from its submission, cut at the window's end
            demanded[job.user] += job.gpus * min(job.run_time, horizon - job.submit)
            jobs[job.user] += 1
        if record.first_start is not None:
            delays[job.user].append(record.first_start - job.submit)
    for span in result.leases:
        overlap = min(span.end, horizon) - span.start
        if overlap > 0:
            received[result.jobs[span.job].user] += span.gpus * overlap
    users = sorted(u for u, d in demanded.items() if d > 0)
    share = {u: min(received[u] / demanded[u], 1.0) for u in users}
    values = list(share.values())
    square = sum(x * x for x in values)
    jain = (sum(values) ** 2 / (len(values) * square)) if square > 0 else None
    return {
        "jain_index": jain,
        "horizon_s": horizon,
        "users": len(users),
        "per_user": {
            u: {
                "jobs": jobs[u],
                "demanded_gpu_s": round(demanded[u], 3),
                "received_gpu_s": round(received[u], 3),
                "normalized_service": round(share[u], 6),
                "mean_queueing_delay_s": (
                    round(sum(delays[u]) / len(delays[u]), 3) if delays[u] else None
                ),
            }
            for u in users
        },
    }


def measure(
    result: RunResult, fractional: bool = False, until: float | None = None
) -> dict[str, Any]:
    """Every figure of ``result`` as a JSON-ready dict (see the module doc)."""
    jobs, records = result.jobs, result.records
    end = result.end
    delays = [
        r.first_start - j.submit
        for j, r in zip(jobs, records, strict=True)
        if r.first_start is not None
    ]
    jct = [r.finish - j.submit for j, r in zip(jobs, records, strict=True) if r.finish is not None]
    arrived = sum(1 for j in jobs if j.submit <= end)
    finished = sum(1 for r in records if r.finish is not None)
    replayed = sum(1 for j in jobs if j.submit <= result.end)
    allocated, requested = integrate(result.series, end)
    capacity = result.total_gpus * end
    last_submit = max((j.submit for j in jobs), default=0.0)
    horizon = last_submit if until is None else min(last_submit, until)
    out: dict[str, Any] = {
        "scheduler": result.scheduler,
        "jobs": {
            "submitted": len(jobs),
            "arrived": arrived,
            "started": len(delays),
            "finished": finished,
            "timed_out": sum(1 for r in records if r.timed_out),
            "never_started": arrived - len(delays),
            "unfinished": arrived - finished,
        },
        "queueing_delay_s": summary(delays),
        "jct_s": summary(jct),
        "makespan_s": max((r.finish for r in records if r.finish is not None), default=0.0),
        "allocation": {
            "ratio": allocated / capacity if capacity > 0 else None,
            "gpu_seconds": allocated,
            "window_s": [0.0, end],
            "series": binned(result.series, end, result.total_gpus),
        },
        "preemptions": {
            "notices": result.notices,
            "evictions": result.evictions,
            "withdrawn": result.withdrawn,
            "jobs_preempted": sum(1 for r in records if r.preempted),
            "lost_gpu_seconds": sum(r.lost_gpu_seconds for r in records),
        },
        "fairness": _fairness(result, horizon),
        "simulation": {
            "passes": result.passes,
            "passes_skipped": result.skipped,
            "prefix_passes": result.prefix_passes,
            "full_passes_after_prefix": result.full_passes,
            "events": result.events,
            "wall_s": result.wall,
            # the jobs submitted before the replay stopped (--until): those it handled
            "jobs_replayed": replayed,
            "jobs_per_s": replayed / result.wall if result.wall > 0 else None,
        },
    }
    if fractional:
        out["fractional"] = {
            "capacity_allocated": requested / capacity if capacity > 0 else None,
            "fragmentation_rate": 1.0 - requested / allocated if allocated > 0 else None,
            "requested_gpu_seconds": requested,
        }
    return out
