"""The Slurm-like baseline: multifactor priority, EASY backfill, no preemption.

A pure pass with the scheduler's signature, ``schedule(state, now) ->
Decisions``, built from the scheduler's own parts (the pass's
:class:`~gpubroker.scheduler.placement.Pool` and
:mod:`~gpubroker.scheduler.fairshare`), so that it places, reserves and
weighs fair share exactly as the broker does, and differs only in policy:

- priority (Slurm's ``priority/multifactor``): ``age`` x min(waited /
  ``max_age``, 1) + ``fairshare`` x fair-share factor (the broker's
  formula, ``2**(-usage/share)``) + ``job_size`` x GPUs / cluster GPUs
  (or, with ``favor_small``, (cluster GPUs - GPUs + 1) / cluster GPUs);
  priority classes and quotas are ignored;
- EASY backfill (``sched/backfill`` with one reservation): requests start
  in priority order while they fit; the first that does not fit gets the
  one reservation, on the devices that free up first by the running
  leases' time limits; later requests start now only if they fit on devices
  that are not reserved, or end (by their time limit) before the
  reservation starts;
- no preemption; a lease is ended at its time limit, as Slurm does.

The FIFO baseline is :func:`gpubroker.scheduler.fifo_schedule`.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from ..scheduler import fairshare
from ..scheduler.placement import NEVER, Pool
from ..scheduler.types import Decisions, Eviction, Grant, Request, SchedulerState, Wait, WaitReason

_ONE_SECOND = dt.timedelta(seconds=1)

_MESSAGES = {
    WaitReason.resources: "waiting: not enough free GPUs on one node (holds the reservation)",
    WaitReason.reserved: "waiting: the free GPUs are reserved for a request ahead of yours",
    WaitReason.priority: "waiting: requests of higher priority go first",
    WaitReason.pool_drained: "waiting: no node has that many GPUs in service",
}


@dataclass(frozen=True)
class SlurmSettings:
    """Weights of the multifactor priority (Slurm's ``PriorityWeight*``) and
    the backfill depth.

    Attributes:
        age: weight of the age factor.
        fairshare: weight of the fair-share factor.
        job_size: weight of the job-size factor.
        max_age: seconds of waiting at which the age factor reaches 1
            (``PriorityMaxAge``, 7 days by default).
        favor_small: smaller jobs get the larger size factor
            (``PriorityFavorSmall``).
        max_job_test: requests examined per pass, in priority order
            (``bf_max_job_test``); ``None``: all.
    """

    age: float = 1000.0
    fairshare: float = 10000.0
    job_size: float = 1000.0
    max_age: float = 7 * 86400.0
    favor_small: bool = False
    max_job_test: int | None = None


DEFAULT_SETTINGS = SlurmSettings()


def _order(state: SchedulerState, now: dt.datetime, settings: SlurmSettings) -> list[Request]:
    """Pending requests by priority (highest first), then age, then id."""
    policy = state.policy
    total = sum(1 for s in state.slots if not s.drained) or 1
    usage = fairshare.decayed_usage(state.usage, state.running, now, policy.half_life)
    users = {r.user for r in state.pending} | {r.user for r in state.running}
    factor = fairshare.factors(users, usage, policy.shares, total, policy.half_life)
    fair = {u: settings.fairshare * f for u, f in factor.items()}
    max_age = dt.timedelta(seconds=max(settings.max_age, 1.0))
    w_age = settings.age
    if settings.favor_small:
        size = [settings.job_size * (total - g + 1) / total for g in range(total + 1)]
    else:
        size = [settings.job_size * g / total for g in range(total + 1)]

    def key(r: Request) -> tuple[float, dt.datetime, int]:
        age = (now - r.created) / max_age
        age = 1.0 if age > 1.0 else 0.0 if age < 0.0 else age
        return (-(w_age * age + fair[r.user] + size[min(r.gpus, total)]), r.created, r.lease_id)

    return sorted(state.pending, key=key)


class _Misses:
    """Sizes and ends of requests that did not fit this pass.

    Placement only gets harder as a pass goes on (devices are taken and
    reserved, never freed), and a request needing at least as many GPUs
    for at least as long as one that did not fit does not fit either.
    """

    def __init__(self) -> None:
        self.earliest: dict[int, dt.datetime] = {}  # GPUs -> earliest end that missed

    def covers(self, gpus: int, ends: dt.datetime) -> bool:
        return any(g <= gpus and e <= ends for g, e in self.earliest.items())

    def add(self, gpus: int, ends: dt.datetime) -> None:
        if ends < self.earliest.get(gpus, NEVER) or gpus not in self.earliest:
            self.earliest[gpus] = ends


def schedule(
    state: SchedulerState, now: dt.datetime, settings: SlurmSettings = DEFAULT_SETTINGS
) -> Decisions:
    """One Slurm-like pass over ``state`` at ``now`` (aware UTC).

    Returns:
        :class:`~gpubroker.scheduler.Decisions`: grants, evictions of leases
        past their time limit, and a :class:`~gpubroker.scheduler.Wait` for
        each request examined and left waiting (the reservation holder's
        with its ETA). Once the reservation is made and no device is free
        (or ``max_job_test`` requests were examined), nothing behind can
        start, so the pass stops there and those behind are not listed.
    """
    evictions = []
    busy_until = {}
    for lease in state.running:
        end = lease.ends or NEVER
        if lease.ends is not None and lease.ends <= now:
            evictions.append(Eviction(lease.lease_id, "time limit reached"))
        if end < NEVER:
            end = max(end, now + _ONE_SECOND)  # held until the broker has ended it
        for uuid in lease.devices:
            busy_until[uuid] = end
    pool = Pool.build(state.slots, busy_until, (), state.topology, now)
    grants: list[Grant] = []
    waits: list[Wait] = []
    misses = _Misses()
    reserved = False
    depth = settings.max_job_test
    for request in _order(state, now, settings):
        if reserved and (
            pool.largest_free() == 0 or (depth is not None and len(waits) + len(grants) >= depth)
        ):
            break  # nothing behind can start now: leave the rest unlisted
        if request.gpus > pool.largest_node():
            reason = WaitReason.pool_drained
            waits.append(Wait(request.lease_id, len(waits) + 1, reason, _MESSAGES[reason]))
            continue
        ends = NEVER
        if request.time_limit is not None:
            ends = now + dt.timedelta(seconds=request.time_limit)
        devices = None
        if not misses.covers(request.gpus, ends):
            devices = pool.place(request.gpus, ends)
            if devices is None:
                misses.add(request.gpus, ends)
        if devices is not None:
            pool.take(devices, ends)
            grants.append(Grant(request.lease_id, devices))
            continue
        eta = None
        if not reserved:
            reserved = True
            planned = pool.reserve(request.gpus, request.time_limit)
            eta = None if planned is None or planned[0] >= NEVER else planned[0]
            reason = WaitReason.resources
        elif pool.fits_ignoring_reservations(request.gpus):
            reason = WaitReason.reserved
        else:
            reason = WaitReason.priority
        waits.append(Wait(request.lease_id, len(waits) + 1, reason, _MESSAGES[reason], eta))
    return Decisions(grants=tuple(grants), evictions=tuple(evictions), waits=tuple(waits))
