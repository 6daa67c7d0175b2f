"""Making fractional grants real, and undoing them: MIG instances created and
destroyed through the device backend, shares given their enforcement
environment (framework caps, CUDA MPS). Part of
:class:`gpubroker.core.Broker` (a mixin).

A MIG instance is created when its lease is granted and destroyed when the
lease is released -- after the holder's server has stopped, so an instance
in use is never touched (the driver would refuse anyway: ``NVML_ERROR_IN_USE``).
An instance that cannot be destroyed stays as a *foreign* instance that
occupies its slices; :meth:`SharingOpsMixin.clean_mig` retries.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from .commands import command
from .devices.base import DeviceBackendError
from .devices.mig import Placement
from .devices.models import MODELS
from .enforce import EnforcementError
from .enforce.caps import framework_env
from .errors import BadRequest, NotFound
from .pools import PoolSpec
from .scheduler import Instance, Part, PoolMode
from .store.models import Device, Lease


class SharingOpsMixin:
    """MIG inventory, grant realisation and release clean-up for the broker."""

    backend: Any
    pools: Any
    mps: Any
    framework_caps: bool
    log: Any

    def _init_sharing(self) -> None:
        #: MIG instances present on each MIG-enabled device, from the backend
        self._mig_inventory: dict[str, list[Instance]] = {}
        #: pool of each known device, by UUID
        self._pools: dict[str, PoolSpec] = {}

    def pool_spec(self, uuid: str) -> PoolSpec:
        """The pool of device ``uuid`` (the default pool when unknown)."""
        spec = self._pools.get(uuid)
        if spec is None:
            spec = self.pools.spec(self.pools.default_pool)
        assert spec is not None
        return spec

    def _pool_of(self, devices: Iterable[Device]) -> dict[str, PoolSpec]:
        return dict(self.pools.assign([(d.uuid, d.node, d.index, d.name) for d in devices]))

    def _refresh_pools(self, session: Session) -> None:
        """Recompute each device's pool and re-read the MIG instances."""
        devices = [d for d in session.scalars(select(Device)) if d.present]
        self._pools = self._pool_of(devices)
        inventory: dict[str, list[Instance]] = {}
        for device in devices:
            if device.mig_enabled:
                inventory[device.uuid] = self._read_instances(device.uuid)
        self._mig_inventory = inventory

    def _read_instances(self, uuid: str) -> list[Instance]:
        try:
            found = self.backend.mig_devices(uuid)
        except (DeviceBackendError, KeyError) as err:
            self.log.error("Cannot list the MIG instances of %s: %s", uuid, err)
            return []
        return [
            Instance(m.profile, m.placement.start, m.placement.size, m.uuid, m.memory_mib)
            for m in found
        ]

    # -- grants ------------------------------------------------------------------

    def _realize(self, lease: Lease, parts: tuple[Part, ...]) -> tuple[Part, ...]:
        """Create the MIG instance of a grant (unless it is a static one) and
        set the lease's environment.

        Raises:
            DeviceBackendError: the backend refused to create the instance,
                or the share's enforcement could not be set up (nothing is
                left half-made: instances made are destroyed).
        """
        made: list[Part] = []
        try:
            for part in parts:
                made.append(self._make(part))
            lease.grant_env = self._grant_env(lease, tuple(made))
        except (DeviceBackendError, EnforcementError, ValueError) as err:
            for part in made:
                if part.kind == "mig" and part.instance and not self._is_static(part.device):
                    self._destroy(part.device, part.instance)
            if isinstance(err, RuntimeError):
                raise
            raise DeviceBackendError(str(err)) from err
        return tuple(made)

    def _is_static(self, device: str) -> bool:
        spec = self._pools.get(device)
        return spec is not None and spec.mig_layout == "static"

    def _make(self, part: Part) -> Part:
        if part.kind != "mig" or part.instance:
            return part
        created = self.backend.create_mig_device(
            part.device, part.profile, Placement(part.start, part.size)
        )
        self.log.info(
            "Created MIG %s %s at %s on %s",
            created.profile,
            created.uuid,
            created.placement,
            part.device,
        )
        self._mig_inventory.setdefault(part.device, []).append(
            Instance(
                created.profile,
                created.placement.start,
                created.placement.size,
                created.uuid,
                created.memory_mib,
            )
        )
        return Part(
            part.device,
            part.kind,
            part.weight,
            part.profile,
            part.start,
            part.size,
            created.memory_mib,
            created.uuid,
        )

    def _grant_env(self, lease: Lease, parts: tuple[Part, ...]) -> dict[str, str]:
        """Environment of a fractional grant: the MIG UUIDs, or the shared
        devices plus the share's caps (framework caps; MPS when enabled and
        the lease has one share)."""
        visible = ",".join(p.instance if p.kind == "mig" else p.device for p in parts)
        env = {
            "CUDA_VISIBLE_DEVICES": visible,
            "NVIDIA_VISIBLE_DEVICES": visible,
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "GPUBROKER_LEASE_ID": str(lease.id),
        }
        shares = [p for p in parts if p.kind == "share"]
        if not shares:
            return env
        share = shares[0]
        device = self._session_of(lease).get(Device, share.device)  # type: ignore[attr-defined]
        assert device is not None
        total = device.memory_total_mib
        env["GPUBROKER_SHARE_MEMORY_MIB"] = str(share.memory_mib)
        if self.framework_caps:
            env.update(framework_env(share.memory_mib, total))
        if self.mps.enabled and len(shares) == 1:
            self.mps.ensure_daemon(share.device)
            percent = max(1, min(100, math.ceil(100 * share.memory_mib / total)))
            env.update(self.mps.client_env(share.device, share.memory_mib, percent))
        return env

    def _lost_instances(self, lease: Lease) -> list[str]:
        """MIG instances ``lease`` holds that its device no longer has."""
        return [
            a.instance_uuid
            for a in lease.allocations
            if a.active
            and a.kind == "mig"
            and a.instance_uuid
            and a.instance_uuid not in {i.uuid for i in self._mig_inventory.get(a.device_uuid, [])}
        ]

    # -- releases ----------------------------------------------------------------

    def _unrealize(self, lease: Lease) -> None:
        """Destroy the on-demand MIG instances a released lease held."""
        for allocation in lease.allocations:
            if (
                allocation.active
                and allocation.kind == "mig"
                and allocation.instance_uuid
                and not self._is_static(allocation.device_uuid)
            ):
                self._destroy(allocation.device_uuid, allocation.instance_uuid)

    def _destroy(self, device: str, instance: str) -> bool:
        try:
            self.backend.destroy_mig_device(device, instance)
        except (DeviceBackendError, KeyError) as err:
            self.log.error("Cannot destroy MIG instance %s on %s: %s", instance, device, err)
            return False
        self.log.info("Destroyed MIG instance %s on %s", instance, device)
        self._mig_inventory[device] = [
            i for i in self._mig_inventory.get(device, []) if i.uuid != instance
        ]
        return True

    def clean_mig(self, session: Session) -> list[str]:
        """Destroy MIG instances on on-demand devices that no active lease
        holds (left by a failed destroy or made by hand). Returns their UUIDs."""
        held = {
            a.instance_uuid
            for x in self._world.active()  # type: ignore[attr-defined]
            for a in x.allocations
            if a.active and a.instance_uuid is not None
        }
        destroyed = []
        for device, instances in list(self._mig_inventory.items()):
            spec = self._pools.get(device)
            if spec is None or spec.mode != PoolMode.mig.value or spec.mig_layout == "static":
                continue
            for instance in list(instances):
                if instance.uuid not in held and self._destroy(device, instance.uuid):
                    destroyed.append(instance.uuid)
        return destroyed

    # -- shares ------------------------------------------------------------------

    def share_caps(self) -> list[tuple[Lease, str, int]]:
        """``(lease, device UUID, cap MiB)`` of every share held now (detached
        lease rows), for the memory watchdog."""
        return [
            (x, a.device_uuid, a.memory_mib or 0)
            for x in self._world.active()  # type: ignore[attr-defined]
            if x.state == "granted"
            for a in x.allocations
            if a.active and a.kind == "share"
        ]

    @command("scheduler")
    def housekeep_mig(self) -> None:
        """Apply MIG mode changes asked for, and destroy left-over instances
        (run by the broker's scheduling loop)."""
        if self.apply_mig_modes():
            self.schedule_now()  # type: ignore[attr-defined]
        with self._read() as session:  # type: ignore[attr-defined]
            if self.clean_mig(session):
                self.schedule_now()  # type: ignore[attr-defined]

    # -- MIG mode: an admin drain operation ------------------------------------------

    @command("admin")
    def request_mig_mode(self, uuid: str, enabled: bool) -> dict[str, Any]:
        """Ask for MIG mode ``enabled`` on device ``uuid``: the device takes no
        new grants and the mode changes once nothing holds it
        (:meth:`apply_mig_modes`, run by the scheduling loop and here).

        Returns:
            ``{"uuid", "mig_enabled", "mig_target"}`` after the attempt.

        Raises:
            NotFound: no such device.
            BadRequest: the model does not support MIG.
        """
        with self._write() as session:  # type: ignore[attr-defined]
            device = session.get(Device, uuid)
            if device is None:
                raise NotFound(f"device {uuid}: no such device")
            model = MODELS.get(device.name)
            if enabled and model is not None and not model.mig_capable:
                raise BadRequest(f"mig_mode: {device.name} does not support MIG")
            device.mig_target = None if device.mig_enabled == enabled else enabled
        if self.apply_mig_modes():
            self.schedule_now()  # type: ignore[attr-defined]
        with self._read() as session:  # type: ignore[attr-defined]
            device = session.get(Device, uuid)
            assert device is not None
            return {
                "uuid": uuid,
                "mig_enabled": device.mig_enabled,
                "mig_target": device.mig_target,
            }

    def apply_mig_modes(self) -> list[str]:
        """Change the MIG mode of every device an admin asked for, once no
        active lease holds any of its slots. Returns the UUIDs changed."""
        changed = []
        with self._write() as session:  # type: ignore[attr-defined]
            world = self._world  # type: ignore[attr-defined]
            targets = [d for d in world.devices.values() if d.mig_target is not None]
            if not targets:
                return changed
            busy = {a.device_uuid for x in world.active() for a in x.allocations if a.active}
            for device in targets:
                if device.uuid in busy:
                    continue
                for instance in self._mig_inventory.get(device.uuid, []):
                    self._destroy(device.uuid, instance.uuid)
                try:
                    self.backend.set_mig_mode(device.uuid, bool(device.mig_target))
                except DeviceBackendError as err:
                    self.log.error("Cannot set MIG mode of %s: %s", device.uuid, err)
                    continue
                self.log.warning("MIG mode of %s is now %s", device.uuid, device.mig_target)
                device.mig_enabled = bool(device.mig_target)
                device.mig_target = None
                changed.append(device.uuid)
            if changed:
                session.flush()
                self._refresh_pools(session)
        return changed
