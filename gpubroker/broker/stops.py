"""Server stops the broker asks the hub for: an evicted, preempted or
culled lease of a hub server keeps its devices until the server has
stopped (so two servers never share a device), or until
``Broker.evict_timeout``. Each stop is a stored intent (``intents``, kind
``stop-server``), resumed by a restarted broker. A part of the broker
(:class:`gpubroker.core.Broker` delegates to it)."""

from __future__ import annotations

import datetime as dt
import functools
from collections.abc import Callable, Collection
from typing import Any

from ..commands import command
from ..store.models import HolderKind, Intent, Lease, LeaseState
from ..store.repository import Repository
from ..usage.intervals import CAUSE_ACTORS
from ..views import lease_view
from .runner import CommandRunner, lease_or_404
from .world import World

#: releases a lease (:meth:`Leases.release`): (lease, reason, now, cause, actor)
Release = Callable[[Lease, str, dt.datetime, str, str | None], None]


class ServerStops:
    """Evictions, and the stored stops of hub servers they ask for.

    Args:
        runner: the broker's command runner.
        world: the broker's state in memory (open stops by lease).
        release: release a lease, with its cause and actor.
        evict_timeout: ``Broker.evict_timeout`` (seconds).
        schedule: run or ask for a scheduling pass in the open transaction.
        notify: wake the long-polls of changed leases.
        log: the broker's logger.
    """

    def __init__(
        self,
        runner: CommandRunner,
        world: World,
        release: Release,
        evict_timeout: Callable[[], float],
        schedule: Callable[[Repository, dt.datetime], None],
        notify: Callable[[], None],
        log: Any,
    ) -> None:
        self.runner = runner
        self.world = world
        self.release = release
        self.evict_timeout = evict_timeout
        self.schedule = schedule
        self.notify = notify
        self.log = log
        #: called with the view of each server lease to stop (set by the
        #: service, ``Broker.on_evict``); ``None``: leases are released at once
        self.on_evict: Callable[[dict[str, Any]], None] | None = None
        #: ids of server leases whose holder an engine follows (a Docker
        #: container, :class:`~gpubroker.broker.docker_servers.DockerServers`,
        #: set by the service): past ``evict_timeout`` they are not released
        #: here; the engine's reconciliation stops the holder, then releases
        self.followed: Callable[[], Collection[int]] = lambda: ()
        #: whether a job lease's process is stopped first, as a hub server is
        #: (set by the job service): its evicted lease keeps its devices, with
        #: an open stop, until the job service has seen the process end and
        #: releases it, however long that takes (never at ``evict_timeout``)
        self.jobs_stopped_first = False

    def _stopped_first(self, lease: Lease) -> bool:
        """Whether ``lease``'s holder is stopped before its devices are freed:
        a hub server (when the hub is asked, :attr:`on_evict`) or a job (when
        a job service stops it, :attr:`jobs_stopped_first`)."""
        if lease.holder_kind == HolderKind.job.value:
            return self.jobs_stopped_first
        return lease.holder_kind == HolderKind.server.value and self.on_evict is not None

    def evict(
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
        restarted broker asks the hub again (:meth:`resume`, at ``Broker.adopt``), and the first
        reason stays the release reason."""
        if self._stopped_first(lease):
            repo = self.world.repo
            job = lease.holder_kind == HolderKind.job.value
            intent = self.open_stop(lease.id)
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
                self.world.stops[lease.id] = intent
                self.runner.rec(repo, now, actor).note(lease, "stopping", reason)
                holder = "job" if job else "server"
                self.log.warning("Stopping %s of lease %s: %s", holder, lease.id, reason)
                if not job:  # the job service sees the open stop at its next check
                    self._ask_hub(lease_view(lease) | {"release_reason": reason})
            if job:
                return False  # the job service releases it once its process ended
            if (now - intent.created).total_seconds() < self.evict_timeout():
                return False
            if lease.id in self.followed():
                return False  # its engine stops the holder first
            reason, cause = intent.reason, intent.cause or cause
            actor = self.asked_by(repo, lease.id) or CAUSE_ACTORS.get(cause, actor)
        self.release(lease, reason, now, cause, actor)
        self.log.warning("Evicted lease %s of %s: %s", lease.id, lease.user, reason)
        return True

    def asked_by(self, repo: Repository, lease_id: int) -> str | None:
        """Who asked for the stop of lease ``lease_id``'s server: the actor
        of its latest ``stopping`` transition (the scheduler, the culler, an
        admin, the user), ``None`` when none is recorded. Its release
        carries that actor, not the one who reports the server stopped."""
        stops = [e for e in repo.events_of(lease_id) if e.kind == "stopping"]
        return stops[-1].actor if stops else None

    def asked_at(self, lease_id: int) -> dt.datetime | None:
        """When the open stop of ``lease_id``'s server was first asked
        (aware UTC), or ``None``: no stop is open."""
        intent = self.open_stop(lease_id)
        return None if intent is None else intent.created

    def open_stop(self, lease_id: int) -> Intent | None:
        """The open ``stop-server`` intent of ``lease_id``, if any."""
        intent = self.world.stops.get(lease_id)
        return intent if intent is not None and intent.state == "open" else None

    def expire(self, repo: Repository, now: dt.datetime) -> None:
        """Release the leases whose server stop was asked ``evict_timeout``
        seconds ago or more and has not happened (but those :attr:`followed`)."""
        since = now - dt.timedelta(seconds=self.evict_timeout())
        stale = [i for i in self.world.stops.values() if i.created <= since]
        followed = set(self.followed()) if stale else set()
        for intent in stale:
            if intent.lease_id in followed:
                continue  # its engine stops the holder first
            lease = repo.lease(intent.lease_id)
            if (
                lease is not None
                and lease.holder_kind == HolderKind.job.value
                and lease.state == LeaseState.granted.value
                and self.jobs_stopped_first
            ):
                continue  # the job service releases it once its process ended
            if lease is not None and lease.state == LeaseState.granted.value:
                self.log.warning(
                    "The %s of lease %s did not stop in %s s; releasing it",
                    "job" if lease.holder_kind == HolderKind.job.value else "server",
                    lease.id,
                    self.evict_timeout(),
                )
                cause = intent.cause or "release"
                self.release(lease, intent.reason, now, cause, CAUSE_ACTORS.get(cause))
            else:
                intent.state, intent.done_at = "done", now

    def resume(self, repo: Repository) -> int:
        """Ask the hub again to stop the servers whose stop a previous run of
        the broker asked for (at start-up). Returns how many."""
        if self.on_evict is None:
            return 0
        count = 0
        for intent in list(self.world.stops.values()):
            lease = repo.lease(intent.lease_id)
            if lease is None or lease.state != LeaseState.granted.value:
                continue
            if lease.holder_kind != HolderKind.server.value:
                continue  # a job's stop: the job service resumes it
            intent.attempts += 1
            self.log.warning(
                "Resuming the stop of lease %s's server (asked %s): %s",
                lease.id,
                intent.created.isoformat(),
                intent.reason,
            )
            self._ask_hub(lease_view(lease) | {"release_reason": intent.reason})
            count += 1
        return count

    def _ask_hub(self, view: dict[str, Any]) -> None:
        """Ask the hub (:attr:`on_evict`) to stop the server of lease
        ``view`` once the open transaction, which stores the stop, has
        committed: a stop that rolls back is never asked for."""
        on_evict = self.on_evict
        if on_evict is not None:
            self.world.after_commit(functools.partial(on_evict, view))

    @command("culler")
    def stop_lease(self, lease_id: int, reason: str, cause: str = "release") -> None:
        """End a granted server lease the way an eviction does: its hub server
        is stopped first, then the lease is released with ``reason``. A job
        lease's process is stopped first in the same way, by the job service
        (:attr:`jobs_stopped_first`), which then releases the lease.

        Used by the culler (``cause`` ``cull``), and for a user who releases
        the lease of her running server (``DELETE /leases/{id}``): she keeps
        no GPU she gave back. External leases are released at once. The
        ``cause`` is recorded with the stop and on the release.

        Raises:
            NotFound: no such lease.
        """
        now = self.runner.now()
        with self.runner.write() as repo:
            lease = lease_or_404(repo, lease_id)
            actor = CAUSE_ACTORS.get(cause)
            if lease.state == LeaseState.granted.value and self.evict(
                lease, reason, now, cause, actor
            ):
                repo.flush()
                self.schedule(repo, now)
        self.notify()
