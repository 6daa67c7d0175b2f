"""MIG placement under overload: the broker's ``least-fragmentation``
placement against ``first-fit``, on 64 simulated H100 80GB GPUs (one ``mig``
pool, 8 nodes x 8, instances made on demand).

The workload is drawn once from a fixed seed and replayed under both
strategies (same arrivals, same durations, same patience): requests for one
MIG instance of ``1g.10gb`` / ``2g.20gb`` / ``3g.40gb`` / ``7g.80gb`` (50 / 25
/ 15 / 10 % of requests) from 8 users arrive as a Poisson process offering
``OFFERED`` times the GPUs' compute slices; each runs for an exponential time
(mean 1 h) once granted, and a user still waiting after an exponential
patience (mean 30 min) gives up. Demand exceeds supply, so the queue is never
empty and what placement leaves unusable shows as capacity not allocated.

A discrete-event simulation calls the broker's pure
:func:`~gpubroker.scheduler.schedule` at every arrival and every departure,
with the real running leases (and their MIG placements) and queue. To keep
the run short it passes each call only the requests whose outcome can
change: at an arrival, the new request (nothing was freed, and every waiting
request fitted nowhere after the previous pass); at a departure, the
waiting requests whose profile fits the freed device's free slices. That
gives the same grants as a pass over the whole queue;
``python -m benchmarks.sharing --check`` replays three hours both ways and
compares every grant and every request's first answer.

Figures, over six mean durations after a warm-up of one and a half: the
time-averaged share of the 448 compute slices held by leases; the share
*stranded*: free on GPUs where not even a ``1g.10gb`` fits (printed by
layout, the analysis of what blocks); the share of requests whose first
answer was ``Fragmented`` (the profile fitted nowhere although some GPU had
enough free slices); the share of requests served (granted before their
user gave up), overall and per profile.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import heapq
import random
import time
from collections import Counter, defaultdict
from typing import Any

from gpubroker.devices import mig
from gpubroker.scheduler import (
    Decisions,
    Policy,
    Request,
    Running,
    SchedulerState,
    Slot,
    WaitReason,
    schedule,
)
from gpubroker.scheduler.sharing import mig_weight

NODES = 8
GPUS_PER_NODE = 8
MODEL = "NVIDIA H100 80GB HBM3"
MEMORY_MIB = 81559
_SPEC = mig.spec_for(MODEL)
assert _SPEC is not None
SPEC: mig.GpuMigSpec = _SPEC
CAPACITY = NODES * GPUS_PER_NODE * SPEC.compute_slices  # compute slices

#: profiles requested and their share of requests
MIX = (("1g.10gb", 0.50), ("2g.20gb", 0.25), ("3g.40gb", 0.15), ("7g.80gb", 0.10))
#: offered compute demand / capacity
OFFERED = 1.75
MEAN_HOLD = 3600.0  # seconds a granted instance is held, mean (exponential)
MEAN_PATIENCE = 1800.0  # seconds a user waits before giving up, mean (exponential)
WARMUP = 1.5 * MEAN_HOLD
WINDOW = 6 * MEAN_HOLD
USERS = 8
SEED = 20260302
STRATEGIES = ("least-fragmentation", "first-fit")
BASELINE = "first-fit MIG placement (first GPU by node and index, lowest start slot)"

T0 = dt.datetime(2026, 3, 2, 8, 0, tzinfo=dt.timezone.utc)


@dataclasses.dataclass(frozen=True)
class Arrival:
    """One request of the workload."""

    lease_id: int
    at: float  # seconds after T0
    profile: str
    user: str
    hold: float
    patience: float


def slots() -> tuple[Slot, ...]:
    """The 64 MIG-enabled H100s of pool ``mig``."""
    return tuple(
        Slot(
            f"GPU-n{n:02d}-{i}",
            f"n{n:02d}",
            i,
            pool="mig",
            mode="mig",
            model=MODEL,
            memory_mib=MEMORY_MIB,
        )
        for n in range(NODES)
        for i in range(GPUS_PER_NODE)
    )


def workload(horizon: float, seed: int = SEED) -> list[Arrival]:
    """Poisson arrivals over ``horizon`` seconds offering ``OFFERED`` x capacity."""
    rng = random.Random(seed)
    names = [name for name, _ in MIX]
    weights = [w for _, w in MIX]
    mean_slices = sum(SPEC.profile(name).compute_slices * w for name, w in MIX)
    rate = OFFERED * CAPACITY / (mean_slices * MEAN_HOLD)  # requests per second
    arrivals: list[Arrival] = []
    at = 0.0
    while True:
        at += rng.expovariate(rate)
        if at >= horizon:
            return arrivals
        arrivals.append(
            Arrival(
                lease_id=len(arrivals) + 1,
                at=at,
                profile=rng.choices(names, weights)[0],
                user=f"user{rng.randrange(USERS)}",
                hold=rng.expovariate(1 / MEAN_HOLD),
                patience=rng.expovariate(1 / MEAN_PATIENCE),
            )
        )


@dataclasses.dataclass
class Outcome:
    """What one strategy did with the workload."""

    strategy: str
    slice_seconds: float = 0.0  # compute slices held x seconds, in the window
    window: float = 0.0
    arrived: Counter[str] = dataclasses.field(default_factory=Counter)
    served: Counter[str] = dataclasses.field(default_factory=Counter)
    #: requests told Fragmented by the pass that saw them arrive
    fragmented: Counter[str] = dataclasses.field(default_factory=Counter)
    #: free compute slices x seconds on GPUs where not even a 1g.10gb fits, by layout
    stranded: dict[str, float] = dataclasses.field(default_factory=lambda: defaultdict(float))
    passes: int = 0
    pass_seconds: float = 0.0
    decisions: list[tuple[float, Decisions]] = dataclasses.field(default_factory=list)

    @property
    def allocated(self) -> float:
        return self.slice_seconds / (CAPACITY * self.window) if self.window else 0.0

    @property
    def stranded_fraction(self) -> float:
        total = sum(self.stranded.values())
        return total / (CAPACITY * self.window) if self.window else 0.0

    def share(self, counter: Counter[str], profile: str | None = None) -> float:
        if profile is None:
            total = sum(self.arrived.values())
            return sum(counter.values()) / total if total else 0.0
        return counter[profile] / self.arrived[profile] if self.arrived[profile] else 0.0


def simulate(
    strategy: str,
    arrivals: list[Arrival],
    warmup: float = WARMUP,
    window: float = WINDOW,
    full_passes: bool = False,
    keep_decisions: bool = False,
) -> Outcome:
    """Replay ``arrivals`` under ``strategy``; measure over ``[warmup, warmup + window)``.

    ``full_passes``: give every pass the whole queue (slow; for ``--check``).
    """
    inventory = slots()
    device_of = {s.uuid: s for s in inventory}
    policy = Policy()
    out = Outcome(strategy)
    end = warmup + window
    requests = {a.lease_id: a for a in arrivals}
    running: dict[int, Running] = {}
    pending: dict[int, Request] = {}
    # events: (time, order, kind, lease id); departures before arrivals at one time
    events: list[tuple[float, int, str, int]] = [(a.at, 2, "arrive", a.lease_id) for a in arrivals]
    heapq.heapify(events)
    held_slices = 0
    last = 0.0
    smallest = min((name for name, _ in MIX), key=lambda n: SPEC.profile(n).compute_slices)
    layouts: dict[str, list[tuple[str, mig.Placement]]] = {u: [] for u in device_of}
    #: per GPU: since when its layout is unchanged, its stranded slices and the layout
    since: dict[str, tuple[float, int, str]] = {u: (0.0, 0, "") for u in device_of}

    def changed(uuid: str, now: float) -> None:
        """The GPU's layout changed at ``now``: book its stranded slices so far."""
        start, stranded, name = since[uuid]
        lo, hi = max(start, warmup), min(now, end)
        if stranded and hi > lo:
            out.stranded[name] += stranded * (hi - lo)
        layout = sorted(layouts[uuid], key=_start)
        free = mig.free_compute_slices(SPEC, layout)
        fits = free and mig.valid_placements(SPEC, layout, smallest)
        name = " + ".join(f"{n}@{p.start}" for n, p in layout)
        since[uuid] = (now, 0 if fits else free, name)

    def account(now: float) -> None:
        nonlocal last
        lo, hi = max(last, warmup), min(now, end)
        if hi > lo:
            out.slice_seconds += held_slices * (hi - lo)
        last = now

    def run_pass(now: float, subset: list[Request], arriving: int | None = None) -> None:
        nonlocal held_slices
        clock = T0 + dt.timedelta(seconds=now)
        given = list(pending.values()) if full_passes else subset
        state = SchedulerState(
            inventory, tuple(running.values()), tuple(given), policy, sharing_strategy=strategy
        )
        t0 = time.perf_counter()
        d = schedule(state, clock)
        out.pass_seconds += time.perf_counter() - t0
        out.passes += 1
        if keep_decisions:
            out.decisions.append((now, d))
        for g in d.grants:
            request = pending.pop(g.lease_id)
            running[g.lease_id] = Running(g.lease_id, request.user, (), clock, parts=g.parts)
            held_slices += sum(SPEC.profile(p.profile).compute_slices for p in g.parts)
            for p in g.parts:
                layouts[p.device].append((p.profile, mig.Placement(p.start, p.size)))
                changed(p.device, now)
            arrival = requests[g.lease_id]
            if warmup <= arrival.at < end:
                out.served[arrival.profile] += 1
            heapq.heappush(events, (now + arrival.hold, 1, "depart", g.lease_id))
        for w in d.waits:
            arrival = requests[w.lease_id]
            if w.lease_id == arriving and warmup <= arrival.at < end:
                out.fragmented[arrival.profile] += int(w.reason is WaitReason.fragmented)

    while events:
        now, _order, kind, lease_id = heapq.heappop(events)
        if now >= end:
            break
        account(now)
        if kind == "arrive":
            arrival = requests[lease_id]
            if warmup <= arrival.at < end:
                out.arrived[arrival.profile] += 1
            request = Request(
                lease_id,
                arrival.user,
                1,
                T0 + dt.timedelta(seconds=now),
                kind="mig",
                mig_profile=arrival.profile,
                pool="mig",
                weight=mig_weight(MODEL, arrival.profile),
            )
            pending[lease_id] = request
            heapq.heappush(events, (now + arrival.patience, 3, "renege", lease_id))
            run_pass(now, [request], arriving=lease_id)
        elif kind == "renege":
            pending.pop(lease_id, None)  # gone if granted meanwhile
        else:  # depart
            lease = running.pop(lease_id)
            held_slices -= sum(SPEC.profile(p.profile).compute_slices for p in lease.parts)
            for p in lease.parts:
                layouts[p.device].remove((p.profile, mig.Placement(p.start, p.size)))
                changed(p.device, now)
            freed = {p.device for p in lease.parts}
            fits = [
                r
                for r in pending.values()
                if any(
                    not device_of[u].drained
                    and mig.valid_placements(SPEC, layouts[u], r.mig_profile)
                    for u in freed
                )
            ]
            if fits or full_passes:
                run_pass(now, fits)
    account(end)
    for uuid in device_of:
        changed(uuid, end)
    out.window = window
    return out


