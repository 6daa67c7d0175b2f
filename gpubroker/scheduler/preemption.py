"""Choosing victims: whom to preempt or reclaim from, for a request that may.

A request may take devices back when it is within its guarantee (then
*borrowed* leases of others are candidates: reclaim) or when its class is
``preempting`` (then leases of lower-rank, preemptible classes are). Never a
lease of a non-preemptible class, never one inside its minimum runtime, never
one already told. Victims are taken lowest class first, then the most over
guarantee, then the shortest running; the node needing the fewest victims wins.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .accounting import Accounting
from .placement import Pool
from .types import Policy, PriorityClass, Request, Running


@dataclass(frozen=True)
class Plan:
    """Victims on one node and the devices that will go to the request."""

    node: str
    victims: tuple[Running, ...]
    free: tuple[str, ...]
    reclaimed: tuple[str, ...]


def _eligible(
    victim: Running,
    request: Request,
    cls: PriorityClass,
    in_guarantee: bool,
    acct: Accounting,
    policy: Policy,
    now: dt.datetime,
) -> bool:
    vcls = policy.classes.get(victim.priority_class)
    if vcls is None or not vcls.preemptible or victim.preempt_deadline is not None:
        return False
    if (now - victim.started).total_seconds() < vcls.min_runtime:
        return False
    reclaim = in_guarantee and victim.lease_id in acct.borrowed and victim.user != request.user
    return reclaim or (cls.preempting and vcls.rank < cls.rank)


def victim_order(victim: Running, acct: Accounting, policy: Policy) -> tuple[float, float, float]:
    """Sort key: lowest class, most over guarantee, shortest running."""
    rank = policy.classes[victim.priority_class].rank
    return (rank, -acct.over_guarantee(victim.user, victim.group), -victim.started.timestamp())


def find_victims(
    request: Request,
    in_guarantee: bool,
    running_by_node: Mapping[str, Sequence[Running]],
    pool: Pool,
    acct: Accounting,
    policy: Policy,
    now: dt.datetime,
    told: frozenset[int] = frozenset(),
) -> Plan | None:
    """The cheapest :class:`Plan` freeing ``request.gpus`` devices on one node.

    Leases in ``told`` (victims chosen earlier in this pass) are left alone.
    """
    cls = policy.classes[request.priority_class]
    best: tuple[tuple[int, str], Plan] | None = None
    for node, leases in running_by_node.items():
        if len(pool.by_node.get(node, ())) < request.gpus:
            continue
        free = tuple(sorted(pool.free.get(node, {})))[: request.gpus]
        need = request.gpus - len(free)
        candidates = [
            v
            for v in leases
            if v.lease_id not in told
            and not pool.earmarked.intersection(v.devices)
            and _eligible(v, request, cls, in_guarantee, acct, policy, now)
        ]
        candidates.sort(key=lambda v: victim_order(v, acct, policy))
        victims: list[Running] = []
        devices: list[str] = []
        for victim in candidates:
            if len(devices) >= need:
                break
            victims.append(victim)
            devices += [d for d in victim.devices if pool.node_of(d) == node]
        if len(devices) < need or not victims:
            continue
        plan = Plan(node, tuple(victims), free, tuple(devices[:need]))
        key = (len(victims), node)
        if best is None or key < best[0]:
            best = (key, plan)
    return None if best is None else best[1]
