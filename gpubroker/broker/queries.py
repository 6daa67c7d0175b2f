"""Reads of the broker's state: leases, their transition logs, devices
with their holders, and the long-poll's wait for a lease to change. A part
of the broker (:class:`gpubroker.core.Broker` delegates to it); reads only,
from memory (the released leases and the logs from the store)."""

from __future__ import annotations

import time
from typing import Any

from ..model.holdings import DeviceRef, HeldSlot, LeaseRef
from ..store.models import Device, HolderKind, Lease, LeaseState
from ..transitions import event_view
from ..views import lease_view
from .runner import CommandRunner, lease_or_404
from .waiters import Waiters
from .world import World


class Queries:
    """What the API, the panel and the culler read.

    Args:
        runner: the broker's command runner (its reads).
        world: the broker's state in memory.
        waiters: the long-poll waiters per lease (woken by the broker
            after each command).
    """

    def __init__(self, runner: CommandRunner, world: World, waiters: Waiters) -> None:
        self.runner = runner
        self.world = world
        self.waiters = waiters

    def lease_events(self, lease_id: int) -> list[dict[str, Any]]:
        """The transition log of lease ``lease_id``, oldest first.

        Raises:
            NotFound: no such lease.
        """
        with self.runner.read() as repo:
            lease_or_404(repo, lease_id)
            return [event_view(row) for row in repo.events_of(lease_id)]

    def version_of(self, lease_id: int) -> int | None:
        """The ``version`` of lease ``lease_id`` (``None``: no such lease)."""
        lease = self.world.leases.get(lease_id)
        if lease is not None:
            return lease.version
        with self.runner.read() as repo:
            gone = repo.lease(lease_id)
            return None if gone is None else gone.version

    def get_lease(self, lease_id: int) -> dict[str, Any]:
        """The view of lease ``lease_id``.

        Raises:
            NotFound: no such lease.
        """
        with self.runner.read() as repo:
            return lease_view(lease_or_404(repo, lease_id))

    def list_leases(self, user: str | None = None, active: bool = True) -> list[dict[str, Any]]:
        """Lease views, oldest first; only ``user``'s when given; only
        pending and granted ones unless ``active`` is false."""
        if active:
            leases = [x for x in self.world.active() if user is None or x.user == user]
            return [lease_view(lease) for lease in leases]
        with self.runner.read() as repo:
            return [lease_view(lease) for lease in repo.leases(user)]

    def device_rows(self) -> list[tuple[DeviceRef, list[dict[str, Any]]]]:
        """Every known device with every slot of it held now: a whole device
        has at most one holder, a MIG or shared device one per instance or
        share.

        Returns:
            ``(device, holders)`` pairs in node and index order; each holder
            is ``{"lease_id", "user", "server_name", "kind"`` (``device``,
            ``mig``, ``share``), ``"profile", "instance_uuid", "memory_gib"}``.
        """
        held = [(a, x) for x in self.world.active() for a in x.allocations if a.active]
        held.sort(key=lambda pair: pair[0].id)
        holders: dict[str, list[dict[str, Any]]] = {}
        for allocation, lease in held:
            holders.setdefault(allocation.device_uuid, []).append(
                {
                    "lease_id": lease.id,
                    "user": lease.user,
                    "server_name": lease.server_name,
                    "kind": allocation.kind,
                    "profile": allocation.profile,
                    "instance_uuid": allocation.instance_uuid,
                    "memory_gib": None
                    if allocation.memory_mib is None
                    else allocation.memory_mib / 1024,
                }
            )
        devices = sorted(self.world.devices.values(), key=lambda d: (d.node, d.index))
        return [(device_ref(d), holders.get(d.uuid, [])) for d in devices]

    async def wait_for_change(
        self, lease_id: int, timeout: float, known_version: int | None = None
    ) -> dict[str, Any]:
        """Wait up to ``timeout`` seconds for lease ``lease_id`` to change.

        Args:
            lease_id: the lease.
            timeout: seconds to wait at most.
            known_version: the ``version`` the caller last saw; when the lease
                is already past it, answer at once (nothing is missed between
                two polls). ``None`` means the current version.

        Returns:
            the view after the change, or the unchanged view on time-out.

        Raises:
            NotFound: no such lease.
        """
        current = self.get_lease(lease_id)
        known = current["version"] if known_version is None else known_version
        deadline = time.monotonic() + timeout
        while current["version"] == known and (remaining := deadline - time.monotonic()) > 0:
            if not await self.waiters.wait(lease_id, known, remaining):
                break
            current = self.get_lease(lease_id)
        return current

    def server_leases(self) -> list[LeaseRef]:
        """Granted leases of hub servers, as pictures taken now (for the
        culler and the reconciliations with Docker and Slurm, which keep
        them across awaits)."""
        return [
            lease_ref(x)
            for x in self.world.active()
            if x.state == LeaseState.granted.value and x.holder_kind == HolderKind.server.value
        ]


def lease_ref(lease: Lease) -> LeaseRef:
    """A picture of ``lease`` now, with its active slots."""
    return LeaseRef(
        id=lease.id,
        user=lease.user,
        server_name=lease.server_name or "",
        holder_kind=lease.holder_kind,
        priority_class=lease.priority_class,
        created=lease.created,
        granted_at=lease.granted_at,
        server_url=lease.server_url,
        container_id=lease.container_id,
        docker_engine=lease.docker_engine,
        slurm_job=lease.slurm_job,
        slots=tuple(
            HeldSlot(a.kind, a.device_uuid, a.instance_uuid, a.profile, a.memory_mib)
            for a in lease.allocations
            if a.active
        ),
    )


def device_ref(device: Device) -> DeviceRef:
    """A picture of ``device`` now."""
    return DeviceRef(
        uuid=device.uuid,
        node=device.node,
        index=device.index,
        name=device.name,
        memory_total_mib=device.memory_total_mib,
        pci_bus_id=device.pci_bus_id,
        mig_enabled=bool(device.mig_enabled),
        present=bool(device.present),
        drained=bool(device.drained),
        mig_target=device.mig_target,
    )
