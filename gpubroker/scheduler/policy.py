"""The broker's scheduling policy: one pure pass over the state.

Order: priority class rank, then fair-share factor (in steps of
``Policy.fairshare_resolution``), then age. Walking the queue in that order,
each request is

1. held at a limit (``QuotaUserLimit``/``QuotaGroupLimit``) or refused
   service when larger than every node of the pool it asks for
   (``PoolDrained``) or when its non-preemptible class would run above
   guarantee (``OverGuarantee``);
2. granted devices reclaimed for it once they are free (earmarked);
3. granted now when devices are free on one node, topology-aware, and not
   reserved for a request ahead of it, unless it ends before that
   reservation (backfill);
4. else, when it may preempt (within guarantee, or a ``preempting`` class),
   given victims: they are told now and evicted after their grace period,
   and their devices (with free ones not reserved for a request ahead) are
   earmarked for it alone;
5. else given a reservation on the devices that free up first (up to
   ``Policy.max_reservations`` per pass), whose start is its ETA; it waits
   for ``Reserved``, ``Priority`` (a competing request ahead is blocked
   too) or ``Resources``.

Leases told of a preemption whose grace is over are evicted; a preemption
whose request went away is withdrawn (:func:`_evictions`), and the pass
treats its victim as running untold.
"""

from __future__ import annotations

import datetime as dt
import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from . import fairshare
from .accounting import EPS, Accounting
from .messages import UNTIMED, clock, drained, ordinal, unplanned, wait_parts
from .messages import gpus as gpus_text
from .placement import NEVER, Pool
from .preemption import VictimIndex, earliest_reclaim, find_victims
from .sharing import Miss, SharingPool
from .types import (
    INTERACTIVE_POOLS,
    Decisions,
    Eviction,
    Grant,
    Part,
    Preemption,
    Quota,
    Request,
    Running,
    SchedulerState,
    Wait,
    WaitReason,
    in_pool,
)

#: the pools a request may name and still preempt or reclaim (victims are
#: looked for on every device it may use: a pool named is not searched)
_ANY_POOL = (None, INTERACTIVE_POOLS)


def queue_order(state: SchedulerState, now: dt.datetime) -> list[Request]:
    """Pending requests in policy order (class rank, fair share, age, id)."""
    policy = state.policy
    pending = state.pending
    waiting_users = {r.user for r in pending}
    # only the factors of waiting users are used: leave out the decay of the others
    usage = fairshare.decayed_usage(
        {u: rec for u, rec in state.usage.items() if u in waiting_users},
        [lease for lease in state.running if lease.user in waiting_users],
        now,
        policy.half_life,
    )
    users = waiting_users | state.also_waiting | {r.user for r in state.running}
    total = sum(1 for s in state.slots if not s.drained)
    factor = fairshare.factors(
        users, usage, policy.shares, total, policy.half_life, only=waiting_users
    )
    step = policy.fairshare_resolution or 1e-9
    rank = {name: -policy.class_of(name).rank for name in {r.priority_class for r in pending}}
    share = {user: -round(f / step) for user, f in factor.items()}
    # sorted by (rank, share, created, lease id, index): buckets of equal
    # (rank, share), each sorted by age (the index breaks ties as a stable
    # sort would, and requests are never compared)
    buckets: dict[tuple[int, int], list[tuple[dt.datetime, int, int]]] = {}
    for i, r in enumerate(pending):
        key = (rank[r.priority_class], share[r.user])
        bucket = buckets.get(key)
        if bucket is None:
            buckets[key] = [(r.created, r.lease_id, i)]
        else:
            bucket.append((r.created, r.lease_id, i))
    ordered: list[Request] = []
    for key in sorted(buckets):
        bucket = buckets[key]
        bucket.sort()
        ordered += [pending[k[2]] for k in bucket]
    return ordered


