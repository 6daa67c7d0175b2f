"""The discrete-event loop: a virtual clock, the real scheduling core.

Events are arrivals (a job's submit time), completions (start + run time)
and wake-ups (a preemption's grace deadline, or "run again now" after
evictions). At each event time the engine applies every event due, then
runs one scheduling pass on a :class:`~gpubroker.scheduler.SchedulerState`
kept up to date incrementally, and applies the decisions with
:func:`gpubroker.scheduler.apply`, the pure applier whose rules the live
broker follows (:func:`gpubroker.passes.apply_decisions`):

- a grant becomes a :class:`~gpubroker.scheduler.Running` lease (started
  now, ``ends`` = now + its time limit) holding whole devices, or the MIG
  instance or shares granted (``parts``), and completes after its run time;
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

The broker's passes over a long queue see only its head in queue order (see
:meth:`Engine._prefix_pass`, checked exact); the engine keeps each user's
requests sorted and merges them into the broker's order as far as the head
goes, and finds the requests behind the head that might start through an
index by size and time limit, so that no pass sorts or scans the whole queue.

The virtual clock counts integer microseconds from the first submission;
the scheduler sees aware UTC datetimes from :data:`EPOCH` (an arbitrary
origin: 2020-01-01 00:00 UTC).
"""

from __future__ import annotations

import bisect
import datetime as dt
import heapq
import itertools
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Protocol

from ..gcpause import paused_gc
from ..scheduler import (
    Decisions,
    Policy,
    PoolMode,
    Request,
    Running,
    SchedulerState,
    UsageRecord,
    WaitReason,
    fairshare,
)
from ..scheduler.apply import CAUSE_TIME_LIMIT, ApplyError, apply, charge
from .cluster import Cluster
from .workload import SimJob, Workload

#: the virtual time 0 as the scheduler sees it
EPOCH = dt.datetime(2020, 1, 1, tzinfo=dt.timezone.utc)
#: microseconds per second
US = 1_000_000

SchedulerFn = Callable[[SchedulerState, dt.datetime], Decisions]

