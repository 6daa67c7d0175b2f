"""gpubroker benchmarks; run with ``make bench`` (``python -m benchmarks``)."""

from __future__ import annotations

from typing import Any


def figure(
    value: float, unit: str, baseline: float, name: str, digits: int | None = 3
) -> dict[str, Any]:
    """One ``bench-results.json`` entry: value, unit, baseline (named) and
    value / baseline (0 when the baseline is 0), rounded to ``digits``
    (``None``: not rounded)."""
    ratio = value / baseline if baseline else 0.0
    if digits is not None:
        value, baseline, ratio = round(value, digits), round(baseline, digits), round(ratio, digits)
    return {
        "value": value,
        "unit": unit,
        "baseline": baseline,
        "baseline_name": name,
        "ratio": ratio,
    }