@dataclass
class _Pass:
    state: SchedulerState
    now: dt.datetime
    acct: Accounting
    pool: Pool
    running: list[Running]
    sharing: SharingPool
    grants: list[Grant] = field(default_factory=list)
    preemptions: list[Preemption] = field(default_factory=list)
    waits: list[Wait] = field(default_factory=list)
    reservations: int = 0
    blocked: bool = False
    #: build each wait's sentence (``SchedulerState.explain``)
    explain: bool = True
    told: set[int] = field(default_factory=set)
    spare: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    #: waits so far by (slot kind, pool asked for; None: any pool)
    waiting: dict[tuple[str, str | None], int] = field(default_factory=lambda: defaultdict(int))
    waiting_kind: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    #: the names of the batch pools (:attr:`Slot.batch`), set by :func:`schedule`
    batch_pools: frozenset[str] = frozenset()
    #: waits so far blocked for devices (step 5: ``Resources``, ``Priority``,
    #: ``Reserved``) by (slot kind, pool asked for), and by slot kind
    blocked_waiting: dict[tuple[str, str | None], int] = field(
        default_factory=lambda: defaultdict(int)
    )
    blocked_kind: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    #: devices held by leases without a time limit (and not told): nobody
    #: knows when they free up
    untimed: frozenset[str] = frozenset()
    #: why a wait has no ETA once the reservation window is full
    #: (:func:`~gpubroker.scheduler.messages.unplanned`)
    window_full: str = ""
    #: message parts by (reason, eta, detail, why the ETA is unknown)
    _messages: dict[tuple[WaitReason, dt.datetime | None, str, str], tuple[str, str]] = field(
        default_factory=dict
    )
    #: (gpus, ends, pool) that found no devices: free devices only go
    #: during a pass, so they stay without
    no_fit: set[tuple[int, dt.datetime, str | None]] = field(default_factory=set)
    #: victim searches that found none, valid for (pool version, preemptions)
    no_victims: dict[tuple[object, ...], tuple[int, int]] = field(default_factory=dict)

    #: requests with valid earmarked devices, counted as held from the
    #: pass's start (:func:`_count_earmarked`): lease id -> covered
    counted: dict[int, bool] = field(default_factory=dict)

    #: the victim index, built on the first victim search (:meth:`victims`)
    _victims: VictimIndex | None = None
    #: the same, with leases inside their minimum runtime (:meth:`later_victims`)
    _later: VictimIndex | None = None
    #: reclaims found among leases inside their minimum runtime, by
    #: (gpus, pool, user): (pool version, preemptions) -> (start, ETA) or None
    reclaim_later: dict[
        tuple[object, ...], tuple[tuple[int, int], tuple[dt.datetime, dt.datetime] | None]
    ] = field(default_factory=dict)
    #: what the victim index is built from: holdings and told leases at the start
    _victim_basis: tuple[Accounting, frozenset[int]] | None = None

    def victims(self) -> VictimIndex:
        """The pass's :class:`VictimIndex`, built on first use from the
        holdings and told leases of the pass's start (so it is the index an
        eager build would give)."""
        if self._victims is None:
            assert self._victim_basis is not None
            acct, told = self._victim_basis
            self._victims = VictimIndex(
                self.running, self.pool, acct, self.state.policy, self.now, told
            )
        return self._victims

    def later_victims(self) -> VictimIndex:
        """:meth:`victims` as it will be once every lease has run its
        ``min_runtime`` (built on first use; victims told in this pass are
        left out by their earmarked devices)."""
        if self._later is None:
            assert self._victim_basis is not None
            acct, told = self._victim_basis
            self._later = VictimIndex(
                self.running, self.pool, acct, self.state.policy, NEVER, told | self.told
            )
        return self._later

    def _ahead(self, kind: str, pool: str) -> int:
        """Waits so far of ``kind`` that compete with a request of ``pool``
        (:func:`_competing`)."""
        return _competing(self.waiting, self.waiting_kind, self.batch_pools, kind, pool)

    def blocked_ahead(self, request: Request) -> bool:
        """Whether a request ahead of ``request`` that competes with it
        (same kind, overlapping pool: :func:`_competing`) waits blocked for
        devices; then ``request`` waits for ``Priority``, not ``Resources``."""
        kind, pool = request.kind, request.pool
        if pool is None:
            return self.blocked_kind[kind] > 0
        return _competing(self.blocked_waiting, self.blocked_kind, self.batch_pools, kind, pool) > 0

    def block(self, request: Request) -> None:
        """Record that ``request`` waits blocked for devices (step 5)."""
        self.blocked = True
        self.blocked_waiting[(request.kind, request.pool)] += 1
        self.blocked_kind[request.kind] += 1

    def position(self, request: Request) -> int:
        """1-based place among the waits so far that compete with ``request``:
        the same kind of slot (whole devices, MIG instances, shares) and a
        pool that overlaps (either asks for any pool, or both the same)."""
        kind, pool = request.kind, request.pool
        waiting = self.waiting
        ahead = self.waiting_kind[kind] if pool is None else self._ahead(kind, pool)
        waiting[(kind, pool)] += 1
        self.waiting_kind[kind] += 1
        return ahead + 1

    def wait(
        self,
        request: Request,
        reason: WaitReason,
        eta: dt.datetime | None = None,
        detail: str = "",
        earmarked: tuple[str, ...] = (),
        why: str = "",
    ) -> None:
        """Record that ``request`` waits; its message is built from parts
        shared by the requests that wait for the same reason. ``eta``: aware
        UTC or ``None``; ``why``: why the ETA is unknown
        (:func:`~gpubroker.scheduler.messages.wait_message`)."""
        kind, pool = request.kind, request.pool  # position(request), inlined (hot)
        waiting = self.waiting
        position = (self.waiting_kind[kind] if pool is None else self._ahead(kind, pool)) + 1
        waiting[(kind, pool)] += 1
        self.waiting_kind[kind] += 1
        if self.explain:
            key = (reason, eta, detail, why)
            parts = self._messages.get(key)
            if parts is None:
                parts = wait_parts(reason, eta, self.now, detail, why)
                self._messages[key] = parts
            message = parts[0] + ordinal(position) + parts[1]
        else:
            message = ""
        wait = _NEW(Wait)
        _SET(
            wait,
            "__dict__",
            {
                "lease_id": request.lease_id,
                "position": position,
                "reason": reason,
                "message": message,
                "eta": eta,
                "earmarked": earmarked,
            },
        )
        self.waits.append(wait)

    def wait_plain(self, request: Request, reason: WaitReason, why: str = "") -> None:
        """:meth:`wait` without ETA, detail or earmarked devices (the common
        case: thousands per pass), with less work per call; the same Wait."""
        kind, pool = request.kind, request.pool
        waiting = self.waiting
        position = (self.waiting_kind[kind] if pool is None else self._ahead(kind, pool)) + 1
        waiting[(kind, pool)] += 1
        self.waiting_kind[kind] += 1
        wait = _NEW(Wait)
        values = wait.__dict__
        values["lease_id"] = request.lease_id
        values["position"] = position
        values["reason"] = reason
        if self.explain:
            key = (reason, None, "", why)
            parts = self._messages.get(key)
            if parts is None:
                parts = self._messages[key] = wait_parts(reason, None, self.now, "", why)
            values["message"] = parts[0] + ordinal(position) + parts[1]
        else:
            values["message"] = ""
        values["eta"] = None
        values["earmarked"] = ()
        self.waits.append(wait)

    def grant(self, request: Request, devices: tuple[str, ...]) -> None:
        ends = NEVER
        if request.time_limit is not None:
            ends = self.now + dt.timedelta(seconds=request.time_limit)
        self.pool.take(devices, ends)
        covered = self.counted.get(request.lease_id)
        if covered is None:
            self.acct.add(request.lease_id, request.user, request.group, float(len(devices)))
        elif not covered:  # counted as held at the pass's start
            self.acct.borrowed.add(request.lease_id)
        self.grants.append(Grant(request.lease_id, devices))

    def grant_parts(self, request: Request, parts: tuple[Part, ...]) -> None:
        self.sharing.take(request.lease_id, parts)
        weight = sum(part.weight for part in parts)
        self.acct.add(request.lease_id, request.user, request.group, weight)
        self.grants.append(Grant(request.lease_id, (), parts))


