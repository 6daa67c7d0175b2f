"""What is free now, per pool, and what a user may still take: the answer of
``GET /api/v1/pools`` that the spawn form shows. A part of the broker
(:class:`gpubroker.core.Broker` delegates to it); reads only."""

from __future__ import annotations

import datetime as dt
from collections import Counter
from collections.abc import Callable
from typing import Any

from .. import scheduler
from ..devices import mig
from ..pools import Pools
from ..scheduler.sharing import SharingPool, mig_weight
from ..store.models import ACTIVE_STATES, Lease, LeaseState
from .admission import held_weight
from .runner import CommandRunner

#: the scheduler's view of memory and the leases it was built from
StateOf = Callable[[], tuple[scheduler.SchedulerState, dict[int, Lease]]]

#: MIG instances counted at most per profile and pool (the form says "N+")
MAX_COUNTED = 50


def _free_mig(state: scheduler.SchedulerState, pool: str, profiles: list[str]) -> dict[str, int]:
    """Instances of each profile that could be created now, one profile at a
    time (each count assumes only that profile is created)."""
    counts = {}
    for profile in profiles:
        sharing = SharingPool.build(state.slots, state.running, "first-fit")
        request = scheduler.Request(
            0, "", 1, dt.datetime.now(dt.timezone.utc), kind="mig", mig_profile=profile, pool=pool
        )
        n = 0
        while n < MAX_COUNTED:
            part, _miss = sharing.place_mig(request)
            if part is None:
                break
            sharing.take(-1 - n, (part,))
            n += 1
        counts[profile] = n
    return counts


def _share_room(state: scheduler.SchedulerState, pool: str) -> tuple[float, float]:
    """(largest share grantable now on one device, total share room), GiB."""
    sharing = SharingPool.build(state.slots, state.running)
    rooms = [
        d.share_room
        for d in sharing.devices.values()
        if d.slot.pool == pool and d.slot.mode == "timeslice" and not d.slot.drained
    ]
    return max(rooms, default=0) / 1024, sum(max(r, 0) for r in rooms) / 1024


class Availability:
    """``availability(user)`` for the spawn form and ``GET /pools``.

    Args:
        runner: the broker's command runner (its reads).
        state_of: the scheduler's view of the broker's memory
            (:meth:`Scheduling.state`).
        pools: the pools' configuration.
    """

    def __init__(self, runner: CommandRunner, state_of: StateOf, pools: Pools) -> None:
        self.runner = runner
        self.state_of = state_of
        self.pools = pools

    def availability(self, user: str | None = None) -> dict[str, Any]:
        """Each pool with what is free now, and ``user``'s quota room.

        Returns:
            A dict with two keys. ``pools`` lists each pool as a dict with
            ``name``, ``mode``, ``purpose``, ``description``, ``devices``
            (count), ``models`` (NVML names), ``mig_weights`` (MIG profile
            to device units charged) and ``free``, which holds
            ``gpus`` (whole devices free now), ``gpus_one_node`` (the most
            of them on one node: the largest request granted now), ``mig`` (profile to
            instances creatable now), ``share_gib`` (largest share grantable
            now) and ``shares_total_gib``. ``quota`` is ``None`` or a dict
            with ``user``, ``limit``, ``guaranteed``, ``held``, ``pending``
            and ``remaining``, in device units (a MIG instance counts compute
            slices / the device's, a share memory / the device's memory);
            ``limit`` and ``remaining`` are ``None`` when there is no limit.
        """
        with self.runner.read():
            state, leases = self.state_of()
            quota = self._quota_view(state.policy, user, leases.values()) if user else None
        held = {d for r in state.running for d in r.devices} | {
            d for r in state.pending for d in r.earmarked
        }
        pools = []
        for spec in self.pools.specs():
            slots = [s for s in state.slots if s.pool == spec.name]
            if not slots and spec.name != self.pools.default_pool:
                continue
            free: dict[str, Any] = {
                "gpus": 0,
                "gpus_one_node": 0,
                "mig": {},
                "share_gib": 0.0,
                "shares_total_gib": 0.0,
            }
            entry_weights: dict[str, float] = {}
            if spec.mode == "exclusive":
                on_node = Counter(s.node for s in slots if not s.drained and s.uuid not in held)
                free["gpus"] = sum(on_node.values())
                # a request's devices are all on one node (the scheduler's rule)
                free["gpus_one_node"] = max(on_node.values(), default=0)
            elif spec.mode == "mig":
                offered = sorted(
                    {p for s in slots if (m := mig.spec_for(s.model)) for p in m.profiles}
                )
                free["mig"] = _free_mig(state, spec.name, offered)
                entry_weights = {
                    profile: round(mig_weight(model, profile), 6)
                    for model in sorted({s.model for s in slots})
                    for profile in offered
                    if (m := mig.spec_for(model)) and profile in m.profiles
                }
            else:
                free["share_gib"], free["shares_total_gib"] = _share_room(state, spec.name)
            pools.append(
                {
                    "name": spec.name,
                    "mode": spec.mode,
                    "purpose": spec.purpose,
                    "description": spec.description,
                    "devices": len(slots),
                    "models": sorted({s.model for s in slots}),
                    "free": free,
                    "mig_weights": entry_weights,
                }
            )
        return {"pools": pools, "quota": quota}

    @staticmethod
    def _quota_view(policy: scheduler.Policy, user: str, leases: Any) -> dict[str, Any]:
        quota = policy.user_quota(user)
        mine = [x for x in leases if x.user == user and x.state in ACTIVE_STATES]
        held = sum(held_weight(x) for x in mine if x.state == LeaseState.granted.value)
        pending = sum(held_weight(x) for x in mine if x.state == LeaseState.pending.value)
        remaining = None if quota.limit is None else max(quota.limit - held - pending, 0.0)
        return {
            "user": user,
            "limit": quota.limit,
            "guaranteed": quota.guaranteed,
            "held": round(held, 4),
            "pending": round(pending, 4),
            "remaining": None if remaining is None else round(remaining, 4),
        }
