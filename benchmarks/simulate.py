"""Trace replay: the Philly 15,000-job subset on a 128-GPU cluster (16 x 8)
under FIFO, the Slurm-like baseline and the broker's default policy.

Prints, for each, the mean and median queueing delay, the mean JCT and the
allocation ratio with their ratios to FIFO, and the simulated jobs per
second of wall time. The trace lives outside the repository
(``../shared/traces/philly``, read-only); where it is absent the benchmark
says so and is skipped.

The trace asks for about 4.3 times what 128 GPUs can give over its 57.6 days,
so queues grow long and delays are weeks: it is a stress test of the
policies and of the simulator, not a model of Philly's own (much larger)
cluster.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpubroker.policy_config import SchedulingPolicy
from gpubroker.simulate.cluster import parse_spec
from gpubroker.simulate.compare import SCHEDULERS, replay, report
from gpubroker.simulate.readers import read_trace
from gpubroker.simulate.workload import Enrichment, prepare

TRACE_DIR = Path(__file__).resolve().parents[2] / "shared" / "traces" / "philly"
TRACE = TRACE_DIR / "philly_last15000_jobs.csv"
CLUSTER = "16x8xA100-80GB"
BASELINE = "FIFO without backfill"

#: (figure name, section, key, unit)
FIGURES = (
    ("queue_mean_s", "queueing_delay_s", "mean", "s"),
    ("queue_median_s", "queueing_delay_s", "median", "s"),
    ("jct_mean_s", "jct_s", "mean", "s"),
    ("allocation_ratio", "allocation", "ratio", "fraction"),
    ("jobs_per_s", "simulation", "jobs_per_s", "jobs/s"),
)


def describe() -> str:
    """One line: what the benchmark replays."""
    return (
        f"Simulation: Philly 15,000-job subset on {CLUSTER} (128 GPUs), "
        f"{', '.join(SCHEDULERS)}; figures relative to {BASELINE}"
    )


def _days(seconds: float) -> str:
    return f"{seconds:>13,.0f} s ({seconds / 86400:5.1f} d)"


def run() -> dict[str, dict[str, Any]]:
    """Replay the trace; figures: name -> {value, unit, baseline, baseline_name, ratio}."""
    if not TRACE.is_file():
        print(f"Simulation: skipped, no Philly trace at {TRACE}")
        return {}
    cluster = parse_spec(CLUSTER)
    trace = read_trace(TRACE, "philly")
    workload = prepare(trace, cluster, Enrichment(), seed=0)
    policy = SchedulingPolicy().build()
    results = replay(workload, cluster, ("fifo", "slurm-like", "broker"), policy)
    data = report(workload, cluster, results)
    runs = data["runs"]
    print(
        f"  {len(workload.jobs):,} jobs replayed, {len(workload.problems)} rows left out "
        f"(more GPUs than a node has)"
    )
    print(
        f"  {'policy':<11} {'queue mean':>24} {'queue median':>24} {'JCT mean':>24} "
        f"{'alloc':>6} {'jobs/s':>8} {'wall s':>7}   ratios to FIFO (mean, median, JCT, alloc)"
    )
    fifo = runs["fifo"]
    figures: dict[str, dict[str, Any]] = {}
    for name, run_ in runs.items():
        delay, jct = run_["queueing_delay_s"], run_["jct_s"]
        ratios = data["ratios_to_fifo"][name]
        print(
            f"  {name:<11} {_days(delay['mean'])} {_days(delay['median'])} {_days(jct['mean'])} "
            f"{run_['allocation']['ratio']:>6.3f} {run_['simulation']['jobs_per_s']:>8,.0f} "
            f"{run_['simulation']['wall_s']:>7.1f}   "
            f"{ratios['queueing_delay_s.mean']:.3f}, {ratios['queueing_delay_s.median']:.3f}, "
            f"{ratios['jct_s.mean']:.3f}, {ratios['allocation.ratio']:.3f}"
        )
        for figure, section, key, unit in FIGURES:
            value, base = run_[section][key], fifo[section][key]
            figures[f"simulate.philly.{name}.{figure}"] = {
                "value": round(value, 3),
                "unit": unit,
                "baseline": round(base, 3),
                "baseline_name": BASELINE,
                "ratio": round(value / base, 3) if base else None,
            }
    return figures


if __name__ == "__main__":
    print(describe())
    run()
