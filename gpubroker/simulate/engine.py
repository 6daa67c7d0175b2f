"""The discrete-event loop: a virtual clock, the real scheduling core.

Events are arrivals (a job's submit time), completions (start + run time)
and wake-ups (a preemption's grace deadline, or "run again now" after
evictions). At each event time the engine applies every event due, then
runs one scheduling pass on a :class:`~gpubroker.scheduler.SchedulerState`
kept up to date incrementally, and applies the decisions in memory the way
:func:`gpubroker.passes.apply_decisions` writes them to the store:

- a grant becomes a :class:`~gpubroker.scheduler.Running` lease (started
  now, ``ends`` = now + its time limit) that completes after its run time;
- a preemption sets the victim's ``preempt_deadline`` (and a wake-up then);
  the request's ``earmarked`` devices follow its :class:`~gpubroker.scheduler.Wait`;
- an eviction ends the lease; a preempted job goes back to the queue (same
  submit time, a new lease id) and restarts from zero, unless its class
  checkpoints, when it resumes with the run time it has left;
- a withdrawn preemption clears the deadline.

Evictions free devices only after the pass that decided them, so another
pass runs at the same virtual time (the live broker does the same).

Passes run only at event times. A pass is skipped only when it provably
decides nothing: no device is free, no lease is in its grace period, no
request has devices earmarked, and the scheduler cannot preempt (FIFO and
Slurm-like never do; the broker's policy only with guarantees or a
preempting class waiting). For a strict-FIFO scheduler, arrivals behind a
blocked head change nothing either, and only the first ``free + 1`` requests
in arrival order can be granted, so only those are passed.

The virtual clock counts integer microseconds from the first submission;
the scheduler sees aware UTC datetimes from :data:`EPOCH` (an arbitrary
origin: 2020-01-01 00:00 UTC).
"""

from __future__ import annotations

import datetime as dt
import heapq
import itertools
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Protocol

from ..scheduler import (
    Decisions,
    Policy,
    Request,
    Running,
    SchedulerState,
    UsageRecord,
    WaitReason,
)
from ..scheduler.fairshare import decay, running_usage
from .cluster import Cluster
from .workload import SimJob, Workload

#: the virtual time 0 as the scheduler sees it
EPOCH = dt.datetime(2020, 1, 1, tzinfo=dt.timezone.utc)
#: microseconds per second
US = 1_000_000

SchedulerFn = Callable[[SchedulerState, dt.datetime], Decisions]

#: a prefix pass sees at least this many requests...
PREFIX_BASE = 256
#: ... and at least this many that fit a node's free devices, plus PREFIX_PER_FREE per free device
PREFIX_FITTING = 32
PREFIX_PER_FREE = 8

_COMPLETE, _ARRIVAL, _WAKE = 0, 1, 2

#: wait reasons given only after a request was tried for placement and did not fit
_NOT_PLACED = frozenset({WaitReason.resources, WaitReason.priority, WaitReason.reserved})


class SimulationError(RuntimeError):
    """A scheduler decided something impossible (e.g. granted a busy device)."""


class Progress(Protocol):
    """What the engine needs of a progress bar (``tqdm`` fits)."""

    def update(self, n: float | None = 1) -> bool | None:
        """``n`` more jobs are done."""


@dataclass(frozen=True)
class Scheduler:
    """A policy to replay and what the engine may assume about it.

    Attributes:
        name: label in the output (``broker``, ``fifo``, ``slurm-like``).
        schedule: the pure pass, ``(state, now) -> Decisions``.
        preempts: it may preempt (then passes run when guarantees exist or a
            preempting class waits, even with no device free).
        strict_fifo: it grants strictly in ``(created, lease_id)`` order and
            stops at the first request that does not fit (FIFO, no backfill).
        order: its queue order (the broker's
            :func:`~gpubroker.scheduler.queue_order`); when given, the engine
            may pass a prefix of the queue and check the result (see
            :meth:`Engine._prefix_pass`).
    """

    name: str
    schedule: SchedulerFn
    preempts: bool = False
    strict_fifo: bool = False
    order: Callable[[SchedulerState, dt.datetime], list[Request]] | None = None


