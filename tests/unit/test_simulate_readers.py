"""Trace readers on tiny inline samples, bad rows included (with their lines)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from gpubroker.simulate.readers import TraceError, read_trace


def read(text: str, fmt: str):  # type: ignore[no-untyped-def]
    return read_trace(io.StringIO(text.lstrip("\n")), fmt)


PHILLY = """
u_id,user,gpu_num,cpu_num,node_num,interval,run_time,wall_time,new_status
0,1,1,0,1,0,100,0,Pass
1,2,8,0,1,50,200,0,Failed
2,2,x,0,1,10,300,0,Pass
3,3,0,0,1,5,300,0,Pass
4,3,2,0,1,-1,300,0,Pass
5,4,4,0,1,20,400,0,Killed
"""


def test_philly_submit_times_are_the_cumulative_sum_of_interval() -> None:
    trace = read(PHILLY, "philly")
    assert [(j.job_id, j.user, j.gpus, j.submit, j.run_time) for j in trace.jobs] == [
        ("0", "1", 1, 0.0, 100.0),
        ("1", "2", 8, 50.0, 200.0),
        ("5", "4", 4, 85.0, 400.0),  # 50 + 10 + 5 (bad rows still submitted) + 20
    ]
    assert [(p.line, p.job_id) for p in trace.problems] == [(4, "2"), (5, "3"), (6, "4")]
    reasons = [p.reason for p in trace.problems]
    assert "gpu_num 'x' is not a number" in reasons[0]
    assert "asks for no GPU" in reasons[1]
    assert "interval -1 is negative" in reasons[2]
    assert str(trace.problems[0]).startswith("line 4 (job 2): gpu_num")
    assert any("cumulative sum of `interval`" in n for n in trace.notes)


def test_helios_reads_the_subset_layout_and_the_cluster_log_layout() -> None:
    subset = read(PHILLY, "helios")
    assert len(subset.jobs) == 3
    log = read(
        """
job_id,user,vc,gpu_num,cpu_num,node_num,state,submit_time,start_time,end_time,duration
a1,u1,vcA,2,8,1,COMPLETED,2020-04-01 00:00:00,2020-04-01 00:00:05,2020-04-01 00:10:05,600
a2,u2,,0,8,1,COMPLETED,2020-04-01 00:01:00,,,60
a3,u2,vcB,1,8,1,FAILED,2020-04-01 00:02:00,,,oops
a4,u3,vcB,1,8,1,CANCELLED,1585699330,,,30
""",
        "helios",
    )
    assert [(j.job_id, j.group, j.gpus, j.run_time) for j in log.jobs] == [
        ("a1", "vcA", 2, 600.0),
        ("a4", "vcB", 1, 30.0),
    ]
    assert log.jobs[1].submit - log.jobs[0].submit == 130.0
    assert [(p.line, p.job_id) for p in log.problems] == [(3, "a2"), (4, "a3")]
    assert "duration 'oops' is not a number" in log.problems[1].reason


OPENB = """
name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time
openb-pod-0000,12000,16384,1,1000,,LS,Running,0,12537496,0
openb-pod-0001,6000,12288,1,460,,LS,Running,427061,12902960,427061
openb-pod-0016,32000,65536,0,0,,LS,Running,8962274,12902960,8962277
openb-pod-2263,32200,132096,4,1000,,LS,Failed,10814729,10815277,10814729
openb-pod-0009,4000,15258,1,1500,,BE,Running,100,200,100
openb-pod-0010,4000,15258,1,500,,BE,Pending,100,200,
openb-pod-0011,4000,15258,1,500,V100M16,BE,Running,100,50,60
"""


def test_openb_fractional_requests_round_up_and_keep_the_fraction() -> None:
    trace = read(OPENB, "openb")
    assert trace.fractional
    jobs = {j.job_id: j for j in trace.jobs}
    assert set(jobs) == {"openb-pod-0000", "openb-pod-0001", "openb-pod-2263"}
    frac = jobs["openb-pod-0001"]
    assert (frac.gpus, frac.gpu_request, frac.qos, frac.user) == (1, 0.46, "LS", None)
    assert frac.run_time == 12902960 - 427061
    assert (jobs["openb-pod-2263"].gpus, jobs["openb-pod-2263"].gpu_request) == (4, 4.0)
    lines = {p.line: p.reason for p in trace.problems}
    assert set(lines) == {4, 6, 7, 8}
    assert "CPU-only" in lines[4]
    assert "gpu_milli 1500" in lines[6]
    assert "scheduled_time is missing (pod_phase Pending)" in lines[7]
    assert "before scheduled_time" in lines[8]
    assert any("whole device" in n and "milli-GPUs" in n for n in trace.notes)


NATIVE_CSV = """
job_id,user,group,gpus,submit,run_time,time_limit,priority_class
j1,ann,vision,2,0,3600,7200,batch
j2,bob,,1,60.5,100,,
j3,bob,,1,70,100,50,
j4,cy,,1,80,100,200,interactive,extra
j5,,x,1,90,100,,
"""


def test_native_csv() -> None:
    trace = read(NATIVE_CSV, "native")
    j1, j2 = trace.jobs
    assert (j1.job_id, j1.user, j1.group, j1.gpus, j1.submit, j1.run_time) == (
        "j1",
        "ann",
        "vision",
        2,
        0.0,
        3600.0,
    )
    assert (j1.time_limit, j1.priority_class) == (7200.0, "batch")
    assert (j2.group, j2.time_limit, j2.priority_class, j2.submit) == (None, None, None, 60.5)
    problems = {p.line: p.reason for p in trace.problems}
    assert set(problems) == {4, 5, 6}
    assert "time_limit 50 s is shorter than run_time 100 s" in problems[4]
    assert "more fields than the header" in problems[5]
    assert "user is missing" in problems[6]


def test_native_json_array_object_and_lines() -> None:
    array = read(
        '[{"job_id": "a", "user": "u", "gpus": 1, "submit": 0, "run_time": 5},'
        ' {"job_id": "b", "user": "u", "gpus": "two", "submit": 1, "run_time": 5}, 3]',
        "native",
    )
    assert [j.job_id for j in array.jobs] == ["a"]
    assert [(p.where, p.line) for p in array.problems] == [("item", 2), ("item", 3)]
    assert str(array.problems[0]).startswith("item 2 (job b): gpus 'two'")
    wrapped = read(
        '{"jobs": [{"job_id": "a", "user": "u", "gpus": 1, "submit": 0, "run_time": 5}]}', "native"
    )
    assert len(wrapped.jobs) == 1
    lines = read(
        """
{"job_id": "a", "user": "u", "gpus": 1, "submit": "2024-01-01T00:00:00Z", "run_time": 5}

{"job_id": "b", "user": "u", "gpus": 1, "submit": 0
{"job_id": "c", "user": "u", "gpus": 1, "submit": "2024-01-01T00:01:00", "run_time": 5}
""",
        "native",
    )
    assert [j.job_id for j in lines.jobs] == ["a", "c"]
    assert lines.jobs[1].submit - lines.jobs[0].submit == 60.0
    assert [(p.where, p.line) for p in lines.problems] == [("line", 3)]


def test_unreadable_traces_raise() -> None:
    with pytest.raises(TraceError, match="unknown trace format"):
        read("", "slurm")
    with pytest.raises(TraceError, match="lacks interval"):
        read("user,gpu_num,run_time\n1,1,1\n", "philly")
    with pytest.raises(TraceError, match="cannot read trace"):
        read_trace(Path("/nonexistent/trace.csv"), "philly")
