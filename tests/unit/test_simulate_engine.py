"""The simulator's event loop against schedules worked out by hand."""

from __future__ import annotations

import io
import random

import pytest

from gpubroker.scheduler import Policy, Quota
from gpubroker.simulate.cluster import parse_spec
from gpubroker.simulate.compare import make_scheduler, replay, report
from gpubroker.simulate.engine import Engine, RunResult
from gpubroker.simulate.readers import TraceJob, read_trace
from gpubroker.simulate.workload import Enrichment, Workload, prepare

# One node of 4 GPUs. Time limits equal run times, so backfill sees exact ends.
#
# FIFO (no backfill): J1 starts at 0 (2 GPUs, ends 100). J2 (4 GPUs) waits
# for the whole node, and everything behind it waits too. J1 ends at 100: J2
# starts (ends 150). At 150: J3, J4, J5 start (1 + 2 + 1 = 4 GPUs); J6 waits
# for a device: J5 ends first, at 150 + 20 = 170, and J6 starts then.
#
# Broker (reservation + backfill): J2 cannot start at 10 and reserves all four
# devices from 100 (when J1 ends). J3 arrives at 20 and ends by 50 < 100: it
# starts at once on a free device. J4 (2 GPUs) at 30 finds one free device
# only and waits (reserved after J2, from 150). J5 at 40 ends by 60 < 100:
# backfilled. J6 at 45 would end at 145 > 100: it waits, as it does when J3
# and J5 end (50, 60). J1 ends at 100: J2 starts. J2 ends at 150: J4 and J6
# start. The Slurm-like baseline (EASY backfill; the size factor puts J2
# and J4 ahead of the 1-GPU jobs) gives the same schedule here.
HAND = """
job_id,user,gpus,submit,run_time,time_limit
J1,u1,2,0,100,100
J2,u2,4,10,50,50
J3,u3,1,20,30,30
J4,u4,2,30,200,200
J5,u5,1,40,20,20
J6,u6,1,45,100,100
"""
FIFO_STARTS = {"J1": 0, "J2": 100, "J3": 150, "J4": 150, "J5": 150, "J6": 170}
BACKFILL_STARTS = {"J1": 0, "J2": 100, "J3": 20, "J4": 150, "J5": 40, "J6": 150}


def workload(text: str, cluster: str, fmt: str = "native", **enrich: object) -> Workload:
    trace = read_trace(io.StringIO(text.lstrip("\n")), fmt)
    return prepare(trace, parse_spec(cluster), Enrichment(**enrich), seed=0)


def starts(result: RunResult) -> dict[str, float | None]:
    return {j.job_id: r.first_start for j, r in zip(result.jobs, result.records, strict=True)}


@pytest.mark.parametrize(
    ("name", "expected"),
    [("fifo", FIFO_STARTS), ("broker", BACKFILL_STARTS), ("slurm-like", BACKFILL_STARTS)],
)
def test_hand_made_schedule(name: str, expected: dict[str, float]) -> None:
    cluster = parse_spec("1x4xA100-80GB")
    result = Engine(workload(HAND, "1x4"), cluster, make_scheduler(name), Policy()).run()
    assert starts(result) == expected
    finish = {j.job_id: r.finish for j, r in zip(result.jobs, result.records, strict=True)}
    runs = {"J1": 100, "J2": 50, "J3": 30, "J4": 200, "J5": 20, "J6": 100}
    assert finish == {j: expected[j] + runs[j] for j in expected}
    assert result.evictions == 0


def test_a_job_larger_than_any_node_is_reported_and_the_rest_runs() -> None:
    text = """
u_id,user,gpu_num,cpu_num,node_num,interval,run_time,wall_time,new_status
0,1,1,0,1,0,100,0,Pass
1,2,16,0,2,10,100,0,Pass
2,3,8,0,1,10,100,0,Pass
"""
    load = workload(text, "2x8", "philly")
    assert [j.job_id for j in load.jobs] == ["0", "2"]
    (problem,) = load.problems
    assert problem.line == 3 and problem.job_id == "1"
    assert "16 GPUs on one node" in problem.reason and "largest node has 8" in problem.reason
    results = replay(load, parse_spec("2x8"), ["broker", "fifo"], Policy())
    for result in results.values():
        assert starts(result) == {"0": 0.0, "2": 20.0}
    data = report(load, parse_spec("2x8"), results)
    assert data["problems"][0]["line"] == 3


# Preemption: one node of 2 GPUs. A (preemptible) holds both from 0. B
# (batch-urgent, which may preempt) arrives at 100: A is told, and evicted
# after its class's 30 s grace, at 130; B starts at 130 on the devices
# reclaimed for it and ends at 180; A restarts then from zero (ends 1180),
# or, when its class checkpoints, with the 870 s it had left (ends 1050).
PREEMPT = """
job_id,user,gpus,submit,run_time,time_limit,priority_class
A,ann,2,0,1000,1000,preemptible
B,bob,2,100,50,50,batch-urgent
"""


