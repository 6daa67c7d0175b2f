"""The simulator's parts: cluster specs, enrichment, metrics, the Slurm-like pass."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from traitlets import TraitError

from gpubroker.scheduler import Policy, Request, Running, SchedulerState, Slot, WaitReason
from gpubroker.simulate import baselines
from gpubroker.simulate.cluster import ClusterError, load_cluster, parse_spec
from gpubroker.simulate.engine import JobRecord, LeaseSpan, RunResult
from gpubroker.simulate.metrics import binned, integrate, measure, percentile
from gpubroker.simulate.readers import Trace, TraceJob
from gpubroker.simulate.workload import Enrichment, SimJob, prepare

NOW = dt.datetime(2020, 1, 2, tzinfo=dt.timezone.utc)


def test_cluster_specs_and_files(tmp_path: Path) -> None:
    cluster = parse_spec("2x8xA100-80GB+1x4xV100")
    assert cluster.total_gpus == 20 and cluster.largest_node == 8
    assert cluster.models() == {"A100-80GB": 16, "V100": 4}
    assert [n.name for n in cluster.nodes] == ["node0000", "node0001", "node0002"]
    assert len(cluster.slots()) == 20 and cluster.slots()[0].uuid == "node0000/0"
    assert parse_spec("16x8").describe() == "128 GPUs on 16 nodes (128 x GPU)"
    assert (
        cluster.with_dgx_topology().topology[0][1][0][4]
        > cluster.with_dgx_topology().topology[0][1][0][1]
    )
    with pytest.raises(ClusterError, match="expected NODESxGPUSxMODEL"):
        parse_spec("sixteen")
    with pytest.raises(ClusterError, match="at least 1 node"):
        parse_spec("0x8")
    spec = tmp_path / "nodes.txt"
    spec.write_text("# my cluster\ndgx1 8 H100\n2x4xL4  # two small ones\nold 2\n")
    from_file = load_cluster(str(spec))
    assert [(n.name, n.gpus, n.model) for n in from_file.nodes] == [
        ("dgx1", 8, "H100"),
        ("node0001", 4, "L4"),
        ("node0002", 4, "L4"),
        ("old", 2, "GPU"),
    ]
    spec.write_text("a 8\na 4\n")
    with pytest.raises(ClusterError, match="repeat: a"):
        load_cluster(str(spec))
    spec.write_text("a eight\n")
    with pytest.raises(ClusterError, match="line 1"):
        load_cluster(str(spec))


def job(
    job_id: str, user: str | None = "ann", gpus: int = 1, submit: float = 0, **kw: object
) -> TraceJob:
    return TraceJob(job_id, user, gpus, submit, kw.pop("run_time", 100.0), 1, **kw)  # type: ignore[arg-type]


def test_enrichment_fills_groups_classes_and_limits() -> None:
    trace = Trace(
        "t",
        "native",
        [
            job("a", submit=50),
            job("b", "bob", gpus=8, submit=60, group="ml", time_limit=500, priority_class="x"),
            job("c", None, gpus=2, submit=70, qos="BE"),
            job("d", "cy", gpus=4, submit=80),
        ],
    )
    enrichment = Enrichment(
        groups=4,
        group_map={"cy": "vision"},
        class_by_user={"ann": "interactive"},
        class_by_qos={"BE": "preemptible"},
        class_by_size={"2": "batch", 8: "batch-urgent"},
        time_limit_factor=2.0,
    )
    load = prepare(trace, parse_spec("1x8"), enrichment)
    a, b, c, d = load.jobs
    assert [j.submit for j in load.jobs] == [0, 10, 20, 30]
    assert a.group is not None and a.group.startswith("group") and a.priority_class == "interactive"
    assert (b.group, b.priority_class, b.time_limit) == ("ml", "x", 500.0)
    assert c.user.startswith("user") and c.priority_class == "preemptible"
    assert (d.group, d.priority_class, d.time_limit) == ("vision", "batch-urgent", 200.0)
    assert any("trace time 50" in n for n in load.notes)
    assert any("synthetic users" in n for n in load.notes)
    again = prepare(trace, parse_spec("1x8"), enrichment)
    assert again.jobs == load.jobs


def test_time_limits_never_fall_below_run_times() -> None:
    trace = Trace("t", "native", [job(str(i), run_time=10.0 * (i + 1)) for i in range(200)])
    load = prepare(
        trace, parse_spec("1x8"), Enrichment(time_limit_factor=1.0, time_limit_jitter=0.9), 5
    )
    assert all(j.time_limit >= j.run_time for j in load.jobs)
    assert len({j.time_limit / j.run_time for j in load.jobs}) > 10
    with pytest.raises(TraitError, match=">= 1"):
        Enrichment(time_limit_factor=0.5)


def test_percentile_and_integration() -> None:
    assert percentile([], 50) != percentile([], 50)  # NaN
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([0, 10], 95) == 9.5
    series = [(0.0, 2, 1.0), (10.0, 4, 1.5), (20.0, 0, 0.0)]
    assert integrate(series, 30.0) == (60.0, 25.0)
    assert integrate(series, 15.0) == (40.0, 17.5)
    ratios = binned(series, 30.0, 4, points=3)["ratio"]
    assert ratios == [0.5, 1.0, 0.0]


def test_measure_fairness_and_fractional_figures() -> None:
    jobs = (
        SimJob(0, "a", "ann", None, 1, 0.0, 100.0, 100.0, "batch", 0.5, 2),
        SimJob(1, "b", "bob", None, 1, 50.0, 100.0, 100.0, "batch", 1.0, 3),
    )
    records = [JobRecord(0.0, 100.0, 1), JobRecord(100.0, 200.0, 1)]
    leases = [LeaseSpan(0, 1, 0.0, 100.0, "completed"), LeaseSpan(1, 1, 100.0, 200.0, "completed")]
    series = [(0.0, 1, 0.5), (100.0, 1, 1.0), (200.0, 0, 0.0)]
    result = RunResult("x", jobs, records, leases, 2, series, 200.0)
    data = measure(result, fractional=True)
    assert data["queueing_delay_s"]["mean"] == 25.0
    assert data["jct_s"]["mean"] == 125.0
    assert data["allocation"]["ratio"] == 0.5
    assert data["fractional"]["capacity_allocated"] == pytest.approx(150 / 400)
    assert data["fractional"]["fragmentation_rate"] == pytest.approx(0.25)
    fairness = data["fairness"]
    # by the last submission (50 s), ann had all the 50 GPU-s she could have
    # had in it; bob, submitted at its end, could have had none (left out)
    assert fairness["horizon_s"] == 50.0
    assert fairness["per_user"]["ann"]["demanded_gpu_s"] == 50.0
    assert fairness["per_user"]["ann"]["normalized_service"] == 1.0
    assert "bob" not in fairness["per_user"] and fairness["users"] == 1
    assert fairness["jain_index"] == 1.0
    assert "fractional" not in measure(result)


def slots(n: int = 4) -> tuple[Slot, ...]:
    return tuple(Slot(f"a{i}", "a", i) for i in range(n))


def test_slurm_like_priority_and_easy_backfill() -> None:
    busy = Running(1, "x", ("a0",), NOW - dt.timedelta(hours=1), ends=NOW + dt.timedelta(hours=1))
    pending = (
        Request(10, "ann", 4, NOW - dt.timedelta(minutes=5), time_limit=3600),  # head: reserves all
        Request(11, "bob", 1, NOW - dt.timedelta(minutes=10), time_limit=7200),  # too long
        Request(
            12, "cy", 2, NOW - dt.timedelta(minutes=1), time_limit=1800
        ),  # ends first: backfill
        Request(13, "dan", 8, NOW, time_limit=60),  # larger than any node
    )
    state = SchedulerState(slots(), (busy,), pending, Policy())
    # priority: size first (10 and 13 ahead of 12, then 11), then age
    decisions = baselines.schedule(state, NOW)
    assert [(g.lease_id, len(g.devices)) for g in decisions.grants] == [(12, 2)]
    waits = {w.lease_id: w for w in decisions.waits}
    assert [w.lease_id for w in decisions.waits] == [10, 13, 11]
    assert waits[10].reason == WaitReason.resources and waits[10].eta == NOW + dt.timedelta(hours=1)
    assert waits[13].reason == WaitReason.pool_drained
    assert waits[11].reason == WaitReason.reserved  # a device is free, but reserved for 10
    small = baselines.schedule(state, NOW, baselines.SlurmSettings(favor_small=True, job_size=1e6))
    assert [g.lease_id for g in small.grants] == [11, 12]  # smallest first, no reservation yet


def test_slurm_like_ends_leases_at_their_time_limit() -> None:
    late = Running(1, "x", ("a0",), NOW - dt.timedelta(hours=2), ends=NOW - dt.timedelta(seconds=1))
    decisions = baselines.schedule(SchedulerState(slots(), (late,), ()), NOW)
    assert [(e.lease_id, e.reason) for e in decisions.evictions] == [(1, "time limit reached")]