#: a prefix pass sees at least this many requests more than Policy.max_reservations ...
PREFIX_BASE = 32
#: ... and at least this many that fit a node's free devices, plus PREFIX_PER_FREE per free device
PREFIX_FITTING = 32
PREFIX_PER_FREE = 2
#: requests that might start behind a prefix are added this many at a time (+ per free device)
CHUNK_BASE = 32
CHUNK_PER_FREE = 2

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
        fair_share_order: ``order`` is the broker's: class rank, then the
            fair-share factor in steps of ``Policy.fairshare_resolution``,
            then age and id. The engine then merges its per-user queues into
            that order as far as a pass needs, instead of sorting the whole
            queue every pass (``verify`` checks it against ``order``).
    """

    name: str
    schedule: SchedulerFn
    preempts: bool = False
    strict_fifo: bool = False
    order: Callable[[SchedulerState, dt.datetime], list[Request]] | None = None
    fair_share_order: bool = False


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
        passed_over: requests within the span of a prefix pass's head left
            out of it (larger than any node's free devices, past the head's
            first part), summed over passes.
        events: events applied.
        wall: wall-clock seconds of the replay.
    """

    scheduler: str
    jobs: tuple[SimJob, ...]
    records: list[JobRecord]
    leases: list[LeaseSpan]
    total_gpus: int
    series: list[tuple[float, float, float]]
    end: float
    notices: int = 0
    evictions: int = 0
    withdrawn: int = 0
    passes: int = 0
    skipped: int = 0
    prefix_passes: int = 0
    full_passes: int = 0
    candidates: int = 0
    passed_over: int = 0
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
        #: devices holding parts (MIG instances, shares): parts held on each
        self._shared: Counter[str] = Counter()
        #: device units held in parts
        self._fraction = 0.0
        #: the cluster has devices that are handed out in parts
        self._fractional = any(s.mode != PoolMode.exclusive.value for s in self._slots)
        self._usage: dict[str, UsageRecord] = {}
        self._ids = itertools.count(1)
        #: per size (GPUs), (time limit s or inf, lease id) of pending requests, sorted
        self._by_size: dict[int, list[tuple[float, int]]] = {}
        #: per user, (-class rank, created us, lease id) of its pending requests, sorted
        self._queues: dict[str, list[tuple[int, int, int]]] = {}
        self._seq = itertools.count()
        self._events: list[tuple[int, int, int, int]] = []
        self._held = 0
        self._requested = 0.0
        self._series: list[tuple[float, float, float]] = [(0.0, 0, 0.0)]
        self._leases: list[LeaseSpan] = []
        self._in_grace = 0
        self._earmarked: set[int] = set()
        self._preempting = 0
        self._waiting_users: Counter[str] = Counter()
        #: the fair-share buckets of the last pass: (its state, its time, buckets)
        self._bucket_memo: tuple[SchedulerState, dt.datetime, dict[str, int]] | None = None
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
                with paused_gc():  # as the broker runs its passes (gpubroker.gcpause)
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
        if self._held < len(self._slots) or self._in_grace or self._earmarked or self._fractional:
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
            kind=job.kind,
            mig_profile=job.mig_profile,
            memory_mib=job.memory_mib,
        )
        self._waiting_users[job.user] += 1
        if self.scheduler.order is not None:  # the indexes of prefix passes
            rank = self.policy.class_of(job.priority_class).rank
            bisect.insort(self._queues.setdefault(job.user, []), (-rank, created, lease_id))
            limit = self._limit_left[job.index] / US
            bisect.insort(self._by_size.setdefault(job.gpus, []), (limit, lease_id))
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
            explain=False,  # only reasons, ETAs and earmarks are read here
        )
        seen = state
        if self.scheduler.order is not None and self._may_use_prefix(state):
            decisions, seen = self._prefix_pass(state, when)
            if self.verify:
                self._check(decisions, self.scheduler.schedule(state, when), when)
        else:
            decisions = self.scheduler.schedule(state, when)
        self._result.passes += 1
        self._dirty = False
        self._apply(decisions, seen, now)
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
            not self._fractional
            and not self._earmarked
            and not self._in_grace
            and not self._preempting
            and not self.policy.has_guarantees
            and len(state.pending) > self.policy.max_reservations + PREFIX_BASE
        )

    def _free_per_node(self) -> dict[str, int]:
        """Free devices (in service, not held) per node, at the pass's start."""
        free: dict[str, int] = {}
        for slot in self._slots:
            if slot.uuid not in self._busy and not slot.drained:
                free[slot.node] = free.get(slot.node, 0) + 1
        return free

    def _split(self, queue: Iterator[Request], size: int) -> tuple[list[Request], bool]:
        """The head of the queue for a prefix pass, and whether requests
        are left behind it.

        The head holds the first ``size`` requests of ``queue`` (the queue
        order), then, until it holds :data:`PREFIX_FITTING` (+
        :data:`PREFIX_PER_FREE` per free device) requests small enough for a
        node's free devices (so that the free devices are likely taken or
        shown reserved within it), the next ones of those small enough only:
        once the pass's reservations are used up within the first ``size``
        (:meth:`_serve` checks it), a request larger than any node's free
        devices only waits and changes nothing the pass decides after it.
        """
        free = self._free_per_node()
        largest = max(free.values(), default=0)
        wanted = PREFIX_FITTING + PREFIX_PER_FREE * sum(free.values()) if largest else 0
        head: list[Request] = []
        consumed = fitting = 0
        while consumed < size or fitting < wanted:
            request = next(queue, None)
            if request is None:
                break
            consumed += 1
            fits = request.gpus <= largest
            if fits or consumed <= size:
                head.append(request)
            fitting += fits
        self._result.passed_over += consumed - len(head)
        return head, consumed < len(self._pending)

    def _prefix_pass(
        self, state: SchedulerState, when: dt.datetime
    ) -> tuple[Decisions, SchedulerState]:
        """The pass's decisions from part of the queue, when that is provably exact.

        Requests are served in the scheduler's queue order, and within a pass
        placement only gets harder (devices are taken and reserved, never given
        back). So, once the head of the queue is served, a request behind it
        cannot start when no node has as many free devices as it needs, or
        when a request of the head needing at most as many GPUs for at most as
        long was tried and did not fit (see :meth:`_may_start`). Such a
        request only waits; once the pass's reservations are used up within
        the head, it does not even change what the pass plans, so it can be
        left out (also from the head, past its first part: :meth:`_split`).

        The scheduler first sees the head, told who else waits
        (``SchedulerState.also_waiting``, so that fair-share factors, which
        depend on who waits, stay the same). While some request behind might
        start, the next few of those are added to the head and the pass runs
        again. When the reservations were not used up within the head's
        first part, the head is taken again, twice as long. The decisions
        are those of the full pass, less the waits of the requests left out;
        nothing here may preempt (see :meth:`_may_use_prefix`).
        """
        assert self.scheduler.order is not None
        size = self.policy.max_reservations + PREFIX_BASE
        while True:
            head, left = self._split(self._queue_order(state, when), size)
            if not left:
                return self._full_pass(state, when)
            if self.verify:
                self._check_head(state, when, head, size)
            decided = self._serve(state, when, head, size)
            if decided is not None:
                return decided
            size *= 2  # the reservations were not used up within the head: a longer one

    def _check_head(
        self, state: SchedulerState, when: dt.datetime, head: list[Request], size: int
    ) -> None:
        """Raise unless ``head`` is what :meth:`_split` takes from the policy's order."""
        assert self.scheduler.order is not None
        largest = max(self._free_per_node().values(), default=0)
        order = self.scheduler.order(state, when)
        last = next(k for k, r in enumerate(order) if r.lease_id == head[-1].lease_id)
        want = [
            r.lease_id for k, r in enumerate(order[: last + 1]) if k < size or r.gpus <= largest
        ]
        got = [r.lease_id for r in head]
        if want != got:
            raise SimulationError(
                f"at {when}: the merged queue order is not the policy's: "
                f"the policy's head {want[:8]}..., the engine's {got[:8]}..."
            )

    def _serve(
        self, state: SchedulerState, when: dt.datetime, head: list[Request], size: int
    ) -> tuple[Decisions, SchedulerState] | None:
        """The decisions of :meth:`_prefix_pass` from ``head`` (see
        :meth:`_split`) and requests added behind it; ``None`` when the head
        is too short to tell (the pass's reservations were not used up
        within its first ``size`` requests, which are the queue's first)."""
        first_part = {r.lease_id for r in head[:size]}
        # the users waiting behind the head still count in fair share
        also_waiting = frozenset(self._waiting_users)
        served = {r.lease_id: r for r in head}
        rest: list[Request] | None = None  # every pending request behind the head
        first = True
        while True:
            seen = replace(state, pending=tuple(served.values()), also_waiting=also_waiting)
            decisions = self.scheduler.schedule(seen, when)
            if decisions.preemptions:
                return self._full_pass(state, when)
            behind = self._may_start(decisions, served, rest, when)
            if first:
                behind = self._in_order(state, when, behind)
            self._result.candidates += len(behind)
            if not behind:
                if any(g.lease_id not in served for g in decisions.grants):
                    return self._full_pass(state, when)  # cannot happen (see above); be safe
                self._result.prefix_passes += 1
                return decisions, seen
            if first:
                tried = sum(
                    1
                    for w in decisions.waits
                    if w.lease_id in first_part and w.reason in _NOT_PLACED
                )
                if tried < self.policy.max_reservations:
                    return None
                first = False
            chunk = CHUNK_BASE + CHUNK_PER_FREE * (len(self._slots) - self._held)
            served.update((r.lease_id, r) for r in behind[:chunk])
            rest = behind[chunk:]

    def _buckets(self, state: SchedulerState, when: dt.datetime) -> dict[str, int]:
        """Per waiting user, the fair-share part of the broker's queue key
        (:func:`gpubroker.scheduler.queue_order`): minus the factor in steps.
        Computed once per pass (``state`` is the pass's, never changed)."""
        memo = self._bucket_memo
        if memo is not None and memo[0] is state and memo[1] == when:
            return memo[2]
        buckets = self._compute_buckets(state, when)
        self._bucket_memo = (state, when, buckets)
        return buckets

    def _compute_buckets(self, state: SchedulerState, when: dt.datetime) -> dict[str, int]:
        policy = self.policy
        usage = fairshare.decayed_usage(state.usage, state.running, when, policy.half_life)
        users = set(self._waiting_users).union(r.user for r in state.running)
        total = sum(1 for s in state.slots if not s.drained)
        factor = fairshare.factors(users, usage, policy.shares, total, policy.half_life)
        step = policy.fairshare_resolution or 1e-9
        return {user: -round(factor[user] / step) for user in self._waiting_users}

    def _queue_order(self, state: SchedulerState, when: dt.datetime) -> Iterator[Request]:
        """The pending requests in the scheduler's queue order, lazily: a merge
        of the per-user queues by the broker's key (see
        :attr:`Scheduler.fair_share_order`), else the scheduler's own sort."""
        assert self.scheduler.order is not None
        if not self.scheduler.fair_share_order:
            yield from self.scheduler.order(state, when)
            return
        buckets = self._buckets(state, when)
        pending = self._pending

        def keyed(bucket: int, queue: list[tuple[int, int, int]]) -> Iterator[tuple[int, ...]]:
            return ((rank, bucket, created, lease_id) for rank, created, lease_id in queue)

        merged = heapq.merge(
            *(keyed(buckets[user], queue) for user, queue in self._queues.items() if queue)
        )
        for key in merged:
            yield pending[key[3]]

    def _in_order(
        self, state: SchedulerState, when: dt.datetime, requests: list[Request]
    ) -> list[Request]:
        """``requests`` sorted in the scheduler's queue order."""
        if len(requests) < 2:
            return requests
        if not self.scheduler.fair_share_order:
            assert self.scheduler.order is not None
            wanted = {r.lease_id for r in requests}
            return [r for r in self.scheduler.order(state, when) if r.lease_id in wanted]
        buckets = self._buckets(state, when)
        policy = self.policy
        rank = {c: -policy.class_of(c).rank for c in {r.priority_class for r in requests}}
        return sorted(
            requests, key=lambda r: (rank[r.priority_class], buckets[r.user], r.created, r.lease_id)
        )

    def _full_pass(
        self, state: SchedulerState, when: dt.datetime
    ) -> tuple[Decisions, SchedulerState]:
        self._result.full_passes += 1
        return self.scheduler.schedule(state, when), state

    def _may_start(
        self,
        decisions: Decisions,
        head: dict[int, Request],
        behind: list[Request] | None,
        when: dt.datetime,
    ) -> list[Request]:
        """Requests of ``behind`` not shown unable to start once ``head`` was served
        (``behind`` ``None``: every pending request not in ``head``, found
        through the engine's index by size and time limit, in no set order).

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
        if behind is None:
            return self._may_start_indexed(head, largest, bounds, smallest_missed, horizon)
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

    def _may_start_indexed(
        self,
        head: dict[int, Request],
        largest: int,
        bounds: list[tuple[int, float]],
        smallest_missed: float,
        horizon: float,
    ) -> list[Request]:
        """:meth:`_may_start` over every pending request not in ``head``: per
        size, the requests whose time limit is below the bound that rules (2)
        and (3) set, a prefix of the size's requests sorted by time limit."""
        candidates: list[Request] = []
        pending = self._pending
        for gpus, entries in self._by_size.items():
            if gpus > largest or not entries:
                continue
            end = len(entries)
            shortest = min((t for g, t in bounds if g <= gpus), default=None)
            if shortest is not None:  # rule (2): only limits below the shortest missed
                end = bisect.bisect_left(entries, (shortest, -1))
            if gpus >= smallest_missed:  # rule (3): only limits within the horizon
                end = min(end, bisect.bisect_right(entries, (horizon + 0.001, math.inf)))
            candidates.extend(pending[i] for _, i in entries[:end] if i not in head)
        return candidates

    def _apply(self, decisions: Decisions, state: SchedulerState, now: int) -> None:
        """Apply ``decisions`` (of a pass over ``state``) with
        :func:`gpubroker.scheduler.apply`, the rules the live broker follows,
        and keep the engine's indexes and records in step with its outcome."""
        named = {grant.lease_id for grant in decisions.grants}
        if decisions.preemptions or self._earmarked:
            named.update(
                w.lease_id for w in decisions.waits if w.earmarked or w.lease_id in self._earmarked
            )
        # apply() needs only the requests the decisions change: not the whole queue
        state = replace(state, pending=tuple(self._pending[i] for i in named))
        try:
            applied = apply(state, decisions, at(now))
        except ApplyError as err:
            raise SimulationError(f"at {at(now)}: {err}") from err
        if applied.evicted:
            self._usage = dict(applied.usage)  # charged by apply(), in eviction order
            causes = {e.lease_id: e.detail["cause"] for e in applied.events if e.kind == "released"}
            for lease in applied.evicted:
                self._evict(lease.lease_id, causes[lease.lease_id] == CAUSE_TIME_LIMIT, now)
        self._result.withdrawn += len(decisions.withdrawn)
        for lease in applied.marked:
            if self._running[lease.lease_id].preempt_deadline is None:
                self._in_grace += 1
            if lease.preempt_deadline is None:
                self._in_grace -= 1
            self._running[lease.lease_id] = lease
        for lease in applied.granted:
            self._grant(lease, now)
        for preemption in decisions.preemptions:
            self._push(max(micros(preemption.deadline), now), _WAKE)
            self._result.notices += 1
        for request in applied.earmarked:
            self._pending[request.lease_id] = request
            if request.earmarked:
                self._earmarked.add(request.lease_id)
            else:
                self._earmarked.discard(request.lease_id)
        if decisions.evictions:
            self._push(now, _WAKE)  # evicted devices are free for the next pass

    def _grant(self, lease: Running, now: int) -> None:
        lease_id = lease.lease_id
        request = self._pending.pop(lease_id)
        self._earmarked.discard(lease_id)
        self._waiting_users[request.user] -= 1
        if self.scheduler.order is not None:
            queue = self._queues[request.user]
            rank = self.policy.class_of(request.priority_class).rank
            del queue[bisect.bisect_left(queue, (-rank, micros(request.created), lease_id))]
            sized = self._by_size[request.gpus]
            limit = math.inf if request.time_limit is None else request.time_limit
            del sized[bisect.bisect_left(sized, (limit, lease_id))]
        if not self._waiting_users[request.user]:
            del self._waiting_users[request.user]
        if self.policy.class_of(request.priority_class).preempting:
            self._preempting -= 1
        index = self._lease_job[lease_id]
        job = self._jobs[index]
        self._take(lease, 1)
        self._running[lease_id] = lease
        self._attempt[lease_id] = _Attempt(index, now)
        self._push(now + self._run_left[index], _COMPLETE, lease_id)
        record = self._records[index]
        if record.first_start is None:
            record.first_start = now / US
        record.starts += 1
        self._requested += job.demand
        self._mark(now)

    def _take(self, lease: Running, sign: int) -> None:
        """Count the slots of ``lease`` as held (``sign`` 1) or free again (-1)."""
        if sign > 0:
            self._busy.update(lease.devices)
        else:
            self._busy.difference_update(lease.devices)
        self._held += sign * len(lease.devices)
        for part in lease.parts:
            self._shared[part.device] += sign
            if not self._shared[part.device]:
                del self._shared[part.device]
            self._fraction += sign * part.weight
        if not self._shared:
            self._fraction = 0.0  # no rounding residue once no part is held

    def _end(self, lease_id: int, now: int, how: str, charged: bool = False) -> _Attempt:
        """Remove a running lease: free its slots, charge its usage (unless
        :func:`~gpubroker.scheduler.apply` has)."""
        lease = self._running.pop(lease_id)
        attempt = self._attempt.pop(lease_id)
        job = self._jobs[attempt.job]
        if lease.preempt_deadline is not None:
            self._in_grace -= 1
        self._take(lease, -1)
        self._requested -= job.demand
        if not charged:
            self._usage = charge(self._usage, lease, at(now), self.policy.half_life)
        self._leases.append(LeaseSpan(attempt.job, job.gpus, attempt.start / US, now / US, how))
        self._mark(now)
        if how in ("completed", "time limit"):
            record = self._records[attempt.job]
            record.finish = now / US
            record.timed_out = how == "time limit"
            if self.progress is not None:
                self.progress.update(1)
        return attempt

    def _evict(self, lease_id: int, timed_out: bool, now: int) -> None:
        if timed_out:
            self._end(lease_id, now, "time limit", charged=True)
            return
        attempt = self._end(lease_id, now, "preempted", charged=True)
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

    def _mark(self, now: int) -> None:
        held = self._held + self._fraction if self._fraction else self._held
        point = (now / US, held, self._requested)
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
