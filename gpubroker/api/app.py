"""The Tornado application of the broker's REST API."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

from tornado import httputil, iostream, web

from ..core import Broker
from ..usage.workers import ReportWorkers
from . import handlers
from .longpoll import LongPollRegistry
from .redact import make_log_function

#: default largest request body, bytes (``GPUBrokerApp.max_body_bytes``)
MAX_BODY_BYTES = 64 * 1024
#: a refused body is discarded (lingering close) up to this many bytes ...
DRAIN_BYTES = 64 * 1024 * 1024
#: ... or for this many seconds, then the connection is closed
DRAIN_SECONDS = 5.0
#: default most open long-polls per caller (``GPUBrokerApp.max_long_polls_per_user``)
MAX_LONG_POLLS = 8

#: (path relative to ``{base_url}api/v1``, handler); the OpenAPI and scopes tests
#: read this (every handler method must declare what it needs: :mod:`.auth`)
ROUTES: list[tuple[str, type[web.RequestHandler]]] = [
    ("/health", handlers.HealthHandler),
    ("/devices", handlers.DevicesHandler),
    ("/devices/{uuid}", handlers.DeviceHandler),
    ("/inventory", handlers.InventoryHandler),
    ("/leases", handlers.LeasesHandler),
    ("/leases/{id}", handlers.LeaseHandler),
    ("/leases/{id}/events", handlers.LeaseEventsHandler),
    ("/queue", handlers.QueueHandler),
    ("/pools", handlers.PoolsHandler),
    ("/notices", handlers.NoticesHandler),
    ("/quotas", handlers.QuotasHandler),
    ("/quotas/{kind}/{name}", handlers.QuotaHandler),
    ("/jobs", handlers.JobsHandler),
    ("/jobs/{id}", handlers.JobHandler),
    ("/jobs/{id}/logs", handlers.JobLogsHandler),
    ("/usage", handlers.UsageHandler),
    ("/audit", handlers.AuditHandler),
    ("/openapi.json", handlers.OpenAPIHandler),
]


#: each path parameter's pattern; ``{kind}`` takes any segment, so that
#: ``/quotas/team/x`` is a 400 naming ``kind``, not a 404
_PARAMS = {"{id}": r"(\d+)", "{uuid}": r"([^/]+)", "{kind}": r"([^/]+)", "{name}": r"([^/]+)"}


def _pattern(path: str) -> str:
    for name, regex in _PARAMS.items():
        path = path.replace(name, regex)
    return path


def make_app(
    broker: Broker,
    base_url: str = "/",
    log: logging.Logger | None = None,
    hub_auth: Any = None,
    groups_of: Any = None,
    server_running: Any = None,
    has_user: Any = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    max_long_polls: int = MAX_LONG_POLLS,
    ledger: Any = None,
    metrics: Any = None,
    metrics_scope: str = "custom:gpubroker:metrics",
    jobs: Any = None,
    panel_auth: Any = None,
    **settings: Any,
) -> web.Application:
    """Build the API application.

    Args:
        broker: the broker core the handlers call.
        base_url: URL prefix, e.g. ``/services/gpubroker/`` when hub-managed.
        log: logger for handlers and access logs (URIs redacted, see
            :mod:`gpubroker.api.redact`).
        hub_auth: the :class:`jupyterhub.services.auth.HubAuth` that checks
            callers' tokens.
        groups_of: ``async (user) -> list[str] | None``, the user's hub groups.
        server_running: ``async (user, server_name) -> bool``, whether the hub
            runs that server (a user's release of its lease stops it first).
        has_user: ``async (user) -> bool | None``, whether the hub has that
            user (``None``: it cannot tell); a quota set for a user it does
            not have is kept, with a warning in the answer.
        max_body_bytes: largest request body, bytes; a request whose
            ``Content-Length`` is larger gets 413 before its body is read,
            a chunked body past it 400 (both with the JSON error). Pass the
            same value as ``max_body_size`` to the HTTPServer (for a chunked
            body the check here raises Tornado's own limit to
            :data:`DRAIN_BYTES`, past which Tornado answers a bare 400).
            0: no check here.
        max_long_polls: most open long-polls per caller; one more ends the
            caller's oldest (see :class:`~gpubroker.api.longpoll.LongPollRegistry`).
        ledger: the usage ledger (:class:`~gpubroker.usage.ledger.Ledger`):
            flushed before a usage report, and its prices; ``None``: reports
            read the store as it is.
        metrics: the :class:`~gpubroker.observe.metrics.BrokerMetrics` served
            at ``{base_url}metrics``; ``None``: that route answers 404.
        metrics_scope: the scope a caller needs to read the metrics.
        jobs: the :class:`~gpubroker.jobs.service.JobService`; ``None``: the
            job routes answer 404.
        panel_auth: the :class:`~jupyterhub.services.auth.HubOAuth` of the
            web panel (:mod:`gpubroker.web`), served at ``base_url`` beside
            the API; ``None``: no panel. The panel's settings (``cookie_secret``,
            ``idle_since``, ``panel_refresh``) come in ``settings``.

    Returns:
        the application; routes are ``{base_url}api/v1{path}`` for ROUTES,
        and ``{base_url}metrics``.
    """
    prefix = base_url.rstrip("/") + "/api/v1"
    routes = [(prefix + _pattern(path), handler) for path, handler in ROUTES]
    routes.append((base_url.rstrip("/") + "/metrics", handlers.MetricsHandler))
    if panel_auth is not None:
        from ..web.routes import panel_routes

        routes += panel_routes(base_url)
        settings.setdefault("panel_base", base_url.rstrip("/") + "/")
    log = log or logging.getLogger("gpubroker")
    settings.setdefault("log_function", make_log_function(log))
    settings.setdefault("default_handler_class", handlers.NotFoundHandler)
    settings.setdefault("reports", ReportWorkers())
    return BrokerApplication(
        routes,
        broker=broker,
        log=log,
        hub_auth=hub_auth,
        groups_of=groups_of or _no_groups,
        server_running=server_running or _no_server,
        has_user=has_user or _cannot_tell,
        max_body_bytes=max_body_bytes,
        long_polls=LongPollRegistry(max_long_polls, log),
        ledger=ledger,
        metrics=metrics,
        metrics_scope=metrics_scope,
        jobs=jobs,
        panel_auth=panel_auth,
        **settings,
    )


async def _no_groups(user: str) -> list[str] | None:
    return None


async def _no_server(user: str, server_name: str) -> bool:
    return False


async def _cannot_tell(user: str) -> bool | None:
    return None


class BrokerApplication(web.Application):
    """The API's Tornado application; refuses oversized bodies from their headers."""

    def start_request(
        self, server_conn: object, request_conn: httputil.HTTPConnection
    ) -> httputil.HTTPMessageDelegate:
        """Wrap Tornado's delegate in :class:`_BodyLimit`."""
        delegate = super().start_request(server_conn, request_conn)
        limit = int(self.settings.get("max_body_bytes") or 0)
        if limit <= 0:
            return delegate
        return _BodyLimit(delegate, request_conn, limit, self.settings["log"])


