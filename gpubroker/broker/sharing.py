"""Making fractional grants real, and undoing them: MIG instances created and
destroyed through the device backend, shares given their enforcement
environment (framework caps, CUDA MPS), the MIG inventory and each device's
pool. A part of the broker (:class:`gpubroker.core.Broker` delegates to it).

A MIG instance is created when its lease is granted and destroyed when the
lease is released -- after the holder's server has stopped, so an instance
in use is never touched (the driver would refuse anyway: ``NVML_ERROR_IN_USE``).
An instance that cannot be destroyed stays as a *foreign* instance that
occupies its slices; :meth:`SharingOps.clean_mig` retries.
"""

from __future__ import annotations

import datetime as dt
import functools
import math
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..commands import command
from ..devices import mig
from ..devices.base import DeviceBackend, DeviceBackendError
from ..devices.mig import Placement
from ..devices.models import MODELS
from ..enforce import EnforcementError
from ..enforce.caps import framework_env
from ..enforce.mps import MPSControl
from ..errors import BadRequest, Conflict, NotFound
from ..model.holdings import LeaseRef
from ..passes import PREPARING, grant_parts, set_wait
from ..pools import Pools, PoolSpec
from ..scheduler import Instance, Part, PoolMode, Running
from ..store.models import Device, Lease
from ..store.repository import Repository
from .actuator import Actuator
from .queries import lease_ref
from .runner import CommandRunner
from .world import World


class MigModeRefused(DeviceBackendError):
    """The device refused a MIG mode change (:meth:`SharingOps._switch_mig_mode`).

    Attributes:
        instances: the MIG instances left on the device, listed by the
            worker after the refusal (none when MIG mode is off).
    """

    def __init__(self, message: str, instances: list[Instance]) -> None:
        super().__init__(message)
        self.instances = instances


def mig_mode_key(uuid: str) -> str:
    """The actuator's key of device ``uuid``'s MIG mode change."""
    return f"MIG mode of {uuid}"


