"""Wiring of a running broker: store, devices, core, HTTP server and loops.

Runs as a JupyterHub-managed service: the hub passes ``JUPYTERHUB_API_TOKEN``,
``JUPYTERHUB_API_URL``, ``JUPYTERHUB_SERVICE_URL`` and
``JUPYTERHUB_SERVICE_PREFIX`` in the environment.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import signal
import time
from typing import TYPE_CHECKING, Any

from jupyterhub.services.auth import HubAuth
from tornado.httpserver import HTTPServer

from .api.app import make_app
from .core import Broker, utcnow
from .culler import Culler
from .devices import load_backend
from .hub import HubClient
from .share_guard import ShareGuard
from .store.db import make_engine, make_session_factory, upgrade

if TYPE_CHECKING:
    from .app import GPUBrokerApp


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

    def _build(self) -> None:
        app = self.app
        if app.upgrade_db:
            upgrade(app.db_url)
        self.engine = make_engine(app.db_url)
        self.backend = load_backend(app.device_backend, parent=app, log=self.log)
        self.broker = Broker(
            parent=app, session_factory=make_session_factory(self.engine), backend=self.backend
        )
        self.hub = HubClient(parent=app)
        self.hub_auth = HubAuth(parent=app, api_token=self.hub.api_token, api_url=self.hub.api_url)
        self.broker.on_evict = self._evicted
        self.culler = Culler(self.broker, self.hub, parent=app)
        self.share_guard = ShareGuard(self.broker, parent=app)
        self._groups: dict[str, tuple[float, list[str]]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def _evicted(self, lease: dict[str, Any]) -> None:
        task = asyncio.ensure_future(self._stop_server(lease))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _stop_server(self, lease: dict[str, Any]) -> None:
        """Stop the hub server of an evicted lease (its reason is on the lease)."""
        try:
            await self.hub.stop_server(lease["user"], lease["server_name"])
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
        when the hub cannot tell (unknown user, hub unreachable), the last
        known groups, else ``None``."""
        now = time.monotonic()
        cached = self._groups.get(user)
        if cached and now - cached[0] < self.app.groups_ttl:
            return cached[1]
        try:
            groups = await self.hub.user_groups(user)
        except Exception as err:
            # hub unreachable or user unknown: the last known groups, if any
            self.log.debug("No hub groups for %s: %s", user, err)
            return cached[1] if cached else None
        self._groups[user] = (now, groups)
        return groups

    async def run(self) -> None:
        """Start everything, serve until SIGTERM/SIGINT, then shut down cleanly."""
        self._build()
        loop = asyncio.get_running_loop()
        # a service started with `&` inherits "ignore SIGINT": set our own handlers
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        self.broker.sync_inventory()
        self.broker.adopt()
        web_app = make_app(
            self.broker,
            base_url=self.app.base_url,
            log=self.log,
            hub_auth=self.hub_auth,
            groups_of=self.groups_of,
        )
        server = HTTPServer(web_app, xheaders=True)
        server.listen(self.app.port, self.app.ip)
        self.log.info(
            "gpubroker %s listening on http://%s:%s%s (backend %s%s)",
            self.app.version,
            self.app.ip,
            self.app.port,
            self.app.base_url,
            self.backend.kind,
            ", SIMULATED GPUs" if self.backend.simulated else "",
        )
        tasks = [asyncio.create_task(self._schedule_loop())]
        if self.app.reconcile_interval > 0:
            tasks.append(asyncio.create_task(self._reconcile_loop()))
        if self.culler.enabled:
            tasks.append(asyncio.create_task(self.culler.run()))
        if self.share_guard.enabled:
            tasks.append(asyncio.create_task(self.share_guard.run()))
        await self._stop.wait()
        self.log.info("Shutting down")
        server.stop()
        for task in tasks:
            task.cancel()
        if self.broker.mps.enabled:
            self.broker.mps.stop_all()
        self.backend.close()
        self.engine.dispose()

    async def _schedule_loop(self) -> None:
        while True:
            await asyncio.sleep(self.app.schedule_interval)
            try:
                self.broker.schedule_now()
                self.broker.housekeep_mig()
            except Exception:
                self.log.exception("Scheduling pass failed")

    async def reconcile_once(self) -> list[int]:
        """Ask the hub which servers exist; release leases of servers that are gone."""
        as_of: dt.datetime = utcnow()
        servers = await self.hub.active_servers()
        return self.broker.reconcile(servers, as_of)

    async def _reconcile_loop(self) -> None:
        # soon after a start (leases of servers stopped while the broker was
        # down, e.g. at hub shutdown), then every reconcile_interval
        delay = min(5.0, self.app.reconcile_interval)
        while True:
            await asyncio.sleep(delay)
            delay = self.app.reconcile_interval
            try:
                await self.reconcile_once()
            except Exception as err:
                self.log.warning("Reconciliation with the hub failed: %s", err)
