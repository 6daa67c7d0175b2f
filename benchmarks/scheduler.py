"""One scheduling pass over a busy 1,024-GPU cluster: the broker's policy
against the FIFO baseline (same state, same machine).

The cluster: 128 nodes of 8 GPUs with a DGX-like topology (two NVLink
islands of 4, SYSTEM across). Whole-GPU leases fill it almost up (1, 2, 4 and
8 GPUs each, on one island or node, ~1,000 GPUs); 5,000 requests of 200
users in 20 groups wait (mixed sizes and classes, most with a time limit);
half of the users and half of the groups have quotas; every user has past
usage. The workload is built from a fixed seed, so runs compare.
"""

from __future__ import annotations

import datetime as dt
import functools
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from gpubroker.scheduler import (
    Decisions,
    Policy,
    Quota,
    Request,
    Running,
    SchedulerState,
    Slot,
    UsageRecord,
    fifo_schedule,
    schedule,
)

NODES = 128
GPUS_PER_NODE = 8
BUSY_GPUS = 1000  # of 1,024: a few stay free, so grants and backfill happen
PENDING = 5000
USERS = 200
GROUPS = 20
PASSES = 100
SEED = 20261130

NOW = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.timezone.utc)
NVLINK, SYSTEM = 5, 50  # gpubroker.devices.topology.LinkLevel values
ISLAND = 4

#: request sizes (GPUs) and their weights
SIZES = ((1, 0.5), (2, 0.25), (4, 0.15), (8, 0.10))
#: how running leases split a node, and their weights
PATTERNS = (
    ((8,), 0.15),
    ((4, 4), 0.15),
    ((4, 2, 2), 0.15),
    ((4, 2, 1, 1), 0.15),
    ((2, 2, 2, 2), 0.1),
    ((2, 2, 1, 1, 1, 1), 0.1),
    ((1,) * 8, 0.2),
)
#: classes and their weights among requests and leases
CLASS_MIX = {"interactive": 0.4, "batch-urgent": 0.05, "batch": 0.4, "preemptible": 0.15}


def dgx_topology(n: int = GPUS_PER_NODE) -> tuple[tuple[int, ...], ...]:
    """Two NVLink islands of 4 (level 5), SYSTEM (50) across, 0 on the diagonal."""
    return tuple(
        tuple(0 if i == j else NVLINK if i // ISLAND == j // ISLAND else SYSTEM for j in range(n))
        for i in range(n)
    )


def _size(rng: random.Random) -> int:
    return rng.choices([s for s, _ in SIZES], weights=[w for _, w in SIZES])[0]


def _class(rng: random.Random) -> str:
    return rng.choices(list(CLASS_MIX), weights=list(CLASS_MIX.values()))[0]


def _minutes(rng: random.Random, lo: int, hi: int) -> dt.timedelta:
    return dt.timedelta(minutes=rng.randint(lo, hi))


@functools.lru_cache(maxsize=1)
def workload() -> SchedulerState:
    """The benchmark's state (deterministic)."""
    rng = random.Random(SEED)
    users = [f"user{u:03d}" for u in range(USERS)]
    groups = [f"group{g:02d}" for g in range(GROUPS)]
    group_of = {u: groups[i % GROUPS] for i, u in enumerate(users)}
    slots = tuple(
        Slot(f"GPU-{n:03d}-{i}", f"node{n:03d}", i)
        for n in range(NODES)
        for i in range(GPUS_PER_NODE)
    )
    topology = {f"node{n:03d}": dgx_topology() for n in range(NODES)}

    # running leases: each node split into aligned blocks by a pattern, so
    # multi-GPU leases sit on one NVLink island (or the whole node)
    running: list[Running] = []
    busy = 0
    for n in range(NODES):
        pattern = rng.choices([p for p, _ in PATTERNS], weights=[w for _, w in PATTERNS])[0]
        at = 0
        for size in pattern:
            size = min(size, BUSY_GPUS - busy)
            if size <= 0:
                break
            user = rng.choice(users)
            running.append(
                Running(
                    lease_id=len(running) + 1,
                    user=user,
                    devices=tuple(f"GPU-{n:03d}-{i}" for i in range(at, at + size)),
                    started=NOW - _minutes(rng, 1, 12 * 60),
                    group=group_of[user],
                    priority_class=_class(rng),
                    ends=NOW + _minutes(rng, 5, 24 * 60) if rng.random() < 0.8 else None,
                )
            )
            at += size
            busy += size

    pending = []
    for k in range(PENDING):
        user = rng.choice(users)
        pending.append(
            Request(
                lease_id=100_000 + k,
                user=user,
                gpus=_size(rng),
                created=NOW - _minutes(rng, 0, 6 * 60),
                group=group_of[user],
                priority_class=_class(rng),
                time_limit=rng.choice((1800.0, 3600.0, 4 * 3600.0, 12 * 3600.0))
                if rng.random() < 0.85
                else None,
            )
        )

    def quota() -> Quota:
        guaranteed = float(rng.choice((0, 1, 2, 4, 8)))
        return Quota(guaranteed, guaranteed + rng.choice((4.0, 8.0, 16.0, 32.0)))

    policy = Policy(
        user_quotas={u: quota() for u in users[::2]},
        group_quotas={g: Quota(float(rng.choice((8, 16, 32))), 128.0) for g in groups[::2]},
        shares={u: 2.0 for u in users[::10]},
    )
    usage = {
        u: UsageRecord(rng.uniform(0, 30 * 86400), NOW - _minutes(rng, 0, 24 * 60)) for u in users
    }
    return SchedulerState(slots, tuple(running), tuple(pending), policy, usage, topology)


def describe() -> str:
    """One line: what the benchmark schedules."""
    state = workload()
    held = sum(len(r.devices) for r in state.running)
    return (
        f"Scheduler: one pass over {len(state.slots):,} GPUs ({NODES} nodes x {GPUS_PER_NODE}), "
        f"{len(state.running):,} running leases on {held:,} GPUs, {len(state.pending):,} pending "
        f"requests of {USERS} users in {GROUPS} groups; median/p99 of {PASSES} passes, "
        f"policy vs FIFO"
    )


def _time(
    fn: Callable[[SchedulerState, dt.datetime], Decisions], state: SchedulerState
) -> dict[str, float]:
    fn(state, NOW)  # warm up
    samples = []
    for _ in range(PASSES):
        t0 = time.perf_counter()
        fn(state, NOW)
        samples.append(time.perf_counter() - t0)
    p99 = statistics.quantiles(samples, n=100, method="inclusive")[98]
    return {"p50_ms": 1000 * statistics.median(samples), "p99_ms": 1000 * p99}


def run() -> dict[str, dict[str, Any]]:
    """Time both schedulers; figures: name -> {value, unit, baseline, baseline_name, ratio}."""
    state = workload()
    policy = _time(schedule, state)
    fifo = _time(fifo_schedule, state)
    return {
        f"scheduler.pass.{key}": {
            "value": round(policy[key], 3),
            "unit": "ms",
            "baseline": round(fifo[key], 3),
            "baseline_name": "FIFO scheduler (no quotas, preemption or backfill)",
            "ratio": round(policy[key] / fifo[key], 3),
        }
        for key in ("p50_ms", "p99_ms")
    }