def _start(instance: tuple[str, mig.Placement]) -> int:
    return instance[1].start


def describe() -> str:
    """One line: what the benchmark simulates."""
    mix = " / ".join(f"{name} {w:.0%}" for name, w in MIX)
    return (
        f"Sharing: MIG placement on {NODES * GPUS_PER_NODE} H100 80GB ({NODES} nodes x "
        f"{GPUS_PER_NODE}), {mix}, Poisson arrivals offering {OFFERED:g}x the compute slices, "
        f"holds ~exp({MEAN_HOLD / 3600:g} h), patience ~exp({MEAN_PATIENCE / 60:g} min); "
        f"least-fragmentation vs first-fit, schedule() at every arrival and departure"
    )


def _print(outcomes: dict[str, Outcome], wall: dict[str, float]) -> None:
    names = [name for name, _ in MIX]
    print(
        f"  {'strategy':<20} {'allocated':>9} {'stranded':>8} {'told Fragmented':>15} "
        f"{'served':>7}  "
        + "  ".join(f"{n:>8}" for n in names)
        + f"  {'passes':>6} {'ms/pass':>7} {'wall s':>6}"
    )
    for name, o in outcomes.items():
        print(
            f"  {name:<20} {o.allocated:>9.3f} {o.stranded_fraction:>8.3f} "
            f"{o.share(o.fragmented):>15.3f} "
            f"{o.share(o.served):>7.3f}  "
            + "  ".join(f"{o.share(o.served, n):>8.3f}" for n in names)
            + f"  {o.passes:>6} {1000 * o.pass_seconds / max(o.passes, 1):>7.2f}"
            f" {wall[name]:>6.1f}"
        )
    print(
        "  allocated / stranded: time-averaged share of the compute slices held / free on GPUs\n"
        "  where not even a 1g.10gb fits; told Fragmented: share of requests whose first\n"
        "  answer was Fragmented; served: share of requests granted before their user gave up"
    )
    for name, o in outcomes.items():
        print(f"  {name}: stranded slices (share of capacity) by GPU layout:")
        for layout, n in sorted(o.stranded.items(), key=lambda item: -item[1])[:4]:
            print(f"    {n / (CAPACITY * o.window):.4f}  {layout}")


