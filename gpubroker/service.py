"""Wiring of a running broker: store, devices, core, HTTP server and loops.

Runs as a JupyterHub-managed service: the hub passes ``JUPYTERHUB_API_TOKEN``,
``JUPYTERHUB_API_URL``, ``JUPYTERHUB_SERVICE_URL`` and
``JUPYTERHUB_SERVICE_PREFIX`` in the environment.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import math
import os
import signal
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from jupyterhub.services.auth import HubAuth, HubOAuth
from tornado.httpclient import AsyncHTTPClient, HTTPClientError
from tornado.httpserver import HTTPServer
from traitlets import TraitError

from .api.app import make_app
from .broker.actuator import Actuator
from .broker.docker_servers import DockerServers
from .broker.leases import STARTED_SLACK
from .broker.passloop import PassLoop
from .broker.slurm_servers import SlurmServers
from .core import Broker, utcnow
from .culler import Culler
from .devices import load_backend
from .engines.base import EngineError, Node
from .engines.docker import DockerEngine
from .hub import HubClient, parse_time
from .hub_tls import InternalTLS, from_environment
from .jobs.service import JobService
from .observe.metrics import BrokerMetrics
from .share_guard import ShareGuard
from .store.db import check_schema, make_engine, make_session_factory, shown_url, upgrade
from .store.lock import DatabaseLocked, DatabaseUnavailable, WriterLock, describe_self
from .usage.ledger import EngineTelemetry, Ledger
from .usage.workers import ReportWorkers

if TYPE_CHECKING:
    from .app import GPUBrokerApp


#: exit status of a broker that lost its database lock
LOST_LOCK = 4


class SettingError(Exception):
    """A setting the configuration got wrong, found while the broker's
    parts are built at its start (a ``default_priority_class`` no class
    has): the broker does not start (``gpubroker serve`` exits 2)."""


class BrokerService:
    """One running broker process.

    Args:
        app: the configured :class:`~gpubroker.app.GPUBrokerApp`.
        log: its logger.
    """

    def __init__(self, app: GPUBrokerApp, log: Any) -> None:
        self.app = app
        self.log = log
        self._stop = asyncio.Event()
        #: the process's exit status: 0, or 3 (hub gone), 4 (database lock lost)
        self.exit_code = 0
        #: JupyterHub's internal TLS (``internal_ssl``), if the hub turned it on
        self.tls: InternalTLS | None = from_environment(os.environ)

    async def _take_lock(self) -> None:
        """One writer per database: the lock, before any migration, adoption
        or pass. A hub-managed broker waits up to ``lock_wait_timeout`` for a
        previous broker of a hub that died to exit (a hub stops when its
        managed service fails at its start); a standby
        (``GPUBrokerApp.standby``) waits as long as it takes; others refuse
        at once.

        Raises:
            DatabaseLocked: held by another broker (for longer than the wait).
        """
        self.engine = make_engine(self.app.db_url)
        self.lock = WriterLock(self.engine, describe_self(self._url()))
        managed = bool(os.environ.get("JUPYTERHUB_SERVICE_NAME"))
        wait = self.app.lock_wait_timeout if managed else 0
        deadline = float("inf") if self.app.standby else time.monotonic() + wait
        said = -float("inf")
        while True:
            try:
                self.lock.acquire()
                return
            except (DatabaseLocked, DatabaseUnavailable) as err:
                now = time.monotonic()
                unreachable_active = isinstance(err, DatabaseUnavailable) and not self.app.standby
                if now >= deadline or unreachable_active:
                    raise
                if not self.app.standby or now - said >= 60:
                    self.log.warning("Waiting for the database lock: %s", err)
                    said = now
                await asyncio.sleep(1)

    def _build(self) -> None:
        app = self.app
        self.log.info("Store: %s", shown_url(app.db_url))
        if app.upgrade_db:
            upgrade(app.db_url)
        else:
            check_schema(app.db_url)  # never run on a schema of another release
        self.backend = load_backend(app.device_backend, parent=app, log=self.log)
        self.broker = Broker(
            parent=app, session_factory=make_session_factory(self.engine), backend=self.backend
        )
        self.hub = HubClient(parent=app)
        self.hub_auth = HubAuth(
            parent=app,
            api_token=self.hub.api_token,
            api_url=self.hub.api_url,
            cache_max_age=app.token_cache_max_age,
        )
        #: the panel's login (OAuth cookies; the API takes tokens only)
        self.panel_auth = self._panel_auth() if app.panel and self.hub.api_token else None
        if app.panel and self.panel_auth is None:
            self.log.warning("No web panel: no hub API token to log users in with")
        self.broker.on_evict = self._evicted
        self.broker.passes = PassLoop(
            self.broker.pass_interval, lazy_factor=self.broker.lazy_pass_factor
        )
        self.broker.actuator = Actuator(self.log)
        self.culler = Culler(self.broker, self.hub, parent=app)
        # with the hub's internal TLS, servers take no certificate of the
        # broker's: their kernels cannot be read (no token is minted for it)
        self.culler.kernels_readable = self.tls is None
        self.ledger = Ledger(
            self.broker.session_factory,
            self.backend
            if self.broker.engine.name == "local"
            else EngineTelemetry(self.broker.engine),
            pool_of=lambda uuid: self.broker.pool_spec(uuid).name,
            inventory=self._inventory,
            parent=app,
        )
        self.jobs = JobService(self.broker, self.broker.engine, parent=app)
        #: the Docker engine asked about DockerGPUSpawner containers (made on first use)
        self.docker: DockerEngine | None = None
        self.slurm_servers = SlurmServers(self.broker, self.log)
        self.docker_servers = DockerServers(self.broker, self.docker_engine, self.log)
        self.broker.containers_followed = self.docker_servers.followed
        self.metrics = BrokerMetrics(self.broker, self.ledger if self.ledger.enabled else None)
        self.culler.on_check = self.metrics.culler_checked
        self.broker.bus.subscribe(self.metrics.on_event)
        self.share_guard = ShareGuard(self.broker, parent=app)
        self._groups: dict[str, tuple[float, list[str] | None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def _inventory(self) -> list[tuple[str, int, str, str, bool]]:
        """The present devices, for the ledger's telemetry."""
        return [
            (d.uuid, d.index, d.name, d.node, d.mig_enabled)
            for d, _ in self.broker.device_rows()
            if d.present
        ]

    def _panel_auth(self) -> HubOAuth:
        """The panel's OAuth login: the hub passes its client id and callback
        to a managed service; an external one (started elsewhere) uses the
        hub's defaults, ``service-NAME`` and ``{base_url}oauth_callback``."""
        name = os.environ.get("JUPYTERHUB_SERVICE_NAME") or "gpubroker"
        base = self.app.base_url.rstrip("/") + "/"
        return HubOAuth(
            parent=self.app,
            api_token=self.hub.api_token,
            api_url=self.hub.api_url,
            cache_max_age=self.app.token_cache_max_age,
            base_url=base,
            oauth_client_id=os.environ.get("JUPYTERHUB_CLIENT_ID") or f"service-{name}",
            oauth_redirect_uri=os.environ.get("JUPYTERHUB_OAUTH_CALLBACK_URL")
            or base + "oauth_callback",
        )

    def _idle_since(self) -> dict[int, dt.datetime]:
        """Lease id → when the culler last saw its GPU busy (the panel's idle time)."""
        return {k: t.gpu_active for k, t in self.culler.tracks.items() if t.gpu_active}

    def _evicted(self, lease: dict[str, Any]) -> None:
        task = asyncio.ensure_future(self._stop_server(lease))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _stop_server(self, lease: dict[str, Any]) -> None:
        """Stop the hub server of an evicted lease (its reason is on the
        lease), unless the hub's server of that name was started after the
        lease was requested (with :data:`~gpubroker.broker.leases.STARTED_SLACK`):
        that is a newer server (the user started it again, e.g. while the
        broker was down), not the lease's; reconciliation releases the lease."""
        created = parse_time(lease.get("created"))
        started_by = created + STARTED_SLACK if created is not None else None
        try:
            stopped = await self.hub.stop_server(lease["user"], lease["server_name"], started_by)
            if not stopped:
                self.log.warning(
                    "Not stopping server %s/%s for lease %s: the hub lists no server of"
                    " that name started before the lease",
                    lease["user"],
                    lease["server_name"],
                    lease["id"],
                )
                return
            self.log.warning(
                "Stopped server %s/%s: %s",
                lease["user"],
                lease["server_name"],
                lease["release_reason"],
            )
        except Exception as err:
            self.log.error(
                "Could not stop server %s/%s of evicted lease %s: %s",
                lease["user"],
                lease["server_name"],
                lease["id"],
                err,
            )

    async def groups_of(self, user: str) -> list[str] | None:
        """The user's hub groups, cached for ``GPUBrokerApp.groups_ttl`` seconds;
        ``None`` for a name the hub has no user of (also cached); when the
        hub cannot tell now (unreachable, an error), the last known groups,
        else ``None``."""
        now = time.monotonic()
        cached = self._groups.get(user)
        if cached and now - cached[0] < self.app.groups_ttl:
            return cached[1]
        try:
            groups: list[str] | None = await self.hub.user_groups(user)
        except HTTPClientError as err:
            if err.code != 404:  # the hub cannot tell now: the last known groups, if any
                self.log.debug("No hub groups for %s: %s", user, err)
                return cached[1] if cached else None
            groups = None  # no such hub user (an external holder): known for the ttl too
        except Exception as err:  # hub unreachable
            self.log.debug("No hub groups for %s: %s", user, err)
            return cached[1] if cached else None
        self._groups[user] = (now, groups)
        return groups

    def _url(self) -> str:
        scheme = "https" if self.tls and self._serves_https() else "http"
        return f"{scheme}://{self.app.ip}:{self.app.port}{self.app.base_url}"

    @staticmethod
    def _serves_https() -> bool:
        """Whether the hub reaches the broker at an ``https`` URL."""
        return os.environ.get("JUPYTERHUB_SERVICE_URL", "").startswith("https:")

    def _use_tls(self) -> dict[str, Any]:
        """With the hub's internal TLS: every Tornado request of this
        process (the hub's API: users, groups, servers, tokens) presents
        the broker's certificate and trusts only the hub's bundle; the
        broker serves HTTPS when its
        service URL (``JUPYTERHUB_SERVICE_URL``) is ``https``, plain HTTP
        otherwise. Returns the HTTP server's TLS arguments (none for HTTP)."""
        if self.tls is None:
            return {}
        AsyncHTTPClient.configure(None, defaults={"ssl_options": self.tls.client_context()})
        if not self._serves_https():
            self.log.info(
                "JupyterHub internal TLS: calling the hub with %s; serving plain HTTP "
                "(the service URL is not https)",
                self.tls.certfile,
            )
            return {}
        self.log.info("JupyterHub internal TLS: serving HTTPS with %s", self.tls.certfile)
        return {"ssl_options": self.tls.server_context()}

    async def run(self) -> None:
        """Start everything, serve until SIGTERM/SIGINT (or until the hub is
        gone for ``GPUBrokerApp.hub_gone_timeout``), then shut down cleanly.

        Raises:
            DatabaseLocked: another broker is the active one of this database;
                nothing was changed.
            SettingError: a setting is wrong (nothing was changed).
        """
        self._parent = os.getppid()
        await self._take_lock()
        # after the lock: a broker that waited for it must not reopen the
        # ledger's intervals from before the previous broker's last heartbeat
        booted = time.time()
        try:
            self._build()
        except TraitError as err:  # a setting the configuration file got wrong
            raise SettingError(str(err)) from None
        loop = asyncio.get_running_loop()
        # a service started with `&` inherits "ignore SIGINT": set our own handlers
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        if self.ledger.enabled:  # first: leases adopted below are charged from its intervals
            self.ledger.start(booted)
            self.broker.load_held_usage()
        read = await first_inventory(self.broker, self.read_inventory, self.log)
        self.broker.adopt()
        if read and self.slurm_servers.watched():
            # servers' Slurm jobs from before the restart are the broker's own
            self.slurm_servers.adopt()
            read = await first_inventory(self.broker, self.read_inventory, self.log)
        web_app = make_app(
            self.broker,
            base_url=self.app.base_url,
            log=self.log,
            hub_auth=self.hub_auth,
            groups_of=self.groups_of,
            server_running=self.hub.server_running,
            has_user=self.hub.has_user,
            max_body_bytes=self.app.max_body_bytes,
            max_long_polls=self.app.max_long_polls_per_user,
            ledger=self.ledger,
            reports=ReportWorkers(self.app.report_threads, self.app.reports_per_caller),
            metrics=self.metrics,
            metrics_scope=self.app.metrics_scope,
            read_inventory=self.read_inventory,
            service_name=os.environ.get("JUPYTERHUB_SERVICE_NAME", "gpubroker"),
            jobs=self.jobs,
            panel_auth=self.panel_auth,
            # a restart asks the hub again for panel logins (no second login)
            cookie_secret=os.urandom(32),
            idle_since=self._idle_since,
            panel_refresh=self.app.panel_refresh,
            private_queue=self.app.private_queue,
            hub_url=os.environ.get("JUPYTERHUB_BASE_URL", "/").rstrip("/") + "/hub/",
        )
        server = HTTPServer(
            web_app, xheaders=True, max_body_size=self.app.max_body_bytes, **self._use_tls()
        )
        server.listen(self.app.port, self.app.ip)
        self.log.info(
            "gpubroker %s listening on %s (backend %s%s)",
            self.app.version,
            self._url(),
            self.backend.kind,
            ", SIMULATED GPUs" if self.backend.simulated else "",
        )
        tasks = [
            asyncio.create_task(self.broker.passes.run(self.broker.schedule_now, self.log)),
            asyncio.create_task(self._schedule_loop()),
            asyncio.create_task(self._watch_loop()),
        ]
        if not read:
            tasks.append(
                asyncio.create_task(
                    inventory_until_read(self.broker, self.read_inventory, self.log)
                )
            )
        if self.app.reconcile_interval > 0:
            tasks.append(asyncio.create_task(self._reconcile_loop()))
        if self.broker.inventory_changes and self.broker.inventory_interval > 0:
            tasks.append(asyncio.create_task(self._inventory_loop()))
        if self.culler.enabled:
            self.metrics.culler_started()
            tasks.append(asyncio.create_task(self.culler.run()))
        if self.share_guard.enabled:
            tasks.append(asyncio.create_task(self.share_guard.run()))
        if self.ledger.enabled:
            tasks.append(asyncio.create_task(self.ledger.run()))
        tasks.append(asyncio.create_task(self.jobs.run()))
        await self._stop.wait()
        self.log.info("Shutting down")
        server.stop()
        for task in tasks:
            task.cancel()
        if self.broker.actuator is not None:
            self.broker.actuator.cancel()
        self.jobs.close()
        if self.exit_code == LOST_LOCK:
            # another broker may be the writer now: write nothing more
            self.log.warning("Not writing the last usage records: the database lock is lost")
        else:
            try:
                self.broker.write_usage()
            except Exception:
                self.log.exception("Writing the usage records at shutdown failed")
            if self.ledger.enabled:
                self.ledger.stop()
        if self.broker.mps.enabled:
            self.broker.mps.stop_all()
        self.backend.close()
        if self.docker is not None:
            self.docker.close()
        self.lock.release()
        self.engine.dispose()

    async def read_inventory(self) -> list[Node]:
        """The engine's nodes, read off the event loop; the hub's servers'
        Slurm jobs are counted as the broker's own first (not *outside*).

        Raises:
            EngineError: the engine cannot say.
        """
        self.slurm_servers.adopt()
        return await asyncio.to_thread(self.broker.engine.nodes)

    async def _inventory_loop(self) -> None:
        """Read the engine's inventory every ``Broker.inventory_interval``
        seconds, off the event loop; one that cannot be read keeps the last
        (logged: nothing is ended on it)."""
        while True:
            await asyncio.sleep(self.broker.inventory_interval)
            try:
                nodes = await self.read_inventory()
            except EngineError as err:
                self.log.warning("Inventory not read (the last one stays): %s", err)
                continue
            try:
                self.broker.sync_inventory(nodes)
            except Exception:
                self.log.exception("Inventory update failed")

    async def _schedule_loop(self) -> None:
        while True:
            await asyncio.sleep(self.app.schedule_interval)
            try:
                self.broker.schedule_now()
                self.broker.housekeep_mig()
            except Exception:
                self.log.exception("Scheduling pass failed")

    async def reconcile_once(self) -> list[int]:
        """Ask the hub which servers exist, the Docker engine which
        servers' containers still run and Slurm which servers' jobs do;
        release the leases of those gone. A server's container or Slurm job
        is its engine's to judge: one still running after the hub lost its
        server is stopped first
        (:class:`~gpubroker.broker.docker_servers.DockerServers`,
        :class:`~gpubroker.broker.slurm_servers.SlurmServers`)."""
        as_of: dt.datetime = utcnow()
        try:
            models, _ = await self.hub.active_server_models()
        except Exception:
            # Docker and Slurm know, whatever the hub's state
            await self.docker_servers.reconcile()
            await self.slurm_servers.reconcile()
            raise
        servers = set(models)
        started = {key: parse_time(model.get("started")) for key, model in models.items()}
        followed = self.slurm_servers.followed() | self.docker_servers.followed()
        released = self.broker.reconcile(servers, as_of, followed, started)
        released += await self.docker_servers.reconcile(servers, as_of)
        return released + await self.slurm_servers.reconcile(servers, as_of)

    def docker_engine(self) -> DockerEngine:
        """The Docker engine asked about ``DockerGPUSpawner`` containers
        (``DockerEngine.docker_url``), made on first use."""
        if self.docker is None:
            self.docker = DockerEngine(parent=self.app)
        return self.docker

    async def _reconcile_loop(self) -> None:
        # at once after a start (leases of servers stopped while the broker was
        # down, e.g. at hub shutdown, which stops the broker before the
        # servers), retried every second until the hub answers, then every
        # reconcile_interval
        started = False
        said = -math.inf  # when the last failure was logged as a warning
        while True:
            try:
                await self.reconcile_once()
                started = True
                self.metrics.reconciled_once(True)
            except Exception as err:
                self.metrics.reconciled_once(False)
                # while the hub starts, once a minute, not every second
                now = time.monotonic()
                log = self.log.warning if started or now - said >= 60 else self.log.debug
                if log is self.log.warning:
                    said = now
                log("Reconciliation with the hub at %s failed: %s", self.hub.api_url, err)
            await asyncio.sleep(self.app.reconcile_interval if started else 1.0)

    async def _watch_loop(self) -> None:
        """Exit when the hub is gone or the database lock is lost.

        A hub-managed broker whose hub process died exits within a second: a
        hub restarted after SIGKILL starts its own broker, which waits for
        this one's lock. A hub whose API does not answer for
        ``hub_gone_timeout`` seconds (checked every 5 s) is gone too. A lost
        lock (PostgreSQL session gone) stops the broker at once.
        """
        timeout = self.app.hub_gone_timeout
        gone_since: float | None = None
        tick = 0
        while True:
            await asyncio.sleep(1.0)
            tick += 1
            if self._orphaned():
                # certain, not a blip: the restarted hub's broker waits for our lock
                self.log.critical(
                    "The hub process %s that started this broker exited; exiting", self._parent
                )
                self.exit_code = 3
                self._stop.set()
                return
            if not await asyncio.to_thread(self.lock.check):  # each second, as a standby tries
                self.log.critical("Lost the database lock; stopping (another broker may hold it)")
                self.exit_code = LOST_LOCK
                self._stop.set()
                return
            if tick % 5:
                continue
            if timeout <= 0:
                continue
            why = await self._hub_gone()
            if why is None:
                gone_since = None
                continue
            now = time.monotonic()
            if gone_since is None:
                self.log.warning("The hub seems gone (%s); exiting in %.0f s", why, timeout)
                gone_since = now
            elif now - gone_since >= timeout:
                self.log.critical("The hub is gone for %.0f s (%s); exiting", timeout, why)
                self.exit_code = 3
                self._stop.set()
                return

    def _orphaned(self) -> bool:
        """Whether this hub-managed broker's hub process has died."""
        managed = bool(os.environ.get("JUPYTERHUB_SERVICE_NAME")) and self._parent > 1
        return managed and os.getppid() != self._parent

    async def _hub_gone(self) -> str | None:
        """Why the hub API looks gone, or ``None`` while it answers."""
        try:
            await self.hub.ping()
        except Exception as err:
            return f"hub API unreachable: {err}"
        return None


