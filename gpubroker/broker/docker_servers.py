"""Reconciliation of notebook servers that run in Docker containers.

``DockerGPUSpawner`` tells the broker each server's container id and the
ID of the Docker engine that runs it, with the server's URL (``PATCH
/leases/{id}``). The container holds the lease's devices for as long as
it runs, whatever the hub thinks of the server, so the broker follows the
container, not the hub's listing. Every ``GPUBrokerApp.reconcile_interval``
it asks the engine at ``DockerEngine.docker_url`` about every recorded
container, off the event loop, and:

* releases the lease of a container found exited or gone in two
  reconciliations in a row, with what Docker said (``"exited with status
  137"``): a server the hub stops is one whose container has ended just
  before the spawner's own release (``server stopped``, or how it died),
  which comes in between and is kept; an ended container holds no device,
  so the wait costs nothing;
* stops a running container (SIGTERM to its processes,
  :data:`ORPHAN_GRACE` seconds, SIGKILL) whose server the hub has not
  listed in two reconciliations in a row (a stop that failed: JupyterHub
  forgets the server all the same), then releases its lease; until then
  the lease keeps its devices, and the hub's reconciliation leaves it
  alone (``Broker.reconcile``'s ``followed``);
* stops a running container whose server the broker asked the hub to
  stop (preemption, cull) ``Broker.evict_timeout`` seconds ago or more,
  then releases its lease with the stop's reason: the devices never go to
  the next holder while the container still runs
  (``ServerStops.followed``);
* never stops a container that is not the lease's: one whose environment
  does not hold ``GPUBROKER_LEASE_ID=<the lease's id>`` (as
  ``DockerGPUSpawner`` sets it) is left running and its lease kept, with
  an error logged (an admin may have recorded another container's id on
  the lease: ``PATCH /leases/{id}``);
* does nothing when Docker cannot be read (the state is unknown, no lease
  is ended on it, nor left to the hub's reconciliation: a container may
  still run on the devices), but says so at every round with the leases
  so held, and once as an error when Docker has not answered for
  :data:`UNREACHABLE_ALARM` seconds (an admin must check the engine, or
  release by hand the leases whose containers are gone);
* leaves containers of another engine, or of one the spawner could not
  name, to the hub's reconciliation (a container this engine has never
  seen is not thereby gone).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

from gpubroker.engines.base import EngineError, Handle
from gpubroker.engines.docker import DockerEngine

ORPHAN_GRACE = 10.0
"""Seconds a container the broker stops gets between SIGTERM and SIGKILL."""

UNREACHABLE_ALARM = 600.0
"""Seconds of a Docker engine not answering after which the leases it
holds back are reported as an error (once; warnings every round before)."""

LEASE_VARIABLE = "GPUBROKER_LEASE_ID"
"""The variable of a lease's container that names the lease (its id)."""

if TYPE_CHECKING:
    from gpubroker.core import Broker
    from gpubroker.model.holdings import LeaseRef

#: lease id -> (container id, what Docker says of it)
Ended = dict[int, tuple[str, str]]