def run(seed: int = SEED) -> dict[str, dict[str, Any]]:
    """Simulate both strategies; figures: name -> {value, unit, baseline, baseline_name, ratio}."""
    arrivals = workload(WARMUP + WINDOW, seed)
    outcomes, wall = {}, {}
    for strategy in STRATEGIES:
        t0 = time.perf_counter()
        outcomes[strategy] = simulate(strategy, arrivals)
        wall[strategy] = time.perf_counter() - t0
    _print(outcomes, wall)
    broker, base = outcomes["least-fragmentation"], outcomes["first-fit"]

    def figure(value: float, baseline: float, unit: str = "fraction") -> dict[str, Any]:
        return {
            "value": round(value, 4),
            "unit": unit,
            "baseline": round(baseline, 4),
            "baseline_name": BASELINE,
            "ratio": round(value / baseline, 4) if baseline else 0.0,
        }

    figures = {
        "sharing.mig.allocated_fraction": figure(broker.allocated, base.allocated),
        "sharing.mig.fragmented_fraction": figure(
            broker.share(broker.fragmented), base.share(base.fragmented)
        ),
        "sharing.mig.stranded_fraction": figure(broker.stranded_fraction, base.stranded_fraction),
        "sharing.mig.served_fraction": figure(broker.share(broker.served), base.share(base.served)),
    }
    for profile, _ in MIX:
        figures[f"sharing.mig.served_fraction.{profile}"] = figure(
            broker.share(broker.served, profile), base.share(base.served, profile)
        )
    return figures


