"""PNG figures of a comparison: allocation over time, queueing-delay CDF.

matplotlib is imported only here, and only when figures are drawn; the
figures use the Agg canvas directly (no pyplot, no global backend change).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .engine import RunResult

DAY = 86400.0


def _figure(width: float = 8.0, height: float = 4.5) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def allocation(report: Mapping[str, Any], path: Path) -> Path:
    """Allocated / total GPUs over time (bin means), one line per scheduler."""
    figure = _figure()
    axes = figure.add_subplot()
    for name, run in report["runs"].items():
        series = run["allocation"]["series"]
        days = [t / DAY for t in series["t_s"]]
        mean = run["allocation"]["ratio"] or 0.0
        axes.plot(days, series["ratio"], linewidth=1.0, label=f"{name} (mean {mean:.2f})")
    axes.set_xlabel("days after the first submission")
    axes.set_ylabel("allocated / total GPUs")
    axes.set_ylim(0, 1.05)
    axes.set_title(f"GPU allocation, {report['cluster']['gpus']} GPUs")
    axes.grid(alpha=0.3)
    axes.legend(loc="lower right")
    figure.savefig(path)
    return path


def delay_cdf(results: Mapping[str, RunResult], path: Path) -> Path:
    """CDF of queueing delays (first start - submit), one line per scheduler."""
    figure = _figure()
    axes = figure.add_subplot()
    for name, result in results.items():
        delays = sorted(
            max(r.first_start - j.submit, 0.0)
            for j, r in zip(result.jobs, result.records, strict=True)
            if r.first_start is not None
        )
        if not delays:
            continue
        n = len(delays)
        axes.step(delays, [(i + 1) / n for i in range(n)], where="post", label=name)
    axes.set_xscale("symlog", linthresh=1.0)
    axes.set_xlabel("queueing delay, seconds (symmetric log scale)")
    axes.set_ylabel("fraction of jobs")
    axes.set_ylim(0, 1.0)
    axes.set_title("Queueing delay CDF")
    axes.grid(alpha=0.3)
    axes.legend(loc="lower right")
    figure.savefig(path)
    return path


def write(report: Mapping[str, Any], results: Mapping[str, RunResult], out: Path) -> list[Path]:
    """Both figures into ``out``; their paths."""
    out.mkdir(parents=True, exist_ok=True)
    return [
        allocation(report, out / "allocation.png"),
        delay_cdf(results, out / "queueing_delay_cdf.png"),
    ]
