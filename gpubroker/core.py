"""The broker core: every state change is one command and one transaction.

The REST handlers, the reconciliation loop, the culler and the watchdog
change state only through :class:`Broker`. The broker's state lives in
memory (:class:`~gpubroker.broker.world.World`: devices, active leases,
usage, quotas, open intents, loaded once at start-up); each command changes
it inside one write-through transaction, which the store commits before the
command answers. A command asks for a scheduling pass
(:mod:`gpubroker.scheduler`), which runs inside it when the broker is idle
or, under load, once for many commands (:mod:`gpubroker.broker.passloop`);
then the long-polls whose lease changed are woken.

The broker runs on one asyncio event loop and the commands are synchronous,
so two changes never interleave: that, plus the partial unique indexes of
:mod:`gpubroker.store.models` and the writer lock of the database, gives
exactly-once ownership of devices.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

from traitlets import Any as AnyTrait
from traitlets import (
    Bool,
    Enum,
    Float,
    Instance,
    Integer,
    List,
    TraitError,
    default,
    observe,
    validate,
)
from traitlets.config import LoggingConfigurable

from . import scheduler, state_check
from .broker.actuator import Actuator
from .broker.admin import AdminOps
from .broker.admission import Admission, Shape
from .broker.availability import Availability
from .broker.notices import Notices
from .broker.passloop import PassLoop
from .broker.runner import CommandRunner, lease_or_404
from .broker.sharing import SharingOps
from .broker.waiters import Waiters
from .broker.world import World
from .commands import command
from .devices.base import DeviceBackend
from .enforce.mps import MPSControl
from .engines import Engine, LocalEngine, Node
from .errors import BadRequest, Conflict
from .passes import PREPARING, QUEUED, QUEUED_MESSAGE, apply_decisions, build_state, set_wait
from .policy_config import SchedulingPolicy
from .pools import Pools, PoolSpec
from .store.models import (
    ACTIVE_STATES,
    Allocation,
    Device,
    HolderKind,
    Intent,
    Lease,
    LeaseState,
)
from .store.repository import Repository
from .transitions import EventBus, event_view
from .usage.intervals import CAUSE_ACTORS, release_cause
from .views import lease_view, summary


def utcnow() -> dt.datetime:
    """The current time, aware UTC."""
    return dt.datetime.now(dt.timezone.utc)


class Broker(LoggingConfigurable):
    """Owns leases and devices; see the module docstring. A facade: lease
    commands, inventory and scheduling are its own; admission
    (:class:`~gpubroker.broker.admission.Admission`), admin operations
    (:class:`~gpubroker.broker.admin.AdminOps`), notices
    (:class:`~gpubroker.broker.notices.Notices`), the sharing operations
    (:class:`~gpubroker.broker.sharing.SharingOps`) and what is free
    (:class:`~gpubroker.broker.availability.Availability`) are parts built
    here with explicit dependencies, which its methods call.

    Args:
        session_factory: the store's session factory (:mod:`gpubroker.store.db`).
        backend: the device backend of this node.
    """

    session_factory = AnyTrait(help="SQLAlchemy sessionmaker bound to the store.")
    backend = AnyTrait(help="The DeviceBackend instance of this node.")

    engine_kind = Enum(
        ["local", "slurm"],
        default_value="local",
        help="""Where the inventory comes from and holders' processes run:
        "local" (this host: the device backend's GPUs, plain processes) or
        "slurm" (the nodes and GPUs of a Slurm cluster, from sinfo; jobs as
        Slurm jobs; configure SlurmEngine). The "slurm" runner of JobService
        runs jobs on it.""",
    ).tag(config=True)

    inventory_interval = Float(
        30.0,
        help="""Seconds between reads of the inventory from an engine whose
        inventory changes by itself (Slurm: nodes drained, down or back,
        GPUs that Slurm jobs from outside the broker take or free). 0: read
        once at start. The local engine's inventory is read once at start.""",
    ).tag(config=True)

    evict_timeout = Float(
        120,
        help="""Seconds to wait for the hub to stop the server of an evicted
        lease before its devices are released anyway.""",
    ).tag(config=True)

    max_gpus_per_request = Integer(
        0,
        help="""Most whole GPUs one lease may ask for; 0 means the number of
        devices on the largest node. Requests above it are refused with 400.""",
    ).tag(config=True)

    pass_interval = Float(
        0.05,
        help="""Longest gap in seconds the service's pass loop keeps between
        two scheduling passes; the gap is as long as the last pass took (so
        passes take at most about half of the broker's time), capped by
        this. A command arriving after the gap is scheduled at once, inside
        the command; commands arriving within it only mark the state dirty,
        and one pass covers them all (POST /leases waits for that pass, at
        most 1 s, before it answers).""",
    ).tag(config=True)

    lazy_pass_factor = Float(
        3.0,
        min=1.0,
        help="""After a change whose pass cannot grant anything at once, the
        service's pass loop keeps a gap this many times as long as the last
        pass took (capped by pass_interval) before the pass that covers it:
        a request for which no device it could take is free, or a pending
        request withdrawn while no whole device is free and nothing was
        earmarked or being made for it (no restart released a lease either).
        Such a pass can only place requests in the queue, or start a
        preemption, which has a grace period anyway. While the longer gap
        stays under pass_interval, a stream of such changes over a long
        queue spends at most 1 / (1 + lazy_pass_factor) of the broker's time
        in passes. Any other change cuts the gap back to pass_interval's
        rule. Such a request is answered Queued at once; its place and
        reason come with that pass.""",
    ).tag(config=True)

    grant_retry_backoff = Float(
        1.0,
        help="""Seconds before a grant whose MIG instance could not be made
        is tried again (then twice as long after each further failure, at
        most 60 s). Applies where the service's actuator makes instances off
        the event loop; without one a failed grant is tried at the next
        pass.""",
    ).tag(config=True)

    policy = Instance(SchedulingPolicy, help="The scheduling policy (configure SchedulingPolicy).")

    pools = Instance(Pools, help="The pools of devices (configure Pools).")

    mig_placement = Enum(
        ["least-fragmentation", "first-fit"],
        default_value="least-fragmentation",
        help="""Where a new MIG instance goes: "least-fragmentation" (the
        fullest device it fits on, at the placement that keeps the largest
        profiles placeable) or "first-fit" (the first device and the lowest
        start slot, as a baseline).""",
    ).tag(config=True)

    share_placement = Enum(
        ["packing", "fgd", "best-fit", "first-fit"],
        default_value="packing",
        help="""Where a time-sliced share goes (see docs/sharing.md):
        "packing" (where expected fragmentation under the share mix rises
        least, then best fit), "fgd" (the same gradient, ties in node order),
        "best-fit" (the least room left) or "first-fit" (the first node and
        device with room), the last three as baselines.""",
    ).tag(config=True)

    share_mix_gib = List(
        Float(),
        help="""Share sizes, GiB, counted once each in the share mix that
        placement weighs, besides the shares held and the requests waiting
        (e.g. the sizes the spawn form offers, so that room for them is
        kept before anyone has asked). Each must be at least 1 MiB
        (1/1024 GiB) and at most 1,024 GiB.""",
    ).tag(config=True)

    @validate("share_mix_gib")
    def _valid_share_mix(self, proposal: Any) -> list[float]:
        sizes = list(proposal["value"])
        bad = [s for s in sizes if not 1 / 1024 <= s <= 1024]  # nan fails both
        if bad:
            raise TraitError(
                f"Broker.share_mix_gib: each size must be 1/1024..1024 GiB, got {bad[0]}"
            )
        return sizes

    framework_caps = Bool(
        True,
        help="""Give each share's server the framework caps (JAX, TensorFlow,
        PyTorch memory limits through environment variables and a
        sitecustomize hook; see gpubroker.enforce.caps). Soft: user code can
        override them.""",
    ).tag(config=True)

    mps = Instance(MPSControl, help="CUDA MPS for shares (configure MPSControl).")

    check_state = Enum(
        ["off", "log", "raise"],
        default_value="off",
        help="""Check the broker's invariants after every command
        (validate_state: no slot held twice, every granted lease holds its
        slots, each changed lease's transition log replays to its state).
        "log": log each broken invariant as an error; "raise": fail the
        command (the test suite runs so); "off": skip (it reads every active
        allocation, every active lease and the released leases' usage per
        command).""",
    ).tag(config=True)

    usage_write_interval = Float(
        60.0,
        help="""Seconds between writes of the fair-share usage records
        (gpubroker.usage). A release changes its user's record in memory
        only; the records that changed are written by the periodic pass at
        most this often and when the broker stops. Nothing is lost in a
        crash between two writes: loading adds the leases released after
        each stored record again. 0: write at every periodic pass.""",
    ).tag(config=True)

    @default("mps")
    def _default_mps(self) -> MPSControl:
        return MPSControl(parent=self)

    @default("policy")
    def _default_policy(self) -> SchedulingPolicy:
        return SchedulingPolicy(parent=self)

    @default("pools")
    def _default_pools(self) -> Pools:
        return Pools(parent=self)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._waiters = Waiters()
        #: set by the service: coalesce passes (None: every command runs one)
        self.passes: PassLoop | None = None
        self._topology: dict[str, scheduler.Topology] = {}
        #: called with the view of each server lease to evict (preemption, time
        #: limit), so the service can stop its hub server
        self.on_evict: Callable[[dict[str, Any]], None] | None = None
        #: lease events go here after each command's commit
        self.bus = EventBus(self.log)
        self._world = World(self.session_factory, lambda: self.policy.fairshare_half_life)
        #: runs every command of the broker and its parts (stimulus, events)
        self.runner = CommandRunner(self._world, self.bus, self._after_command)
        self._usage_written = time.monotonic()
        self._world.on_reload.append(self._after_rollback)
        #: where holders run and where the inventory comes from (the local
        #: host first; Docker and Slurm engines plug in beside it)
        self.engine: Engine = self._make_engine()
        self._policy_cache: tuple[tuple[int, str], scheduler.Policy] | None = None
        self._build_parts()

    def _build_parts(self) -> None:
        """The parts the facade delegates to, each given what it uses."""
        self.sharing = SharingOps(
            self.runner,
            self._world,
            self.backend,
            self.pools,
            self.mps,
            framework_caps=lambda: self.framework_caps,
            retry_backoff=lambda: self.grant_retry_backoff,
            schedule=self._schedule,
            schedule_now=self.schedule_now,
            notify=self._notify,
            log=self.log,
        )
        self.admission = Admission(
            self._world,
            self.pools,
            self.sharing.pool_spec,
            self._policy,
            default_class=lambda: self.policy.default_priority_class,
            max_gpus=lambda: self.max_gpus_per_request,
        )
        self.admin = AdminOps(
            self.runner,
            self._world,
            self.policy,
            self._policy,
            self._schedule,
            self._notify,
            self._evict,
            self.log,
        )
        self.notice_book = Notices(self.runner, self.log)
        self.free = Availability(self.runner, self._scheduler_state, self.pools)

    @observe("mps", "backend")
    def _pass_on(self, change: Any) -> None:
        """A device backend or MPS control set after start goes to the
        sharing operations too (the parts hold what they use)."""
        sharing = self.__dict__.get("sharing")
        if sharing is not None:
            setattr(sharing, change["name"], change["new"])

    # -- commands and their events ---------------------------------------------------

    def _after_command(self, touched: set[int]) -> None:
        """After each outermost command: check the state (``check_state``)."""
        if self.check_state != "off":
            self.validate_state(touched)

    def _rec(self, repo: Repository, now: dt.datetime, actor: str | None = None) -> Any:
        """A recorder of the current command's changes in ``repo``."""
        return self.runner.rec(repo, now, actor)

    # -- the parts' operations, as the API, the service and the culler call them ----

    @property
    def actuator(self) -> Actuator | None:
        """Makes and destroys MIG instances off the event loop (set by the
        service; ``None``: inside the command, as the unit tests and CLI do)."""
        return self.sharing.actuator

    @actuator.setter
    def actuator(self, actuator: Actuator | None) -> None:
        self.sharing.actuator = actuator

    def pool_spec(self, uuid: str) -> PoolSpec:
        """The pool of device ``uuid`` (:meth:`SharingOps.pool_spec`)."""
        return self.sharing.pool_spec(uuid)

    def request_limit(self) -> int:
        """Most GPUs one lease may ask for now (:meth:`Admission.request_limit`)."""
        return self.admission.request_limit()

    def shape(self, *args: Any, **kwargs: Any) -> Shape:
        """What a request asks for, checked (:meth:`Admission.shape`)."""
        return self.admission.shape(*args, **kwargs)

    def class_for_caller(
        self, name: str | None, admin: bool, policy: scheduler.Policy | None = None
    ) -> None:
        """Whether the caller may name class ``name`` (:meth:`Admission.class_for_caller`)."""
        self.admission.class_for_caller(name, admin, policy)

    def availability(self, user: str | None = None) -> dict[str, Any]:
        """Each pool with what is free now (:meth:`Availability.availability`)."""
        return self.free.availability(user)

    def quotas(self) -> dict[str, Any]:
        """Quotas in force (:meth:`AdminOps.quotas`)."""
        return self.admin.quotas()

    def set_quota(self, *args: Any, **kwargs: Any) -> None:
        """Store a quota (:meth:`AdminOps.set_quota`)."""
        self.admin.set_quota(*args, **kwargs)

    def delete_quota(self, *args: Any, **kwargs: Any) -> None:
        """Remove a stored quota (:meth:`AdminOps.delete_quota`)."""
        self.admin.delete_quota(*args, **kwargs)

    def set_priority_class(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Move a pending request to another class (:meth:`AdminOps.set_priority_class`)."""
        return self.admin.set_priority_class(*args, **kwargs)

    def set_drained(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Drain or undrain a device (:meth:`AdminOps.set_drained`)."""
        return self.admin.set_drained(*args, **kwargs)

    def preempt_lease(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """An admin's preemption (:meth:`AdminOps.preempt_lease`)."""
        return self.admin.preempt_lease(*args, **kwargs)

    def queue(self) -> list[dict[str, Any]]:
        """Pending leases in queue order (:meth:`AdminOps.queue`)."""
        return self.admin.queue()

    def add_notice(self, *args: Any, **kwargs: Any) -> None:
        """A notice for a lease's holder (:meth:`Notices.add_notice`)."""
        self.notice_book.add_notice(*args, **kwargs)

    def note_lease(self, *args: Any, **kwargs: Any) -> None:
        """A note in a lease's transition log (:meth:`Notices.note_lease`)."""
        self.notice_book.note_lease(*args, **kwargs)

    def notices(self, user: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        """Notices, newest first (:meth:`Notices.notices`)."""
        return self.notice_book.notices(user, limit)

    def share_caps(self) -> list[tuple[Lease, str, int]]:
        """Every share held now with its cap (:meth:`SharingOps.share_caps`)."""
        return self.sharing.share_caps()

    def housekeep_mig(self, **kwargs: Any) -> None:
        """MIG mode changes and left-over instances (:meth:`SharingOps.housekeep_mig`)."""
        self.sharing.housekeep_mig(**kwargs)

    def request_mig_mode(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Ask for a device's MIG mode (:meth:`SharingOps.request_mig_mode`)."""
        return self.sharing.request_mig_mode(*args, **kwargs)

    async def after_mig_mode(self, view: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
        """The MIG mode answer once made (:meth:`SharingOps.after_mig_mode`)."""
        return await self.sharing.after_mig_mode(view, timeout)

    def validate_state(self, touched: Iterable[int] = ()) -> list[str]:
        """Check the invariants (:mod:`gpubroker.state_check`) on what the
        store holds (read through a fresh repository: what a restart would
        load), replaying the transition logs of the leases ``touched``, and
        that the broker's memory holds exactly the store's active leases.

        Returns:
            the broken invariants (logged as errors), empty when all hold.

        Raises:
            StateInvalid: one is broken and ``check_state`` is ``raise``.
        """
        with self._fresh() as repo:
            found = state_check.problems(repo, touched)
            found += state_check.memory_matches(repo, self._world.active())
            found += self._world.refresh_inputs().drift(self._world.leases)
            found += state_check.usage_matches(repo, self._world.usage, self._world.half_life)
        for problem in found:
            self.log.error("State check: %s", problem)
        if found and self.check_state == "raise":
            raise state_check.StateInvalid("; ".join(found))
        return found

    def lease_events(self, lease_id: int) -> list[dict[str, Any]]:
        """The transition log of lease ``lease_id``, oldest first.

        Raises:
            NotFound: no such lease.
        """
        with self._read() as repo:
            lease_or_404(repo, lease_id)
            return [event_view(row) for row in repo.events_of(lease_id)]

    # -- sessions and notification -------------------------------------------------

    def _write(self) -> contextlib.AbstractContextManager[Repository]:
        """A write-through transaction on the in-memory state (see
        :meth:`World.write`)."""
        return self._world.write()

    def _after_rollback(self) -> None:
        """A transaction rolled back (memory is the store's again): the pass
        it may have run is undone, so ask for another."""
        if self.passes is not None:
            self.passes.mark_dirty()

    def _read(self) -> contextlib.AbstractContextManager[Repository]:
        """Read the in-memory state (see :meth:`World.read`)."""
        return self._world.read()

    def _fresh(self) -> contextlib.AbstractContextManager[Repository]:
        """A fresh repository on the store, outside the broker's memory: what
        a restart would load (for :meth:`validate_state`)."""
        return Repository.fresh(self.session_factory)

    def _notify(self) -> None:
        """Wake the long-poll waiters whose lease changed (see
        :class:`~gpubroker.broker.waiters.Waiters`)."""
        self._waiters.wake(self._version_of)

    def _version_of(self, lease_id: int) -> int | None:
        lease = self._world.leases.get(lease_id)
        if lease is not None:
            return lease.version
        with self._read() as repo:
            gone = repo.lease(lease_id)
            return None if gone is None else gone.version

    # -- inventory -----------------------------------------------------------------

    def _make_engine(self) -> Engine:
        """The engine ``engine_kind`` names (Slurm's configured as SlurmEngine)."""
        if self.engine_kind == "slurm":
            from .engines.slurm import SlurmEngine

            return SlurmEngine(parent=self)
        return LocalEngine(self.backend)

    @property
    def inventory_changes(self) -> bool:
        """Whether the engine's inventory changes by itself (read it again
        every ``inventory_interval``): true for Slurm."""
        return self.engine.name == "slurm"

    def outside_reason(self, uuid: str) -> str | None:
        """Why the engine takes no new work on device ``uuid`` (its node is
        drained or down in Slurm, a Slurm job from outside holds it);
        ``None``: nothing outside the broker stops it."""
        return self._world.outside.get(uuid)

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
        backend: DeviceBackend = self.backend
        nodes = self.engine.nodes() if nodes is None else nodes
        reported = {d.uuid: d for node in nodes for d in node.devices}
        self._world.outside = _outside(nodes)
        if len({d.node for d in reported.values()}) == 1 and self.engine.name == "local":
            self._topology = {
                nodes[0].name: tuple(tuple(int(x) for x in row) for row in backend.topology())
            }
        with self._write() as repo:
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
            self._leave_mig_mode(list(repo.devices()))
            self._schedule(repo, utcnow())
        self._notify()
        if self.sharing.apply_mig_modes():
            self.schedule_now()
        return [vars(d) for d in reported.values()]

    def _leave_mig_mode(self, devices: Iterable[Device]) -> None:
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
        now = utcnow()
        with self._write() as repo:
            lease = lease_or_404(repo, lease_id)
            mine = [a for a in lease.allocations if a.active]
            want = list(dict.fromkeys(uuids))
            if lease.state != LeaseState.granted.value or any(a.kind != "device" for a in mine):
                raise Conflict(f"lease {lease_id}: only a granted lease of whole devices rebinds")
            if len(want) != len(mine) or any(u not in self._world.devices for u in want):
                raise Conflict(f"lease {lease_id} holds {len(mine)} devices, not {want}")
            have = {a.device_uuid for a in mine}
            if set(want) == have:
                return sorted(have)
            moves = self._rebind_moves(repo, lease_id, mine, want)
            for allocation, _ in moves:  # never two active on one device, even mid-way
                allocation.active = False
            repo.flush()
            for allocation, uuid in moves:
                allocation.device = self._world.devices[uuid]
            repo.flush()
            for allocation, _ in moves:
                allocation.active = True
            rec = self._rec(repo, now)
            for other in {a.lease_id for a, _ in moves} - {lease_id}:
                why = f"its devices swapped with lease {lease_id}'s, as its engine bound them"
                rec.note(lease_or_404(repo, other), "rebound", why, {"lease": lease_id})
            rec.note(lease, "rebound", "bound by its engine to " + ", ".join(want), {})
            self._schedule(repo, now)
        self._notify()
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

    @command("broker")
    def adopt(self) -> dict[str, int]:
        """Re-adopt the leases of the store after a (re)start.

        A granted lease whose MIG instance no longer exists (a GPU reset, a
        reboot, someone's ``nvidia-smi mig -dci``) is evicted: its server is
        stopped and the lease released with that reason.

        Returns:
            counts of ``granted`` and ``pending`` leases found.
        """
        now = utcnow()
        with self._write() as repo:
            counts = {state: 0 for state in ACTIVE_STATES}
            for lease in repo.active_leases():
                counts[lease.state] += 1
                lost = self.sharing.lost_instances(lease)
                if lost:
                    why = f"its MIG instance {lost[0]} no longer exists (GPU reset or reboot?)"
                    self.log.warning("Lease %s: %s", lease.id, why)
                    self._evict(lease, why, now, "reconcile", "reconcile")
            repo.flush()
            self._resume_stops(repo)
            self._schedule(repo, now)
        self.log.info(
            "Adopted %s granted and %s pending leases", counts["granted"], counts["pending"]
        )
        self._notify()
        return counts

    # -- state changes ---------------------------------------------------------------

    @command("broker")
    def request_lease(
        self,
        user: str,
        server_name: str,
        gpus: int | None = None,
        holder_kind: str = HolderKind.server.value,
        priority_class: str | None = None,
        time_limit: float | None = None,
        group: str | None = None,
        groups: list[str] | None = None,
        dry_run: bool = False,
        admin: bool = True,
        mig_profile: str | None = None,
        memory_gib: float | None = None,
        count: int | None = None,
        pool: str | None = None,
        restart_of: int | None = None,
    ) -> dict[str, Any]:
        """Ask for slots for ``user``'s server ``server_name``: ``gpus`` whole
        devices, one MIG instance of ``mig_profile``, or ``count`` shares of
        ``memory_gib`` GiB on distinct devices (exactly one of the three),
        optionally in ``pool``.

        Args:
            user, server_name, holder_kind: for whom.
            gpus, mig_profile, memory_gib, count, pool: what (see
                :meth:`shape`).
            priority_class: a configured class (default
                ``SchedulingPolicy.default_priority_class``).
            time_limit: seconds the lease may run once granted (``None``: none).
            group: the group to charge; must be one of ``groups``.
            groups: the user's JupyterHub groups (``None``: unknown).
            dry_run: check everything, change nothing (Kubernetes-style).
            admin: whether the caller is a broker admin (else limited in
                the classes it may name, see :meth:`class_for_caller`).
            restart_of: the previous lease of this same server, which died
                and is started again: the new lease counts the restart
                (``restarts``: the previous one's + 1) and takes the
                previous lease's whole devices when they are all free. A
                previous lease still active (its release was lost) is
                released first, reason ``server restarted``, in the same
                transaction.

        Returns:
            the lease view (``state`` ``granted`` or ``pending``); with
            ``dry_run``, ``{"admitted": True, "user", "gpus", "kind",
            "weight", "priority_class", "group"}``.

        Raises:
            BadRequest: ``gpus`` outside 1..:meth:`request_limit`, a pool,
                profile or share size the pools cannot serve (see
                :meth:`shape`), unknown class, non-positive time limit.
            Forbidden: a user or group limit would be exceeded (held plus
                pending), or ``group`` is not one of the user's groups.
            Conflict: the server already has an active lease (other than
                ``restart_of``).
            BadRequest: ``restart_of`` is not a lease of this user's server.
        """
        if [gpus, mig_profile, memory_gib].count(None) != 2:
            raise BadRequest("gpus/mig_profile/memory_gib: give exactly one of them")
        admission = self.admission
        admission.check_purpose(pool, holder_kind)
        interactive = holder_kind != HolderKind.job.value
        shape = admission.shape(gpus, mig_profile, memory_gib, count, pool, interactive)
        policy = self._policy()
        admission.class_for_caller(priority_class, admin, policy)
        cls = priority_class or self.policy.default_priority_class
        if cls not in policy.classes:
            raise BadRequest(
                f"priority_class: must be one of {sorted(policy.classes)}, got {cls!r}"
            )
        if time_limit is not None and time_limit <= 0:
            raise BadRequest(f"time_limit: must be a positive number of seconds, got {time_limit}")
        charged = admission.charge_group(user, group, groups, policy)
        admission.check_guarantee_room(policy, cls, user, charged, shape.weight)
        now = utcnow()
        with self._write() as repo:
            previous = None
            freed = False  # a restart released the lease it replaces
            if restart_of is not None:
                previous = self._restarted(repo, restart_of, user, server_name, holder_kind)
                if previous.state in ACTIVE_STATES and not dry_run:
                    self._release(previous, "server restarted", now)
                    repo.flush()
                    freed = True
            if holder_kind == HolderKind.server.value:
                self._check_no_active_lease(repo, user, server_name, restart_of)
            admission.check_limits(policy, user, charged, shape.weight)
            if dry_run:
                return {
                    "admitted": True,
                    "user": user,
                    "gpus": shape.count,
                    "kind": shape.kind,
                    "weight": shape.weight,
                    "priority_class": cls,
                    "group": charged,
                }
            lease = Lease(
                user=user,
                server_name=server_name,
                holder_kind=holder_kind,
                gpus=shape.count,
                state=LeaseState.pending.value,
                created=now,
                priority_class=cls,
                time_limit=time_limit,
                group_name=charged,
                kind=shape.kind,
                mig_profile=shape.mig_profile,
                memory_mib=shape.memory_mib,
                pool=shape.pool,
                weight=None if shape.kind == "gpus" else shape.weight,
                version=1,  # the columns' defaults, set now: it is written at the commit
                reclaimable=False,
                restarts=0,
            )
            if previous is not None:
                lease.restart_of = previous.id
                lease.restarts = (previous.restarts or 0) + 1
                lease.prefer_devices = _devices_to_prefer(previous, shape.kind, shape.count)
            lease.allocations = []  # new: nothing to load
            self._world.add_lease(lease)
            detail = {"summary": summary(lease), "priority_class": cls, "group": charged}
            if previous is not None:
                detail["restart_of"] = previous.id
            self._rec(repo, now).created(lease, f"requested {summary(lease)}", detail)
            # nothing free it could have (and no restart freed slots): its pass
            # can only place it in the queue
            lazy = (
                self.passes is not None
                and not freed
                and not self._may_grant_now(lease.kind, lease.pool)
            )
            self._schedule(repo, now, lazy=lazy)
            if lease.state == LeaseState.pending.value and lease.queue_reason is None:
                # the pass that covers it runs a little later (coalesced)
                set_wait(lease, QUEUED, QUEUED_MESSAGE, None, inputs=self._world.inputs)
            view = lease_view(lease)
        self.log.info(
            "Lease %s for %s/%s (%s, %s): %s",
            view["id"],
            user,
            server_name,
            view["summary"],
            cls,
            view["state"],
        )
        self._notify()
        return view

    def _restarted(
        self, repo: Repository, lease_id: int, user: str, server_name: str, holder_kind: str
    ) -> Lease:
        """The previous lease a restart names; it must be this server's."""
        previous = repo.lease(lease_id)
        if (
            previous is None
            or holder_kind != HolderKind.server.value
            or previous.holder_kind != HolderKind.server.value
            or (previous.user, previous.server_name) != (user, server_name)
        ):
            raise BadRequest(
                f"restart_of: lease {lease_id} is not a lease of the server "
                f"{user}/{server_name or '(default)'}"
            )
        return previous

    def _check_no_active_lease(
        self, repo: Repository, user: str, server_name: str, replaced: int | None = None
    ) -> None:
        existing = self._world.server_lease(user, server_name, replaced or 0)
        if existing is not None and existing.state in ACTIVE_STATES:
            raise Conflict(
                f"server_name: {user}/{server_name or '(default)'} already has active "
                f"lease {existing.id}; one active lease per server"
            )

    @command("broker")
    def release_lease(self, lease_id: int, reason: str) -> dict[str, Any]:
        """Release lease ``lease_id`` (granted or pending), recording ``reason``.

        Idempotent: releasing a released lease returns it unchanged.

        Raises:
            NotFound: no such lease.
        """
        now = utcnow()
        with self._write() as repo:
            lease = lease_or_404(repo, lease_id)
            if lease.state != LeaseState.released.value:
                # a request withdrawn frees nothing, unless devices were earmarked
                # for it, its MIG instance was being made, or its reservation kept
                # a free device back (then others may take them at once)
                lazy = (
                    self.passes is not None
                    and lease.state == LeaseState.pending.value
                    and not lease.earmarked
                    and lease.queue_reason != PREPARING
                    and not self._may_grant_now("gpus", None)
                )
                stopping = self._open_stop(lease.id)
                cause, actor = "release", None
                if stopping is not None:  # the broker asked for this stop: its reason
                    reason = f"{stopping.reason} (server stopped)"
                    cause = stopping.cause or "release"
                    actor = CAUSE_ACTORS.get(cause)
                self._release(lease, reason, now, cause, actor)
                repo.flush()
                self._schedule(repo, now, lazy=lazy)
                self.log.info("Released lease %s of %s: %s", lease.id, lease.user, reason)
            view = lease_view(lease)
        self._notify()
        return view

    def _release(
        self,
        lease: Lease,
        reason: str,
        now: dt.datetime,
        cause: str = "release",
        actor: str | None = None,
    ) -> None:
        """Release ``lease``: its ``released`` event carries ``cause`` (one
        of :data:`gpubroker.usage.intervals.CAUSES`; a pending lease's is
        ``cancel``) in its detail, decided by the broker, never read from the
        reason a caller wrote; ``actor``: who decided, when not the command's."""
        repo = self._world.repo  # every lease in memory is the world's
        if lease.state == LeaseState.granted.value:
            self._world.charge(lease, now)
            self.sharing.unrealize(lease)
        elif cause == "release":
            cause = "cancel"
        self.sharing.forget_retry(lease.id)
        self._rec(repo, now, actor).transition(
            lease, LeaseState.released.value, reason, {"cause": cause}
        )
        stop = self._world.stops.get(lease.id)
        if stop is not None and stop.state == "open":
            stop.state, stop.done_at = "done", now
        lease.released_at = now
        lease.release_reason = reason
        lease.queue_position = lease.queue_reason = lease.queue_message = None
        lease.queue_eta = None
        lease.earmarked = None
        for allocation in lease.allocations:
            allocation.active = False

    @command("reconcile")
    def reconcile(
        self,
        servers: Iterable[tuple[str, str]],
        as_of: dt.datetime,
        followed: Collection[int] = (),
    ) -> list[int]:
        """Release server leases whose hub server no longer exists.

        Args:
            servers: (user, server name) of every server the hub lists as
                active (ready or pending), fetched starting at ``as_of``.
            as_of: aware UTC time the hub listing was requested; leases
                created after it are left alone (their server may be newer).
            followed: ids of leases whose holder an engine follows (a
                server's Slurm job): left alone here, since the holder may
                still run and hold the devices after the hub lost the server
                (a stop that failed); the engine's reconciliation ends them
                (:class:`~gpubroker.broker.slurm_servers.SlurmServers`).

        Returns:
            ids of the leases released.
        """
        alive = set(servers)
        skip = set(followed)

        def gone(lease: Lease) -> str | None:
            if lease.holder_kind != HolderKind.server.value or lease.created >= as_of:
                return None
            if lease.id in skip:
                return None
            if (lease.user, lease.server_name) in alive:
                return None
            return f"reconcile: server {lease.user}/{lease.server_name} is gone from the hub"

        return self._reconcile_release(gone, "server gone")

    def _reconcile_release(self, why: Callable[[Lease], str | None], what: str) -> list[int]:
        """Release every active lease ``why`` gives a reason for (cause
        ``reconcile``), then one pass; return their ids."""
        released = []
        now = utcnow()
        with self._write() as repo:
            for lease in self._world.active():
                reason = why(lease)
                if reason is not None:
                    self._release(lease, reason, now, "reconcile")
                    released.append(lease.id)
            if released:
                repo.flush()
                self._schedule(repo, now)
        if released:
            self.log.warning("Reconciliation released leases %s (%s)", released, what)
            self._notify()
        return released

    def reconcile_containers(self, ended: dict[int, tuple[str, str]]) -> list[int]:
        """Release server leases whose Docker container has ended or is gone.

        Args:
            ended: lease id -> (the container id that was checked, what the
                Docker engine said of it, e.g. ``"exited with status 137"``
                or ``"is gone"``). A lease whose container has changed since
                the check (a new start), or that is no longer granted, is
                left alone.

        Returns:
            ids of the leases released.
        """

        return self._reconcile_ended(
            ended, lambda x: x.container_id, "the container {run:.12}", "container ended"
        )

    def reconcile_slurm_servers(self, ended: dict[int, tuple[str, str]]) -> list[int]:
        """Release server leases whose Slurm job (``SlurmGPUSpawner``) has
        ended or is gone.

        Args:
            ended: lease id -> (the Slurm job id that was checked, what
                Slurm said of it, e.g. ``"was cancelled (signal 15)"``). A
                lease whose job has changed since the check, or that is no
                longer granted, is left alone.

        Returns:
            ids of the leases released.
        """
        return self._reconcile_ended(
            ended, lambda x: x.slurm_job, "the Slurm job {run}", "Slurm job ended"
        )

    def _reconcile_ended(
        self,
        ended: dict[int, tuple[str, str]],
        recorded: Callable[[Lease], str | None],
        name: str,
        what: str,
    ) -> list[int]:
        """Release the granted server leases of ``ended`` whose recorded run
        (``recorded(lease)``) is still the one checked; the reason names the
        run (``name``, formatted with ``run``) and what its engine said."""

        def gone(lease: Lease) -> str | None:
            checked = ended.get(lease.id)
            if checked is None or lease.state != LeaseState.granted.value:
                return None
            run, said = checked
            if recorded(lease) != run:
                return None
            server = f"{lease.user}/{lease.server_name}"
            return f"reconcile: {name.format(run=run)} of server {server} {said}"

        return self._reconcile_release(gone, what)

    # -- reads ---------------------------------------------------------------------

    def get_lease(self, lease_id: int) -> dict[str, Any]:
        """The view of lease ``lease_id``.

        Raises:
            NotFound: no such lease.
        """
        with self._read() as repo:
            return lease_view(lease_or_404(repo, lease_id))

    def list_leases(self, user: str | None = None, active: bool = True) -> list[dict[str, Any]]:
        """Lease views, oldest first; only ``user``'s when given; only
        pending and granted ones unless ``active`` is false."""
        if active:
            leases = [x for x in self._world.active() if user is None or x.user == user]
            return [lease_view(lease) for lease in leases]
        with self._read() as repo:
            return [lease_view(lease) for lease in repo.leases(user)]

    def device_rows(self) -> list[tuple[Device, list[dict[str, Any]]]]:
        """Every known device with every slot of it held now: a whole device
        has at most one holder, a MIG or shared device one per instance or
        share.

        Returns:
            ``(device, holders)`` pairs in node and index order; each holder
            is ``{"lease_id", "user", "server_name", "kind"`` (``device``,
            ``mig``, ``share``), ``"profile", "instance_uuid", "memory_gib"}``.
        """
        held = [(a, x) for x in self._world.active() for a in x.allocations if a.active]
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
        devices = sorted(self._world.devices.values(), key=lambda d: (d.node, d.index))
        return [(d, holders.get(d.uuid, [])) for d in devices]

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
            if not await self._waiters.wait(lease_id, known, remaining):
                break
            current = self.get_lease(lease_id)
        return current

    # -- scheduling ----------------------------------------------------------------

    async def after_pass(self, view: dict[str, Any], timeout: float = 1.0) -> dict[str, Any]:
        """The view of a lease a command just created or changed, once the
        scheduling pass that covers the change has run (with coalesced
        passes, :attr:`passes`) and, for a grant whose MIG instance is being
        made (reason ``Preparing``), once it is made: a request that can be
        granted is answered granted. At most ``timeout`` seconds; then the
        lease as it stands. ``view``: the command's answer.

        Raises:
            NotFound: the lease is gone meanwhile (never: leases stay).
        """
        if view.get("state") != LeaseState.pending.value:
            return view
        deadline = time.monotonic() + timeout
        if self.passes is not None:
            if not self._may_grant_now(view.get("kind", "gpus"), view.get("pool")):
                return view  # the pass could not grant it now: the long-poll sees its verdict
            await self.passes.settled(timeout=timeout)
            view = self.get_lease(int(view["id"]))
        while (
            view["state"] == LeaseState.pending.value
            and (view.get("queue") or {}).get("reason") == PREPARING
            and (remaining := deadline - time.monotonic()) > 0
        ):
            await self._waiters.wait(int(view["id"]), int(view["version"]), remaining)
            view = self.get_lease(int(view["id"]))
        return view

    def _may_grant_now(self, kind: str, wanted: str | None) -> bool:
        """Whether a pass may grant a pending request of slot ``kind`` in
        pool ``wanted`` (``None``: any) at once: always for MIG instances
        and shares; for whole devices, when a device of an exclusive pool
        (of the pool asked for, if one was) is free: in service, not held,
        not kept for another request. When not, the request's first verdict
        is a wait (or a preemption, which takes a grace period): it is
        answered without waiting for the pass, and its pass is lazy."""
        if kind != "gpus":
            return True
        inputs = self._world.refresh_inputs()
        taken = inputs.held_devices() | inputs.earmarked_devices()
        for device in self._world.present_devices():
            if device.uuid in taken or device.drained or device.mig_target is not None:
                continue
            spec = self.sharing.pool_spec(device.uuid)
            if spec.mode != scheduler.PoolMode.exclusive.value or device.mig_enabled:
                continue
            if wanted is None or spec.name == wanted:
                return True
        return False

    async def settled(self, timeout: float = 1.0) -> None:
        """Return once the commands answered so far are covered by a pass
        (at most ``timeout`` seconds): what a read answers then includes
        their verdicts (queue place and reason, grants)."""
        if self.passes is not None:
            await self.passes.settled(timeout=timeout)

    @command("scheduler")
    def schedule_now(self) -> None:
        """Run a scheduling pass in its own transaction (the periodic timer);
        server stops that took longer than ``evict_timeout`` end first."""
        now = utcnow()
        with self._write() as repo:
            self._expire_stops(repo, now)
            repo.flush()
            self._schedule(repo, now, force=True)
            if time.monotonic() - self._usage_written >= self.usage_write_interval:
                self._write_usage()
        self._notify()

    @command("broker")
    def load_held_usage(self) -> int:
        """Charge the leases held across this broker's restart, in fair
        share, as the usage ledger counts them (:meth:`World.load_held`); the
        service calls it once ``Ledger.start`` has reopened their intervals.
        Returns how many leases it found."""
        return self._world.load_held()

    def write_usage(self) -> int:
        """Write the fair-share usage records that changed since the last
        write (``usage_write_interval``; the service calls it when it
        stops). Returns how many were written."""
        with self._write():
            return self._write_usage()

    def _write_usage(self) -> int:
        self._usage_written = time.monotonic()
        written = self._world.write_usage()
        if written:
            self.log.debug("Wrote the usage records of %s users", written)
        return written

    def _policy(self) -> scheduler.Policy:
        """The pure policy: config plus quotas stored through the admin API
        (built again only when the stored quotas changed)."""
        key = (self._world.quota_version, self.policy.fingerprint())
        if self._policy_cache is None or self._policy_cache[0] != key:
            stored = [(q.kind, q.name, q.guaranteed, q.limit) for q in self._world.quotas.values()]
            self._policy_cache = (key, self.policy.build(stored))
        return self._policy_cache[1]

    def _schedule(
        self,
        repo: Repository,
        now: dt.datetime,
        again: bool = True,
        force: bool = False,
        lazy: bool = False,
    ) -> None:
        """Run the pure scheduler on the in-memory state and apply its
        decisions; with a pass loop (:attr:`passes`) and a pass less than
        its gap ago, only mark the state dirty (unless ``force``). ``lazy``:
        the pass cannot grant anything at once (the longer gap of
        :attr:`lazy_pass_factor`).

        When an eviction released devices, one more pass hands them on.
        """
        if not force and self.passes is not None and not self.passes.at_once(lazy):
            return
        state, leases = self._scheduler_state()
        decisions = scheduler.schedule(state, now)
        evicted = apply_decisions(
            repo,
            decisions,
            leases,
            now,
            lambda lease, why: self._evict(
                lease, why, now, release_cause(why, "scheduler", lease.state), "scheduler"
            ),
            self.sharing.prepare,
            self._rec(repo, now, "scheduler"),
            self._world.inputs,
            state,
        )
        for grant in decisions.grants:
            what = grant.devices or tuple(f"{p.kind}:{p.device}" for p in grant.parts)
            self.log.info("Granted lease %s: %s", grant.lease_id, ",".join(what))
        for preemption in decisions.preemptions:
            self.log.warning(
                "Preempting lease %s for %s by %s: %s",
                preemption.lease_id,
                preemption.for_lease,
                preemption.deadline.isoformat(),
                preemption.reason,
            )
        if evicted and again:
            self._schedule(repo, now, again=False, force=True)
        if self.passes is not None and again:
            self.passes.ran()

    def _scheduler_state(self) -> tuple[scheduler.SchedulerState, dict[int, Lease]]:
        """The scheduler's view of memory (:func:`build_state`): MIG
        instances being made occupy their slices, and their requests are
        left out."""
        sharing = self.sharing
        return build_state(
            self._world,
            self._policy(),
            self._topology,
            sharing.device_pools,
            sharing.scheduler_instances(),
            self.mig_placement,
            skip=sharing.preparing,
            share_placement=self.share_placement,
            share_sizes=tuple(round(s * 1024) for s in self.share_mix_gib),
        )

    def _evict(
        self,
        lease: Lease,
        reason: str,
        now: dt.datetime,
        cause: str = "release",
        actor: str | None = None,
    ) -> bool:
        """End an evicted lease; a hub server is stopped first (so two servers
        never share a device) and released when it has stopped, or after
        ``evict_timeout`` seconds. Returns whether the lease is released now.

        The stop is a stored intent (``intents``, kind ``stop-server``): a
        restarted broker asks the hub again (:meth:`adopt`), and the first
        reason stays the release reason."""
        if lease.holder_kind == HolderKind.server.value and self.on_evict is not None:
            repo = self._world.repo
            intent = self._open_stop(lease.id)
            if intent is None:
                intent = Intent(
                    kind="stop-server",
                    lease_id=lease.id,
                    reason=reason,
                    cause=cause,
                    created=now,
                    state="open",
                    attempts=1,
                )
                repo.add(intent)
                self._world.stops[lease.id] = intent
                self._rec(repo, now, actor).note(lease, "stopping", reason)
                self.log.warning("Stopping server of lease %s: %s", lease.id, reason)
                self.on_evict(lease_view(lease) | {"release_reason": reason})
            if (now - intent.created).total_seconds() < self.evict_timeout:
                return False
            reason, cause = intent.reason, intent.cause or cause
            actor = CAUSE_ACTORS.get(cause, actor)
        self._release(lease, reason, now, cause, actor)
        self.log.warning("Evicted lease %s of %s: %s", lease.id, lease.user, reason)
        return True

    def _open_stop(self, lease_id: int) -> Intent | None:
        """The open ``stop-server`` intent of ``lease_id``, if any."""
        intent = self._world.stops.get(lease_id)
        return intent if intent is not None and intent.state == "open" else None

    def _expire_stops(self, repo: Repository, now: dt.datetime) -> None:
        """Release the leases whose server stop was asked ``evict_timeout``
        seconds ago or more and has not happened."""
        since = now - dt.timedelta(seconds=self.evict_timeout)
        stale = [i for i in self._world.stops.values() if i.created <= since]
        for intent in stale:
            lease = repo.lease(intent.lease_id)
            if lease is not None and lease.state == LeaseState.granted.value:
                self.log.warning(
                    "Server of lease %s did not stop in %s s; releasing it",
                    lease.id,
                    self.evict_timeout,
                )
                cause = intent.cause or "release"
                self._release(lease, intent.reason, now, cause, CAUSE_ACTORS.get(cause))
            else:
                intent.state, intent.done_at = "done", now

    def _resume_stops(self, repo: Repository) -> int:
        """Ask the hub again to stop the servers whose stop a previous run of
        the broker asked for (at start-up). Returns how many."""
        if self.on_evict is None:
            return 0
        count = 0
        for intent in list(self._world.stops.values()):
            lease = repo.lease(intent.lease_id)
            if lease is None or lease.state != LeaseState.granted.value:
                continue
            intent.attempts += 1
            self.log.warning(
                "Resuming the stop of lease %s's server (asked %s): %s",
                lease.id,
                intent.created.isoformat(),
                intent.reason,
            )
            self.on_evict(lease_view(lease) | {"release_reason": intent.reason})
            count += 1
        return count

    @command("culler")
    def stop_lease(self, lease_id: int, reason: str, cause: str = "release") -> None:
        """End a granted server lease the way an eviction does: its hub server
        is stopped first, then the lease is released with ``reason``.

        Used by the culler (``cause`` ``cull``), and for a user who releases
        the lease of her running server (``DELETE /leases/{id}``): she keeps
        no GPU she gave back. External leases are released at once. The
        ``cause`` is recorded with the stop and on the release.

        Raises:
            NotFound: no such lease.
        """
        now = utcnow()
        with self._write() as repo:
            lease = lease_or_404(repo, lease_id)
            actor = CAUSE_ACTORS.get(cause)
            if lease.state == LeaseState.granted.value and self._evict(
                lease, reason, now, cause, actor
            ):
                repo.flush()
                self._schedule(repo, now)
        self._notify()

    def set_server_url(
        self,
        lease_id: int,
        url: str,
        container_id: str | None = None,
        docker_engine: str | None = None,
        slurm_job: str | None = None,
    ) -> dict[str, Any]:
        """Record where the lease's single-user server listens (from the spawner),
        so the culler can read its kernels directly (not through the proxy,
        which would count as activity), and the Docker container it runs in
        and that engine's ID (``DockerGPUSpawner``), which
        :meth:`reconcile_containers` checks; ``container_id=None`` leaves
        the recorded container as it is. ``slurm_job`` is the Slurm job the
        server runs as (``SlurmGPUSpawner``), which
        :meth:`reconcile_slurm_servers` checks; ``None`` leaves it as it is.

        Raises:
            NotFound: no such lease.
        """
        with self._write() as repo:
            lease = lease_or_404(repo, lease_id)
            lease.server_url = url
            if container_id is not None:
                lease.container_id, lease.docker_engine = container_id, docker_engine
            if slurm_job is not None:
                lease.slurm_job = slurm_job
            view = lease_view(lease)
        return view

    def server_leases(self) -> list[Lease]:
        """Granted leases of hub servers (detached rows, for the culler)."""
        return [
            x
            for x in self._world.active()
            if x.state == LeaseState.granted.value and x.holder_kind == HolderKind.server.value
        ]


def _devices_to_prefer(previous: Lease, kind: str, count: int) -> list[str] | None:
    """The whole devices of ``previous`` a restart of the same shape should
    get back (``None``: fractional, or another shape)."""
    if kind != "gpus" or previous.kind != "gpus" or previous.gpus != count:
        return None
    devices = [a.device_uuid for a in previous.allocations if a.kind == "device"]
    return devices if len(devices) == count else None


def _outside(nodes: Iterable[Node]) -> dict[str, str]:
    """The devices an engine takes no new work on, by UUID, with why: every
    device of a node not up, and those something outside the broker holds."""
    found: dict[str, str] = {}
    for node in nodes:
        if node.state != "up":
            why = f"node {node.name} is {node.state}" + (f": {node.reason}" if node.reason else "")
            found.update(dict.fromkeys((d.uuid for d in node.devices), why))
        found.update({uuid: f"held by {what}" for uuid, what in node.outside.items()})
    return found
