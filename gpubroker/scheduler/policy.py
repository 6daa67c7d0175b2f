"""The broker's scheduling policy: one pure pass over the state.

Order: priority class rank, then fair-share factor (in steps of
``Policy.fairshare_resolution``), then age. Walking the queue in that order,
each request is

1. held at a limit (``QuotaUserLimit``/``QuotaGroupLimit``) or refused
   service when too large (``PoolDrained``) or when its non-preemptible class
   would run above guarantee (``OverGuarantee``);
2. granted devices reclaimed for it once they are free (earmarked);
3. granted now when devices are free on one node, topology-aware, and not
   reserved for a request ahead of it, unless it ends before that
   reservation (backfill);
4. else, when it may preempt (within guarantee, or a ``preempting`` class),
   given victims: they are told now and evicted after their grace period,
   and their devices are earmarked for it alone;
5. else given a reservation on the devices that free up first (up to
   ``Policy.max_reservations`` per pass), whose start is its ETA.

Leases told of a preemption whose grace is over are evicted; a preemption
whose request went away is withdrawn.
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from dataclasses import dataclass, field, replace

from . import fairshare
from .accounting import Accounting
from .messages import clock, wait_message
from .messages import gpus as gpus_text
from .placement import NEVER, Pool
from .preemption import VictimIndex, find_victims
from .sharing import SharingPool
from .types import (
    Decisions,
    Eviction,
    Grant,
    Part,
    PoolMode,
    Preemption,
    Request,
    Running,
    SchedulerState,
    Wait,
    WaitReason,
)


def queue_order(state: SchedulerState, now: dt.datetime) -> list[Request]:
    """Pending requests in policy order (class rank, fair share, age, id)."""
    policy = state.policy
    usage = fairshare.decayed_usage(state.usage, state.running, now, policy.half_life)
    users = {r.user for r in state.pending} | {r.user for r in state.running}
    total = sum(1 for s in state.slots if not s.drained)
    factor = fairshare.factors(users, usage, policy.shares, total, policy.half_life)
    step = policy.fairshare_resolution or 1e-9

    def key(r: Request) -> tuple[int, int, dt.datetime, int]:
        return (
            -policy.class_of(r.priority_class).rank,
            -round(factor[r.user] / step),
            r.created,
            r.lease_id,
        )

    return sorted(state.pending, key=key)


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
    told: set[int] = field(default_factory=set)
    spare: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    #: waits so far by (slot kind, pool asked for; None: any pool)
    waiting: dict[tuple[str, str | None], int] = field(default_factory=lambda: defaultdict(int))
    waiting_kind: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def position(self, request: Request) -> int:
        """1-based place among the waits so far that compete with ``request``:
        the same kind of slot (whole devices, MIG instances, shares) and a
        pool that overlaps (either asks for any pool, or both the same)."""
        if request.pool is None:
            ahead = self.waiting_kind[request.kind]
        else:
            ahead = self.waiting[(request.kind, request.pool)] + self.waiting[(request.kind, None)]
        self.waiting[(request.kind, request.pool)] += 1
        self.waiting_kind[request.kind] += 1
        return ahead + 1

    def wait(
        self,
        request: Request,
        reason: WaitReason,
        eta: dt.datetime | None = None,
        detail: str = "",
        earmarked: tuple[str, ...] = (),
    ) -> None:
        position = self.position(request)
        message = wait_message(reason, position, eta, self.now, detail, request.whole)
        self.waits.append(Wait(request.lease_id, position, reason, message, eta, earmarked))

    def grant(self, request: Request, devices: tuple[str, ...]) -> None:
        ends = NEVER
        if request.time_limit is not None:
            ends = self.now + dt.timedelta(seconds=request.time_limit)
        self.pool.take(devices, ends)
        self.acct.add(request.lease_id, request.user, request.group, float(len(devices)))
        self.grants.append(Grant(request.lease_id, devices))

    def grant_parts(self, request: Request, parts: tuple[Part, ...]) -> None:
        self.sharing.take(request.lease_id, parts)
        weight = sum(part.weight for part in parts)
        self.acct.add(request.lease_id, request.user, request.group, weight)
        self.grants.append(Grant(request.lease_id, (), parts))


def _evictions(state: SchedulerState, now: dt.datetime) -> tuple[list[Eviction], list[int]]:
    """Leases past their time limit or their preemption grace, and
    preemptions whose request went away."""
    wanted = {d for r in state.pending for d in r.earmarked}
    evict, withdraw = [], []
    for lease in state.running:
        if lease.ends is not None and lease.ends <= now:
            evict.append(Eviction(lease.lease_id, "time limit reached"))
        elif lease.preempt_deadline is None:
            continue
        elif not wanted.intersection(lease.devices):
            withdraw.append(lease.lease_id)
        elif lease.preempt_deadline <= now:
            evict.append(Eviction(lease.lease_id, "preempted: grace period over"))
    return evict, withdraw


def _start(state: SchedulerState, now: dt.datetime) -> _Pass:
    """The pass's pool and accounting. Leases being evicted still hold their
    devices until the broker has ended them (their server may still run)."""
    running = list(state.running)
    busy_until = {}
    for lease in running:
        end = min(lease.preempt_deadline or NEVER, lease.ends or NEVER)
        end = max(end, now + dt.timedelta(seconds=1)) if end < NEVER else NEVER
        for uuid in lease.devices:
            busy_until[uuid] = end
        for part in lease.parts:  # a device with parts is never free as a whole
            busy_until[part.device] = NEVER
    earmarked = [d for r in state.pending for d in r.earmarked]
    exclusive = [s for s in state.slots if s.mode == PoolMode.exclusive.value]
    pool = Pool.build(exclusive, busy_until, earmarked, state.topology, now)
    sharing = SharingPool.build(state.slots, running, state.sharing_strategy)
    acct = Accounting.of(state.policy, tuple(running))
    return _Pass(state, now, acct, pool, running, sharing)


def _fractional(p: _Pass, request: Request) -> None:
    """A MIG instance or shares: granted when they fit now, else a wait with
    ``Resources``, ``Fragmented`` (naming the instances in the way) or
    ``PoolDrained``. Fractional requests are not given reservations and do
    not preempt (their pools hold no whole-device leases)."""
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
                return  # the slots found weigh more than estimated: a limit holds it
        p.grant_parts(request, parts)
        return
    assert miss is not None
    p.wait(request, miss.reason, None, miss.detail)


def _held(p: _Pass, request: Request) -> bool:
    """Steps 1: limits, size and class rules. True when the request must wait."""
    hit = p.acct.limit_hit(request)
    if hit is not None:
        kind, name, held, limit = hit
        reason = WaitReason.quota_user if kind == "user" else WaitReason.quota_group
        who = "you hold" if kind == "user" else f"group {name} holds"
        detail = f"{who} {held:g} of {'your' if kind == 'user' else 'its'} {gpus_text(limit)} limit"
        p.wait(request, reason, None, detail)
        return True
    if request.whole and request.gpus > p.pool.largest_node():
        detail = f"no node has {request.gpus} GPUs in service (largest: {p.pool.largest_node()})"
        p.wait(request, WaitReason.pool_drained, None, detail)
        return True
    cls = p.state.policy.class_of(request.priority_class)
    if not cls.preemptible and not p.acct.within_guarantee(
        request.user, request.group, request.amount
    ):
        detail = f"class {cls.name} is not preemptible, so it only runs within your guarantee"
        p.wait(request, WaitReason.over_guarantee, None, detail)
        return True
    return False


def _earmarked(p: _Pass, request: Request) -> None:
    """Step 2: grant reclaimed devices once free, else keep waiting for them."""
    busy = [d for d in request.earmarked if p.pool.available_from[d] > p.now]
    if not busy:
        p.grant(request, request.earmarked)
        return
    _counts_as_held(p, request)
    eta = max(p.pool.available_from[d] for d in busy)
    detail = f"{gpus_text(len(busy))} being reclaimed for you, expected by {clock(eta, p.now)}"
    p.wait(request, WaitReason.preempting, eta, detail, request.earmarked)


def _counts_as_held(p: _Pass, request: Request) -> None:
    """A request with devices reclaimed for it counts as held from now on, so
    its guarantee and limits are not used twice."""
    p.acct.add(-request.lease_id, request.user, request.group, request.amount)
    p.acct.borrowed.discard(-request.lease_id)  # not a lease yet: never reported


def _preempt(p: _Pass, request: Request, index: VictimIndex, window: bool) -> bool:
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
    plan = find_victims(request, in_guarantee, index, p.pool, p.acct, policy, p.spare)
    if plan is None:
        return False
    index.remove(plan.victims, plan.node)
    deadline = max((p.pool.available_from[d] for d in plan.spare), default=p.now)
    for victim in plan.victims:
        p.told.add(victim.lease_id)
        vcls = policy.class_of(victim.priority_class)
        end = p.now + dt.timedelta(seconds=vcls.grace)
        deadline = max(deadline, end)
        why = (
            f"reclaimed for {request.user}, who is within their guarantee; "
            "your lease was borrowed above guarantees"
            if in_guarantee and victim.lease_id in p.acct.borrowed
            else f"preempted by a {request.priority_class} request of {request.user}"
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
    """Step 5: a reservation and ETA (within the window), else wait unplanned."""
    could_fit = p.pool.fits_ignoring_reservations(request.gpus, request.pool)
    if p.reservations >= p.state.policy.max_reservations:
        blocked = WaitReason.priority if p.blocked else WaitReason.resources
        p.blocked = True
        p.wait(request, WaitReason.reserved if could_fit else blocked)
        return
    p.reservations += 1
    planned = p.pool.reserve(request.gpus, request.time_limit, request.pool)
    eta = None if planned is None or planned[0] >= NEVER else planned[0]
    if could_fit:
        reason = WaitReason.reserved
    elif p.blocked:
        reason = WaitReason.priority
    else:
        reason = WaitReason.resources
    p.blocked = True
    p.wait(request, reason, eta)


def schedule(state: SchedulerState, now: dt.datetime) -> Decisions:
    """One pass of the broker's policy over ``state`` at ``now`` (aware UTC).

    Returns:
        :class:`Decisions`: grants, new preemptions, evictions of victims whose
        grace is over, a :class:`Wait` for every other request in queue order
        (position, reason, message, ETA), and the reclaimable lease ids.
    """
    evictions, withdrawn = _evictions(state, now)
    p = _start(state, now)
    p.told.update(e.lease_id for e in evictions)
    for lease in p.running:  # devices of victims told before that nobody waits for
        if lease.preempt_deadline is not None and lease.lease_id not in withdrawn:
            node = p.pool.node_of(lease.devices[0]) if lease.devices else None
            spare = [d for d in lease.devices if d not in p.pool.earmarked and d in p.pool.slots]
            if node is not None and spare:
                p.spare[node].extend(spare)
    index = VictimIndex(p.running, p.pool, p.acct, state.policy, now, frozenset(p.told))
    for request in queue_order(state, now):
        if _held(p, request):
            continue
        if not request.whole:
            _fractional(p, request)
            continue
        if request.earmarked and all(d in p.pool.slots for d in request.earmarked):
            _earmarked(p, request)
            continue
        ends = (
            NEVER if request.time_limit is None else now + dt.timedelta(seconds=request.time_limit)
        )
        devices = p.pool.place(request.gpus, ends, request.pool, request.prefer)
        if devices is not None:
            p.grant(request, devices)
            continue
        window = p.reservations < state.policy.max_reservations
        if request.pool is None and _preempt(p, request, index, window):
            continue
        _reserve(p, request)
    return Decisions(
        grants=tuple(p.grants),
        preemptions=tuple(p.preemptions),
        evictions=tuple(evictions),
        waits=tuple(p.waits),
        reclaimable=frozenset(p.acct.borrowed) if state.policy.has_guarantees else frozenset(),
        withdrawn=tuple(withdrawn),
    )