@pytest.mark.parametrize(
    ("checkpoint", "a_finish", "lost"),
    [(frozenset(), 1180.0, 260.0), (frozenset({"preemptible"}), 1050.0, 0.0)],
)
def test_preempted_job_restarts_from_zero_unless_it_checkpoints(
    checkpoint: frozenset[str], a_finish: float, lost: float
) -> None:
    cluster = parse_spec("1x2")
    result = Engine(
        workload(PREEMPT, "1x2"), cluster, make_scheduler("broker"), Policy(), checkpoint
    ).run()
    a, b = result.records
    assert (b.first_start, b.finish) == (130.0, 180.0)
    assert (a.first_start, a.finish, a.starts, a.preempted) == (0.0, a_finish, 2, 1)
    assert a.lost_gpu_seconds == lost
    assert (result.notices, result.evictions) == (1, 1)
    spans = [(s.start, s.end, s.ended) for s in result.leases if s.job == 0]
    assert spans[0] == (0.0, 130.0, "preempted")


def test_baselines_never_preempt() -> None:
    cluster = parse_spec("1x2")
    for name in ("fifo", "slurm-like"):
        result = Engine(workload(PREEMPT, "1x2"), cluster, make_scheduler(name), Policy()).run()
        assert starts(result) == {"A": 0.0, "B": 1000.0}
        assert result.notices == 0


def test_until_stops_the_clock() -> None:
    cluster = parse_spec("1x4")
    result = Engine(
        workload(HAND, "1x4"), cluster, make_scheduler("fifo"), Policy(), until=120.0
    ).run()
    assert result.end == 120.0
    assert starts(result) == {"J1": 0, "J2": 100, "J3": None, "J4": None, "J5": None, "J6": None}
    assert [r.finish for r in result.records] == [100.0] + [None] * 5


def test_same_seed_and_inputs_give_identical_results() -> None:
    def once(seed: int) -> dict[str, object]:
        trace = read_trace("tests/data/philly_first300.csv", "philly")
        enrichment = Enrichment(time_limit_jitter=0.5, class_by_size={1: "batch", 8: "preemptible"})
        load = prepare(trace, parse_spec("4x8"), enrichment, seed)
        results = replay(load, parse_spec("4x8"), ["broker", "slurm-like"], Policy())
        data = report(load, parse_spec("4x8"), results)
        for run in data["runs"].values():
            run.pop("simulation")  # wall-clock timings
        return data

    first = once(7)
    assert once(7) == first
    assert once(8) != first


def random_workload(seed: int, jobs: int, cluster: str, **enrich: object) -> Workload:
    """Many small and some whole-node jobs arriving faster than they run."""
    rng = random.Random(seed)
    rows, t = [], 0.0
    for i in range(jobs):
        t += rng.expovariate(1 / 20)
        run = rng.choice((5, 30, 60, 600, 3600)) * rng.uniform(0.5, 1.5)
        gpus = rng.choices((1, 2, 4, 8), weights=(70, 10, 10, 10))[0]
        rows.append(TraceJob(f"r{i}", f"u{rng.randrange(12)}", gpus, t, run, i + 2))
    from gpubroker.simulate.readers import Trace

    trace = Trace("<random>", "native", rows)
    enrichment = Enrichment(time_limit_jitter=0.3, **enrich)
    return prepare(trace, parse_spec(cluster), enrichment, seed)


LIMITS = Policy(user_quotas={"u1": Quota(limit=2), "u2": Quota(limit=4)}, max_reservations=20)
GUARANTEES = Policy(user_quotas={"u1": Quota(guaranteed=4, limit=8)})


@pytest.mark.parametrize(
    ("policy", "classes", "jobs", "prefix"),
    [
        (Policy(), {}, 800, True),
        (LIMITS, {1: "interactive", 4: "batch"}, 700, True),
        (GUARANTEES, {1: "batch", 8: "preemptible"}, 400, False),
    ],
)
def test_prefix_passes_decide_as_full_passes_do(
    policy: Policy, classes: dict[int, str], jobs: int, prefix: bool
) -> None:
    """The broker's passes over a long queue run on a prefix; each is checked
    against the full pass (verify), and the whole run against full passes only."""
    cluster = parse_spec("2x8")
    load = random_workload(3, jobs, "2x8", class_by_size=classes)
    fast = Engine(load, cluster, make_scheduler("broker"), policy, verify=True).run()
    assert (fast.prefix_passes > 50) == prefix
    if not classes:
        assert fast.candidates > 100  # requests behind a prefix had to be tried
    if policy is LIMITS:  # a short reservation window: heads leave large requests out
        assert fast.passed_over > 1000
    plain = make_scheduler("broker")
    slow = Engine(load, cluster, type(plain)("broker", plain.schedule, preempts=True), policy).run()
    assert slow.prefix_passes == 0
    assert [r.first_start for r in fast.records] == [r.first_start for r in slow.records]
    assert fast.series == slow.series
    assert fast.evictions == slow.evictions


def test_fifo_prefix_and_skips_match_plain_fifo() -> None:
    cluster = parse_spec("2x8")
    load = random_workload(4, 600, "2x8")
    fifo = make_scheduler("fifo")
    fast = Engine(load, cluster, fifo).run()
    slow = Engine(load, cluster, type(fifo)("fifo", fifo.schedule)).run()
    assert fast.skipped > slow.skipped
    assert [r.first_start for r in fast.records] == [r.first_start for r in slow.records]