class SharingOps:
    """MIG inventory, device pools, grant realisation and release clean-up.

    Args:
        runner: the broker's command runner.
        world: the broker's state in memory.
        backend: the device backend (MIG instances, MIG mode).
        pools: the pools' configuration.
        mps: CUDA MPS control, for shares.
        framework_caps: whether shares' servers get the framework caps
            (``Broker.framework_caps``).
        framework_context_mib: MiB of a share left to the CUDA context
            outside the frameworks' allocators (``Broker.framework_context_mib``).
        retry_backoff: seconds before a failed grant is tried again
            (``Broker.grant_retry_backoff``).
        schedule: run or ask for a scheduling pass in the open
            transaction (:meth:`Scheduling.schedule`).
        schedule_now: a scheduling pass of its own (``Broker.schedule_now``).
        notify: wake the long-polls of changed leases.
        log: the broker's logger.
    """

    def __init__(
        self,
        runner: CommandRunner,
        world: World,
        backend: DeviceBackend,
        pools: Pools,
        mps: MPSControl,
        framework_caps: Callable[[], bool],
        retry_backoff: Callable[[], float],
        schedule: Callable[[Repository, dt.datetime], None],
        schedule_now: Callable[[], None],
        notify: Callable[[], None],
        log: Any,
        framework_context_mib: Callable[[], int] = lambda: 0,
    ) -> None:
        self.runner = runner
        self._world = world
        self.backend = backend
        self.pools = pools
        self.mps = mps
        self.framework_caps = framework_caps
        self.framework_context_mib = framework_context_mib
        self.retry_backoff = retry_backoff
        self.schedule = schedule
        self.schedule_now = schedule_now
        self.notify = notify
        self.log = log
        #: MIG instances present on each MIG-enabled device, from the backend
        self._mig_inventory: dict[str, list[Instance]] = {}
        #: pool of each known device, by UUID
        self._pools: dict[str, PoolSpec] = {}
        #: set by the service: makes and destroys MIG instances off the event
        #: loop (None: inside the command, as the unit tests and CLI do)
        self.actuator: Actuator | None = None
        #: grants whose MIG instances are being made: lease id -> parts
        self._preparing: dict[int, tuple[Part, ...]] = {}
        #: when each grant of :attr:`_preparing` began to be made (aware UTC)
        self._preparing_since: dict[int, dt.datetime] = {}
        #: leases whose instance could not be made: lease id -> (failures,
        #: monotonic time before which no new try is made)
        self.retry_after: dict[int, tuple[int, float]] = {}

    @property
    def mig_inventory(self) -> Mapping[str, list[Instance]]:
        """The MIG instances present on each MIG-enabled device (read only)."""
        return self._mig_inventory

    @property
    def device_pools(self) -> Mapping[str, PoolSpec]:
        """The pool of each known device, by UUID (read only)."""
        return self._pools

    @property
    def preparing(self) -> Mapping[int, tuple[Part, ...]]:
        """Grants whose MIG instances are being made or MPS daemon started:
        lease id -> parts (read only)."""
        return self._preparing

    def scheduler_instances(self) -> dict[str, list[Instance]]:
        """The MIG instances the scheduler sees, by device: those present
        and those being made (:meth:`preparing_instances`)."""
        instances = {uuid: list(found) for uuid, found in self._mig_inventory.items()}
        for uuid, planned in self.preparing_instances().items():
            instances.setdefault(uuid, []).extend(planned)
        return instances

    def preparing_running(self) -> tuple[Running, ...]:
        """The pending leases whose grant is being made (:attr:`preparing`),
        as the running leases they are about to become: for the scheduler,
        what they will hold is taken from the start of the making (shares'
        memory, MIG slices, quotas), so no pass hands it out again
        meanwhile. A lease cancelled meanwhile is left out (its share holds
        nothing; an instance made for it is destroyed again)."""
        found = []
        for lease_id, parts in self._preparing.items():
            lease = self._world.leases.get(lease_id)
            if lease is None or lease.state != "pending":
                continue
            found.append(
                Running(
                    lease_id=lease_id,
                    user=lease.user,
                    devices=(),
                    started=self._preparing_since.get(lease_id, lease.created),
                    group=lease.group_name,
                    priority_class=lease.priority_class,
                    parts=parts,
                )
            )
        return tuple(found)

    def forget_retry(self, lease_id: int) -> None:
        """Drop the backoff of ``lease_id`` (it is released)."""
        self.retry_after.pop(lease_id, None)

    def pool_spec(self, uuid: str) -> PoolSpec:
        """The pool of device ``uuid`` (the default pool when unknown)."""
        spec = self._pools.get(uuid)
        if spec is None:
            spec = self.pools.spec(self.pools.default_pool)
        assert spec is not None
        return spec

    def _pool_of(self, devices: Iterable[Device]) -> dict[str, PoolSpec]:
        return dict(self.pools.assign([(d.uuid, d.node, d.index, d.name) for d in devices]))

    def refresh_pools(self, repo: Repository) -> None:
        """Recompute each device's pool and re-read every MIG-enabled
        device's instances through the backend (at start-up and when the
        inventory is read again)."""
        devices = self._assign_pools(repo)
        self._mig_inventory = {
            d.uuid: self._read_instances(d.uuid) for d in devices if d.mig_enabled
        }

    def recompute_pools(self, repo: Repository, read: Mapping[str, list[Instance]]) -> None:
        """Recompute each device's pool after MIG mode changes, without
        device I/O: ``read`` holds the instances of the changed devices
        (listed off the event loop, by the change's worker); the others keep
        the instances known."""
        devices = self._assign_pools(repo)
        known = self._mig_inventory
        self._mig_inventory = {
            d.uuid: list(read.get(d.uuid, known.get(d.uuid, []))) for d in devices if d.mig_enabled
        }

    def _assign_pools(self, repo: Repository) -> list[Device]:
        """Each present device's pool (and whether some pool is a batch
        pool, which interactive requests keep off); returns those devices."""
        devices = [d for d in repo.devices() if d.present]
        self._pools = self._pool_of(devices)
        batch = any(spec.purpose == "batch" for spec in self._pools.values())
        inputs = self._world.inputs
        if inputs.batch_pools != batch:  # interactive requests keep off batch pools
            inputs.batch_pools = batch
            inputs.forget()
        return devices

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
            self._learn_instances(parts)
            if isinstance(err, RuntimeError):
                raise
            raise DeviceBackendError(str(err)) from err
        return tuple(made)

    def prepare(self, lease: Lease, parts: tuple[Part, ...]) -> tuple[Part, ...] | None:
        """Realise a fractional grant: at once (:meth:`_realize`) when
        nothing is to be made or started or there is no actuator; else make
        its MIG instances, or start the MPS daemon its share needs, off the
        event loop and return ``None`` (the lease waits, reason
        ``Preparing``, until :meth:`_prepared` commits the outcome).

        Raises:
            DeviceBackendError: as :meth:`_realize`.
        """
        to_make = [p for p in parts if p.kind == "mig" and not p.instance]
        daemon = self._daemon_to_start(parts)
        if self.actuator is None or not (to_make or daemon):
            return self._realize(lease, parts)
        not_before = self.retry_after.get(lease.id, (0, 0.0))[1]
        if time.monotonic() < not_before:
            return None  # keeps the failure as its wait; tried after the backoff
        self._preparing[lease.id] = parts
        self._preparing_since[lease.id] = self.runner.now()
        lease_id = lease.id
        self.actuator.submit(
            f"preparing lease {lease_id}",
            lambda: self._make_ready(parts, daemon),
            lambda made, err: self._prepared(lease_id, made, err),
        )
        what = ", ".join(f"making MIG {p.profile} on {p.device}" for p in to_make)
        if daemon:
            what = f"starting the MPS daemon of {daemon}"
        set_wait(lease, PREPARING, what, inputs=self._world.inputs)
        return None

    def _daemon_to_start(self, parts: tuple[Part, ...]) -> str | None:
        """The device whose MPS daemon a grant of ``parts`` needs started
        (MPS on, exactly one share, no daemon of ours running there), or
        ``None``."""
        shares = [p for p in parts if p.kind == "share"]
        if not self.mps.enabled or len(shares) != 1:
            return None
        device = shares[0].device
        if device in self.mps.started and self.mps.daemon_state(device) != "stale":
            return None
        return device

    def _make_ready(self, parts: tuple[Part, ...], daemon: str | None) -> tuple[Part, ...]:
        """What a worker thread does for a grant: make its MIG instances
        (:meth:`_make_all`) and start the MPS daemon of ``daemon``.

        Raises:
            DeviceBackendError: an instance was refused, or the daemon did
                not start (its reason in the message).
        """
        made = self._make_all(parts)
        if daemon is not None:
            try:
                self.mps.ensure_daemon(daemon)
            except (EnforcementError, ValueError) as err:
                raise DeviceBackendError(str(err)) from err
        return made

    @command("scheduler")
    def _prepared(
        self, lease_id: int, made: tuple[Part, ...] | None, err: BaseException | None
    ) -> None:
        """Commit the outcome of making a grant's MIG instances (on the event
        loop): the grant; or the failure as a ``grant-failed`` event, the
        request waiting on and tried again after a backoff
        (``grant_retry_backoff`` seconds, doubling, at most 60 s); or, for
        a request cancelled meanwhile, the instances destroyed again
        (nothing is left half-made). A share's device is checked again
        first (:meth:`_share_room_problem`): a grant it has no room for any
        more fails as above instead of over-committing the device."""
        parts = self._preparing.pop(lease_id, ())
        self._preparing_since.pop(lease_id, None)
        now = self.runner.now()
        world = self._world
        with self.runner.write() as repo:
            found = world.leases.get(lease_id)
            lease = found if found is not None and found.state == "pending" else None
            rec = self.runner.rec(repo, now, "scheduler")
            if err is None and made is not None and lease is not None:
                problem = self._share_room_problem(lease, made)
                if problem is not None:
                    err = DeviceBackendError(problem)
            if err is not None or made is None:
                if lease is not None:
                    self._failed(lease, err, rec, made or parts)
            else:
                known = {i.uuid for found in self._mig_inventory.values() for i in found}
                for part in made:
                    if part.kind == "mig" and part.instance not in known:
                        self._remember(part)
                if lease is None:  # cancelled meanwhile
                    for part in made:
                        if part.kind == "mig" and not self._is_static(part.device):
                            self._destroy_later(part.device, part.instance)
                else:
                    self.retry_after.pop(lease_id, None)
                    lease.grant_env = self._grant_env(lease, made)
                    grant_parts(repo, lease, made, now, rec)
            self.schedule(repo, now)
        self.notify()

    def _share_room_problem(self, lease: Lease, parts: tuple[Part, ...]) -> str | None:
        """Why ``parts``' shares no longer fit their devices (in service,
        share room ``memory_total_mib`` less the pool's reserve, MiB, less
        the shares granted there to other leases), or ``None`` when they
        fit: checked when a prepared grant is committed."""
        for part in parts:
            if part.kind != "share":
                continue
            device = self._world.devices.get(part.device)
            if device is None or not device.present:
                return f"device {part.device} is no longer in the inventory"
            room = device.memory_total_mib - self.pool_spec(part.device).reserve_mib
            used = sum(
                a.memory_mib or 0
                for x in self._world.active()
                if x.state == "granted" and x.id != lease.id
                for a in x.allocations
                if a.active and a.kind == "share" and a.device_uuid == part.device
            )
            if used + part.memory_mib > room:
                return (
                    f"device {part.device} has {max(room - used, 0)} MiB of share room left,"
                    f" less than the {part.memory_mib} MiB asked"
                )
        return None

    def _failed(
        self, lease: Lease, err: BaseException | None, rec: Any, parts: tuple[Part, ...] = ()
    ) -> None:
        """Record a failed making of ``lease``'s instances, and its backoff;
        re-read the MIG instances of the devices of its MIG ``parts``
        (:meth:`_learn_instances`): one made outside the broker is learned,
        so the next pass places the request elsewhere or tells the true
        reason it waits."""
        self._learn_instances(parts)
        failures = self.retry_after.get(lease.id, (0, 0.0))[0] + 1
        delay = min(60.0, self.retry_backoff() * 2.0 ** (failures - 1))
        self.retry_after[lease.id] = (failures, time.monotonic() + delay)
        rec.note(lease, "grant-failed", str(err), {"failures": failures})
        set_wait(
            lease,
            "Resources",
            f"waiting: {err}; tried again in {delay:g} s",
            inputs=self._world.inputs,
        )

    def _make_all(self, parts: tuple[Part, ...]) -> tuple[Part, ...]:
        """Make every MIG instance of ``parts`` (in a worker thread: only
        backend calls here). On a failure the ones made are destroyed again.

        Raises:
            DeviceBackendError: the backend refused one.
        """
        made: list[Part] = []
        try:
            for part in parts:
                made.append(
                    self._create(part) if part.kind == "mig" and not part.instance else part
                )
        except (DeviceBackendError, ValueError) as err:
            for part in made:
                if part.kind == "mig" and part.instance and not self._is_static(part.device):
                    try:
                        self.backend.destroy_mig_device(part.device, part.instance)
                    except (DeviceBackendError, KeyError) as undo:
                        self.log.error("Cannot undo MIG instance %s: %s", part.instance, undo)
            raise DeviceBackendError(str(err)) from err
        return tuple(made)

    def _create(self, part: Part) -> Part:
        """Create ``part``'s MIG instance on the backend; the part with its UUID."""
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

    def _remember(self, part: Part) -> None:
        """Add a made MIG instance to the in-memory inventory."""
        self._mig_inventory.setdefault(part.device, []).append(
            Instance(part.profile, part.start, part.size, part.instance, part.memory_mib)
        )

    def _learn_instances(self, parts: Iterable[Part]) -> None:
        """Re-read the MIG instances of the devices of ``parts``' MIG parts
        through the backend, after a make failed there (an instance made by
        hand, unknown to the inventory, may have been in the way). A device
        that cannot be listed keeps the instances known."""
        for device in sorted({p.device for p in parts if p.kind == "mig"}):
            if device not in self._mig_inventory:
                continue
            try:
                found = self.backend.mig_devices(device)
            except (DeviceBackendError, KeyError) as err:
                self.log.error("Cannot list the MIG instances of %s: %s", device, err)
                continue
            read = [
                Instance(m.profile, m.placement.start, m.placement.size, m.uuid, m.memory_mib)
                for m in found
            ]
            new = {i.uuid for i in read} - {i.uuid for i in self._mig_inventory[device]}
            if new:
                self.log.warning(
                    "MIG instance(s) %s on %s were not made by the broker: their slices are taken",
                    ", ".join(sorted(new)),
                    device,
                )
            self._mig_inventory[device] = read

    def preparing_instances(self) -> dict[str, list[Instance]]:
        """The MIG instances being made, by device (they occupy their
        slices for the scheduler until made or given up)."""
        planned: dict[str, list[Instance]] = {}
        for lease_id, parts in self._preparing.items():
            for p in parts:
                if p.kind == "mig" and not p.instance:
                    uuid = f"in-flight:{lease_id}:{p.start}"
                    planned.setdefault(p.device, []).append(
                        Instance(p.profile, p.start, p.size, uuid, p.memory_mib)
                    )
        return planned

    def _is_static(self, device: str) -> bool:
        spec = self._pools.get(device)
        return spec is not None and spec.mig_layout == "static"

    def _make(self, part: Part) -> Part:
        if part.kind != "mig" or part.instance:
            return part
        made = self._create(part)
        self._remember(made)
        return made

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
        device = self._world.repo.device(share.device)
        assert device is not None
        total = device.memory_total_mib
        env["GPUBROKER_SHARE_MEMORY_MIB"] = str(share.memory_mib)
        if self.framework_caps():
            context = self.framework_context_mib()
            env.update(framework_env(share.memory_mib, total, context_mib=context))
        if self.mps.enabled and len(shares) == 1:
            self.mps.ensure_daemon(share.device)
            percent = max(1, min(100, math.ceil(100 * share.memory_mib / total)))
            env.update(self.mps.client_env(share.device, share.memory_mib, percent))
        return env

    def lost_instances(self, lease: Lease) -> list[str]:
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

    def unrealize(self, lease: Lease) -> None:
        """Destroy the on-demand MIG instances a released lease held."""
        for allocation in lease.allocations:
            if (
                allocation.active
                and allocation.kind == "mig"
                and allocation.instance_uuid
                and not self._is_static(allocation.device_uuid)
            ):
                self._destroy_later(allocation.device_uuid, allocation.instance_uuid)

    def _destroy_later(self, device: str, instance: str) -> None:
        """Destroy a MIG instance no lease holds any more: off the event loop
        with an actuator (retried with backoff; until it is gone it occupies
        its slices, and a failure leaves it to :meth:`clean_mig`), else now."""
        if self.actuator is None:
            self._destroy(device, instance)
            return
        self.actuator.submit(
            f"destroying MIG instance {instance}",
            lambda: self._destroy_or_gone(device, instance),
            lambda _result, err: self._destroyed(device, instance, err),
            retry=True,
        )

    def _destroy_or_gone(self, device: str, instance: str) -> None:
        """Destroy ``instance`` (in the actuator's thread); an instance
        already gone counts as destroyed (:meth:`_gone`).

        Raises:
            KeyError, DeviceBackendError: it could not be destroyed.
        """
        try:
            self.backend.destroy_mig_device(device, instance)
        except KeyError as err:
            if not self._gone(device, instance, err):
                raise

    def _destroyed(self, device: str, instance: str, err: BaseException | None) -> None:
        """The outcome of :meth:`_destroy_later`, on the event loop."""
        if err is not None:
            self.log.error("Cannot destroy MIG instance %s on %s: %s", instance, device, err)
            return
        self.log.info("Destroyed MIG instance %s on %s", instance, device)
        self._mig_inventory[device] = [
            i for i in self._mig_inventory.get(device, []) if i.uuid != instance
        ]
        self.schedule_now()  # its slices are free

    def _destroy(self, device: str, instance: str) -> bool:
        try:
            self.backend.destroy_mig_device(device, instance)
        except (DeviceBackendError, KeyError) as err:
            if not self._gone(device, instance, err):
                self.log.error("Cannot destroy MIG instance %s on %s: %s", instance, device, err)
                return False
        else:
            self.log.info("Destroyed MIG instance %s on %s", instance, device)
        self._mig_inventory[device] = [
            i for i in self._mig_inventory.get(device, []) if i.uuid != instance
        ]
        return True

    def _gone(self, device: str, instance: str, err: BaseException) -> bool:
        """Whether a destroy that raised ``err`` found the instance already
        gone (destroyed by hand, or by a GPU reset): the backend knows the
        device and does not list the instance; logged. Then it is as good
        as destroyed, rather than retried and logged as an error for ever.
        """
        if not isinstance(err, KeyError):
            return False
        try:
            present = {d.uuid for d in self.backend.mig_devices(device)}
        except (DeviceBackendError, KeyError):
            return False  # the device itself is unknown, or cannot be read
        if instance in present:
            return False
        self.log.warning(
            "MIG instance %s on %s was already gone (not listed by the device backend)",
            instance,
            device,
        )
        return True

    def clean_mig(self) -> list[str]:
        """Destroy MIG instances on on-demand devices that no active lease
        holds (left by a failed destroy or made by hand). Returns their UUIDs."""
        held = {
            a.instance_uuid
            for x in self._world.active()
            for a in x.allocations
            if a.active and a.instance_uuid is not None
        }
        destroyed = []
        # an instance being made for a grant is nobody's yet: leave its device be
        making = {p.device for parts in self._preparing.values() for p in parts}
        for device, instances in list(self._mig_inventory.items()):
            if device in making:
                continue
            spec = self._pools.get(device)
            if spec is None or spec.mode != PoolMode.mig.value or spec.mig_layout == "static":
                continue
            for instance in list(instances):
                if instance.uuid not in held and self._destroy(device, instance.uuid):
                    destroyed.append(instance.uuid)
        return destroyed

    # -- shares ------------------------------------------------------------------

    def share_caps(self) -> list[tuple[LeaseRef, str, int]]:
        """``(lease, device UUID, cap MiB)`` of every share held now (the
        lease as a picture taken now), for the memory watchdog."""
        found = []
        for x in self._world.active():
            if x.state != "granted":
                continue
            shares = [a for a in x.allocations if a.active and a.kind == "share"]
            if shares:
                ref = lease_ref(x)
                found += [(ref, a.device_uuid, a.memory_mib or 0) for a in shares]
        return found

    @command("scheduler")
    def housekeep_mig(self) -> None:
        """Apply MIG mode changes asked for, and destroy left-over instances
        (run by the broker's scheduling loop)."""
        if self.apply_mig_modes():
            self.schedule_now()
        with self.runner.read():
            if self.clean_mig():
                self.schedule_now()

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
            Conflict: the device is absent from the inventory, or a change
                of its MIG mode to the other mode runs now (it cannot be
                reversed until done: the switch would destroy what a grant
                got meanwhile).
            BadRequest: the model does not support MIG or is not in the MIG
                catalogue (:func:`gpubroker.devices.mig.spec_for`), or MIG
                mode on for a device outside a pool of mode ``mig`` (no
                request could use its instances: it would only stop being
                granted whole).
        """
        with self.runner.write() as repo:
            device = repo.device(uuid)
            if device is None:
                raise NotFound(f"device {uuid}: no such device")
            if not device.present:
                raise Conflict(
                    f"mig_mode: device {uuid} is absent from the inventory (not seen at the"
                    " last inventory read); its MIG mode cannot change"
                )
            key = mig_mode_key(uuid)
            if self.actuator is not None and self.actuator.busy(key):
                under_way = device.mig_target
                if under_way is None or bool(under_way) != enabled:
                    now = "on" if under_way else "off"
                    raise Conflict(
                        f"mig_mode: the MIG mode of device {uuid} is being turned {now} now;"
                        " ask again once that change is done"
                    )
            model = MODELS.get(device.name)
            if enabled and model is not None and not model.mig_capable:
                raise BadRequest(f"mig_mode: {device.name} does not support MIG")
            if enabled and mig.spec_for(device.name) is None:
                raise BadRequest(
                    f"mig_mode: device {uuid} is a {device.name}, which is not in the MIG"
                    f" catalogue (it has: {', '.join(mig.SPECS)})"
                )
            pool = self.pool_spec(uuid)
            if enabled and pool.mode != "mig":
                raise BadRequest(
                    f"mig_mode: device {uuid} is in pool {pool.name!r} of mode {pool.mode};"
                    " MIG mode goes on only in pools of mode mig (Pools.pools)"
                )
            device.mig_target = None if device.mig_enabled == enabled else enabled
            self.runner.audit(repo, "device-mig", uuid, {"mig_mode": enabled})
        if self.apply_mig_modes():
            self.schedule_now()
        return self.mig_mode_view(uuid)

    def mig_mode_view(self, uuid: str) -> dict[str, Any]:
        """``{"uuid", "mig_enabled", "mig_target"}`` of a known device."""
        device = self._world.devices[uuid]
        return {"uuid": uuid, "mig_enabled": device.mig_enabled, "mig_target": device.mig_target}

    async def after_mig_mode(self, view: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
        """The answer of :meth:`request_mig_mode` once a change it started
        off the event loop has finished (at most ``timeout`` seconds; then
        the device as it stands, its ``mig_target`` still set)."""
        uuid = str(view["uuid"])
        if self.actuator is None or not self.actuator.busy(mig_mode_key(uuid)):
            return view
        await self.actuator.settled(mig_mode_key(uuid), timeout)
        return self.mig_mode_view(uuid)

    def apply_mig_modes(self) -> list[str]:
        """Change the MIG mode of every device an admin asked for, once no
        active lease holds any of its slots. Returns the UUIDs changed now.

        With an actuator (the service), the device calls (destroying the
        device's instances, then setting the mode: NVML takes seconds for
        it) run off the event loop, and the outcome is committed by
        :meth:`_mig_mode_done`, so nothing is changed now and ``[]`` is
        returned; until then the device keeps its ``mig_target`` and takes
        no grants. Without one (unit tests, the CLI) they run here."""
        changed: list[str] = []
        read: dict[str, list[Instance]] = {}
        with self.runner.write() as repo:
            world = self._world
            targets = [d for d in world.devices.values() if d.mig_target is not None]
            if not targets:
                return changed
            busy = {a.device_uuid for x in world.active() for a in x.allocations if a.active}
            busy |= {p.device for parts in self._preparing.values() for p in parts}
            for device in targets:
                if device.uuid in busy or not device.present:
                    continue  # held; or absent: the backend does not know it
                uuid, target = device.uuid, bool(device.mig_target)
                instances = [i.uuid for i in self._mig_inventory.get(uuid, [])]
                if self.actuator is not None:
                    self.actuator.submit(
                        mig_mode_key(uuid),
                        functools.partial(self._switch_mig_mode, uuid, target, instances),
                        functools.partial(self._mig_mode_done, uuid, target),
                    )
                    continue
                try:
                    read[uuid] = self._switch_mig_mode(uuid, target, instances)
                except MigModeRefused as err:
                    self.log.error("Cannot set MIG mode of %s: %s", uuid, err)
                    continue
                self._mig_mode_set(device, target)
                changed.append(uuid)
            if changed:
                repo.flush()
                self.recompute_pools(repo, read)
        return changed

    def _switch_mig_mode(self, uuid: str, target: bool, instances: list[str]) -> list[Instance]:
        """The device calls of a MIG mode change: destroy ``instances``
        (those the broker knows of on the device), then set the mode
        (NVML's rule: no instance may exist when MIG mode changes), then
        list the device's instances as they are now. Runs in a worker
        thread with an actuator; touches no broker state.

        Returns:
            the device's MIG instances after the change (none when MIG
            mode went off).

        Raises:
            MigModeRefused: the mode cannot be set (an instance that could
                not be destroyed makes the mode change fail, or the backend
                does not know the device); it carries the instances left
                on the device (MIG mode still on) or none.
        """
        for instance in instances:
            try:
                self.backend.destroy_mig_device(uuid, instance)
            except (DeviceBackendError, KeyError) as err:
                self.log.error("Cannot destroy MIG instance %s on %s: %s", instance, uuid, err)
        try:
            self.backend.set_mig_mode(uuid, target)
        except KeyError:
            raise MigModeRefused(f"device {uuid} is not known to the device backend", []) from None
        except DeviceBackendError as err:
            # the mode is unchanged: MIG is on exactly when it was to go off
            left = self._read_instances(uuid) if not target else []
            raise MigModeRefused(str(err), left) from err
        return self._read_instances(uuid) if target else []

    def _mig_mode_set(self, device: Device, target: bool) -> None:
        """Record that ``device``'s MIG mode is now ``target`` (inside a
        write; the caller then recomputes the pools and MIG inventory)."""
        self.log.warning("MIG mode of %s is now %s", device.uuid, target)
        device.mig_enabled = target
        if device.mig_target is not None and bool(device.mig_target) == target:
            device.mig_target = None  # an admin may have asked otherwise meanwhile

    @command("scheduler")
    def _mig_mode_done(
        self,
        uuid: str,
        target: bool,
        found: list[Instance] | None,
        err: BaseException | None,
    ) -> None:
        """The outcome of an off-loop MIG mode change, on the event loop: on
        success the mode is committed, the pools recomputed with the
        instances the worker listed (no device call here) and a pass runs
        (the device's slots changed); on failure it is logged, the device
        keeps its target (the scheduling loop's next housekeeping tries
        again) and the instances left, as the worker listed them, are kept."""
        if err is not None:
            self.log.error("Cannot set MIG mode of %s: %s", uuid, err)
            device = self._world.devices.get(uuid)
            if device is not None and device.mig_enabled and isinstance(err, MigModeRefused):
                self._mig_inventory[uuid] = list(err.instances)
            return
        with self.runner.write() as repo:
            device = self._world.devices.get(uuid)
            if device is None:
                return
            self._mig_mode_set(device, target)
            repo.flush()
            self.recompute_pools(repo, {uuid: found or []})
        self.schedule_now()