#: ``Wait(...)`` without the frozen dataclass's per-field ``__setattr__``
#: (thousands per pass): a bare instance whose ``__dict__`` is set at once
#: (the same object as the constructor's)
_NEW = object.__new__
_SET = object.__setattr__


def _competing(
    counts: dict[tuple[str, str | None], int],
    totals: dict[str, int],
    batch: frozenset[str],
    kind: str,
    pool: str | None,
) -> int:
    """Of the waits counted in ``counts`` (by slot kind and pool asked for)
    and ``totals`` (by slot kind), those of ``kind`` that compete with a
    request of ``pool`` (``None``: any pool; a pool's name; or
    :data:`INTERACTIVE_POOLS`): every one for a request of any pool; else
    those asking for any pool, for the same one, and, between the
    interactive pools and one of them, each other (``batch``: the batch
    pools, which are not interactive ones)."""
    if pool is None:
        return totals[kind]
    if pool == INTERACTIVE_POOLS:
        return totals[kind] - sum(counts[(kind, b)] for b in batch)
    ahead = counts[(kind, pool)] + counts[(kind, None)]
    if batch and pool not in batch:
        ahead += counts[(kind, INTERACTIVE_POOLS)]
    return ahead


def _evictions(
    state: SchedulerState, now: dt.datetime
) -> tuple[list[Eviction], list[int], frozenset[int]]:
    """Leases past their time limit or their preemption grace, and
    preemptions to withdraw (their victims keep running).

    A preemption is withdrawn when its request went away: for a victim whose
    request is known (``Running.preempted_for``), when that request is no
    longer pending or its earmarked devices no longer include the victim's;
    else when no pending request's earmarked devices include the victim's.
    The earmarks of other requests on a withdrawn victim's devices (its
    spare devices, taken because it was being evicted anyway) are dropped:
    those requests are placed anew, and preemptions for them are withdrawn
    in turn by the same rule.

    Returns:
        (evictions, withdrawn lease ids in ``state.running`` order, lease
        ids of the pending requests whose earmarks are dropped).
    """
    earmarks = {r.lease_id: r.earmarked for r in state.pending if r.earmarked}
    told = [
        lease
        for lease in state.running
        if lease.preempt_deadline is not None and (lease.ends is None or lease.ends > now)
    ]
    withdrawn: set[int] = set()
    dropped: set[int] = set()
    while True:  # until no earmark is dropped (one round unless requesters are known)
        wanted = {d for e in earmarks.values() for d in e}
        gone: set[str] = set()
        for lease in told:
            if lease.lease_id in withdrawn:
                continue
            if lease.preempted_for is None:
                needed = not wanted.isdisjoint(lease.devices)
            else:
                mine = earmarks.get(lease.preempted_for, ())
                needed = any(d in mine for d in lease.devices)
            if not needed:
                withdrawn.add(lease.lease_id)
                gone.update(lease.devices)
        stale = [i for i, e in earmarks.items() if not gone.isdisjoint(e)]
        if not stale:
            break
        for lease_id in stale:
            del earmarks[lease_id]
            dropped.add(lease_id)
    evict, withdraw = [], []
    for lease in state.running:
        if lease.ends is not None and lease.ends <= now:
            evict.append(Eviction(lease.lease_id, "time limit reached"))
        elif lease.preempt_deadline is None:
            continue
        elif lease.lease_id in withdrawn:
            withdraw.append(lease.lease_id)
        elif lease.preempt_deadline <= now:
            evict.append(Eviction(lease.lease_id, "preempted: grace period over"))
    return evict, withdraw, frozenset(dropped)