@dataclass
class JobRecord:
    """What happened to one job (times in seconds after the first submission).

    Attributes:
        first_start: its first start, ``None`` if it never started.
        finish: when it completed (or was ended at its time limit).
        starts: times it was started (1 + restarts).
        preempted: times it was evicted by a preemption.
        lost_gpu_seconds: GPU-seconds of work thrown away by restarts.
        timed_out: it was ended at its time limit.
    """

    first_start: float | None = None
    finish: float | None = None
    starts: int = 0
    preempted: int = 0
    lost_gpu_seconds: float = 0.0
    timed_out: bool = False


@dataclass(frozen=True)
class LeaseSpan:
    """One lease from grant to end: job index, GPUs, start and end (seconds), how it ended."""

    job: int
    gpus: int
    start: float
    end: float
    ended: str


@dataclass
class RunResult:
    """The outcome of one replay.

    Attributes:
        scheduler: the scheduler's name.
        jobs: the workload's jobs.
        records: per job, same order.
        leases: every lease, in the order they ended (running ones at ``end``).
        total_gpus: devices in the cluster.
        series: ``(time s, allocated GPUs, requested GPUs)`` from each change on.
        end: virtual time the run stopped, seconds.
        notices: preemption notices given.
        evictions: leases evicted by preemption.
        withdrawn: preemptions withdrawn.
        passes: scheduling passes run.
        skipped: passes skipped (provably no decision).
        prefix_passes: passes decided on a prefix of the queue (checked exact).
        full_passes: passes on the whole queue after a prefix did not suffice.
        candidates: requests behind a prefix that might have started, summed
            over passes (they are added to a second prefix pass).
        events: events applied.
        wall: wall-clock seconds of the replay.
    """

    scheduler: str
    jobs: tuple[SimJob, ...]
    records: list[JobRecord]
    leases: list[LeaseSpan]
    total_gpus: int
    series: list[tuple[float, int, float]]
    end: float
    notices: int = 0
    evictions: int = 0
    withdrawn: int = 0
    passes: int = 0
    skipped: int = 0
    prefix_passes: int = 0
    full_passes: int = 0
    candidates: int = 0
    events: int = 0
    wall: float = 0.0


def at(us: int) -> dt.datetime:
    """The scheduler's datetime of virtual time ``us`` (microseconds)."""
    return EPOCH + dt.timedelta(microseconds=us)


def micros(when: dt.datetime) -> int:
    """Virtual microseconds of ``when`` (the inverse of :func:`at`)."""
    return (when - EPOCH) // dt.timedelta(microseconds=1)


def seconds_to_us(value: float) -> int:
    """Seconds -> integer microseconds."""
    return round(value * US)


@dataclass
class _Attempt:
    job: int
    start: int


