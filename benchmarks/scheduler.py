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

import contextlib
import dataclasses
import datetime as dt
import functools
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from gpubroker.devices import mig
from gpubroker.gcpause import paused_gc
from gpubroker.scheduler import (
    DEFAULT_CLASSES,
    Decisions,
    Instance,
    Part,
    Policy,
    PriorityClass,
    Quota,
    Request,
    Running,
    SchedulerState,
    Slot,
    UsageRecord,
    fifo_schedule,
    schedule,
)
from gpubroker.scheduler.sharing import mig_weight, share_weight

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
    fn: Callable[[SchedulerState, dt.datetime], Decisions],
    state: SchedulerState,
    passes: int = PASSES,
    gc_paused: bool = True,
) -> dict[str, float]:
    """Median and p99 of ``passes`` passes over ``state``, ms (after one
    warm-up); ``gc_paused``: each pass with the garbage collector paused,
    as the broker and the simulator run it (:mod:`gpubroker.gcpause`)."""
    fn(state, NOW)  # warm up
    samples = []
    pause = paused_gc if gc_paused else contextlib.nullcontext
    for _ in range(passes):
        with pause():
            t0 = time.perf_counter()
            fn(state, NOW)
            samples.append(time.perf_counter() - t0)
    p99 = statistics.quantiles(samples, n=100, method="inclusive")[98] if passes > 1 else samples[0]
    return {"p50_ms": 1000 * statistics.median(samples), "p99_ms": 1000 * p99}


def _figures(
    prefix: str, policy: dict[str, float], fifo: dict[str, float], baseline_name: str
) -> dict[str, dict[str, Any]]:
    return {
        f"{prefix}.{key}": {
            "value": round(policy[key], 3),
            "unit": "ms",
            "baseline": round(fifo[key], 3),
            "baseline_name": baseline_name,
            "ratio": round(policy[key] / fifo[key], 3),
        }
        for key in ("p50_ms", "p99_ms")
    }