def _without_withdrawn(
    state: SchedulerState, withdrawn: list[int], dropped: frozenset[int]
) -> SchedulerState:
    """``state`` as the pass sees it once the ``withdrawn`` preemptions are
    undone: those victims untold (they may be chosen again, and their
    devices free up at their own end), and the ``dropped`` requests without
    earmarked devices (they are placed anew)."""
    gone = set(withdrawn)
    running = tuple(
        replace(lease, preempt_deadline=None, preempted_for=None)
        if lease.lease_id in gone
        else lease
        for lease in state.running
    )
    pending = tuple(replace(r, earmarked=()) if r.lease_id in dropped else r for r in state.pending)
    return replace(state, running=running, pending=pending)


def _busy_until(running: Iterable[Running], now: dt.datetime) -> dict[str, dt.datetime]:
    """When each held device is expected free: the lease's end or eviction
    (at least a second from ``now``), ``NEVER`` when unknown; a device with
    parts is never free as a whole."""
    soon = now + dt.timedelta(seconds=1)
    busy_until: dict[str, dt.datetime] = {}
    for lease in running:
        if lease.devices:
            deadline, ends = lease.preempt_deadline, lease.ends
            if deadline is None and ends is None:
                end = NEVER
            else:
                end = min(deadline or NEVER, ends or NEVER)
                end = max(end, soon) if end < NEVER else NEVER
            for uuid in lease.devices:
                busy_until[uuid] = end
        for part in lease.parts:
            busy_until[part.device] = NEVER
    return busy_until


def _start(state: SchedulerState, now: dt.datetime) -> _Pass:
    """The pass's pool and accounting. Leases being evicted still hold their
    devices until the broker has ended them (their server may still run)."""
    running = list(state.running)
    busy_until = _busy_until(running, now)
    earmarked = [d for r in state.pending if r.earmarked for d in r.earmarked]
    exclusive = [s for s in state.slots if s.mode == "exclusive"]  # PoolMode.exclusive
    pool = Pool.build(exclusive, busy_until, earmarked, state.topology, now)
    sharing = SharingPool.build(
        state.slots,
        running,
        state.sharing_strategy,
        state.pending,
        state.share_placement,
        state.share_sizes,
    )
    acct = Accounting.of(state.policy, state.running)
    batch = frozenset(s.pool for s in state.slots if s.batch)
    untimed = frozenset(
        uuid
        for lease in running
        if lease.ends is None and lease.preempt_deadline is None
        for uuid in (*lease.devices, *(part.device for part in lease.parts))
    )
    return _Pass(
        state,
        now,
        acct,
        pool,
        running,
        sharing,
        explain=state.explain,
        batch_pools=batch,
        untimed=untimed,
        window_full=unplanned(state.policy.max_reservations),
    )


