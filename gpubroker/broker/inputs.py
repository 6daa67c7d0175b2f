"""The scheduler's values of the active leases, kept current by change.

A pass gives the pure scheduler one :class:`~gpubroker.scheduler.Running`
per granted lease and one :class:`~gpubroker.scheduler.Request` per pending
one. Building them from the rows at every pass costs work proportional to
the queue; here they are kept, and only the leases a command changed are
built again (work proportional to what changed, as in dask.distributed's
scheduler state).

Who says what changed:

- :class:`~gpubroker.broker.world.World` marks every lease that is new,
  flushed, or dirty in the session (any attribute a command set), and every
  lease of an allocation that changed;
- :func:`gpubroker.passes.set_wait` marks the lease whose wait it sets (the
  earmark is part of the request; the wait is kept in memory only);
- a reload (start-up, rollback) forgets everything: the next refresh builds
  every value.

``validate_state`` (after every command in the tests) compares these values
with a build from scratch (:meth:`SchedulerInputs.drift`).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Collection, Mapping
from typing import Any

from .. import scheduler
from ..store.models import Allocation, HolderKind, Lease, LeaseState


def part_of(allocation: Allocation) -> scheduler.Part:
    """The scheduler's value of a fractional allocation (MIG instance, share)."""
    return scheduler.Part(
        device=allocation.device_uuid,
        kind=allocation.kind,
        weight=allocation.weight,
        profile=allocation.profile or "",
        start=allocation.placement_start or 0,
        size=allocation.placement_size or 0,
        memory_mib=allocation.memory_mib or 0,
        instance=allocation.instance_uuid or "",
    )


def running_of(
    lease: Lease, held: tuple[scheduler.UsageRecord, dt.datetime] | None = None
) -> scheduler.Running:
    """The scheduler's value of a granted lease; ``held``: for a lease held
    across a broker restart, what the usage ledger holds it for before the
    restart and when its open interval began (fair share charges that)."""
    assert lease.granted_at is not None
    active = [a for a in lease.allocations if a.active]
    return scheduler.Running(
        lease_id=lease.id,
        user=lease.user,
        devices=tuple(a.device_uuid for a in active if a.kind == "device"),
        started=lease.granted_at,
        group=lease.group_name,
        priority_class=lease.priority_class,
        ends=lease.ends_at,
        preempt_deadline=lease.preempt_deadline,
        preempted_for=lease.preempted_for,
        parts=tuple(part_of(a) for a in active if a.kind != "device"),
        held_before=held[0] if held else None,
        held_since=held[1] if held else None,
    )


def request_of(lease: Lease, batch_pools: bool = False) -> scheduler.Request:
    """The scheduler's value of a pending lease; ``batch_pools``: some pool
    is a batch pool, so a lease that is not a job and names no pool asks
    for :data:`~gpubroker.scheduler.types.INTERACTIVE_POOLS` (jobs only run
    on batch pools)."""
    pool = lease.pool
    if pool is None and batch_pools and lease.holder_kind != HolderKind.job.value:
        pool = scheduler.INTERACTIVE_POOLS
    return scheduler.Request(
        lease_id=lease.id,
        user=lease.user,
        gpus=lease.gpus,
        created=lease.created,
        group=lease.group_name,
        priority_class=lease.priority_class,
        time_limit=lease.time_limit,
        earmarked=tuple(lease.earmarked or ()),
        kind=lease.kind,
        mig_profile=lease.mig_profile or "",
        memory_mib=lease.memory_mib or 0,
        pool=pool,
        weight=lease.weight,
        prefer=tuple(lease.prefer_devices or ()),
    )


