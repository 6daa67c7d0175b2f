"""Admission of lease requests: which group is charged, limits, classes.

A part of the broker (:class:`gpubroker.core.Broker` delegates to it);
every check raises before anything is stored (engineering rule 6).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from .. import scheduler
from ..devices import mig
from ..errors import BadRequest, Forbidden
from ..model.limits import MAX_SHARE_GIB, MIN_SHARE_GIB
from ..pools import Pools, PoolSpec
from ..scheduler.sharing import share_weight
from ..store.models import Device, HolderKind, Lease
from .world import World


def _check_numbers(gpus: int | None, memory_gib: float | None, count: int | None) -> None:
    """The checks of :func:`gpubroker.api.validation.slot_request`, again for
    callers of the core that bypass the API.

    Raises:
        BadRequest: a non-integer or non-positive ``gpus``/``count``, or a
            ``memory_gib`` that is not a finite number in the allowed range.
    """
    for name, value in (("gpus", gpus), ("count", count)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise BadRequest(f"{name}: must be an integer, got {value!r}")
        if name == "count" and value is not None and value < 1:
            raise BadRequest(f"count: must be at least 1, got {value}")
    if memory_gib is not None and not (
        isinstance(memory_gib, int | float)
        and math.isfinite(memory_gib)
        and MIN_SHARE_GIB <= memory_gib <= MAX_SHARE_GIB
    ):
        raise BadRequest(
            f"memory_gib: must be between {MIN_SHARE_GIB:g} and {MAX_SHARE_GIB:g} GiB,"
            f" got {memory_gib!r}"
        )


@dataclass(frozen=True)
class Shape:
    """What a request asks for, checked against the pools.

    Attributes:
        kind: ``gpus``, ``mig`` or ``share``.
        count: whole devices, 1 MIG instance, or the number of shares.
        mig_profile: MIG profile name (``mig``).
        memory_mib: MiB per share (``share``).
        pool: the pool named, if any.
        weight: device units charged to quotas (for shares an estimate from
            the largest device of the pool; the grant sets the real one).
    """

    kind: str
    count: int
    mig_profile: str | None = None
    memory_mib: int | None = None
    pool: str | None = None
    weight: float = 0.0


def _a(word: str) -> str:
    """``word`` with its indefinite article: ``an exclusive``, ``a mig``."""
    return f"{'an' if word[0] in 'aeiou' else 'a'} {word}"


def _pool_devices(
    devices: list[tuple[Device, PoolSpec]], mode: str, pool: str | None, field: str
) -> list[Device]:
    """Present devices of ``mode`` pools (of ``pool`` when named).

    Raises:
        BadRequest: the named pool does not exist or has another mode; no
            pool of that mode exists.
    """
    if pool is not None:
        modes = {spec.mode for _d, spec in devices if spec.name == pool}
        if not modes:
            names = sorted({spec.name for _d, spec in devices})
            raise BadRequest(f"pool: no pool {pool!r} has devices (pools: {', '.join(names)})")
        if mode not in modes:
            raise BadRequest(
                f"pool: {pool!r} is {_a(modes.pop())} pool; {field} needs {_a(mode)} pool"
            )
    found = [d for d, spec in devices if spec.mode == mode and pool in (None, spec.name)]
    if not found:
        raise BadRequest(f"{field}: no {mode} pool has devices")
    return found


class Admission:
    """Checks run by :meth:`Broker.request_lease` before a lease is created.

    Args:
        world: the broker's state in memory (devices, what is taken).
        pools: the pools' configuration.
        pool_spec: the pool of a device, by UUID (the sharing operations').
        policy: the pure policy in force (config plus stored quotas).
        default_class: the configured default priority class's name.
        max_gpus: ``Broker.max_gpus_per_request`` (0: the largest node).
    """

    def __init__(
        self,
        world: World,
        pools: Pools,
        pool_spec: Callable[[str], PoolSpec],
        policy: Callable[[], scheduler.Policy],
        default_class: Callable[[], str],
        max_gpus: Callable[[], int],
    ) -> None:
        self.world = world
        self.pools = pools
        self.pool_spec = pool_spec
        self.policy = policy
        self.default_class = default_class
        self.max_gpus = max_gpus

    def pool_devices(self) -> list[tuple[Device, PoolSpec]]:
        """Every present device (detached row) with its pool."""
        return [(d, self.pool_spec(d.uuid)) for d in self.world.present_devices()]

    def largest_node(self, devices: list[tuple[Device, PoolSpec]] | None = None) -> int:
        """Number of present, non-drained devices of exclusive pools on the
        largest node (of ``devices``, from :meth:`pool_devices`, when given)."""
        per_node: dict[str, int] = {}
        for device, spec in self.pool_devices() if devices is None else devices:
            if not device.drained and spec.mode == scheduler.PoolMode.exclusive.value:
                per_node[device.node] = per_node.get(device.node, 0) + 1
        return max(per_node.values(), default=0)

    def request_limit(self, devices: list[tuple[Device, PoolSpec]] | None = None) -> int:
        """Most GPUs one lease may ask for now (see ``Broker.max_gpus_per_request``);
        ``devices``: :meth:`pool_devices`, when the caller has them."""
        largest = self.largest_node(devices)
        if self.max_gpus():
            return min(largest, self.max_gpus())
        return largest

    def check_purpose(self, pool: str | None, holder_kind: str) -> None:
        """Only jobs run on a pool whose purpose is ``batch`` (Pools).

        Raises:
            BadRequest: ``pool`` is a batch pool and the holder is not a job.
        """
        spec = None if pool is None else self.pools.spec(pool)
        if spec is not None and spec.purpose == "batch" and holder_kind != HolderKind.job.value:
            raise BadRequest(
                f"pool: {pool!r} is a batch pool: only batch jobs run there "
                "(submit a job: gpubroker jobs submit, or %gpu_submit)"
            )

    def shape(
        self,
        gpus: int | None,
        mig_profile: str | None,
        memory_gib: float | None,
        count: int | None,
        pool: str | None,
        interactive: bool = False,
    ) -> Shape:
        """Check what a request asks for against the pools and devices;
        ``interactive``: the holder is not a job, so a request naming no pool
        is checked against the pools that are not batch pools only.

        Raises:
            BadRequest: more GPUs than the request limit; a pool that does
                not exist or has another mode; a MIG profile no device of
                the pool offers (the message lists those it offers); a share
                larger than a device's memory less the pool's reserve; more
                shares than devices on one node.
        """
        _check_numbers(gpus, memory_gib, count)
        devices = self.pool_devices()
        if interactive and pool is None:
            kept = [(d, spec) for d, spec in devices if spec.purpose != "batch"]
            if len(kept) < len(devices):
                try:
                    return self._shape(kept, gpus, mig_profile, memory_gib, count, pool)
                except BadRequest as err:
                    raise BadRequest(f"{err.message} (batch pools take only jobs)") from None
        return self._shape(devices, gpus, mig_profile, memory_gib, count, pool)

    def _shape(
        self,
        devices: list[tuple[Device, PoolSpec]],
        gpus: int | None,
        mig_profile: str | None,
        memory_gib: float | None,
        count: int | None,
        pool: str | None,
    ) -> Shape:
        """:meth:`shape` on ``devices``."""
        if gpus is not None:
            if pool is not None:
                _pool_devices(devices, "exclusive", pool, "gpus")
            limit = self.request_limit(devices)
            if not 1 <= gpus <= limit:
                raise BadRequest(
                    f"gpus: must be between 1 and {limit} (the request limit), got {gpus}"
                )
            return Shape("gpus", gpus, pool=pool, weight=float(gpus))
        if mig_profile is not None:
            found = _pool_devices(devices, "mig", pool, "mig_profile")
            specs = {s.name: s for d in found if (s := mig.spec_for(d.name)) is not None}
            for spec in specs.values():
                if mig_profile in spec.profiles:
                    weight = spec.profiles[mig_profile].compute_slices / spec.compute_slices
                    return Shape("mig", 1, mig_profile=mig_profile, pool=pool, weight=weight)
            offered = sorted({p for spec in specs.values() for p in spec.profiles})
            raise BadRequest(
                f"mig_profile: no device of {'pool ' + pool if pool else 'the MIG pools'} "
                f"offers {mig_profile!r} (offered: {', '.join(offered) or 'none'})"
            )
        assert memory_gib is not None
        return self._share_shape(devices, memory_gib, count or 1, pool)

    @staticmethod
    def _share_shape(
        devices: list[tuple[Device, PoolSpec]], memory_gib: float, count: int, pool: str | None
    ) -> Shape:
        found = _pool_devices(devices, "timeslice", pool, "memory_gib")
        reserve = {d.uuid: spec.reserve_mib for d, spec in devices}
        memory = round(memory_gib * 1024)
        room = max(max(d.memory_total_mib - reserve[d.uuid], 0) for d in found)
        if memory > room:
            raise BadRequest(
                f"memory_gib: at most {room / 1024:g} GiB per share in "
                f"{'pool ' + pool if pool else 'the time-sliced pools'}, got {memory_gib:g}"
            )
        per_node: dict[str, int] = {}
        for d in found:
            if d.memory_total_mib - reserve[d.uuid] >= memory:
                per_node[d.node] = per_node.get(d.node, 0) + 1
        most = max(per_node.values(), default=0)
        if count > most:
            raise BadRequest(
                f"count: at most {most} shares of {memory_gib:g} GiB (one per device of a node),"
                f" got {count}"
            )
        largest = max(d.memory_total_mib for d in found)
        weight = count * share_weight(memory, largest)
        return Shape("share", count, memory_mib=memory, pool=pool, weight=weight)

    @staticmethod
    def charge_group(
        user: str, group: str | None, groups: list[str] | None, policy: scheduler.Policy
    ) -> str | None:
        with_quota = sorted(g for g in groups or () if g in policy.group_quotas)
        if group is not None:
            if groups is None:
                raise Forbidden(f"group: cannot check that {user!r} is in group {group!r} now")
            if group not in groups:
                raise Forbidden(f"group: {user!r} is not a member of group {group!r}")
            if with_quota and group not in with_quota:
                raise Forbidden(
                    f"group: charge one of your groups with a quota ({', '.join(with_quota)}),"
                    f" not {group!r}"
                )
            return group
        return with_quota[0] if with_quota else None

    @staticmethod
    def check_guarantee_room(
        policy: scheduler.Policy, cls: str, user: str, group: str | None, gpus: float
    ) -> None:
        """A non-preemptible class runs only within guarantees: refuse what
        can never fit in them (403) rather than queue it forever."""
        if policy.class_of(cls).preemptible:
            return
        group_quota = policy.group_quota(group)
        room = policy.user_quota(user).guaranteed + (group_quota.guaranteed if group_quota else 0)
        if gpus > room:
            raise Forbidden(
                f"priority_class: {cls!r} is not preemptible and runs only within guarantees;"
                f" {gpus:g} GPUs exceed the {room:g} guaranteed to {user}"
                + (f" and group {group}" if group_quota else "")
            )

    def class_for_caller(
        self, name: str | None, admin: bool, policy: scheduler.Policy | None = None
    ) -> None:
        """Non-admins may ask only for the default class or lower, never a
        preempting one (admins and the spawner choose freely). ``policy``:
        the one in force, if the caller has it already.

        Raises:
            Forbidden: the class is above the caller's reach.
        """
        if admin or name is None:
            return
        policy = policy or self.policy()
        default_rank = policy.class_of(self.default_class()).rank
        cls = policy.class_of(name)
        if cls.preempting or cls.rank > default_rank:
            raise Forbidden(
                f"priority_class: {name!r} may be requested only by broker admins or the spawner"
            )

    def check_limits(
        self,
        policy: scheduler.Policy,
        user: str,
        group: str | None,
        gpus: float,
        replacing: Lease | None = None,
    ) -> None:
        """Refuse what would take held plus pending GPUs above a limit (403).

        ``replacing``: an active lease the request will release once
        admitted (a restart's previous lease); what it holds or waits for
        is not counted, so the check comes before that release and a
        refusal changes nothing.
        """
        inputs = self.world.refresh_inputs()
        checks = [("user", user, policy.user_quota(user))]
        quota = policy.group_quota(group)
        if quota is not None and group is not None:
            checks.append(("group", group, quota))
        for kind, name, q in checks:
            if q.limit is None:
                continue
            taken = inputs.taken(user=name) if kind == "user" else inputs.taken(group=name)
            if replacing is not None and name == (
                replacing.user if kind == "user" else replacing.group_name
            ):
                taken -= held_weight(replacing)
            if taken + gpus > q.limit + 1e-9:
                raise Forbidden(
                    f"quota: {kind} {name} holds or waits for {_gpus(taken)}; "
                    f"{_units(gpus)} more would exceed the {kind} limit of {_gpus(q.limit)}"
                )


def _units(value: float) -> str:
    """Device units for a message: to three decimals, never in exponent
    notation (``1000``, not ``1e+03``; ``0.429`` for 3/7)."""
    return f"{round(value, 3):.12g}"


def _gpus(value: float) -> str:
    """:func:`_units` with its noun: ``1 GPU``, ``2 GPUs``, ``0.429 GPUs``."""
    text = _units(value)
    return f"{text} GPU" if text == "1" else f"{text} GPUs"


def held_weight(lease: Lease) -> float:
    """Device units a lease counts for: its weight, or its whole devices."""
    return lease.weight if lease.weight is not None else float(lease.gpus)
