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

:class:`Broker` is a facade: it holds the options (traitlets) and builds
its parts (:mod:`gpubroker.broker`), each given what it uses; every public
method is one line that calls a part.
"""

from __future__ import annotations

import contextlib
import datetime as dt
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
    Unicode,
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
from .broker.inventory import Inventory
from .broker.leases import Leases
from .broker.notices import Notices
from .broker.passloop import PassLoop
from .broker.queries import Queries
from .broker.release_asked import AskedRelease, release_asked
from .broker.runner import CommandRunner
from .broker.scheduling import Scheduling
from .broker.sharing import SharingOps
from .broker.stops import ServerStops
from .broker.waiters import Waiters
from .broker.world import World
from .enforce.mps import MPSControl
from .engines import Engine, LocalEngine, Node
from .model.holdings import DeviceRef, LeaseRef
from .policy_config import SchedulingPolicy
from .pools import Pools, PoolSpec
from .store.models import (
    Lease,
)
from .store.repository import Repository
from .transitions import EventBus


def utcnow() -> dt.datetime:
    """The current time, aware UTC: the broker's clock (its commands read it
    through their runner at each call, so tests may replace this function)."""
    return dt.datetime.now(dt.timezone.utc)


class Broker(LoggingConfigurable):
    """Owns leases and devices; see the module docstring. A facade over
    parts built in :meth:`_build_parts` with explicit dependencies: lease
    commands (:class:`~gpubroker.broker.leases.Leases`), scheduling
    (:class:`~gpubroker.broker.scheduling.Scheduling`), the inventory
    (:class:`~gpubroker.broker.inventory.Inventory`), server stops
    (:class:`~gpubroker.broker.stops.ServerStops`), admission
    (:class:`~gpubroker.broker.admission.Admission`), admin operations
    (:class:`~gpubroker.broker.admin.AdminOps`), notices
    (:class:`~gpubroker.broker.notices.Notices`), the sharing operations
    (:class:`~gpubroker.broker.sharing.SharingOps`), reads
    (:class:`~gpubroker.broker.queries.Queries`) and what is free
    (:class:`~gpubroker.broker.availability.Availability`). They share one
    :class:`~gpubroker.broker.runner.CommandRunner`; none reads another's
    attributes (a part that needs another's operation gets it as a callable).

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

    local_cgroup_root = Unicode(
        "auto",
        help="""The local engine's cgroup v2 directory for its launches (one
        cgroup each, so that every process of a job, whatever session or
        environment it makes, ends with it): "auto" makes
        "gpubroker-launches" under the broker's own cgroup in the cgroup v2
        mount (the broker must be root, or its cgroup delegated to it:
        systemd Delegate=yes); a path uses that directory; "" uses none
        (processes are then found through /proc alone). Where it cannot be
        made, the engine logs it and uses none.""",
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

    framework_context_mib = Integer(
        512,
        min=0,
        help="""MiB of a share that a framework's CUDA context takes outside
        its allocator: the framework caps give the allocator the share less
        this (at least half the share), so a process that fills its cap stays
        within the share, as the share watchdog measures it (NVML counts the
        context). Measured on an NVIDIA H200 (driver 580, CUDA 12, PyTorch):
        about 0.4-0.7 GiB per process.""",
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
        #: lease events go here after each command's commit
        self.bus = EventBus(self.log)
        self._world = World(self.session_factory, lambda: self.policy.fairshare_half_life)
        #: runs every command of the broker and its parts (stimulus, events)
        self.runner = CommandRunner(
            self._world, self.bus, self._after_command, clock=lambda: utcnow()
        )
        self._world.on_reload.append(self._after_rollback)
        #: where holders run and where the inventory comes from (the local
        #: host first; Docker and Slurm engines plug in beside it)
        self.engine: Engine = self._make_engine()
        self._build_parts()

    def _build_parts(self) -> None:
        """The parts the facade delegates to, each given what it uses. Parts
        built later are reached through lambdas (the dependencies are
        cyclic: a pass evicts, an eviction releases, a release asks for a
        pass)."""

        def schedule(repo: Repository, now: dt.datetime) -> None:
            self.scheduling.schedule(repo, now)

        def evict(*args: Any) -> bool:
            return self.stops.evict(*args)

        def policy() -> scheduler.Policy:
            return self.scheduling.policy()

        self.sharing = SharingOps(
            self.runner,
            self._world,
            self.backend,
            self.pools,
            self.mps,
            framework_caps=lambda: self.framework_caps,
            framework_context_mib=lambda: self.framework_context_mib,
            retry_backoff=lambda: self.grant_retry_backoff,
            schedule=schedule,
            schedule_now=self.schedule_now,
            notify=self._notify,
            log=self.log,
        )
        self.admission = Admission(
            self._world,
            self.pools,
            self.sharing.pool_spec,
            policy,
            default_class=lambda: self.policy.default_priority_class,
            max_gpus=lambda: self.max_gpus_per_request,
        )
        self.policy.check_default_class()  # a TraitError: a setting is wrong
        self.admin = AdminOps(
            self.runner,
            self._world,
            self.policy,
            policy,
            schedule,
            self._notify,
            evict,
            self.log,
        )
        self.notice_book = Notices(self.runner, self.log)
        self.stops = ServerStops(
            self.runner,
            self._world,
            lambda *args: self.leases.release(*args),
            lambda: self.evict_timeout,
            schedule,
            self._notify,
            self.log,
        )
        self.free = Availability(self.runner, self._scheduler_state, self.pools)
        self.queries = Queries(self.runner, self._world, self._waiters)
        self.inventory = Inventory(
            self.runner,
            self._world,
            self.engine,
            self.backend,
            self.sharing,
            schedule,
            self.schedule_now,
            self._notify,
            self.log,
        )
        self.scheduling = Scheduling(
            self.runner,
            self._world,
            self,
            self.sharing,
            lambda: self.inventory.topology,
            evict,
            self.stops.expire,
            self.queries.get_lease,
            self._waiters,
            self._notify,
            self.log,
        )
        self.leases = Leases(
            self.runner,
            self._world,
            self.admission,
            self.sharing,
            self.scheduling,
            self.stops,
            lambda: self.policy.default_priority_class,
            self._notify,
            self.log,
        )

    @observe("mps", "backend", "pools", "policy")
    def _pass_on(self, change: Any) -> None:
        """An option object set after start (device backend, MPS control,
        pools, scheduling policy) goes to the parts that hold it too."""
        holders = {
            "mps": (("sharing", "mps"),),
            "backend": (("sharing", "backend"), ("inventory", "backend")),
            "pools": (("sharing", "pools"), ("admission", "pools"), ("free", "pools")),
            "policy": (("admin", "config"),),  # Scheduling reads it at each use
        }
        for part_name, attribute in holders[change["name"]]:
            part = self.__dict__.get(part_name)
            if part is not None:
                setattr(part, attribute, change["new"])

    # -- commands and their events ---------------------------------------------------

    def _after_command(self, touched: set[int]) -> None:
        """After each outermost command: check the state (``check_state``)."""
        if self.check_state != "off":
            self.validate_state(touched)

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

    def inventory_source(self) -> dict[str, Any]:
        """Where the devices come from, as ``GET /devices`` says it:
        ``{"kind", "simulated", "message"}``. On the local engine, the
        device backend's (``nvml``, ``fake``: simulated); on Slurm,
        ``slurm``: the cluster's GRES, simulated only where the broker runs
        with the fake backend by choice (``make demo-slurm``), not where
        ``auto`` fell back to it on a head node without a driver."""
        backend = self.backend
        if self.engine.name == "local":
            simulated = bool(backend.simulated)
            kind = backend.kind
        else:
            simulated = bool(backend.simulated) and not backend.fallback
            kind = self.engine.name
        if simulated:
            message = "SIMULATED GPUs: no NVIDIA driver is in use; these devices are fake"
        elif kind == "slurm":
            message = "Slurm: the GPUs (GRES) of the cluster's nodes"
        else:
            message = "NVML"
        return {"kind": kind, "simulated": simulated, "message": message}

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

    def priority_classes(self) -> list[str]:
        """The names of the priority classes in force, sorted."""
        return sorted(self.scheduling.policy().classes)

    def add_notice(self, *args: Any, **kwargs: Any) -> None:
        """A notice for a lease's holder (:meth:`Notices.add_notice`)."""
        self.notice_book.add_notice(*args, **kwargs)

    def note_lease(self, *args: Any, **kwargs: Any) -> None:
        """A note in a lease's transition log (:meth:`Notices.note_lease`)."""
        self.notice_book.note_lease(*args, **kwargs)

    def notices(self, user: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        """Notices, newest first (:meth:`Notices.notices`)."""
        return self.notice_book.notices(user, limit)

    def share_caps(self) -> list[tuple[LeaseRef, str, int]]:
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

    def lease_events(self, lease_id: int) -> list[dict[str, Any]]:
        """The transition log of a lease (:meth:`Queries.lease_events`)."""
        return self.queries.lease_events(lease_id)

    def get_lease(self, lease_id: int) -> dict[str, Any]:
        """The view of a lease (:meth:`Queries.get_lease`)."""
        return self.queries.get_lease(lease_id)

    def list_leases(self, user: str | None = None, active: bool = True) -> list[dict[str, Any]]:
        """Lease views, oldest first (:meth:`Queries.list_leases`)."""
        return self.queries.list_leases(user, active)

    def device_rows(self) -> list[tuple[DeviceRef, list[dict[str, Any]]]]:
        """Every known device with its holders (:meth:`Queries.device_rows`)."""
        return self.queries.device_rows()

    async def wait_for_change(
        self, lease_id: int, timeout: float, known_version: int | None = None
    ) -> dict[str, Any]:
        """Wait for a lease to change (:meth:`Queries.wait_for_change`)."""
        return await self.queries.wait_for_change(lease_id, timeout, known_version)

    def server_leases(self) -> list[LeaseRef]:
        """Granted leases of hub servers (:meth:`Queries.server_leases`)."""
        return self.queries.server_leases()

    @property
    def on_evict(self) -> Callable[[dict[str, Any]], None] | None:
        """Called with the view of each server lease to stop (preemption,
        time limit, cull), so the service can stop its hub server
        (:attr:`ServerStops.on_evict`)."""
        return self.stops.on_evict

    @on_evict.setter
    def on_evict(self, callback: Callable[[dict[str, Any]], None] | None) -> None:
        self.stops.on_evict = callback

    @property
    def containers_followed(self) -> Callable[[], Collection[int]]:
        """Gives the ids of server leases whose container the service follows:
        past ``evict_timeout`` they are left to it (:attr:`ServerStops.followed`)."""
        return self.stops.followed

    @containers_followed.setter
    def containers_followed(self, followed: Callable[[], Collection[int]]) -> None:
        self.stops.followed = followed

    def stop_asked_at(self, lease_id: int) -> dt.datetime | None:
        """When the broker first asked the hub to stop ``lease_id``'s server
        (aware UTC), or ``None`` (:meth:`ServerStops.asked_at`)."""
        return self.stops.asked_at(lease_id)

    def stop_lease(self, lease_id: int, reason: str, cause: str = "release", **kwargs: Any) -> None:
        """End a granted server lease as an eviction does (:meth:`ServerStops.stop_lease`)."""
        self.stops.stop_lease(lease_id, reason, cause, **kwargs)

    # -- scheduling (the Scheduling part) --------------------------------------------

    @property
    def passes(self) -> PassLoop | None:
        """Coalesces passes (set by the service; ``None``: every command
        runs one) (:attr:`Scheduling.passes`)."""
        return self.scheduling.passes

    @passes.setter
    def passes(self, passes: PassLoop | None) -> None:
        self.scheduling.passes = passes

    async def after_pass(self, view: dict[str, Any], timeout: float = 1.0) -> dict[str, Any]:
        """A lease's view once its pass has run (:meth:`Scheduling.after_pass`)."""
        return await self.scheduling.after_pass(view, timeout)

    async def settled(self, timeout: float = 1.0) -> None:
        """Once the commands so far are covered by a pass (:meth:`Scheduling.settled`)."""
        await self.scheduling.settled(timeout)

    def schedule_now(self, **kwargs: Any) -> None:
        """A scheduling pass of its own (:meth:`Scheduling.schedule_now`)."""
        self.scheduling.schedule_now(**kwargs)

    def load_held_usage(self, **kwargs: Any) -> int:
        """Charge the leases held across a restart (:meth:`Scheduling.load_held_usage`)."""
        return self.scheduling.load_held_usage(**kwargs)

    def write_usage(self) -> int:
        """Write the changed fair-share usage records (:meth:`Scheduling.write_usage`)."""
        return self.scheduling.write_usage()

    def _scheduler_state(self) -> tuple[scheduler.SchedulerState, dict[int, Lease]]:
        """The scheduler's view of memory (:meth:`Scheduling.state`)."""
        return self.scheduling.state()

    # -- lease commands (the Leases part) ----------------------------------------------

    def adopt(self, **kwargs: Any) -> dict[str, int]:
        """Re-adopt the store's leases after a (re)start (:meth:`Leases.adopt`)."""
        return self.leases.adopt(**kwargs)

    def request_lease(
        self, user: str, server_name: str, *args: Any, **kwargs: Any
    ) -> dict[str, Any]:
        """Ask for slots for a user's server (:meth:`Leases.request_lease`)."""
        return self.leases.request_lease(user, server_name, *args, **kwargs)

    def release_lease(self, lease_id: int, reason: str, **kwargs: Any) -> dict[str, Any]:
        """Release a lease (:meth:`Leases.release_lease`)."""
        return self.leases.release_lease(lease_id, reason, **kwargs)

    async def release_asked(
        self, lease_id: int, reason: str, *args: Any, **kwargs: Any
    ) -> AskedRelease:
        """Release a lease as a person or tool asks: a running holder is
        stopped first (:func:`~gpubroker.broker.release_asked.release_asked`)."""
        return await release_asked(self, lease_id, reason, *args, **kwargs)

    def reconcile(self, *args: Any, **kwargs: Any) -> list[int]:
        """Release leases whose hub server is gone (:meth:`Leases.reconcile`)."""
        return self.leases.reconcile(*args, **kwargs)

    def reconcile_containers(self, ended: dict[int, tuple[str, str]]) -> list[int]:
        """Release leases whose container ended (:meth:`Leases.reconcile_containers`)."""
        return self.leases.reconcile_containers(ended)

    def reconcile_slurm_servers(self, ended: dict[int, tuple[str, str]]) -> list[int]:
        """Release leases whose Slurm job ended (:meth:`Leases.reconcile_slurm_servers`)."""
        return self.leases.reconcile_slurm_servers(ended)

    def set_server_url(self, lease_id: int, url: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Record where a lease's server listens (:meth:`Leases.set_server_url`)."""
        return self.leases.set_server_url(lease_id, url, *args, **kwargs)

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

    # -- sessions and notification -------------------------------------------------

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
        self._waiters.wake(self.queries.version_of)

    # -- inventory -----------------------------------------------------------------

    def _make_engine(self) -> Engine:
        """The engine ``engine_kind`` names (Slurm's configured as SlurmEngine)."""
        if self.engine_kind == "slurm":
            from .engines.slurm import SlurmEngine

            return SlurmEngine(parent=self)
        return LocalEngine(self.backend, cgroup_root=self.local_cgroup_root)

    @property
    def inventory_changes(self) -> bool:
        """Whether the engine's inventory changes by itself (:attr:`Inventory.changes`)."""
        return self.inventory.changes

    def outside_reason(self, uuid: str, admin: bool = True) -> str | None:
        """Why the engine takes no new work on a device, naming whose outside
        job holds it only for ``admin`` (:meth:`Inventory.outside_reason`)."""
        return self.inventory.outside_reason(uuid, admin)

    def sync_inventory(
        self, nodes: list[Node] | None = None, **kwargs: Any
    ) -> list[dict[str, Any]]:
        """Write the engine's devices into the store (:meth:`Inventory.sync_inventory`)."""
        return self.inventory.sync_inventory(nodes, **kwargs)

    def inventory_unknown(self, why: str) -> None:
        """No new grants until the engine's inventory is read (:meth:`Inventory.unknown`)."""
        self.inventory.unknown(why)

    def rebind_lease(self, lease_id: int, uuids: Sequence[str], **kwargs: Any) -> list[str]:
        """Record the devices an engine bound a lease to (:meth:`Inventory.rebind_lease`)."""
        return self.inventory.rebind_lease(lease_id, uuids, **kwargs)
