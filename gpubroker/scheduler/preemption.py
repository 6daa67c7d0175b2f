"""Choosing victims: whom to preempt or reclaim from, for a request that may.

A request may take devices back when it is within its guarantee (then
*borrowed* leases of others are candidates: reclaim) or when its class is
``preempting`` (then leases of lower-rank, preemptible classes are). Never a
lease of a non-preemptible class, never one inside its minimum runtime, never
one already told. Victims are taken lowest class first, then the most over
guarantee, then the shortest running, until the request is covered; then
victims not needed are dropped, the last taken first; the node needing the
fewest victims wins.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .accounting import Accounting
from .placement import Pool
from .types import Policy, PriorityClass, Request, Running, in_pool


@dataclass(frozen=True)
class Plan:
    """Victims on one node and the devices that will go to the request.

    Attributes:
        node: where.
        victims: leases to tell now.
        free: devices free now, not reserved for a request ahead.
        spare: devices of victims told before, not earmarked by anyone nor
            reserved for a request ahead.
        reclaimed: devices of ``victims``.
    """

    node: str
    victims: tuple[Running, ...]
    free: tuple[str, ...]
    spare: tuple[str, ...]
    reclaimed: tuple[str, ...]


class VictimIndex:
    """Per node, the leases that may ever be victims in this pass (preemptible
    class, past minimum runtime, not told yet), in victim order. Victims told
    are removed, so a pass's later searches get cheaper, not dearer."""

    def __init__(
        self,
        running: Sequence[Running],
        pool: Pool,
        acct: Accounting,
        policy: Policy,
        now: dt.datetime,
        told: frozenset[int],
    ) -> None:
        self.by_node: dict[str, list[Running]] = {}
        #: class rank per lease id
        self.rank: dict[int, int] = {}
        classes: dict[str, PriorityClass] = {}
        for victim in running:
            name = victim.priority_class
            vcls = classes.get(name)
            if vcls is None:
                vcls = classes[name] = policy.class_of(name)
            self.rank[victim.lease_id] = vcls.rank
            if not vcls.preemptible or victim.preempt_deadline is not None or not victim.devices:
                continue
            if victim.lease_id in told or (now - victim.started).total_seconds() < vcls.min_runtime:
                continue
            node = pool.node_of(victim.devices[0])
            if node is not None:
                self.by_node.setdefault(node, []).append(victim)
        over: dict[tuple[str, str | None], float] = {}

        def order(victim: Running) -> tuple[float, float, float]:
            """:func:`victim_order`, with each holder's excess computed once."""
            holder = (victim.user, victim.group)
            excess = over.get(holder)
            if excess is None:
                excess = over[holder] = acct.over_guarantee(*holder)
            return (classes[victim.priority_class].rank, -excess, -victim.started.timestamp())

        for leases in self.by_node.values():
            leases.sort(key=order)
        #: the nodes with candidates, sorted (kept: a search does not sort them)
        self.nodes: list[str] = sorted(self.by_node)

    def only(self, keep: Callable[[Running], bool]) -> VictimIndex:
        """A copy holding the candidates ``keep`` accepts, in the same
        victim order (the index a build from those candidates would give)."""
        copy = object.__new__(VictimIndex)
        copy.rank = self.rank
        copy.by_node = {}
        for node, leases in self.by_node.items():
            kept = [v for v in leases if keep(v)]
            if kept:
                copy.by_node[node] = kept
        copy.nodes = sorted(copy.by_node)
        return copy

    def remove(self, victims: Sequence[Running], node: str) -> None:
        """Forget ``victims`` (told now) on ``node``."""
        gone = {v.lease_id for v in victims}
        left = [v for v in self.by_node.get(node, ()) if v.lease_id not in gone]
        if left:
            self.by_node[node] = left
        elif self.by_node.pop(node, None) is not None:
            self.nodes.remove(node)


def victim_order(victim: Running, acct: Accounting, policy: Policy) -> tuple[float, float, float]:
    """Sort key: lowest class, most over guarantee, shortest running."""
    rank = policy.class_of(victim.priority_class).rank
    return (rank, -acct.over_guarantee(victim.user, victim.group), -victim.started.timestamp())


