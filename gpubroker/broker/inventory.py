"""The inventory: which devices exist, on which nodes, and which of them
the engine takes no new work on; the devices an engine bound a lease to. A
part of the broker (:class:`gpubroker.core.Broker` delegates to it)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .. import scheduler
from ..commands import command
from ..devices.base import DeviceBackend
from ..engines import Engine, Node
from ..errors import Conflict
from ..store.models import Allocation, Device, LeaseState
from ..store.repository import Repository
from .runner import CommandRunner, lease_or_404
from .sharing import SharingOps
from .world import OutsideReason, World


class Inventory:
    """The engine's devices written into the store, the topology of this
    node, devices outside the broker's reach, and engine bindings.

    Args:
        runner: the broker's command runner.
        world: the broker's state in memory.
        engine: where the inventory comes from.
        backend: this node's device backend (its topology).
        sharing: the sharing operations (pools, MIG modes).
        schedule: run or ask for a scheduling pass in the open transaction.
        schedule_now: a scheduling pass of its own.
        notify: wake the long-polls of changed leases.
        log: the broker's logger.
    """

    def __init__(
        self,
        runner: CommandRunner,
        world: World,
        engine: Engine,
        backend: DeviceBackend,
        sharing: SharingOps,
        schedule: Callable[[Repository, dt.datetime], None],
        schedule_now: Callable[[], None],
        notify: Callable[[], None],
        log: Any,
    ) -> None:
        self.runner = runner
        self.world = world
        self.engine = engine
        self.backend = backend
        self.sharing = sharing
        self.schedule = schedule
        self.schedule_now = schedule_now
        self.notify = notify
        self.log = log
        #: the topology of this node's devices (local engine), by node
        self.topology: dict[str, scheduler.Topology] = {}

    @property
    def changes(self) -> bool:
        """Whether the engine's inventory changes by itself (read it again
        every ``Broker.inventory_interval``): true for Slurm."""
        return self.engine.name == "slurm"

    def outside_reason(self, uuid: str, admin: bool = True) -> str | None:
        """Why the engine takes no new work on device ``uuid`` (its node is
        drained or down in Slurm, a Slurm job from outside holds it);
        ``None``: nothing outside the broker stops it. ``admin``: name
        whose outside job holds it (:meth:`OutsideReason.describe`)."""
        found = self.world.outside.get(uuid)
        return None if found is None else found.describe(admin)

    @command("broker")
    def sync_inventory(self, nodes: list[Node] | None = None) -> list[dict[str, Any]]:
        """Write the engine's devices into the store (its nodes' inventory:
        for the local engine, the device backend's); mark vanished ones
        absent; keep in memory which devices the engine takes no new work
        on (:meth:`outside_reason`), and schedule.

        Args:
            nodes: the engine's nodes, read already (off the event loop);
                ``None``: read them now (``engine.nodes()``).

        Returns:
            the devices as the engine reports them (list of dicts).

        Raises:
            EngineError: ``nodes`` is ``None`` and the engine cannot say.
        """
        nodes = self.engine.nodes() if nodes is None else nodes
        reported = {d.uuid: d for node in nodes for d in node.devices}
        self.world.outside = _outside(nodes)
        if len({d.node for d in reported.values()}) == 1 and self.engine.name == "local":
            matrix = tuple(tuple(int(x) for x in row) for row in self.backend.topology())
            self.topology = {nodes[0].name: matrix}
        with self.runner.write() as repo:
            known = {d.uuid: d for d in repo.devices()}
            for uuid, info in reported.items():
                row = known.get(uuid) or Device(uuid=uuid, drained=False)
                row.node, row.index, row.name = info.node, info.index, info.name
                row.memory_total_mib, row.pci_bus_id = info.memory_total_mib, info.pci_bus_id
                row.mig_enabled, row.present = info.mig_enabled, True
                repo.add(row)
            for uuid, row in known.items():
                if uuid not in reported and row.present:
                    self.log.warning("Device %s (%s) is no longer reported", uuid, row.name)
                    row.present = False
            repo.flush()
            self.sharing.refresh_pools(repo)
            self.leave_mig_mode(list(repo.devices()))
            self.schedule(repo, self.runner.now())
        self.notify()
        if self.sharing.apply_mig_modes():
            self.schedule_now()
        return [vars(d) for d in reported.values()]

    def unknown(self, why: str) -> None:
        """The engine cannot say its inventory (Slurm or NVML down at the
        broker's start): every stored device counts as one the engine takes
        no new work on, with ``why`` (:meth:`outside_reason`), until
        :meth:`sync_inventory` reads it. Nothing is released or ended on
        it: leases that hold devices keep them."""
        with self.runner.read() as repo:
            self.world.outside = {d.uuid: OutsideReason(why) for d in repo.devices() if d.present}

    def leave_mig_mode(self, devices: Iterable[Device]) -> None:
        """A device in MIG mode whose pool is not a ``mig`` pool (the pools
        changed since it was switched on) is never granted whole or shared:
        it is drained until nothing holds it, then its MIG mode is turned off
        (as ``PATCH /devices/{uuid} {"mig_mode": false}`` would)."""
        for device in devices:
            spec = self.sharing.pool_spec(device.uuid)
            wrong = device.present and device.mig_enabled and spec.mode != "mig"
            if wrong and device.mig_target is None:
                self.log.warning(
                    "Device %s is in MIG mode but its pool %r is %s: no grants on it; "
                    "MIG mode goes off once nothing holds it",
                    device.uuid,
                    spec.name,
                    spec.mode,
                )
                device.mig_target = False

    @command("broker")
    def rebind_lease(self, lease_id: int, uuids: Sequence[str]) -> list[str]:
        """Record the devices an engine bound granted lease ``lease_id`` to,
        where the engine picks them itself (Slurm binds GPU indices of the
        node of its own choosing: ``--gres`` cannot name them). The lease's
        whole-device allocations move to ``uuids``; another lease holding one
        of them (granted at the same time, its own binding not known yet)
        takes the device this lease leaves, so the count held per node stays
        what the scheduler decided. Both leases' logs get a ``rebound`` note.

        Args:
            lease_id: a granted lease of whole devices.
            uuids: the devices (UUIDs) it is bound to, as many as it holds.

        Returns:
            the lease's devices now (UUIDs, sorted).

        Raises:
            NotFound: no such lease.
            Conflict: the lease is not granted, holds MIG instances or
                shares, ``uuids`` is not as many devices as it holds or names
                one that is unknown or held by a MIG instance or share.
        """
        now = self.runner.now()
        with self.runner.write() as repo:
            lease = lease_or_404(repo, lease_id)
            mine = [a for a in lease.allocations if a.active]
            want = list(dict.fromkeys(uuids))
            if lease.state != LeaseState.granted.value or any(a.kind != "device" for a in mine):
                raise Conflict(f"lease {lease_id}: only a granted lease of whole devices rebinds")
            if len(want) != len(mine) or any(u not in self.world.devices for u in want):
                raise Conflict(f"lease {lease_id} holds {len(mine)} devices, not {want}")
            have = {a.device_uuid for a in mine}
            if set(want) == have:
                return sorted(have)
            moves = self._rebind_moves(repo, lease_id, mine, want)
            for allocation, _ in moves:  # never two active on one device, even mid-way
                allocation.active = False
            repo.flush()
            for allocation, uuid in moves:
                allocation.device = self.world.devices[uuid]
            repo.flush()
            for allocation, _ in moves:
                allocation.active = True
            rec = self.runner.rec(repo, now)
            for other in {a.lease_id for a, _ in moves} - {lease_id}:
                why = f"its devices swapped with lease {lease_id}'s, as its engine bound them"
                rec.note(lease_or_404(repo, other), "rebound", why, {"lease": lease_id})
            rec.note(lease, "rebound", "bound by its engine to " + ", ".join(want), {})
            self.schedule(repo, now)
        self.notify()
        return sorted(want)

    def _rebind_moves(
        self, repo: Repository, lease_id: int, mine: list[Allocation], want: list[str]
    ) -> list[tuple[Allocation, str]]:
        """The allocations to move, and where, to give lease ``lease_id``
        the devices ``want`` (a holder of one takes a device it leaves)."""
        held = {a.device_uuid: a for a in repo.active_allocations(on=want)}
        spare = [a for a in mine if a.device_uuid not in want]
        moves: list[tuple[Allocation, str]] = []
        for uuid in want:
            if any(a.device_uuid == uuid for a in mine):
                continue
            leaving = spare.pop()
            other = held.get(uuid)
            if other is not None and other.lease_id != lease_id:
                if other.kind != "device":
                    raise Conflict(
                        f"device {uuid} is held by a {other.kind} of lease {other.lease_id}"
                    )
                moves.append((other, leaving.device_uuid))
            moves.append((leaving, uuid))
        return moves


def _outside(nodes: Iterable[Node]) -> dict[str, OutsideReason]:
    """The devices an engine takes no new work on, by UUID, with why: every
    device of a node not up, and those something outside the broker holds."""
    found: dict[str, OutsideReason] = {}
    for node in nodes:
        if node.state != "up":
            why = f"node {node.name} is {node.state}" + (f": {node.reason}" if node.reason else "")
            found.update(dict.fromkeys((d.uuid for d in node.devices), OutsideReason(why)))
        found.update(
            {
                uuid: OutsideReason(f"held by {hold.what}", hold.user or "?")
                for uuid, hold in node.outside.items()
            }
        )
    return found
