"""The replay's shortcuts change nothing: a pass at every event time on the
whole queue decides the same starts and ends; MIG and share jobs are
replayed through the same apply() as whole-GPU ones."""

from __future__ import annotations

import random

import pytest

from gpubroker.scheduler import Policy, Quota
from gpubroker.simulate.cluster import Cluster, Node, parse_spec
from gpubroker.simulate.compare import make_scheduler
from gpubroker.simulate.engine import Engine, RunResult, Scheduler
from gpubroker.simulate.readers import Trace, TraceJob
from gpubroker.simulate.workload import Enrichment, SimJob, Workload, prepare

H100 = "NVIDIA H100 80GB HBM3"


class EveryEvent(Engine):
    """The reference: a pass at every event time, on the whole queue (no
    skipped pass, no prefix, no merged order)."""

    def _needs_pass(self) -> bool:
        return True


def plain(scheduler: Scheduler) -> Scheduler:
    return Scheduler(scheduler.name, scheduler.schedule, preempts=scheduler.preempts)


def bursty(seed: int, jobs: int) -> Workload:
    """Jobs arriving in bursts at the same second, many small ones and some
    whole nodes, faster than they run, so queues grow long."""
    rng = random.Random(seed)
    rows, t = [], 0.0
    for i in range(jobs):
        if rng.random() < 0.6:  # else the same second as the previous job
            t += round(rng.expovariate(1 / 15))
        run = round(rng.choice((5, 30, 60, 600, 3600)) * rng.uniform(0.5, 1.5))
        gpus = rng.choices((1, 2, 4, 8), weights=(70, 10, 10, 10))[0]
        rows.append(TraceJob(f"b{i}", f"u{rng.randrange(9)}", gpus, t, run, i + 2))
    enrichment = Enrichment(time_limit_jitter=0.3, class_by_size={1: "batch", 8: "preemptible"})
    return prepare(Trace("<bursty>", "native", rows), parse_spec("2x8"), enrichment, seed)


def outcome(result: RunResult) -> list[tuple[float | None, float | None, int, int]]:
    return [(r.first_start, r.finish, r.starts, r.preempted) for r in result.records]


@pytest.mark.parametrize(
    ("name", "policy"),
    [
        ("broker", Policy(max_reservations=20)),
        ("broker", Policy(user_quotas={"u1": Quota(limit=3)}, max_reservations=10)),
        ("broker", Policy(user_quotas={"u2": Quota(guaranteed=8)})),
        ("fifo", Policy()),
        ("slurm-like", Policy()),
    ],
)
def test_shortcuts_give_the_starts_and_ends_of_a_pass_at_every_event(
    name: str, policy: Policy
) -> None:
    load = bursty(11, 500)
    cluster = parse_spec("2x8")
    fast = Engine(load, cluster, make_scheduler(name), policy).run()
    checked = Engine(load, cluster, make_scheduler(name), policy, verify=True).run()
    assert outcome(checked) == outcome(fast)  # every prefix pass decided as the full one
    slow = EveryEvent(load, cluster, plain(make_scheduler(name)), policy).run()
    assert slow.skipped == 0 and slow.prefix_passes == 0
    assert fast.passes < slow.passes  # the shortcuts did skip passes
    if name == "broker" and not policy.has_guarantees:
        assert fast.prefix_passes > 20  # ... and passed only a prefix of the queue
    assert outcome(fast) == outcome(slow)
    assert fast.series == slow.series
    assert [(s.job, s.start, s.end, s.ended) for s in fast.leases] == [
        (s.job, s.start, s.end, s.ended) for s in slow.leases
    ]
    assert sum(r.first_start is not None for r in fast.records) > 450


def test_a_changed_outcome_is_seen() -> None:
    """The comparison above can fail: another policy gives other starts."""
    load = bursty(11, 300)
    cluster = parse_spec("2x8")
    broker = Engine(load, cluster, make_scheduler("broker"), Policy()).run()
    fifo = Engine(load, cluster, make_scheduler("fifo"), Policy()).run()
    assert outcome(broker) != outcome(fifo)


def job(index: int, kind: str, submit: float, run: float, **kw: object) -> SimJob:
    return SimJob(
        index,
        f"j{index}",
        f"u{index}",
        None,
        1,
        submit,
        run,
        run,
        "batch",
        0.5,
        index + 2,
        kind,
        **kw,  # type: ignore[arg-type]
    )


def test_mig_and_share_jobs_get_parts_from_apply() -> None:
    """One H100 in a ``mig`` pool: two 3g.40gb instances fit (7 compute
    slices), the third waits until the first ends. Two GPUs in a
    ``timeslice`` pool: one 50 GB share each; the third share waits."""
    cluster = Cluster(
        (
            Node("m", 1, H100, mode="mig", memory_mib=81559),
            Node("t", 2, H100, mode="timeslice", memory_mib=81559),
        )
    )
    jobs = (
        job(0, "mig", 0.0, 100.0, mig_profile="3g.40gb"),
        job(1, "mig", 1.0, 300.0, mig_profile="3g.40gb"),
        job(2, "mig", 2.0, 50.0, mig_profile="3g.40gb"),
        job(3, "share", 0.0, 200.0, memory_mib=50000),
        job(4, "share", 1.0, 400.0, memory_mib=50000),
        job(5, "share", 2.0, 10.0, memory_mib=50000),
    )
    result = Engine(Workload(jobs), cluster, make_scheduler("broker"), Policy()).run()
    starts = [r.first_start for r in result.records]
    finishes = [r.finish for r in result.records]
    assert starts == [0.0, 1.0, 100.0, 0.0, 1.0, 200.0]
    assert finishes == [100.0, 301.0, 150.0, 200.0, 401.0, 210.0]
    # at 1 s: two MIG instances and two shares, weighing 3/7 and 50000/81559 each
    held = {t: h for t, h, _ in result.series}
    assert held[1.0] == pytest.approx(2 * 3 / 7 + 2 * 50000 / 81559)
    assert held[401.0] == 0