#: seconds before the first new try of an inventory the engine could not
#: give at the broker's start; doubled up to :data:`INVENTORY_RETRY_MAX`
INVENTORY_RETRY_FIRST = 5.0
INVENTORY_RETRY_MAX = 60.0


async def first_inventory(
    broker: Broker, read: Callable[[], Awaitable[list[Node]]], log: Any
) -> bool:
    """Read the engine's inventory (``read``, off the event loop) and write
    it into the store; when the engine cannot say (slurmctld or NVML down
    at the broker's start), serve with the stored devices, none granted
    until it can (:meth:`Broker.inventory_unknown`), instead of not starting.

    Returns:
        whether the inventory was read.
    """
    try:
        nodes = await read()
    except EngineError as err:
        log.error(
            "The %s engine cannot say its inventory (%s): serving with the stored "
            "devices, none granted until it answers",
            broker.engine.name,
            err,
        )
        broker.inventory_unknown(f"the {broker.engine.name} engine has not answered: {err}")
        return False
    broker.sync_inventory(nodes)
    return True


async def inventory_until_read(
    broker: Broker,
    read: Callable[[], Awaitable[list[Node]]],
    log: Any,
    first: float = INVENTORY_RETRY_FIRST,
) -> None:
    """Try :func:`first_inventory` again, after ``first`` seconds and then
    twice as long each time (at most :data:`INVENTORY_RETRY_MAX`), until the
    engine gives its inventory."""
    delay = first
    while True:
        await asyncio.sleep(delay)
        if await first_inventory(broker, read, log):
            log.info("The %s engine's inventory is read: devices granted again", broker.engine.name)
            return
        delay = min(delay * 2, INVENTORY_RETRY_MAX)