def check(hours: float = 3.0, seed: int = SEED) -> None:
    """Replay ``hours`` with every pass given the whole queue and with the
    reduced passes; the grants (lease, time, placement) must be identical."""
    arrivals = workload(hours * 3600, seed)
    for strategy in STRATEGIES:
        fast = simulate(strategy, arrivals, 0.0, hours * 3600, keep_decisions=True)
        full = simulate(strategy, arrivals, 0.0, hours * 3600, True, keep_decisions=True)
        grants_fast = [(t, g) for t, d in fast.decisions for g in d.grants]
        grants_full = [(t, g) for t, d in full.decisions for g in d.grants]
        assert grants_fast == grants_full, f"{strategy}: reduced passes grant differently"
        assert fast.slice_seconds == full.slice_seconds
        assert fast.fragmented == full.fragmented, f"{strategy}: reasons on arrival differ"
        print(
            f"  {strategy}: {len(grants_full)} grants identical over {hours:g} h "
            f"({full.passes} full passes, {fast.passes} reduced)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sharing", description=describe())
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument(
        "--check", action="store_true", help="compare the reduced passes with full passes"
    )
    args = parser.parse_args()
    print(describe())
    if args.check:
        check(seed=args.seed)
        return
    for name, r in run(args.seed).items():
        print(f"  {name:<40} {r['value']:>8.4f}  first-fit {r['baseline']:>8.4f}  {r['ratio']:.3f}")


if __name__ == "__main__":
    main()