class _BodyLimit(httputil.HTTPMessageDelegate):
    """Answer 413 (JSON error) from the headers when ``Content-Length`` is
    over ``limit`` bytes, and close the connection without reading the body;
    answer 400 (JSON error) to a chunked body once it is past ``limit``
    bytes (:meth:`data_received`)."""

    def __init__(
        self,
        delegate: httputil.HTTPMessageDelegate,
        connection: httputil.HTTPConnection,
        limit: int,
        log: logging.Logger,
    ) -> None:
        self.delegate = delegate
        self.connection = connection
        self.limit = limit
        self.log = log
        self.received = 0
        #: a chunked body past the limit: no more of it reaches the handler
        self.refused = False
        self._answered = False
        self._timer: asyncio.TimerHandle | None = None

    def headers_received(
        self,
        start_line: httputil.RequestStartLine | httputil.ResponseStartLine,
        headers: httputil.HTTPHeaders,
    ) -> Any:
        length = (headers.get("Content-Length") or "").strip()
        if length.isascii() and length.isdigit() and (len(length) > 18 or int(length) > self.limit):
            return self._refuse(length)
        if headers.get("Transfer-Encoding") and hasattr(self.connection, "set_max_body_size"):
            # the limit is checked here, with a JSON answer; Tornado's own
            # (HTTPServer max_body_size) answers a bare 400: only past the drain
            self.connection.set_max_body_size(max(self.limit, DRAIN_BYTES))
        return self.delegate.headers_received(start_line, headers)

    def data_received(self, chunk: bytes) -> Any:
        """Pass the body on until it is past the limit (only a chunked body
        can be: a ``Content-Length`` over it was refused from the headers);
        then discard the rest, and answer 400 once it has been read (at
        most :data:`DRAIN_BYTES`) or after :data:`DRAIN_SECONDS`."""
        if self.refused:
            return None
        self.received += len(chunk)
        if self.received <= self.limit:
            return self.delegate.data_received(chunk)
        self.refused = True
        self.log.warning("400 refused a chunked body past %d bytes", self.limit)
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(DRAIN_SECONDS, self._answer_too_large, True)
        return None

    def _answer_too_large(self, closing: bool = False) -> None:
        """Answer 400 with the JSON error of a chunked body past the limit;
        ``closing``: the body is not read to its end, so the connection is
        closed after the answer (Tornado closes it)."""
        if self._answered:
            return
        self._answered = True
        if self._timer is not None:
            self._timer.cancel()
        message = (
            f"body: at most {self.limit} bytes (GPUBrokerApp.max_body_bytes),"
            " got a larger chunked body"
        )
        body = json.dumps({"status": 400, "message": message}).encode()
        headers = httputil.HTTPHeaders(
            {
                "Content-Type": "application/json; charset=utf-8",
                "Content-Length": str(len(body)),
            }
        )
        if closing:
            headers["Connection"] = "close"
        start = httputil.ResponseStartLine("HTTP/1.1", 400, "Bad Request")
        try:
            self.connection.write_headers(start, headers, body)
            self.connection.finish()
        except iostream.StreamClosedError:
            pass

    async def _refuse(self, length: str) -> None:
        shown = length if len(length) <= 20 else length[:20] + "…"
        message = (
            f"body: at most {self.limit} bytes (GPUBrokerApp.max_body_bytes),"
            f" got Content-Length {shown}"
        )
        self.log.warning("413 refused before reading the body: %s", message)
        body = json.dumps({"status": 413, "message": message}).encode()
        head = (
            "HTTP/1.1 413 Payload Too Large\r\n"
            "Content-Type: application/json; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n"
        ).encode()
        stream = self.connection.detach()  # type: ignore[attr-defined]
        try:
            await stream.write(head + body)
            with contextlib.suppress(asyncio.TimeoutError):
                await self._drain(stream, int(length))
        except iostream.StreamClosedError:
            pass
        finally:
            stream.close()

    async def _drain(self, stream: iostream.IOStream, length: int) -> None:
        """Lingering close: discard what the client is still sending, at most
        :data:`DRAIN_BYTES` bytes for :data:`DRAIN_SECONDS`, 64 KiB at a time
        (never kept), so that a proxy in front reads the answer instead of
        seeing the connection reset under its upload."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DRAIN_SECONDS
        left = min(length, DRAIN_BYTES)
        while left > 0 and (remaining := deadline - loop.time()) > 0:
            chunk = await asyncio.wait_for(
                stream.read_bytes(min(left, 65536), partial=True), remaining
            )
            left -= len(chunk)

    def finish(self) -> None:
        if self.refused:
            self._answer_too_large()
            return
        self.delegate.finish()

    def on_connection_close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self.delegate.on_connection_close()
