"""One workload through several schedulers, and the report that compares them.

Schedulers by name:

- ``broker``: the broker's policy, :func:`gpubroker.scheduler.schedule`
  (not a copy), with the configured :class:`~gpubroker.scheduler.Policy`;
- ``fifo``: :func:`gpubroker.scheduler.fifo_schedule`, first in, first out,
  no backfill, no preemption;
- ``slurm-like``: :func:`gpubroker.simulate.baselines.schedule`, multifactor
  priority with EASY backfill, no preemption.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Iterable
from typing import Any

from .. import scheduler as core
from ..scheduler import Policy
from . import baselines
from .cluster import Cluster
from .engine import Engine, RunResult, Scheduler
from .metrics import measure
from .workload import Workload

SCHEDULERS = ("broker", "fifo", "slurm-like")

#: figures compared with FIFO: (section, key)
COMPARED = (
    ("queueing_delay_s", "mean"),
    ("queueing_delay_s", "median"),
    ("queueing_delay_s", "p95"),
    ("jct_s", "mean"),
    ("allocation", "ratio"),
)


def make_scheduler(
    name: str, slurm: baselines.SlurmSettings = baselines.DEFAULT_SETTINGS
) -> Scheduler:
    """The :class:`~gpubroker.simulate.engine.Scheduler` called ``name``.

    Raises:
        ValueError: an unknown name.
    """
    if name == "broker":
        return Scheduler(
            "broker", core.schedule, preempts=True, order=core.queue_order, fair_share_order=True
        )
    if name == "fifo":
        return Scheduler("fifo", core.fifo_schedule, strict_fifo=True)
    if name == "slurm-like":
        return Scheduler("slurm-like", functools.partial(baselines.schedule, settings=slurm))
    raise ValueError(f"unknown scheduler {name!r}: use {', '.join(SCHEDULERS)}")


def replay(
    workload: Workload,
    cluster: Cluster,
    names: Iterable[str],
    policy: Policy,
    checkpoint: frozenset[str] = frozenset(),
    until: float | None = None,
    slurm: baselines.SlurmSettings = baselines.DEFAULT_SETTINGS,
    quiet: bool = True,
) -> dict[str, RunResult]:
    """Replay ``workload`` under each scheduler of ``names``, in turn.

    A progress bar per run goes to stderr unless ``quiet`` or stderr is not a TTY.
    """
    from tqdm import tqdm  # type: ignore[import-untyped, unused-ignore]

    results = {}
    for name in names:
        total = sum(1 for j in workload.jobs if until is None or j.submit <= until)
        with tqdm(
            total=total,
            desc=f"{name:>10}",
            unit="job",
            file=sys.stderr,
            disable=True if quiet else None,
            mininterval=0.5,
            leave=False,
        ) as bar:
            engine = Engine(
                workload,
                cluster,
                make_scheduler(name, slurm),
                policy,
                checkpoint,
                until,
                bar,
            )
            results[name] = engine.run()
    return results


def _ratio(value: Any, base: Any) -> float | None:
    if value is None or base is None or base == 0 or math.isnan(value) or math.isnan(base):
        return None
    return float(value) / float(base)


def report(
    workload: Workload,
    cluster: Cluster,
    results: dict[str, RunResult],
    until: float | None = None,
    settings: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The content of ``metrics.json``: inputs, notes, problems, per-run figures,
    and each run's figures divided by FIFO's (when FIFO ran)."""
    runs = {name: measure(r, workload.fractional, until) for name, r in results.items()}
    ratios: dict[str, dict[str, float | None]] = {}
    if "fifo" in runs:
        fifo = runs["fifo"]
        for name, run in runs.items():
            ratios[name] = {
                f"{section}.{key}": _ratio(run[section][key], fifo[section][key])
                for section, key in COMPARED
            }
    return {
        "trace": {
            "source": workload.source,
            "format": workload.format,
            "jobs": len(workload.jobs),
            "problems": len(workload.problems),
            "fractional": workload.fractional,
        },
        "cluster": {
            "spec": cluster.spec,
            "gpus": cluster.total_gpus,
            "nodes": len(cluster.nodes),
            "models": cluster.models(),
        },
        "settings": settings or {},
        "notes": list(workload.notes),
        "problems": [
            {"line": p.line, "where": p.where, "job_id": p.job_id, "reason": p.reason}
            for p in workload.problems
        ],
        "runs": runs,
        "ratios_to_fifo": ratios,
    }