def _fractional(p: _Pass, request: Request) -> Miss | None:
    """A MIG instance or shares: granted when they fit now, else a wait with
    ``Resources``, ``Fragmented`` (naming the instances in the way) or
    ``PoolDrained``. Fractional requests are not given reservations and do
    not preempt (their pools hold no whole-device leases).

    Returns the :class:`Miss` it waits with when no slots were found (the
    same for every request of that shape until the sharing pool changes),
    else ``None``."""
    parts: tuple[Part, ...] | None
    if request.kind == "mig":
        part, miss = p.sharing.place_mig(request)
        parts = (part,) if part is not None else None
    else:
        parts, miss = p.sharing.place_shares(request)
    if parts is not None:
        actual = replace(request, weight=sum(part.weight for part in parts))
        if actual.amount > request.amount and p.acct.limit_hit(actual) is not None:
            if request.kind == "share":  # the largest devices, where a share weighs least
                parts, _miss = p.sharing.place_shares(request, lightest=True)
                assert parts is not None
                actual = replace(request, weight=sum(part.weight for part in parts))
            if _held(p, actual):
                return None  # the slots found weigh more than estimated: a limit holds it
        p.grant_parts(request, parts)
        return None
    assert miss is not None
    p.wait(request, miss.reason, None, miss.detail)
    return miss


def _held(p: _Pass, request: Request) -> bool:
    """Steps 1: limits, size and class rules. True when the request must wait.
    A request counted as held (:func:`_count_earmarked`) adds nothing more
    to its limits and guarantees."""
    counted = request.lease_id in p.counted
    hit = p.acct.limit_hit(request, 0.0 if counted else None)
    if hit is not None:
        kind, name, held, limit = hit
        reason = WaitReason.quota_user if kind == "user" else WaitReason.quota_group
        who = "you hold" if kind == "user" else f"group {name} holds"
        detail = f"{who} {held:g} of {'your' if kind == 'user' else 'its'} {gpus_text(limit)} limit"
        p.wait(request, reason, None, detail)
        return True
    largest = p.pool.largest_node(request.pool)
    if request.whole and request.gpus > largest:
        detail = drained(request.gpus, request.pool, largest)
        p.wait(request, WaitReason.pool_drained, None, detail)
        return True
    cls = p.state.policy.class_of(request.priority_class)
    if (
        not cls.preemptible
        and not counted
        and not p.acct.within_guarantee(request.user, request.group, request.amount)
    ):
        detail = f"class {cls.name} is not preemptible, so it only runs within your guarantee"
        p.wait(request, WaitReason.over_guarantee, None, detail)
        return True
    return False


def _earmarked(p: _Pass, request: Request, ends: dt.datetime) -> None:
    """Step 2: grant reclaimed devices once free; else, devices that became
    free meanwhile elsewhere (a release during the grace period: the
    preemption is then withdrawn by the next pass, and its victims keep
    running); else keep waiting for the reclaimed ones. ``ends``: when the
    request would end if granted now (aware UTC)."""
    busy = [d for d in request.earmarked if p.pool.available_from[d] > p.now]
    if not busy:
        p.grant(request, request.earmarked)
        return
    devices = p.pool.place(request.gpus, ends, request.pool, request.prefer)
    if devices is not None:
        p.grant(request, devices)
        return
    eta = max(p.pool.available_from[d] for d in busy)
    detail = f"{gpus_text(len(busy))} being reclaimed for you, expected by {clock(eta, p.now)}"
    p.wait(request, WaitReason.preempting, eta, detail, request.earmarked)


def _counts_as_held(p: _Pass, request: Request) -> bool:
    """A request with devices reclaimed for it counts as held from now on, so
    its guarantee and limits are not used twice. Returns whether it is covered."""
    covered = p.acct.add(-request.lease_id, request.user, request.group, request.amount)
    p.acct.borrowed.discard(-request.lease_id)  # not a lease yet: never reported
    return covered