def _scale_passes(gpus: int) -> int:
    """Passes timed at ``gpus`` GPUs: fewer for the large clusters (run time)."""
    return max(3, min(PASSES // 2, PASSES * 128 // gpus))


def run() -> dict[str, dict[str, Any]]:
    """Time both schedulers; figures: name -> {value, unit, baseline, baseline_name, ratio}.

    ``scheduler.pass.*``: the whole-GPU workload (:func:`workload`) against
    FIFO; ``scheduler.pass.mixed.*``: the mixed workload at 1,024 GPUs
    (2,000 running, 5,000 waiting, :func:`mixed_workload`) against FIFO on
    the same state (each pass with the garbage collector paused, as the
    broker runs it; ``scheduler.pass.mixed.gc_on.p50_ms``: with it on);
    ``scheduler.pass.scale.<N>_gpus.p50_ms``: the mixed
    workload scaled to ``N`` GPUs, against the 128-GPU figure (ratio: growth).
    """
    fifo_name = "FIFO scheduler (no quotas, preemption or backfill)"
    results = _figures(
        "scheduler.pass", _time(schedule, workload()), _time(fifo_schedule, workload()), fifo_name
    )
    mixed = mixed_workload(NODES)
    results |= _figures(
        "scheduler.pass.mixed",
        _time(schedule, mixed),
        _time(fifo_schedule, mixed),
        f"{fifo_name}, same state (treats MIG and shared devices as whole GPUs)",
    )
    print(
        f"Scheduler, mixed workload: {len(mixed.slots):,} GPUs, {len(mixed.running):,} running "
        f"leases (whole GPUs, shares, MIG instances), {len(mixed.pending):,} waiting"
    )
    gc_on = _time(schedule, mixed, gc_paused=False)["p50_ms"]
    paused = results["scheduler.pass.mixed.p50_ms"]["value"]
    print(f"  the same pass with the garbage collector on: p50 {gc_on:.2f} ms")
    results["scheduler.pass.mixed.gc_on.p50_ms"] = {
        "value": round(gc_on, 3),
        "unit": "ms",
        "baseline": paused,
        "baseline_name": "the same pass with the garbage collector paused, as the broker runs it",
        "ratio": round(gc_on / paused, 3),
    }
    print(f"{'GPUs':>6}  {'running':>7}  {'waiting':>7}  {'passes':>6}  {'p50 ms':>8}  growth")
    first = None
    for gpus in SCALE_GPUS:
        state = mixed_workload(gpus // GPUS_PER_NODE)
        passes = _scale_passes(gpus)
        p50 = _time(schedule, state, passes)["p50_ms"]
        first = first or p50
        print(
            f"{gpus:>6,}  {len(state.running):>7,}  {len(state.pending):>7,}  {passes:>6}  "
            f"{p50:>8.2f}  {p50 / first:.2f}x"
        )
        results[f"scheduler.pass.scale.{gpus}_gpus.p50_ms"] = {
            "value": round(p50, 3),
            "unit": "ms",
            "baseline": round(first, 3),
            "baseline_name": f"the same pass at {SCALE_GPUS[0]} GPUs (mixed workload, scaled)",
            "ratio": round(p50 / first, 3),
        }
    return results


# -- the mixed workload: whole GPUs, MIG instances and time-sliced shares ------------

MIG_MODEL = "NVIDIA H100 80GB HBM3"
MIG_MIB = 81559
SMALL_MODEL = "NVIDIA A100-SXM4-40GB"
SMALL_MIB = 40960
SHARE_RESERVE_MIB = 1024
#: running leases and waiting requests per 128 GPUs in the mixed workload
RUNNING_PER_128 = 250
PENDING_PER_128 = 625
#: MIG profiles of running instances and of requests, and their weights
MIG_MIX = (
    ("1g.10gb", 0.5),
    ("1g.20gb", 0.1),
    ("2g.20gb", 0.2),
    ("3g.40gb", 0.15),
    ("4g.40gb", 0.05),
)
#: share sizes, MiB, and their weights
SHARE_MIX = ((4096, 0.2), (8192, 0.3), (10240, 0.2), (16384, 0.2), (20480, 0.1))
#: kinds of waiting requests and their weights
KIND_MIX = {"gpus": 0.7, "share": 0.15, "mig": 0.15}
#: scale of the growth table: GPUs (8 per node)
SCALE_GPUS = (128, 512, 1024, 2048, 8192)


def _static_pair(uuid: str) -> tuple[Instance, ...]:
    """The admin-made layout of a static MIG device: a 3g and a 1g."""
    return (
        Instance("3g.40gb", 0, 4, f"MIG-{uuid}-a", 40192),
        Instance("1g.10gb", 4, 1, f"MIG-{uuid}-b", 9856),
    )


def _pick(rng: random.Random, mix: tuple[tuple[Any, float], ...]) -> Any:
    return rng.choices([v for v, _ in mix], weights=[w for _, w in mix])[0]


def _mig_fill(
    rng: random.Random, spec: mig.GpuMigSpec, count: int
) -> list[tuple[str, mig.Placement]]:
    """Up to ``count`` random instances that fit together on one device."""
    layout: list[tuple[str, mig.Placement]] = []
    for _ in range(count * 3):
        if len(layout) >= count:
            break
        name = _pick(rng, MIG_MIX)
        valid = mig.valid_placements(spec, layout, name)
        if valid:
            layout.append((name, rng.choice(valid)))
    return layout


@functools.lru_cache(maxsize=8)
def mixed_workload(nodes: int = NODES, seed: int = SEED, extras: bool = False) -> SchedulerState:
    """A cluster of ``nodes`` x 8 GPUs in three pools (deterministic from ``seed``).

    23/32 of the nodes are whole GPUs (pool ``default``, DGX topology), 3/32
    a ``timeslice`` pool ``shared`` and 6/32 a ``mig`` pool ``mig`` (H100 80GB,
    instances on demand). Running: whole-GPU leases fill the exclusive nodes
    almost up, shares fill the time-sliced devices, MIG instances (about 5
    per device) fill the MIG devices until there are ``RUNNING_PER_128``
    leases per 128 GPUs (the last MIG devices stay free);
    ``PENDING_PER_128`` requests per 128 GPUs wait (70 % whole GPUs, 15 %
    shares, 15 % MIG instances; a third of those name their pool). Users
    and groups scale with the cluster; half have quotas, every user has past
    usage.

    ``extras`` adds the rarer paths (for the golden tests): drained devices,
    expired and preempted leases with requests earmarking their devices, a
    non-preemptible class, preferred devices, smaller (A100 40GB) devices,
    a static MIG layout and foreign instances, nodes without topology.
    """
    rng = random.Random(seed)
    n_users = max(8, USERS * nodes // NODES)
    n_groups = max(4, GROUPS * nodes // NODES)
    users = [f"user{u:04d}" for u in range(n_users)]
    groups = [f"group{g:03d}" for g in range(n_groups)]
    group_of = {u: groups[i % n_groups] for i, u in enumerate(users)}
    n_exclusive = nodes * 23 // 32
    n_share = nodes * 3 // 32
    want_running = RUNNING_PER_128 * nodes // 16
    spec = mig.spec_for(MIG_MODEL)
    assert spec is not None
    classes = dict(CLASS_MIX)
    if extras:
        classes["guaranteed"] = 0.05
        classes["gone"] = 0.02  # a class not in the policy: ranks lowest

    def cls() -> str:
        return rng.choices(list(classes), weights=list(classes.values()))[0]

    slots: list[Slot] = []
    topology: dict[str, tuple[tuple[int, ...], ...]] = {}
    for n in range(nodes):
        node = f"node{n:04d}"
        for i in range(GPUS_PER_NODE):
            uuid = f"GPU-{n:04d}-{i}"
            drained = extras and rng.random() < 0.02
            if n < n_exclusive:
                slots.append(Slot(uuid, node, i, drained=drained))
            elif n < n_exclusive + n_share:
                small = extras and n % 2 == 0
                slots.append(
                    Slot(
                        uuid,
                        node,
                        i,
                        drained=drained,
                        pool="shared",
                        mode="timeslice",
                        model=SMALL_MODEL if small else MIG_MODEL,
                        memory_mib=SMALL_MIB if small else MIG_MIB,
                        reserve_mib=SHARE_RESERVE_MIB,
                    )
                )
            else:
                static = extras and n % 4 == 0 and i < 2
                foreign = ()
                if extras and not static and rng.random() < 0.1:
                    foreign = (Instance("1g.10gb", 7, 1),)
                slots.append(
                    Slot(
                        uuid,
                        node,
                        i,
                        drained=drained,
                        pool="mig",
                        mode="mig",
                        model=MIG_MODEL,
                        memory_mib=MIG_MIB,
                        static=_static_pair(uuid) if static else (),
                        foreign=foreign,
                        mig_static=static,
                    )
                )
        if n < n_exclusive and not (extras and n % 5 == 0):
            topology[node] = dgx_topology()
    by_uuid = {s.uuid: s for s in slots}

    running: list[Running] = []

    def lease(devices: tuple[str, ...] = (), parts: tuple[Part, ...] = ()) -> Running:
        user = rng.choice(users)
        return Running(
            lease_id=len(running) + 1,
            user=user,
            devices=devices,
            started=NOW - _minutes(rng, 1, 12 * 60),
            group=group_of[user],
            priority_class=cls(),
            ends=NOW + _minutes(rng, -5 if extras else 5, 24 * 60) if rng.random() < 0.8 else None,
            parts=parts,
        )

    for n in range(n_exclusive):
        pattern = _pick(rng, PATTERNS)
        at = 0
        for size in pattern:
            if rng.random() < 0.03:  # a few devices stay free
                at += size
                continue
            running.append(lease(tuple(f"GPU-{n:04d}-{i}" for i in range(at, at + size))))
            at += size
    share_devices = [s for s in slots if s.mode == "timeslice"]
    room = {s.uuid: s.memory_mib - s.reserve_mib for s in share_devices}
    for _ in range(40 * len(share_devices)):
        if len(running) >= want_running:
            break
        slot = rng.choice(share_devices)
        memory = _pick(rng, SHARE_MIX)
        if room[slot.uuid] >= memory:
            room[slot.uuid] -= memory
            weight = share_weight(memory, slot.memory_mib)
            running.append(lease(parts=(Part(slot.uuid, "share", weight, memory_mib=memory),)))
    for n in range(n_exclusive + n_share, nodes):
        for i in range(GPUS_PER_NODE):
            if len(running) >= want_running:
                break
            uuid = f"GPU-{n:04d}-{i}"
            slot = by_uuid[uuid]
            if slot.mig_static:
                running.append(
                    lease(parts=(Part(uuid, "mig", 1 / 7, "1g.10gb", 4, 1, 9856, f"MIG-{uuid}-b"),))
                )
                continue
            taken = [(inst.profile, mig.Placement(inst.start, inst.size)) for inst in slot.foreign]
            for name, placement in _mig_fill(rng, spec, 7)[: 7 - len(taken)]:
                if any(placement.overlaps(p) for _n, p in taken):
                    continue
                prof = spec.profile(name)
                weight = prof.compute_slices / spec.compute_slices
                part = Part(
                    uuid,
                    "mig",
                    weight,
                    name,
                    placement.start,
                    placement.size,
                    prof.memory_gib * 1024,
                )
                running.append(lease(parts=(part,)))
                taken.append((name, placement))

    del running[want_running:]
    pending: list[Request] = []
    want_pending = PENDING_PER_128 * nodes // 16
    for k in range(want_pending):
        user = rng.choice(users)
        kind = rng.choices(list(KIND_MIX), weights=list(KIND_MIX.values()))[0]
        common = dict(
            lease_id=1_000_000 + k,
            user=user,
            created=NOW - _minutes(rng, 0, 6 * 60),
            group=group_of[user],
            priority_class=cls(),
            time_limit=rng.choice((1800.0, 3600.0, 4 * 3600.0, 12 * 3600.0))
            if rng.random() < 0.85
            else None,
        )
        if kind == "gpus":
            gpus = _size(rng)
            if extras and rng.random() < 0.01:
                gpus = 16  # larger than any node
            pool = "default" if rng.random() < 0.2 else None
            pending.append(Request(gpus=gpus, pool=pool, **common))  # type: ignore[arg-type]
        elif kind == "mig":
            profile = _pick(rng, MIG_MIX)
            if extras and rng.random() < 0.05:
                profile = "7g.80gb"
            pool = "mig" if rng.random() < 0.33 else None
            weight = mig_weight(MIG_MODEL, profile)
            pending.append(
                Request(gpus=1, kind="mig", mig_profile=profile, pool=pool, weight=weight, **common)  # type: ignore[arg-type]
            )
        else:
            memory = _pick(rng, SHARE_MIX)
            count = 2 if rng.random() < 0.1 else 1
            if extras and rng.random() < 0.02:
                memory = 65536  # too big for the small devices
            pool = "shared" if rng.random() < 0.33 else None
            weight = count * share_weight(memory, MIG_MIB)
            pending.append(
                Request(
                    gpus=count, kind="share", memory_mib=memory, pool=pool, weight=weight, **common
                )  # type: ignore[arg-type]
            )

    if extras:
        running, pending = _extras(rng, running, pending, users, group_of)

    def quota() -> Quota:
        guaranteed = float(rng.choice((0, 1, 2, 4, 8)))
        return Quota(guaranteed, guaranteed + rng.choice((4.0, 8.0, 16.0, 32.0)))

    per_group = nodes * GROUPS / (NODES * n_groups)  # 1 at 1,024 GPUs in 20 groups
    pclasses = {c.name: c for c in DEFAULT_CLASSES}
    if extras:
        pclasses["guaranteed"] = PriorityClass("guaranteed", 90, preemptible=False)
    policy = Policy(
        classes=pclasses,
        user_quotas={u: quota() for u in users[::2]},
        group_quotas={
            g: Quota(rng.choice((8.0, 16.0, 32.0)) * per_group, 128.0 * per_group)
            for g in groups[::2]
        },
        shares={u: 2.0 for u in users[::10]},
        max_reservations=100 if nodes >= NODES else 20,
    )
    usage = {
        u: UsageRecord(rng.uniform(0, 30 * 86400), NOW - _minutes(rng, 0, 24 * 60)) for u in users
    }
    return SchedulerState(tuple(slots), tuple(running), tuple(pending), policy, usage, topology)


def _extras(
    rng: random.Random,
    running: list[Running],
    pending: list[Request],
    users: list[str],
    group_of: dict[str, str],
) -> tuple[list[Running], list[Request]]:
    """Told victims (some with requests earmarking their devices, some
    withdrawn), preferred devices."""
    whole = [r for r in running if r.devices]
    told = rng.sample(whole, max(2, len(whole) // 40))
    by_id = {r.lease_id: r for r in told}
    out_running = []
    for r in running:
        if r.lease_id in by_id:
            deadline = NOW + dt.timedelta(seconds=rng.choice((-10, 30, 120)))
            r = dataclasses.replace(r, preempt_deadline=deadline)
        out_running.append(r)
    out_pending = list(pending)
    for victim in told[: len(told) * 2 // 3]:
        user = rng.choice(users)
        out_pending.append(
            Request(
                lease_id=2_000_000 + victim.lease_id,
                user=user,
                gpus=len(victim.devices),
                created=NOW - _minutes(rng, 0, 60),
                group=group_of[user],
                priority_class="batch-urgent",
                earmarked=victim.devices,
                time_limit=3600.0,
            )
        )
    for k, r in enumerate(out_pending):
        if r.whole and not r.earmarked and k % 50 == 0:
            prefer = tuple(whole[k % len(whole)].devices)
            out_pending[k] = dataclasses.replace(r, gpus=len(prefer), prefer=prefer)
    return out_running, out_pending
