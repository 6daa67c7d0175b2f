"""Scheduling in the broker: the pure policy in force, the scheduler's view
of memory, one pass and its decisions applied, coalesced passes, and the
answers that wait for a pass. A part of the broker
(:class:`gpubroker.core.Broker` delegates to it)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from .. import scheduler
from ..commands import command
from ..gcpause import paused_gc
from ..passes import PREPARING, apply_decisions, build_state
from ..policy_config import SchedulingPolicy
from ..store.models import Lease, LeaseState
from ..store.repository import Repository
from ..usage.intervals import release_cause
from .passloop import PassLoop
from .runner import CommandRunner
from .sharing import SharingOps
from .waiters import Waiters
from .world import World


class Settings(Protocol):
    """The options of ``Broker`` scheduling reads (at each use: they may be
    configured after start)."""

    policy: SchedulingPolicy
    mig_placement: str
    share_placement: str
    share_mix_gib: list[float]
    usage_write_interval: float


class Scheduling:
    """Passes of the pure scheduler over the broker's memory.

    Args:
        runner: the broker's command runner.
        world: the broker's state in memory.
        settings: the broker's options (:class:`Settings`).
        sharing: the sharing operations (pools, MIG inventory, grants made real).
        topology: the topology of this node's devices, by node, as it is
            now (:attr:`Inventory.topology`).
        evict: end a lease as an eviction does (:meth:`ServerStops.evict`).
        expire_stops: release leases whose server stop timed out
            (:meth:`ServerStops.expire`).
        get_lease: the view of a lease (:meth:`Queries.get_lease`).
        waiters: the long-poll waiters per lease.
        notify: wake the long-polls of changed leases.
        log: the broker's logger.
    """

    def __init__(
        self,
        runner: CommandRunner,
        world: World,
        settings: Settings,
        sharing: SharingOps,
        topology: Callable[[], Mapping[str, scheduler.Topology]],
        evict: Callable[[Lease, str, dt.datetime, str, str | None], bool],
        expire_stops: Callable[[Repository, dt.datetime], None],
        get_lease: Callable[[int], dict[str, Any]],
        waiters: Waiters,
        notify: Callable[[], None],
        log: Any,
    ) -> None:
        self.runner = runner
        self.world = world
        self.settings = settings
        self.sharing = sharing
        self.topology = topology
        self.evict = evict
        self.expire_stops = expire_stops
        self.get_lease = get_lease
        self.waiters = waiters
        self.notify = notify
        self.log = log
        #: set by the service: coalesce passes (None: every command runs one)
        self.passes: PassLoop | None = None
        self._usage_written = time.monotonic()
        self._policy_cache: tuple[tuple[int, str], scheduler.Policy] | None = None

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
            if not self.may_grant_now(view.get("kind", "gpus"), view.get("pool")):
                return view  # the pass could not grant it now: the long-poll sees its verdict
            await self.passes.settled(timeout=timeout)
            view = self.get_lease(int(view["id"]))
        while (
            view["state"] == LeaseState.pending.value
            and (view.get("queue") or {}).get("reason") == PREPARING
            and (remaining := deadline - time.monotonic()) > 0
        ):
            await self.waiters.wait(int(view["id"]), int(view["version"]), remaining)
            view = self.get_lease(int(view["id"]))
        return view

    def may_grant_now(self, kind: str, wanted: str | None) -> bool:
        """Whether a pass may grant a pending request of slot ``kind`` in
        pool ``wanted`` (``None``: any) at once: always for MIG instances
        and shares; for whole devices, when a device of an exclusive pool
        (of the pool asked for, if one was) is free: in service, not held,
        not kept for another request. When not, the request's first verdict
        is a wait (or a preemption, which takes a grace period): it is
        answered without waiting for the pass, and its pass is lazy."""
        if kind != "gpus":
            return True
        inputs = self.world.refresh_inputs()
        taken = inputs.held_devices() | inputs.earmarked_devices()
        for device in self.world.present_devices():
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
        server stops that took longer than ``Broker.evict_timeout`` end first."""
        now = self.runner.now()
        with self.runner.write() as repo:
            self.expire_stops(repo, now)
            repo.flush()
            self.schedule(repo, now, force=True)
            if time.monotonic() - self._usage_written >= self.settings.usage_write_interval:
                self._write_usage()
        self.notify()

    @command("broker")
    def load_held_usage(self) -> int:
        """Charge the leases held across this broker's restart, in fair
        share, as the usage ledger counts them (:meth:`World.load_held`); the
        service calls it once ``Ledger.start`` has reopened their intervals.
        Returns how many leases it found."""
        return self.world.load_held()

    def write_usage(self) -> int:
        """Write the fair-share usage records that changed since the last
        write (``Broker.usage_write_interval``; the service calls it when it
        stops). Returns how many were written."""
        with self.runner.write():
            return self._write_usage()

    def _write_usage(self) -> int:
        self._usage_written = time.monotonic()
        written = self.world.write_usage()
        if written:
            self.log.debug("Wrote the usage records of %s users", written)
        return written

    def policy(self) -> scheduler.Policy:
        """The pure policy: config plus quotas stored through the admin API
        (built again only when the stored quotas changed)."""
        key = (self.world.quota_version, self.settings.policy.fingerprint())
        if self._policy_cache is None or self._policy_cache[0] != key:
            stored = [(q.kind, q.name, q.guaranteed, q.limit) for q in self.world.quotas.values()]
            self._policy_cache = (key, self.settings.policy.build(stored))
        return self._policy_cache[1]

    def schedule(
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
        ``Broker.lazy_pass_factor``).

        When an eviction released devices, one more pass hands them on.
        """
        if not force and self.passes is not None and not self.passes.at_once(lazy):
            return
        with paused_gc():
            evicted, decisions = self._pass(repo, now)
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
            self.schedule(repo, now, again=False, force=True)
        if self.passes is not None and again:
            self.passes.ran()

    def _pass(self, repo: Repository, now: dt.datetime) -> tuple[bool, scheduler.Decisions]:
        """Build the scheduler's view, decide and apply the decisions in
        ``repo``'s transaction; (whether a lease was evicted, decisions)."""
        state, leases = self.state()
        decisions = scheduler.schedule(state, now)
        evicted = apply_decisions(
            repo,
            decisions,
            leases,
            now,
            lambda lease, why: self.evict(
                lease, why, now, release_cause(why, "scheduler", lease.state), "scheduler"
            ),
            self.sharing.prepare,
            self.runner.rec(repo, now, "scheduler"),
            self.world.inputs,
            state,
        )
        return evicted, decisions

    def state(self) -> tuple[scheduler.SchedulerState, dict[int, Lease]]:
        """The scheduler's view of memory (:func:`build_state`): a grant
        being made (MIG instances, an MPS daemon starting) is left out of
        the requests and counts as running with the parts it is about to
        hold (:meth:`SharingOps.preparing_running`), so its shares' memory
        and its MIG slices are taken for every pass meanwhile; MIG
        instances being made also occupy their slices as instances."""
        sharing = self.sharing
        state, leases = build_state(
            self.world,
            self.policy(),
            self.topology(),
            sharing.device_pools,
            sharing.scheduler_instances(),
            self.settings.mig_placement,
            skip=sharing.preparing,
            share_placement=self.settings.share_placement,
            share_sizes=tuple(round(s * 1024) for s in self.settings.share_mix_gib),
        )
        preparing = sharing.preparing_running()
        if preparing:
            running = sorted((*state.running, *preparing), key=lambda r: r.lease_id)
            state = dataclasses.replace(state, running=tuple(running))
        return state, leases
