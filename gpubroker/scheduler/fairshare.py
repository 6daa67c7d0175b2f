"""Fair share: order users of one priority class by their decayed past usage.

Usage decays exponentially with half-life ``h`` (Slurm's PriorityDecayHalfLife):
a GPU-second used ``t`` seconds ago counts ``2**(-t/h)``. A lease running since
``s`` at ``g`` GPUs has contributed ``g * h/ln 2 * (1 - 2**(-(now-s)/h))``.

The factor of user ``u`` (Slurm's classic formula, normalised to capacity):

    U = usage(u) / (total_gpus * h / ln 2)     # 1 = the whole cluster forever
    S = share(u) / sum of shares of active users
    F = 2 ** (-U / S)                            # 1: no usage; -> 0: heavy use

Higher ``F`` goes first. Normalising by capacity (not by total usage) lets old
usage fade to nothing, so two users are even again a few half-lives later.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Container, Iterable, Mapping

from .types import Running, UsageRecord

_LN2 = math.log(2)


def decay(value: float, elapsed: float, half_life: float) -> float:
    """``value`` decayed over ``elapsed`` seconds (negative elapsed: no change)."""
    if elapsed <= 0 or half_life <= 0:
        return value
    return value * math.pow(2.0, -elapsed / half_life)


def running_usage(gpus: float, started: dt.datetime, now: dt.datetime, half_life: float) -> float:
    """Decayed GPU-seconds of a lease of ``gpus`` running from ``started`` to ``now``."""
    elapsed = (now - started).total_seconds()
    if elapsed <= 0:
        return 0.0
    if half_life <= 0:
        return gpus * elapsed
    return gpus * half_life / math.log(2) * (1.0 - math.pow(2.0, -elapsed / half_life))


def decayed_usage(
    records: Mapping[str, UsageRecord],
    running: Iterable[Running],
    now: dt.datetime,
    half_life: float,
) -> dict[str, float]:
    """Decayed GPU-seconds per user at ``now``: past records plus running leases.

    Each lease adds :func:`running_usage` from ``held_since`` (else its
    start; the same float, computed once per distinct start time: many
    leases of a pass share one), plus its ``held_before`` decayed (a lease
    held across a broker restart: what the usage ledger holds before it)."""
    usage = {
        user: decay(r.gpu_seconds, (now - r.as_of).total_seconds(), half_life)
        for user, r in records.items()
    }
    # running_usage(g, s, now, h) == g * h / ln 2 * term(s) for h > 0
    terms: dict[dt.datetime, float | None] = {}
    for lease in running:
        started = lease.held_since or lease.started
        before = lease.held_before
        if before is not None:  # held before a broker restart (the ledger's figure)
            elapsed = (now - before.as_of).total_seconds()
            usage[lease.user] = usage.get(lease.user, 0.0) + decay(
                before.gpu_seconds, elapsed, half_life
            )
        if started in terms:
            term = terms[started]
        else:
            elapsed = (now - started).total_seconds()
            term = (
                None
                if elapsed <= 0 or half_life <= 0
                else 1.0 - math.pow(2.0, -elapsed / half_life)
            )
            terms[started] = term
        user = lease.user
        parts = lease.parts
        gpus = (
            float(len(lease.devices)) + sum([p.weight for p in parts])
            if parts
            else float(len(lease.devices))
        )
        if term is None:
            used = running_usage(gpus, started, now, half_life)
        else:
            used = gpus * half_life / _LN2 * term
        usage[user] = usage.get(user, 0.0) + used
    return usage


def factors(
    users: Iterable[str],
    usage: Mapping[str, float],
    shares: Mapping[str, float],
    total_gpus: int,
    half_life: float,
    only: Container[str] | None = None,
) -> dict[str, float]:
    """Fair-share factor in ``(0, 1]`` of each of ``users`` (see module doc);
    with ``only``, just of those of them in ``only`` (the shares still count
    every one of ``users``)."""
    active = sorted(set(users))
    total_shares = sum(max(shares.get(u, 1.0), 0.0) for u in active) or 1.0
    capacity = max(total_gpus, 1) * (half_life / math.log(2) if half_life > 0 else 1.0)
    result = {}
    for user in active:
        if only is not None and user not in only:
            continue
        share = max(shares.get(user, 1.0), 1e-9) / total_shares
        result[user] = math.pow(2.0, -(usage.get(user, 0.0) / capacity) / share)
    return result