@dataclass
class Engine:
    """One replay of ``workload`` on ``cluster`` under ``scheduler``.

    Attributes:
        workload: the jobs.
        cluster: the nodes.
        scheduler: the policy to replay.
        policy: classes, quotas and fair-share knobs (the broker's ``Policy``).
        checkpoint: classes whose preempted jobs resume instead of restarting
            (``"*"``: all).
        until: stop at this virtual time, seconds (``None``: run to the end).
        progress: told of each job that ends.
        verify: also run the full pass after every prefix pass and raise
            :class:`SimulationError` if they decide differently (for tests).
    """

    workload: Workload
    cluster: Cluster
    scheduler: Scheduler
    policy: Policy = field(default_factory=Policy)
    checkpoint: frozenset[str] = frozenset()
    until: float | None = None
    progress: Progress | None = None
    verify: bool = False

    def __post_init__(self) -> None:
        self._slots = self.cluster.slots()
        self._topology = dict(self.cluster.topology)
        self._jobs = self.workload.jobs
        self._records = [JobRecord() for _ in self._jobs]
        self._run_left = [seconds_to_us(j.run_time) for j in self._jobs]
        self._limit_left = [seconds_to_us(j.time_limit) for j in self._jobs]
        self._pending: dict[int, Request] = {}
        self._running: dict[int, Running] = {}
        self._attempt: dict[int, _Attempt] = {}
        self._lease_job: dict[int, int] = {}
        self._busy: set[str] = set()
        self._usage: dict[str, UsageRecord] = {}
        self._ids = itertools.count(1)
        self._seq = itertools.count()
        self._events: list[tuple[int, int, int, int]] = []
        self._held = 0
        self._requested = 0.0
        self._series: list[tuple[float, int, float]] = [(0.0, 0, 0.0)]
        self._leases: list[LeaseSpan] = []
        self._in_grace = 0
        self._earmarked: set[int] = set()
        self._preempting = 0
        self._waiting_users: Counter[str] = Counter()
        self._dirty = True
        self._blocked = False
        self._requeued = False
        self._result = RunResult(
            self.scheduler.name, self._jobs, self._records, self._leases, len(self._slots), [], 0.0
        )

    # -- events ----------------------------------------------------------------------

    def _push(self, us: int, kind: int, value: int = 0) -> None:
        heapq.heappush(self._events, (us, kind, next(self._seq), value))

    def run(self) -> RunResult:
        """Replay every event (up to ``until``); return the result."""
        started = time.perf_counter()
        for job in self._jobs:
            self._push(seconds_to_us(job.submit), _ARRIVAL, job.index)
        limit = None if self.until is None else seconds_to_us(self.until)
        now = 0
        events = self._events
        while events:
            now = events[0][0]
            if limit is not None and now > limit:
                now = limit
                break
            while events and events[0][0] == now:
                _, kind, _, value = heapq.heappop(events)
                self._result.events += 1
                if kind == _ARRIVAL:
                    self._arrive(self._jobs[value])
                elif kind == _COMPLETE:
                    if value in self._running:  # else evicted before it completed
                        self._end(value, now, "completed")
                        self._dirty = True
                else:
                    self._dirty = True
            if self._needs_pass():
                self._pass(now)
            else:
                self._result.skipped += 1
        self._close(now)
        self._result.wall = time.perf_counter() - started
        return self._result

    def _needs_pass(self) -> bool:
        """Whether a pass now could decide anything (see the module doc)."""
        if not self._pending and not self._in_grace:
            return False
        if not self._dirty and self.scheduler.strict_fifo and self._blocked:
            return False  # only arrivals, behind a head that does not fit
        if self._held < len(self._slots) or self._in_grace or self._earmarked:
            return True
        return self.scheduler.preempts and (self.policy.has_guarantees or self._preempting > 0)

    # -- state changes ---------------------------------------------------------------

    def _arrive(self, job: SimJob) -> None:
        self._enqueue(job, seconds_to_us(job.submit))

    def _enqueue(self, job: SimJob, created: int) -> None:
        lease_id = next(self._ids)
        self._lease_job[lease_id] = job.index
        self._pending[lease_id] = Request(
            lease_id=lease_id,
            user=job.user,
            gpus=job.gpus,
            created=at(created),
            group=job.group,
            priority_class=job.priority_class,
            time_limit=self._limit_left[job.index] / US,
        )
        self._waiting_users[job.user] += 1
        if self.policy.class_of(job.priority_class).preempting:
            self._preempting += 1

    def _pass(self, now: int) -> None:
        when = at(now)
        pending: Iterable[Request] = self._pending.values()
        if self.scheduler.strict_fifo and not self._requeued:
            pending = itertools.islice(pending, len(self._slots) - self._held + 1)
        state = SchedulerState(
            slots=self._slots,
            running=tuple(self._running.values()),
            pending=tuple(pending),
            policy=self.policy,
            usage=self._usage,
            topology=self._topology,
        )
        if self.scheduler.order is not None and self._may_use_prefix(state):
            decisions = self._prefix_pass(state, when)
            if self.verify:
                self._check(decisions, self.scheduler.schedule(state, when), when)
        else:
            decisions = self.scheduler.schedule(state, when)
        self._result.passes += 1
        self._dirty = False
        self._apply(decisions, now)
        self._blocked = bool(self._pending)

    @staticmethod
    def _check(part: Decisions, full: Decisions, when: dt.datetime) -> None:
        def essential(d: Decisions) -> tuple[object, ...]:
            return (d.grants, d.preemptions, d.evictions, d.withdrawn)

        if essential(part) != essential(full):
            raise SimulationError(
                f"at {when}: the prefix pass decided {essential(part)}, the full pass "
                f"{essential(full)}"
            )

    def _may_use_prefix(self, state: SchedulerState) -> bool:
        """Whether requests behind a prefix could only wait: nothing earmarked,
        nobody in grace, no preemption possible, and a queue longer than a prefix."""
        return (
            not self._earmarked
            and not self._in_grace
            and not self._preempting
            and not self.policy.has_guarantees
            and len(state.pending) > PREFIX_BASE
        )

    def _split(self, ordered: list[Request]) -> tuple[list[Request], list[Request]]:
        """The queue's head for a prefix pass, and the rest.

        The head is at least :data:`PREFIX_BASE` requests long, and long enough
        to hold :data:`PREFIX_FITTING` (+ :data:`PREFIX_PER_FREE` per free
        device) requests small enough for a node's free devices, so that the
        free devices are likely taken or shown reserved within it.
        """
        free: dict[str, int] = {}
        for slot in self._slots:
            if slot.uuid not in self._busy and not slot.drained:
                free[slot.node] = free.get(slot.node, 0) + 1
        largest = max(free.values(), default=0)
        wanted = PREFIX_FITTING + PREFIX_PER_FREE * sum(free.values()) if largest else 0
        end = fitting = 0
        for end, request in enumerate(ordered, 1):
            if request.gpus <= largest:
                fitting += 1
            if end >= PREFIX_BASE and fitting >= wanted:
                break
        return ordered[:end], ordered[end:]

    def _prefix_pass(self, state: SchedulerState, when: dt.datetime) -> Decisions:
        """The pass's decisions from part of the queue, when that is provably exact.

        Requests are served in the scheduler's queue order, and within a pass
        placement only gets harder (devices are taken and reserved, never given
        back). So, once the head of the queue is served, a request behind it
        cannot start when no node has as many free devices as it needs, or
        when a request of the head needing at most as many GPUs for at most as
        long was tried and did not fit (see :meth:`_may_start`). Such a
        request only waits; once the pass's reservations are used up within
        the head, it does not even change what the pass plans, so it can be
        left out.

        The scheduler first sees the head (see :meth:`_split`) plus each other
        waiting user's first request (so that fair-share factors, which depend
        on who waits, stay the same). While some request behind might start,
        the next few of those are added to the head and the pass runs again
        (only when the reservations were used up within the first head; else
        the full pass runs). The decisions are those of the full pass, less
        the waits of the requests left out; nothing here may preempt (see
        :meth:`_may_use_prefix`).
        """
        assert self.scheduler.order is not None
        ordered = self.scheduler.order(state, when)
        head, rest = self._split(ordered)
        if not rest:
            return self._full_pass(state, when)
        users = {r.user for r in head}
        extra = []
        waiting = len(self._waiting_users)
        for request in rest:
            if len(users) == waiting:
                break
            if request.user not in users:
                users.add(request.user)
                extra.append(request)
        served = {r.lease_id: r for r in head}
        first = True
        while True:
            pending = (*served.values(), *(r for r in extra if r.lease_id not in served))
            decisions = self.scheduler.schedule(replace(state, pending=pending), when)
            if decisions.preemptions:
                return self._full_pass(state, when)
            rest = self._may_start(decisions, served, rest, when)
            self._result.candidates += len(rest)
            if not rest:
                if any(g.lease_id not in served for g in decisions.grants):
                    return self._full_pass(state, when)  # cannot happen (see above); be safe
                self._result.prefix_passes += 1
                return decisions
            if first:
                tried = sum(
                    1 for w in decisions.waits if w.lease_id in served and w.reason in _NOT_PLACED
                )
                if tried < self.policy.max_reservations:
                    return self._full_pass(state, when)
                first = False
            chunk = PREFIX_FITTING + PREFIX_PER_FREE * (len(self._slots) - self._held)
            served.update((r.lease_id, r) for r in rest[:chunk])
            rest = rest[chunk:]

    def _full_pass(self, state: SchedulerState, when: dt.datetime) -> Decisions:
        self._result.full_passes += 1
        return self.scheduler.schedule(state, when)

    def _may_start(
        self,
        decisions: Decisions,
        head: dict[int, Request],
        behind: list[Request],
        when: dt.datetime,
    ) -> list[Request]:
        """Requests of ``behind`` not shown unable to start once ``head`` was served.

        A request cannot start when (1) no node has as many free devices as
        it needs; (2) a request of ``head`` needing at most as many GPUs for
        at most as long was tried and did not fit; or (3) one needing at most
        as many GPUs did not fit (so no node has that many unreserved free
        devices) and it would run past the latest reservation start (so no
        reserved device is usable either).
        """
        taken = set(self._busy)
        for grant in decisions.grants:
            if grant.lease_id in head:
                taken.update(grant.devices)
        free: dict[str, int] = {}
        for slot in self._slots:
            if slot.uuid not in taken and not slot.drained:
                free[slot.node] = free.get(slot.node, 0) + 1
        largest = max(free.values(), default=0)
        if largest == 0:
            return []
        missed: dict[int, float] = {}  # GPUs -> shortest time limit tried that did not fit
        latest = when  # the latest reservation start: no device is held back later
        for wait in decisions.waits:
            request = head.get(wait.lease_id)
            if request is not None and wait.reason in _NOT_PLACED:
                limit = math.inf if request.time_limit is None else request.time_limit
                missed[request.gpus] = min(missed.get(request.gpus, math.inf), limit)
                if wait.eta is not None and wait.eta > latest:
                    latest = wait.eta
        smallest_missed = min(missed, default=math.inf)
        horizon = (latest - when).total_seconds()
        bounds = sorted(missed.items())
        candidates = []
        for request in behind:
            if request.gpus > largest:
                continue
            limit = math.inf if request.time_limit is None else request.time_limit
            if request.gpus >= smallest_missed and limit > horizon + 0.001:
                continue
            if not any(g <= request.gpus and t <= limit for g, t in bounds):
                candidates.append(request)
        return candidates

    def _apply(self, decisions: Decisions, now: int) -> None:
        """Write ``decisions`` in memory, in the order apply_decisions does."""
        for eviction in decisions.evictions:
            if eviction.lease_id not in self._running:
                raise SimulationError(f"evicted lease {eviction.lease_id} is not running")
            self._evict(eviction.lease_id, eviction.reason, now)
        for lease_id in decisions.withdrawn:
            lease = self._running[lease_id]
            if lease.preempt_deadline is not None:
                self._in_grace -= 1
                self._running[lease_id] = replace(lease, preempt_deadline=None)
            self._result.withdrawn += 1
        for grant in decisions.grants:
            self._grant(grant.lease_id, grant.devices, now)
        for preemption in decisions.preemptions:
            victim = self._running[preemption.lease_id]
            if victim.preempt_deadline is None:
                self._in_grace += 1
            self._running[victim.lease_id] = replace(victim, preempt_deadline=preemption.deadline)
            self._push(max(micros(preemption.deadline), now), _WAKE)
            self._result.notices += 1
        if decisions.preemptions or self._earmarked:
            for wait in decisions.waits:
                if wait.earmarked or wait.lease_id in self._earmarked:
                    self._earmark(wait.lease_id, wait.earmarked)
        if decisions.evictions:
            self._push(now, _WAKE)  # evicted devices are free for the next pass

    def _earmark(self, lease_id: int, devices: tuple[str, ...]) -> None:
        request = self._pending[lease_id]
        if request.earmarked != devices:
            self._pending[lease_id] = replace(request, earmarked=devices)
        if devices:
            self._earmarked.add(lease_id)
        else:
            self._earmarked.discard(lease_id)

    def _grant(self, lease_id: int, devices: tuple[str, ...], now: int) -> None:
        request = self._pending.pop(lease_id, None)
        if request is None:
            raise SimulationError(f"granted lease {lease_id} is not pending")
        if len(devices) != request.gpus or self._busy.intersection(devices):
            raise SimulationError(f"grant of lease {lease_id}: devices {devices} are busy or wrong")
        self._earmarked.discard(lease_id)
        self._waiting_users[request.user] -= 1
        if not self._waiting_users[request.user]:
            del self._waiting_users[request.user]
        if self.policy.class_of(request.priority_class).preempting:
            self._preempting -= 1
        index = self._lease_job[lease_id]
        job = self._jobs[index]
        self._busy.update(devices)
        self._running[lease_id] = Running(
            lease_id=lease_id,
            user=request.user,
            devices=devices,
            started=at(now),
            group=request.group,
            priority_class=request.priority_class,
            ends=at(now + self._limit_left[index]),
        )
        self._attempt[lease_id] = _Attempt(index, now)
        self._push(now + self._run_left[index], _COMPLETE, lease_id)
        record = self._records[index]
        if record.first_start is None:
            record.first_start = now / US
        record.starts += 1
        self._held += len(devices)
        self._requested += job.demand
        self._mark(now)

    def _end(self, lease_id: int, now: int, how: str) -> _Attempt:
        """Remove a running lease: free its devices, charge its usage."""
        lease = self._running.pop(lease_id)
        attempt = self._attempt.pop(lease_id)
        job = self._jobs[attempt.job]
        if lease.preempt_deadline is not None:
            self._in_grace -= 1
        self._busy.difference_update(lease.devices)
        self._held -= len(lease.devices)
        self._requested -= job.demand
        self._charge(lease, now)
        self._leases.append(LeaseSpan(attempt.job, job.gpus, attempt.start / US, now / US, how))
        self._mark(now)
        if how in ("completed", "time limit"):
            record = self._records[attempt.job]
            record.finish = now / US
            record.timed_out = how == "time limit"
            if self.progress is not None:
                self.progress.update(1)
        return attempt

    def _evict(self, lease_id: int, reason: str, now: int) -> None:
        if reason.startswith("time limit"):
            self._end(lease_id, now, "time limit")
            return
        attempt = self._end(lease_id, now, "preempted")
        index = attempt.job
        ran = now - attempt.start
        record = self._records[index]
        record.preempted += 1
        self._result.evictions += 1
        job = self._jobs[index]
        if "*" in self.checkpoint or job.priority_class in self.checkpoint:
            self._run_left[index] = max(self._run_left[index] - ran, 0)
            self._limit_left[index] = max(self._limit_left[index] - ran, self._run_left[index])
        else:
            record.lost_gpu_seconds += job.gpus * ran / US
        self._requeued = True
        self._enqueue(job, seconds_to_us(job.submit))

    def _charge(self, lease: Running, now: int) -> None:
        """Add the lease's decayed GPU-seconds to its user (as gpubroker.usage does)."""
        when = at(now)
        half_life = self.policy.half_life
        old = self._usage.get(lease.user)
        past = (
            0.0
            if old is None
            else decay(old.gpu_seconds, (when - old.as_of).total_seconds(), half_life)
        )
        total = past + running_usage(lease.gpus, lease.started, when, half_life)
        self._usage[lease.user] = UsageRecord(total, when)

    def _mark(self, now: int) -> None:
        point = (now / US, self._held, self._requested)
        if self._series[-1][0] == point[0]:
            self._series[-1] = point
        else:
            self._series.append(point)

    def _close(self, now: int) -> None:
        """Stop at ``now``: leases still running end there (for the record only)."""
        for attempt in self._attempt.values():
            job = self._jobs[attempt.job]
            self._leases.append(
                LeaseSpan(attempt.job, job.gpus, attempt.start / US, now / US, "running")
            )
        self._result.series = self._series
        self._result.end = now / US