def _count_earmarked(p: _Pass) -> None:
    """Count every request with devices earmarked for it (by a reclaim or
    preemption of an earlier pass) as held before the walk, so a request
    ranked ahead of it cannot reclaim with the same guarantee again. Only
    earmarks step 2 will honour count: all devices in service and in the
    request's pool (else it is placed anew and counted when granted)."""
    slots = p.pool.slots
    for request in p.state.pending:
        if (
            request.earmarked
            and request.kind == "gpus"
            and all(d in slots and in_pool(slots[d], request.pool) for d in request.earmarked)
        ):
            p.counted[request.lease_id] = _counts_as_held(p, request)


def _preempt(p: _Pass, request: Request, window: bool) -> bool:
    """Step 4: choose victims and earmark their devices; True if it did.

    Reclaim for a request within guarantee is always tried; class preemption
    only within the reservation window (it costs a victim search per request).
    """
    policy = p.state.policy
    in_guarantee = policy.has_guarantees and p.acct.within_guarantee(
        request.user, request.group, request.amount
    )
    preempting = window and policy.class_of(request.priority_class).preempting
    if not in_guarantee and not preempting:
        return False
    cls = policy.class_of(request.priority_class)
    key = (
        request.gpus,
        request.pool,
        in_guarantee,
        request.user if in_guarantee else None,
        cls.preempting,
        cls.rank if cls.preempting else None,
    )
    if p.no_victims.get(key) == (p.pool.version, len(p.preemptions)):
        return False  # the same search found none, and nothing changed since
    index = p.victims()
    plan = find_victims(request, in_guarantee, index, p.pool, p.acct, policy, p.spare)
    if plan is None:
        p.no_victims[key] = (p.pool.version, len(p.preemptions))
        return False
    index.remove(plan.victims, plan.node)
    deadline = max((p.pool.available_from[d] for d in plan.spare), default=p.now)
    for victim in plan.victims:
        p.told.add(victim.lease_id)
        vcls = policy.class_of(victim.priority_class)
        end = p.now + dt.timedelta(seconds=vcls.grace)
        deadline = max(deadline, end)
        # who asked is not said: a victim learns no more of others than the
        # queue shows her (GPUBrokerApp.private_queue); admins see for_lease
        why = (
            "reclaimed for a request within its guarantee; your lease was borrowed above guarantees"
            if in_guarantee and victim.lease_id in p.acct.borrowed
            else f"preempted by a {request.priority_class} request"
        )
        mine = tuple(d for d in victim.devices if d in plan.reclaimed)
        p.preemptions.append(Preemption(victim.lease_id, request.lease_id, mine, why, end))
        for uuid in victim.devices:
            p.pool.set_available(uuid, end)
            if uuid not in plan.reclaimed and uuid in p.pool.slots:
                p.spare[plan.node].append(uuid)
    devices = plan.free + plan.spare + plan.reclaimed
    p.pool.earmark(devices)
    _counts_as_held(p, request)
    detail = f"{gpus_text(len(plan.reclaimed) + len(plan.spare))} being reclaimed for you"
    p.wait(request, WaitReason.preempting, deadline, detail, devices)
    return True


def _reserve(p: _Pass, request: Request) -> None:
    """Step 5: a reservation and ETA (within the window), else wait unplanned.

    The reason is ``Reserved`` when enough devices are free but reserved
    for requests ahead; else ``Priority`` when a competing request ahead is
    blocked too, else ``Resources``. Without an ETA, the message says why
    when it is known: the window is full, or a device planned for it is
    held without a time limit."""
    could_fit = p.pool.fits_ignoring_reservations(request.gpus, request.pool)
    if could_fit:
        reason = WaitReason.reserved
    elif p.blocked_ahead(request):
        reason = WaitReason.priority
    else:
        reason = WaitReason.resources
    p.block(request)
    if p.reservations >= p.state.policy.max_reservations:
        p.wait(request, reason, why=p.window_full)
        return
    p.reservations += 1
    planned = p.pool.reserve(request.gpus, request.time_limit, request.pool)
    eta = None if planned is None or planned[0] >= NEVER else planned[0]
    why = ""
    if planned is not None and eta is None and not p.untimed.isdisjoint(planned[1]):
        why = UNTIMED
    later = _reclaim_later(p, request)
    if later is not None and (eta is None or later[1] < eta):
        start, eta = later
        detail = (
            "GPUs lent from your guarantee can be reclaimed for you from "
            f"{clock(start, p.now)}, once the leases holding them have run their minimum runtime"
        )
        p.wait(request, reason, eta, detail)
        return
    p.wait(request, reason, eta, why=why)