class DockerServers:
    """Follows the Docker containers of ``broker``'s server leases (see the module).

    Args:
        broker: the broker whose server leases are followed.
        engine: gives the Docker engine to ask (made on first use).
        log: where warnings go.
    """

    def __init__(
        self, broker: Broker, engine: Callable[[], DockerEngine], log: logging.Logger
    ) -> None:
        self.broker = broker
        self.engine = engine
        self.log = log
        #: the ID of the engine asked, once it has answered
        self.here: str | None = None
        self._suspects: set[int] = set()
        #: seconds of Docker not answering before the error (see the module)
        self.unreachable_alarm = UNREACHABLE_ALARM
        #: monotonic time Docker first failed to answer, in the current outage
        self._unreachable_since: float | None = None
        self._alarmed = False
        #: leases whose container the last round found ended
        self._ended: set[int] = set()
        #: (lease id, container id) refused a stop: not the lease's container
        self._foreign: set[tuple[int, str]] = set()

    def watched(self) -> dict[int, LeaseRef]:
        """Granted server leases that name a container, by lease id."""
        return {x.id: x for x in self.broker.server_leases() if x.container_id}

    def followed(self) -> set[int]:
        """Ids of the leases whose container this follows: those on the
        engine it asks (before that engine first answered: every lease whose
        container's engine is named)."""
        return {
            lease_id
            for lease_id, x in self.watched().items()
            if x.docker_engine is not None and (self.here is None or x.docker_engine == self.here)
        }

    async def reconcile(
        self, alive: Collection[tuple[str, str]] | None = None, as_of: dt.datetime | None = None
    ) -> list[int]:
        """Ask Docker about every recorded container; release the leases
        of those ended, stop those of servers the hub has lost or whose stop
        is overdue (see the module).

        Args:
            alive: (user, server name) of every server the hub lists, or
                ``None`` when the hub could not be asked (no container is
                then taken for an orphan).
            as_of: aware UTC time the hub listing was requested; a lease
                created after it is not an orphan (its server may be newer).

        Returns:
            ids of the leases released.
        """
        watched = self.watched()
        if not watched:
            self._suspects = set()
            self._ended = set()
            return []
        docker = self.engine()
        asked = {x.id: (x.container_id or "", x.docker_engine) for x in watched.values()}
        try:
            here, (ended, elsewhere) = await asyncio.to_thread(self._ask, docker, asked)
        except EngineError as err:
            # the text only: the error's traceback holds the SDK's sockets
            self._unreachable(str(err))
            return []
        if self._unreachable_since is not None:
            self.log.info(
                "The Docker engine answers again after %.0f s",
                time.monotonic() - self._unreachable_since,
            )
            self._unreachable_since, self._alarmed = None, False
        self.here = here
        if elsewhere:
            self.log.warning(
                "The containers of leases %s run on another Docker engine than the one at "
                "DockerEngine.docker_url (%r): not checked; point it at the hub's engine",
                elsewhere,
                docker.docker_url or "from DOCKER_HOST",
            )
        running = [x for x in watched.values() if x.id not in ended and x.id not in elsewhere]
        # found ended twice in a row: the spawner's own release had its round
        seen, self._ended = self._ended, set(ended)
        ended = {x: said for x, said in ended.items() if x in seen}
        doomed = self._orphans(running, alive, as_of) | self._overdue(running)
        ended.update(await self._stop_all(docker, [(watched[x], why) for x, why in doomed.items()]))
        return self.broker.reconcile_containers(ended) if ended else []

    def _unreachable(self, why: str) -> None:
        """Say that Docker could not be read, with the leases it holds back
        (a warning each round; an error once past ``unreachable_alarm``)."""
        now = time.monotonic()
        if self._unreachable_since is None:
            self._unreachable_since = now
        out = now - self._unreachable_since
        held = sorted(self.followed())
        self.log.warning(
            "Cannot ask the Docker engine about servers' containers (for %.0f s): %s; "
            "leases %s are kept until it answers",
            out,
            why,
            held,
        )
        if out >= self.unreachable_alarm and not self._alarmed:
            self._alarmed = True
            self.log.error(
                "The Docker engine at DockerEngine.docker_url has not answered for %.0f s: "
                "leases %s keep their devices, neither checked nor left to the hub's "
                "reconciliation (their containers may still run); fix the engine or "
                "DockerEngine.docker_url, or release by hand (DELETE /leases/{id}) those "
                "whose containers are gone",
                out,
                held,
            )

    @staticmethod
    def _ask(
        docker: DockerEngine, asked: dict[int, tuple[str, str | None]]
    ) -> tuple[str, tuple[Ended, list[int]]]:
        return docker.engine_id(), docker.ended_containers(asked)

    def _orphans(
        self,
        running: list[LeaseRef],
        alive: Collection[tuple[str, str]] | None,
        as_of: dt.datetime | None,
    ) -> dict[int, str]:
        """The leases of ``running`` whose server the hub has not listed in
        this reconciliation nor in the one before (one listing may race a
        stop under way), with why; a round without a listing starts over."""
        if alive is None or as_of is None:
            self._suspects = set()
            return {}
        lost = {x.id for x in running if x.created < as_of and (x.user, x.server_name) not in alive}
        orphans = lost & self._suspects
        self._suspects = lost
        return {x: "its server is gone from the hub" for x in orphans}

    def _overdue(self, running: list[LeaseRef]) -> dict[int, str]:
        """The leases of ``running`` whose server stop the broker asked for
        ``Broker.evict_timeout`` seconds ago or more, with why."""
        seconds = self.broker.evict_timeout
        now = dt.datetime.now(dt.timezone.utc)
        overdue = {}
        for x in running:
            asked = self.broker.stop_asked_at(x.id)
            if asked is not None and (now - asked).total_seconds() >= seconds:
                overdue[x.id] = f"the hub did not stop its server in {seconds:g} s"
        return overdue

    async def _stop_all(self, docker: DockerEngine, doomed: list[tuple[LeaseRef, str]]) -> Ended:
        """Stop the containers of ``doomed`` together, off the event loop.

        Returns:
            lease id -> (container id, what was done) for the containers
            stopped; one Docker could not stop keeps its lease (a warning is
            logged) and is tried again at the next reconciliation.
        """
        if not doomed:
            return {}

        async def stop(lease: LeaseRef, why: str) -> tuple[int, tuple[str, str]] | None:
            container = lease.container_id or ""
            self.log.warning(
                "Stopping container %s of lease %s (server %s/%s): %s",
                container[:12],
                lease.id,
                lease.user,
                lease.server_name,
                why,
            )
            handle = Handle(docker.name, container, docker.node)
            try:
                env = await asyncio.to_thread(docker.container_env, container)
            except EngineError as err:
                self.log.warning("Cannot read container %s: %s", container[:12], err)
                return None
            named = None if env is None else env.get(LEASE_VARIABLE)
            if env is not None and named != str(lease.id):
                self._refuse(lease, container, named)
                return None
            try:
                await asyncio.to_thread(docker.stop, handle, ORPHAN_GRACE)
            except EngineError as err:
                self.log.warning("Cannot stop container %s: %s", container[:12], err)
                return None
            return lease.id, (container, f"was stopped by the broker: {why}")

        done = await asyncio.gather(*(stop(lease, why) for lease, why in doomed))
        return dict(x for x in done if x is not None)

    def _refuse(self, lease: LeaseRef, container: str, named: str | None) -> None:
        """Log (as an error the first time, then at debug level) that the
        container recorded on ``lease`` is not stopped: its environment
        names lease ``named`` (``None``: no lease), not this one."""
        key = (lease.id, container)
        log = self.log.debug if key in self._foreign else self.log.error
        self._foreign.add(key)
        log(
            "Not stopping container %s recorded on lease %s (server %s/%s): its %s is %s, "
            "not %s, so it is not this lease's container; the lease is kept: stop the "
            "server's real container, or release the lease (DELETE /leases/%s)",
            container[:12],
            lease.id,
            lease.user,
            lease.server_name,
            LEASE_VARIABLE,
            "unset" if named is None else repr(named),
            lease.id,
            lease.id,
        )