def find_victims(
    request: Request,
    in_guarantee: bool,
    index: VictimIndex,
    pool: Pool,
    acct: Accounting,
    policy: Policy,
    spare: Mapping[str, Sequence[str]] | None = None,
) -> Plan | None:
    """The cheapest :class:`Plan` freeing ``request.gpus`` devices on one node.

    Candidates come from ``index``; the ``spare`` devices of victims told
    before (per node, not earmarked) are used first, so a second request does
    not wait for a second grace period. Free and spare devices reserved for
    a request ahead (``pool.reserved_from``: its reservation in this pass)
    are left to it: only victims may make up for them.

    Returns:
        the plan, or ``None`` when no node can free ``request.gpus`` devices
        for it.
    """
    cls = policy.class_of(request.priority_class)
    best: tuple[tuple[int, str], Plan] | None = None
    with_spare = sorted(n for n, d in (spare or {}).items() if d)
    spared = set(with_spare)
    nodes = with_spare + [n for n in index.nodes if n not in spared] if spared else index.nodes
    for node in nodes:
        if len(pool.by_node.get(node, ())) < request.gpus:
            continue
        if node not in spared and not _may_take_any(index, node, request, in_guarantee, acct, cls):
            continue  # no spare device and no lease it may take: no plan here
        wanted = request.pool
        reserved = pool.reserved_from
        free = tuple(
            sorted(
                u
                for u, s in pool.free.get(node, {}).items()
                if u not in reserved and in_pool(s, wanted)
            )
        )
        free = free[: request.gpus]
        spares = tuple(
            d
            for d in (spare or {}).get(node, ())
            if d not in pool.earmarked
            and d not in reserved
            and d in pool.slots
            and in_pool(pool.slots[d], wanted)
        )
        spares = spares[: request.gpus - len(free)]
        need = request.gpus - len(free) - len(spares)
        victims: list[Running] = []
        owned: list[list[str]] = []  # per victim, its devices the request may use
        devices: list[str] = []
        for victim in index.by_node.get(node, ()):
            if len(devices) >= need:
                break
            if pool.earmarked.intersection(victim.devices):
                continue
            if not _may_take(index, victim, request, in_guarantee, acct, cls):
                continue
            theirs = [
                d
                for d in victim.devices
                if pool.node_of(d) == node and d in pool.slots and in_pool(pool.slots[d], wanted)
            ]
            if not theirs:
                continue  # its devices are in pools the request may not use
            victims.append(victim)
            owned.append(theirs)
            devices += theirs
        if len(devices) < need or not (victims or spares):
            continue
        if len(victims) > 1:
            victims, devices = _prune(victims, owned, need)
        plan = Plan(node, tuple(victims), free, spares, tuple(devices[:need]))
        key = (len(victims), node)
        if best is None or key < best[0]:
            best = (key, plan)
        if len(victims) <= 1:
            break  # nothing cheaper than one victim but spares, which come first
    return None if best is None else best[1]


def unlocks(victim: Running, policy: Policy) -> dt.datetime:
    """When ``victim`` has run its class's ``min_runtime`` (aware UTC): from
    then on it may be preempted or reclaimed."""
    return victim.started + dt.timedelta(seconds=policy.class_of(victim.priority_class).min_runtime)


def earliest_reclaim(
    request: Request,
    lent: VictimIndex,
    pool: Pool,
    acct: Accounting,
    policy: Policy,
    spare: Mapping[str, Sequence[str]] | None,
    now: dt.datetime,
) -> tuple[dt.datetime, dt.datetime] | None:
    """The first time a reclaim for ``request`` (within guarantee) can
    start, and its ETA (that time plus the longest grace of its victims),
    both aware UTC; ``None`` when no time gives one.

    Args:
        lent: the candidates that may ever be reclaimed for it (borrowed
            leases of others), whatever their minimum runtime.

    Of the times at which candidates pass their ``min_runtime``, the
    earliest at which :func:`find_victims` finds a plan among those past
    it (more candidates never lose a plan, so the times are searched by
    halves)."""
    times = sorted({max(unlocks(v, policy), now) for vs in lent.by_node.values() for v in vs})

    def plan_at(at: dt.datetime) -> Plan | None:
        index = lent.only(lambda v: unlocks(v, policy) <= at)
        return find_victims(request, True, index, pool, acct, policy, spare)

    if not times or plan_at(times[-1]) is None:
        return None
    lo, hi = 0, len(times) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if plan_at(times[mid]) is not None:
            hi = mid
        else:
            lo = mid + 1
    plan = plan_at(times[lo])
    assert plan is not None
    grace = max((policy.class_of(v.priority_class).grace for v in plan.victims), default=0.0)
    return times[lo], times[lo] + dt.timedelta(seconds=grace)


def _prune(
    victims: list[Running], owned: list[list[str]], need: int
) -> tuple[list[Running], list[str]]:
    """``victims`` (taken in victim order until ``need`` devices were
    covered) without those not needed: the last taken is dropped first,
    while the others still cover ``need``. The greedy pick alone may take a
    small early victim and then a large one that would have sufficed alone,
    and no lease should lose its work for nothing (docs/scheduling.md,
    "Borrowing, reclaim and preemption": victims not needed are dropped). Order is kept, so the
    result is deterministic."""
    keep = [True] * len(victims)
    total = sum(len(d) for d in owned)
    for i in reversed(range(len(victims))):
        if total - len(owned[i]) >= need:
            keep[i] = False
            total -= len(owned[i])
    kept = [i for i, k in enumerate(keep) if k]
    return [victims[i] for i in kept], [d for i in kept for d in owned[i]]


def _may_take(
    index: VictimIndex,
    victim: Running,
    request: Request,
    in_guarantee: bool,
    acct: Accounting,
    cls: PriorityClass,
) -> bool:
    """Whether ``request`` may take ``victim``'s devices: reclaim (it is
    within guarantee, the victim borrowed, another user's) or class
    preemption (a preempting class above the victim's)."""
    if in_guarantee and victim.lease_id in acct.borrowed and victim.user != request.user:
        return True
    return cls.preempting and index.rank[victim.lease_id] < cls.rank


def _may_take_any(
    index: VictimIndex,
    node: str,
    request: Request,
    in_guarantee: bool,
    acct: Accounting,
    cls: PriorityClass,
) -> bool:
    """Whether some candidate on ``node`` may be taken by ``request``
    (:func:`_may_take`; earmarks and pools are checked by the search)."""
    return any(
        _may_take(index, v, request, in_guarantee, acct, cls) for v in index.by_node.get(node, ())
    )