def _reclaim_later(p: _Pass, request: Request) -> tuple[dt.datetime, dt.datetime] | None:
    """For a request within guarantee that found no lease to reclaim now
    (step 4): the first time a reclaim can start, because the borrowed
    leases of others that would make room are still inside their class's
    ``min_runtime``, and when the devices are then expected free (after the
    victims' grace); only a reclaim of lent GPUs counts, never a class
    preemption. ``None``: no such reclaim (not within guarantee, or even
    then no node could make room). Cached per shape and user while the pool
    and the pass's preemptions stay the same."""
    policy = p.state.policy
    if not (
        policy.has_guarantees
        and request.pool in _ANY_POOL
        and p.acct.within_guarantee(request.user, request.group, request.amount)
    ):
        return None
    key = (request.gpus, request.pool, request.user)
    valid = (p.pool.version, len(p.preemptions))
    seen = p.reclaim_later.get(key)
    if seen is not None and seen[0] == valid:
        return seen[1]
    borrowed, user = p.acct.borrowed, request.user
    lent = p.later_victims().only(lambda v: v.lease_id in borrowed and v.user != user)
    found = earliest_reclaim(request, lent, p.pool, p.acct, policy, p.spare, p.now)
    if found is not None and found[0] <= p.now:  # a reclaim would have been found now (step 4)
        found = None
    p.reclaim_later[key] = (valid, found)
    return found


def schedule(state: SchedulerState, now: dt.datetime) -> Decisions:
    """One pass of the broker's policy over ``state`` at ``now`` (aware UTC).

    Returns:
        :class:`Decisions`: grants, new preemptions, evictions of victims whose
        grace is over, a :class:`Wait` for every other request in queue order
        (position, reason, message, ETA), and the reclaimable lease ids.
    """
    evictions, withdrawn, dropped = _evictions(state, now)
    if withdrawn:
        state = _without_withdrawn(state, withdrawn, dropped)
    p = _start(state, now)
    p.told.update(e.lease_id for e in evictions)
    _spare_of_told(p, withdrawn)
    p._victim_basis = (p.acct.holdings(), frozenset(p.told))
    _count_earmarked(p)
    _walk(p, queue_order(state, now))
    return Decisions(
        grants=tuple(p.grants),
        preemptions=tuple(p.preemptions),
        evictions=tuple(evictions),
        waits=tuple(p.waits),
        reclaimable=frozenset(p.acct.borrowed) if state.policy.has_guarantees else frozenset(),
        withdrawn=tuple(withdrawn),
    )


def _spare_of_told(p: _Pass, withdrawn: list[int]) -> None:
    """Devices of victims told before that nobody waits for go to ``p.spare``
    (per node), for the next victim search to use first."""
    pool = p.pool
    for lease in p.running:
        if lease.preempt_deadline is not None and lease.lease_id not in withdrawn:
            node = pool.node_of(lease.devices[0]) if lease.devices else None
            spare = [d for d in lease.devices if d not in pool.earmarked and d in pool.slots]
            if node is not None and spare:
                p.spare[node].extend(spare)