class SchedulerInputs:
    """Running and pending values by lease id, rebuilt per change."""

    def __init__(self) -> None:
        #: granted leases' values, by id
        self.running: dict[int, scheduler.Running] = {}
        #: pending leases' values, by id (ids grow: insertion is id order)
        self.pending: dict[int, scheduler.Request] = {}
        #: leases held across a broker restart: the ledger's figure before it
        #: and the start of their open interval (:meth:`World.load_held`)
        self.held: dict[int, tuple[scheduler.UsageRecord, dt.datetime]] = {}
        #: some pool is a batch pool (set by the broker from its pools;
        #: :func:`request_of`)
        self.batch_pools = False
        #: the last wait a pass set on each pending lease (what it holds now)
        self.waits: dict[int, scheduler.Wait] = {}
        self._changed: set[int] = set()
        self._all = True
        self._running_tuple: tuple[scheduler.Running, ...] | None = None
        self._held: frozenset[str] | None = None
        self._held_devices: frozenset[str] | None = None
        #: devices kept for pending requests (``None``: to be computed again)
        self._earmarked: frozenset[str] | None = None

    def changed(self, lease_id: int) -> None:
        """Lease ``lease_id`` may have changed: build its value again."""
        self._changed.add(lease_id)

    def forget(self) -> None:
        """Everything may have changed (a reload): build every value again."""
        self._all = True
        self.waits.clear()

    def refresh(self, leases: Mapping[int, Lease], dirty: Collection[int] = ()) -> None:
        """Build the values of the leases changed since the last refresh.

        Args:
            leases: the active leases by id (:attr:`World.leases`; one
                released in the open transaction may still be there: its
                state says so).
            dirty: more ids to build (the session's unflushed changes).
        """
        if self._all:
            self._all = False
            self._changed.clear()
            self.running, self.pending = {}, {}
            self._invalidate()
            self._earmarked = None
            for lease_id in sorted(leases):
                self._build(leases, lease_id)
            return
        if dirty:
            self._changed.update(dirty)
        if not self._changed:
            return
        changed, self._changed = self._changed, set()
        for lease_id in sorted(changed):
            self._build(leases, lease_id)

    def _build(self, leases: Mapping[int, Lease], lease_id: int) -> None:
        old = self.pending.get(lease_id)
        self._build_value(leases, lease_id)
        new = self.pending.get(lease_id)
        if (old is not None and old.earmarked) or (new is not None and new.earmarked):
            self._earmarked = None

    def _build_value(self, leases: Mapping[int, Lease], lease_id: int) -> None:
        lease = leases.get(lease_id)
        state = None if lease is None else lease.state
        if state == LeaseState.granted.value:
            assert lease is not None
            self.pending.pop(lease_id, None)
            self.waits.pop(lease_id, None)
            self.running[lease_id] = running_of(lease, self.held.get(lease_id))
            self._invalidate()
        elif state == LeaseState.pending.value:
            assert lease is not None
            if self.running.pop(lease_id, None) is not None:
                self._invalidate()
            out_of_order = (
                lease_id not in self.pending
                and bool(self.pending)
                and lease_id < next(reversed(self.pending))
            )
            self.pending[lease_id] = request_of(lease, self.batch_pools)
            if out_of_order:  # keep id order
                self.pending = dict(sorted(self.pending.items()))
        else:
            self.pending.pop(lease_id, None)
            self.waits.pop(lease_id, None)
            if self.running.pop(lease_id, None) is not None:
                self._invalidate()

    def _invalidate(self) -> None:
        self._running_tuple = None
        self._held = None
        self._held_devices = None

    def running_values(self, skip: Collection[int] = ()) -> tuple[scheduler.Running, ...]:
        """The granted leases' values, by id (``skip``: ids left out)."""
        if self._running_tuple is None:
            self._running_tuple = tuple(self.running[i] for i in sorted(self.running))
        if skip and any(i in self.running for i in skip):
            return tuple(r for r in self._running_tuple if r.lease_id not in skip)
        return self._running_tuple

    def pending_values(self, skip: Collection[int] = ()) -> tuple[scheduler.Request, ...]:
        """The pending leases' values, by id (``skip``: ids left out)."""
        if skip:
            return tuple(r for i, r in self.pending.items() if i not in skip)
        return tuple(self.pending.values())

    def held_devices(self) -> frozenset[str]:
        """UUIDs of the devices granted leases hold, whole or in parts."""
        if self._held_devices is None:
            self._held_devices = frozenset(
                uuid
                for r in self.running.values()
                for uuid in (*r.devices, *(part.device for part in r.parts))
            )
        return self._held_devices

    def earmarked_devices(self) -> frozenset[str]:
        """UUIDs of the devices kept for pending requests (reclaimed for them)."""
        if self._earmarked is None:
            self._earmarked = frozenset(
                d for r in self.pending.values() if r.earmarked for d in r.earmarked
            )
        return self._earmarked

    def held_instances(self) -> frozenset[str]:
        """UUIDs of the MIG instances granted leases hold."""
        if self._held is None:
            self._held = frozenset(
                part.instance for r in self.running.values() for part in r.parts if part.instance
            )
        return self._held

    def taken(self, user: str | None = None, group: str | None = None) -> float:
        """Device units held or asked for by ``user`` (or by ``group``):
        whole devices count 1, MIG instances and shares their weight."""
        total = 0.0
        for values in (self.running.values(), self.pending.values()):
            for v in values:
                if (user is not None and v.user == user) or (
                    group is not None and v.group == group
                ):
                    total += _amount(v)
        return total

    def drift(self, leases: Mapping[int, Lease]) -> list[str]:
        """How the kept values differ from values built from ``leases`` now
        (empty: they agree), in words."""
        found = []
        for lease_id in sorted(leases.keys() | self.running.keys() | self.pending.keys()):
            lease = leases.get(lease_id)
            state = None if lease is None else lease.state
            kept: Any = self.running.get(lease_id) or self.pending.get(lease_id)
            if state == LeaseState.granted.value:
                fresh: Any = running_of(lease, self.held.get(lease_id))  # type: ignore[arg-type]
            elif state == LeaseState.pending.value:
                fresh = request_of(lease, self.batch_pools)  # type: ignore[arg-type]
            else:
                fresh = None
            if kept != fresh:
                found.append(f"lease {lease_id}: scheduler value {kept!r} kept, {fresh!r} now")
        return found


def _amount(value: scheduler.Running | scheduler.Request) -> float:
    """Device units of a running or pending value."""
    if isinstance(value, scheduler.Running):
        return float(len(value.devices)) + sum(p.weight for p in value.parts)
    return float(value.gpus) if value.weight is None else value.weight
