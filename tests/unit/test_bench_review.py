"""Review of the benchmark figures: ratios against a zero baseline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import benchmarks
from benchmarks import __main__ as bench_main


def test_zero_baseline_gives_no_ratio_not_zero() -> None:
    # a ratio of 0 reads as "none of the baseline's time" (a perfect delay);
    # with a zero baseline there is no ratio at all
    entry = benchmarks.figure(10.0, "s", 0.0, "FIFO")
    assert entry["ratio"] is None
    assert benchmarks.figure(3.0, "s", 2.0, "FIFO")["ratio"] == 1.5
    assert benchmarks.figure(1.0, "s", 3.0, "FIFO", None)["ratio"] == pytest.approx(1 / 3)


def test_table_prints_figures_without_a_ratio(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # benchmarks.simulate writes ratio None when FIFO's figure is 0; the
    # summary table must print it, not stop make bench before the JSON is written
    names = ("scheduler", "simulate", "packing", "sharing", "usage", "jobs", "panel", "slurm")
    for name in names:
        module = getattr(bench_main, name)
        monkeypatch.setattr(module, "describe", lambda: "described")
        monkeypatch.setattr(module, "run", lambda: {})
    none = {"value": 5.0, "unit": "s", "baseline": 0.0, "baseline_name": "FIFO", "ratio": None}
    monkeypatch.setattr(bench_main.simulate, "run", lambda: {"simulate.x.queue_median_s": none})
    monkeypatch.setattr(bench_main.api, "run", lambda: {})
    monkeypatch.chdir(tmp_path)
    bench_main.main()
    assert "simulate.x.queue_median_s" in capsys.readouterr().out
    written = json.loads((tmp_path / "bench-results.json").read_text())
    assert written["simulate.x.queue_median_s"]["ratio"] is None


def test_jain_index_of_users_all_served_at_once_is_one() -> None:
    from gpubroker.simulate.engine import JobRecord, LeaseSpan, RunResult
    from gpubroker.simulate.metrics import measure
    from gpubroker.simulate.workload import SimJob

    # three users, three GPUs, every job starts the moment it is submitted:
    # service is as even as it can be, so the index is 1 (it was 0.46: ann's
    # and bob's runs past the last submission, 50 s, counted as unserved)
    jobs = (
        SimJob(0, "a", "ann", None, 1, 0.0, 100.0, 100.0, "batch", 1.0, 2),
        SimJob(1, "b", "bob", None, 1, 40.0, 100.0, 100.0, "batch", 1.0, 3),
        SimJob(2, "c", "cy", None, 1, 50.0, 10.0, 10.0, "batch", 1.0, 4),
    )
    records = [JobRecord(0.0, 100.0, 1), JobRecord(40.0, 140.0, 1), JobRecord(50.0, 60.0, 1)]
    leases = [
        LeaseSpan(2, 1, 50.0, 60.0, "completed"),
        LeaseSpan(0, 1, 0.0, 100.0, "completed"),
        LeaseSpan(1, 1, 40.0, 140.0, "completed"),
    ]
    series = [(0.0, 1, 1.0), (40.0, 2, 2.0), (50.0, 3, 3.0), (60.0, 2, 2.0), (100.0, 1, 1.0)]
    result = RunResult("x", jobs, records, leases, 3, series, 140.0)
    assert measure(result)["fairness"]["jain_index"] == pytest.approx(1.0)


def test_jain_index_of_a_user_kept_waiting_is_below_one() -> None:
    from gpubroker.simulate.engine import JobRecord, LeaseSpan, RunResult
    from gpubroker.simulate.metrics import measure
    from gpubroker.simulate.workload import SimJob

    # one GPU, ann and bob both submit at 0: ann runs first, bob waits the
    # whole window (to cy's submission at 100 s): service is uneven
    jobs = (
        SimJob(0, "a", "ann", None, 1, 0.0, 100.0, 100.0, "batch", 1.0, 2),
        SimJob(1, "b", "bob", None, 1, 0.0, 100.0, 100.0, "batch", 1.0, 3),
        SimJob(2, "c", "cy", None, 1, 100.0, 10.0, 10.0, "batch", 1.0, 4),
    )
    records = [JobRecord(0.0, 100.0, 1), JobRecord(100.0, 200.0, 1), JobRecord(200.0, 210.0, 1)]
    leases = [
        LeaseSpan(0, 1, 0.0, 100.0, "completed"),
        LeaseSpan(1, 1, 100.0, 200.0, "completed"),
        LeaseSpan(2, 1, 200.0, 210.0, "completed"),
    ]
    series = [(0.0, 1, 1.0), (210.0, 0, 0.0)]
    result = RunResult("x", jobs, records, leases, 1, series, 210.0)
    fairness = measure(result)["fairness"]
    assert fairness["per_user"]["bob"]["normalized_service"] == 0.0
    assert fairness["jain_index"] == pytest.approx(0.5)