def _walk(p: _Pass, order: list[Request]) -> None:
    """Steps 1-5 for each request of ``order`` (queue order), recording
    grants, preemptions and waits in ``p``.

    The checks every request goes through are inlined, with per-pass tables
    (each user's and group's limit, each class); the rarer outcomes are
    the step functions above, which decide them exactly as alone.
    """
    state, now, pool, acct, sharing = p.state, p.now, p.pool, p.acct, p.sharing
    policy = state.policy
    max_reservations = policy.max_reservations
    has_guarantees = policy.has_guarantees
    largest_any = pool.largest_node()
    largest_node = pool.largest_node
    window_full = p.window_full
    blocked_waiting, blocked_kind, batch_pools = p.blocked_waiting, p.blocked_kind, p.batch_pools
    slots = pool.slots
    no_fit = p.no_fit
    user_held, group_held = acct.user_held, acct.group_held
    #: limit + epsilon per user and per group (inf: no limit), as limit_hit compares
    user_limit: dict[str, float] = {}
    group_limit: dict[str | None, float] = {}
    preemptible: dict[str, bool] = {}
    ends_of: dict[float | None, dt.datetime] = {None: NEVER}
    #: shape of a fractional request -> (sharing pool version, miss)
    missed: dict[tuple[object, ...], tuple[int, Miss]] = {}
    wait, wait_plain = p.wait, p.wait_plain
    counted = p.counted
    #: set once the window is full and a request was blocked: from then on
    #: it stays so for the rest of the pass
    closed = False
    for request in order:
        user, group = request.user, request.group
        weight = request.weight
        amount = float(request.gpus) if weight is None else weight
        if counted and request.lease_id in counted:
            amount = 0.0  # already counted as held (_count_earmarked)
        # step 1: limits, size and class rules (_held decides and records a hit)
        limit = user_limit.get(user)
        if limit is None:
            limit = user_limit[user] = _plus_eps(policy.user_quota(user).limit)
        if user_held[user] + amount > limit:
            _held(p, request)
            continue
        limit = group_limit.get(group)
        if limit is None:
            limit = group_limit[group] = _plus_eps(_limit_of(policy.group_quota(group)))
        if limit < math.inf and group_held[group] + amount > limit:  # type: ignore[index]
            _held(p, request)
            continue
        whole = request.kind == "gpus"
        largest = largest_any if request.pool is None else largest_node(request.pool)
        if whole and request.gpus > largest:
            _held(p, request)
            continue
        cls_ok = preemptible.get(request.priority_class)
        if cls_ok is None:
            cls_ok = preemptible[request.priority_class] = policy.class_of(
                request.priority_class
            ).preemptible
        if not cls_ok and not acct.within_guarantee(user, group, amount):
            _held(p, request)
            continue
        if closed and whole and not request.earmarked and request.gpus > pool.largest_free():
            # the reservation window is full, a request was blocked, and no
            # node has this many devices free (free devices only go during
            # a pass): no placement, reservation or class preemption can
            # happen, so what the full path gives is a plain wait for
            # Priority (Resources when no competing request ahead is
            # blocked), unless a reclaim for a request within guarantee is
            # possible
            if not (
                has_guarantees
                and request.pool in _ANY_POOL
                and acct.within_guarantee(user, group, amount)
            ):
                # p.blocked_ahead(request) and p.block(request), inlined (hot)
                kind, wanted = request.kind, request.pool
                ahead = (
                    blocked_kind[kind]
                    if wanted is None
                    else _competing(blocked_waiting, blocked_kind, batch_pools, kind, wanted)
                )
                wait_plain(request, _PRIORITY if ahead else _RESOURCES, window_full)
                blocked_waiting[(kind, wanted)] += 1
                blocked_kind[kind] += 1
                continue
        elif not closed and p.blocked and p.reservations >= max_reservations:
            closed = True
        if not whole:
            shape = (request.kind, request.mig_profile, request.memory_mib, request.gpus)
            seen = missed.get((shape, request.pool))
            if seen is not None and seen[0] == sharing.version:
                wait(request, seen[1].reason, None, seen[1].detail)
                continue
            miss = _fractional(p, request)
            if miss is not None:
                missed[(shape, request.pool)] = (sharing.version, miss)
            continue
        time_limit = request.time_limit
        ends = ends_of.get(time_limit)
        if ends is None:
            assert time_limit is not None
            ends = ends_of[time_limit] = now + dt.timedelta(seconds=time_limit)
        # step 2
        if request.earmarked and all(
            d in slots and in_pool(slots[d], request.pool) for d in request.earmarked
        ):
            _earmarked(p, request, ends)
            continue
        # step 3
        fit = (request.gpus, ends, request.pool)
        if fit not in no_fit:
            devices = pool.place(request.gpus, ends, request.pool, request.prefer)
            if devices is not None:
                p.grant(request, devices)
                continue
            no_fit.add(fit)
        # step 4 (outside the window, only a request within guarantee may preempt)
        window = p.reservations < max_reservations
        if (
            request.pool in _ANY_POOL
            and (window or (has_guarantees and acct.within_guarantee(user, group, amount)))
            and _preempt(p, request, window)
        ):
            continue
        # step 5
        if window:
            _reserve(p, request)
            continue
        # _reserve once the window is full: no reservation, no ETA
        if pool.fits_ignoring_reservations(request.gpus, request.pool):
            wait_plain(request, _RESERVED, window_full)
        else:
            wait_plain(request, _PRIORITY if p.blocked_ahead(request) else _RESOURCES, window_full)
        p.block(request)


_RESERVED, _PRIORITY, _RESOURCES = WaitReason.reserved, WaitReason.priority, WaitReason.resources


def _limit_of(quota: Quota | None) -> float | None:
    """The limit of ``quota`` (``None``: no quota or no limit)."""
    return None if quota is None else quota.limit


def _plus_eps(limit: float | None) -> float:
    """``limit + EPS``, as :meth:`Accounting.limit_hit` compares held GPUs
    with it; ``inf`` for no limit (then no amount exceeds it)."""
    return math.inf if limit is None else limit + EPS
