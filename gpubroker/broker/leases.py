"""Lease commands: a request admitted and queued, a release, the
reconciliations with the hub and the engines, the adoption at start-up,
and where a server listens. A part of the broker
(:class:`gpubroker.core.Broker` delegates to it)."""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any, cast

from ..commands import command
from ..errors import BadRequest, Conflict, Forbidden
from ..passes import PREPARING, QUEUED, QUEUED_MESSAGE, set_wait
from ..store.models import ACTIVE_STATES, HolderKind, Lease, LeaseState
from ..store.repository import Repository
from ..usage.intervals import CAUSE_ACTORS
from ..views import isoformat, lease_view, summary
from .admission import Admission
from .runner import CommandRunner, lease_or_404
from .scheduling import Scheduling
from .sharing import SharingOps
from .stops import ServerStops
from .world import World

#: how much later than a lease's request its server's start may be dated
#: and still be that lease's server (clocks of the hub and the broker)
STARTED_SLACK = dt.timedelta(seconds=60)


class Leases:
    """The commands that create, release and adopt leases.

    Args:
        runner: the broker's command runner.
        world: the broker's state in memory.
        admission: the checks a request passes before it is stored.
        sharing: the sharing operations (MIG instances undone at release).
        scheduling: passes (run or asked for), the policy in force.
        stops: evictions and the stored stops of hub servers.
        default_class: the configured default priority class's name.
        notify: wake the long-polls of changed leases.
        log: the broker's logger.
    """

    def __init__(
        self,
        runner: CommandRunner,
        world: World,
        admission: Admission,
        sharing: SharingOps,
        scheduling: Scheduling,
        stops: ServerStops,
        default_class: Callable[[], str],
        notify: Callable[[], None],
        log: Any,
    ) -> None:
        self.runner = runner
        self.world = world
        self.admission = admission
        self.sharing = sharing
        self.scheduling = scheduling
        self.stops = stops
        self.default_class = default_class
        self.notify = notify
        self.log = log

    @command("broker")
    def adopt(self) -> dict[str, int]:
        """Re-adopt the leases of the store after a (re)start.

        A granted lease whose MIG instance no longer exists (a GPU reset, a
        reboot, someone's ``nvidia-smi mig -dci``) is evicted: its server is
        stopped and the lease released with that reason.

        Returns:
            counts of ``granted`` and ``pending`` leases found.
        """
        now = self.runner.now()
        with self.runner.write() as repo:
            # the stops a previous run stored first: one decided below is
            # asked for as it is stored, never a second time as a resumed one
            self.stops.resume(repo)
            counts = {state: 0 for state in ACTIVE_STATES}
            for lease in repo.active_leases():
                counts[lease.state] += 1
                lost = self.sharing.lost_instances(lease)
                if lost:
                    why = f"its MIG instance {lost[0]} no longer exists (GPU reset or reboot?)"
                    self.log.warning("Lease %s: %s", lease.id, why)
                    self.stops.evict(lease, why, now, "reconcile", "reconcile")
            repo.flush()
            self.scheduling.schedule(repo, now)
        self.log.info(
            "Adopted %s granted and %s pending leases", counts["granted"], counts["pending"]
        )
        self.notify()
        return counts

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
                transaction; only for an ``admin`` (the spawner, which
                saw the server exit): that release says the server has
                stopped, so no stop is asked.

        Returns:
            the lease view (``state`` ``granted`` or ``pending``); with
            ``dry_run``, ``{"admitted": True, "user", "gpus", "kind",
            "weight", "priority_class", "group"}``.

        Raises:
            BadRequest: ``gpus`` outside 1..:meth:`request_limit`, a pool,
                profile or share size the pools cannot serve (see
                :meth:`shape`), unknown class, non-positive time limit.
            Forbidden: a user or group limit would be exceeded (held plus
                pending), ``group`` is not one of the user's groups, or a
                caller not ``admin`` names an active lease in ``restart_of``.
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
        policy = self.scheduling.policy()
        admission.class_for_caller(priority_class, admin, policy)
        cls = priority_class or self.default_class()
        if cls not in policy.classes:
            raise BadRequest(
                f"priority_class: must be one of {sorted(policy.classes)}, got {cls!r}"
            )
        if time_limit is not None and time_limit <= 0:
            raise BadRequest(f"time_limit: must be a positive number of seconds, got {time_limit}")
        charged = admission.charge_group(user, group, groups, policy)
        admission.check_guarantee_room(policy, cls, user, charged, shape.weight)
        now = self.runner.now()
        with self.runner.write() as repo:
            previous = replacing = None
            freed = False  # a restart released the lease it replaces
            if restart_of is not None:
                previous = self._restarted(repo, restart_of, user, server_name, holder_kind)
                if previous.state in ACTIVE_STATES:
                    replacing = previous
                    if not admin:
                        # replacing it releases it at once: that says its
                        # server has stopped, which only the spawner may say
                        raise Forbidden(
                            f"restart_of: lease {previous.id} is still {previous.state}; "
                            "only a broker admin (the spawner) may replace an active "
                            f"lease: release it first (DELETE /api/v1/leases/{previous.id}"
                            " stops its server)"
                        )
            if holder_kind == HolderKind.server.value:
                self._check_no_active_lease(repo, user, server_name, restart_of)
            # before the release: a refusal must leave the previous lease, and
            # its devices (a MIG instance is destroyed at release), untouched
            admission.check_limits(policy, user, charged, shape.weight, replacing)
            if replacing is not None and not dry_run:
                self.release(replacing, "server restarted", now)
                repo.flush()
                freed = True
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
            self.world.add_lease(lease)
            detail: dict[str, Any] = {
                "summary": summary(lease),
                "priority_class": cls,
                "group": charged,
            }
            if previous is not None:
                detail["restart_of"] = previous.id
            self.runner.rec(repo, now).created(lease, f"requested {summary(lease)}", detail)
            # nothing free it could have (and no restart freed slots): its pass
            # can only place it in the queue
            lazy = (
                self.scheduling.passes is not None
                and not freed
                and not self.scheduling.may_grant_now(lease.kind, lease.pool)
            )
            self.scheduling.schedule(repo, now, lazy=lazy)
            if lease.state == LeaseState.pending.value and lease.queue_reason is None:
                # the pass that covers it runs a little later (coalesced)
                set_wait(lease, QUEUED, QUEUED_MESSAGE, None, inputs=self.world.inputs)
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
        self.notify()
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
        existing = self.world.server_lease(user, server_name, replaced or 0)
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
        now = self.runner.now()
        with self.runner.write() as repo:
            lease = lease_or_404(repo, lease_id)
            if lease.state != LeaseState.released.value:
                # a request withdrawn frees nothing, unless devices were earmarked
                # for it, its MIG instance was being made, or its reservation kept
                # a free device back (then others may take them at once)
                lazy = (
                    self.scheduling.passes is not None
                    and lease.state == LeaseState.pending.value
                    and not lease.earmarked
                    and lease.queue_reason != PREPARING
                    and not self.scheduling.may_grant_now("gpus", None)
                )
                stopping = self.stops.open_stop(lease.id)
                cause, actor = "release", None
                if stopping is not None:  # the broker asked for this stop: its reason
                    holder = "job" if lease.holder_kind == HolderKind.job.value else "server"
                    reason = f"{stopping.reason} ({holder} stopped)"
                    cause = stopping.cause or "release"
                    # and its actor: who asked for the stop (the scheduler,
                    # the culler, an admin, the user), not the spawner that
                    # reports it
                    actor = self.stops.asked_by(repo, lease.id) or CAUSE_ACTORS.get(cause)
                self.release(lease, reason, now, cause, actor)
                repo.flush()
                self.scheduling.schedule(repo, now, lazy=lazy)
                self.log.info("Released lease %s of %s: %s", lease.id, lease.user, reason)
            view = lease_view(lease)
        self.notify()
        return view

    def release(
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
        repo = self.world.repo  # every lease in memory is the world's
        if lease.state == LeaseState.granted.value:
            self.world.charge(lease, now)
            self._unrealize_after_commit(lease)
        elif cause == "release":
            cause = "cancel"
        self.sharing.forget_retry(lease.id)
        self.runner.rec(repo, now, actor).transition(
            lease, LeaseState.released.value, reason, {"cause": cause}
        )
        stop = self.world.stops.get(lease.id)
        if stop is not None and stop.state == "open":
            stop.state, stop.done_at = "done", now
        lease.released_at = now
        lease.release_reason = reason
        lease.queue_position = lease.queue_reason = lease.queue_message = None
        lease.queue_eta = None
        lease.earmarked = None
        for allocation in lease.allocations:
            allocation.active = False

    def _unrealize_after_commit(self, lease: Lease) -> None:
        """Destroy the on-demand MIG instances ``lease`` holds once its
        release has committed (:meth:`World.after_commit`): a release that
        rolls back leaves its holder, still granted in the store, on its
        instances. Without an actuator (destroyed at once), a pass then
        hands their slices on, as the release's own pass could not."""
        held = [
            _HeldSlot(a.kind, a.device_uuid, a.instance_uuid)
            for a in lease.allocations
            if a.active and a.kind == "mig" and a.instance_uuid
        ]
        if not held:
            return
        # what it held, as its allocations were before the release
        stand_in = cast(Lease, _Held(held))

        def destroy() -> None:
            self.sharing.unrealize(stand_in)
            if self.sharing.actuator is None:
                self.scheduling.schedule_now()

        self.world.after_commit(destroy)

    @command("reconcile")
    def reconcile(
        self,
        servers: Iterable[tuple[str, str]],
        as_of: dt.datetime,
        followed: Collection[int] = (),
        started: Mapping[tuple[str, str], dt.datetime | None] | None = None,
    ) -> list[int]:
        """Release server leases whose hub server no longer exists, or is a
        newer server of the same name.

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
            started: when each listed server was started (the hub's
                ``started``, aware UTC), where known. JupyterHub sets it
                before the spawner starts, so a server's own lease is
                requested after it; a lease requested more than
                :data:`STARTED_SLACK` before its server started belongs to
                an earlier server of that name (its release failed, e.g.
                while the broker was down, and the user started the server
                again, perhaps without GPUs) and is released.

        Returns:
            ids of the leases released.
        """
        alive = set(servers)
        skip = set(followed)
        since = started or {}

        def gone(lease: Lease) -> str | None:
            if lease.holder_kind != HolderKind.server.value or lease.created >= as_of:
                return None
            if lease.id in skip:
                return None
            name = f"{lease.user}/{lease.server_name}"
            key = (lease.user, lease.server_name)
            if key not in alive:
                return f"reconcile: server {name} is gone from the hub"
            newer = since.get(key)
            if newer is not None and newer > lease.created + STARTED_SLACK:
                return (
                    f"reconcile: server {name} was started again at {isoformat(newer)},"
                    " after this lease was requested; it is not this lease's server"
                )
            return None

        return self._reconcile_release(gone, "server gone")

    def _reconcile_release(self, why: Callable[[Lease], str | None], what: str) -> list[int]:
        """Release every active lease ``why`` gives a reason for (cause
        ``reconcile``; one whose server stop the broker had asked for keeps
        that stop's reason first, its cause and its actor), then one pass;
        return their ids."""
        released = []
        now = self.runner.now()
        with self.runner.write() as repo:
            for lease in self.world.active():
                reason = why(lease)
                if reason is None:
                    continue
                cause, actor = "reconcile", None
                stopping = self.stops.open_stop(lease.id)
                if stopping is not None:
                    reason, cause = f"{stopping.reason} ({reason})", stopping.cause or cause
                    actor = self.stops.asked_by(repo, lease.id) or CAUSE_ACTORS.get(cause)
                self.release(lease, reason, now, cause, actor)
                released.append(lease.id)
            if released:
                repo.flush()
                self.scheduling.schedule(repo, now)
        if released:
            self.log.warning("Reconciliation released leases %s (%s)", released, what)
            self.notify()
        return released

    @command("reconcile")
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

    @command("reconcile")
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

    @command("broker")
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

        The change is noted in the lease's transition log (``server-recorded``,
        with what was recorded and the actor), so the audit log shows an
        admin's record on another user's lease (reconciliation ends a lease
        by what is recorded here); the spawner's own records, made with the
        broker's service token, act for the user and are not audited.

        Raises:
            NotFound: no such lease.
        """
        now = self.runner.now()
        with self.runner.write() as repo:
            lease = lease_or_404(repo, lease_id)
            lease.server_url = url
            detail: dict[str, Any] = {"server_url": url}
            if container_id is not None:
                lease.container_id, lease.docker_engine = container_id, docker_engine
                detail |= {"container_id": container_id, "docker_engine": docker_engine}
            if slurm_job is not None:
                lease.slurm_job = slurm_job
                detail["slurm_job"] = slurm_job
            self.runner.rec(repo, now).note(lease, "server-recorded", "server recorded", detail)
            view = lease_view(lease)
        return view


@dataclasses.dataclass(frozen=True)
class _HeldSlot:
    """An active MIG allocation as it was when its lease was released
    (what :meth:`SharingOps.unrealize` reads of it)."""

    kind: str
    device_uuid: str
    instance_uuid: str | None
    active: bool = True


@dataclasses.dataclass(frozen=True)
class _Held:
    """The MIG allocations a released lease held (a stand-in for the lease)."""

    allocations: list[_HeldSlot]


def _devices_to_prefer(previous: Lease, kind: str, count: int) -> list[str] | None:
    """The whole devices of ``previous`` a restart of the same shape should
    get back (``None``: fractional, or another shape)."""
    if kind != "gpus" or previous.kind != "gpus" or previous.gpus != count:
        return None
    devices = [a.device_uuid for a in previous.allocations if a.kind == "device"]
    return devices if len(devices) == count else None
