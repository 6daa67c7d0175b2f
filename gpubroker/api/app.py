"""The Tornado application of the broker's REST API."""

from __future__ import annotations

import logging
from typing import Any

from tornado import web

from ..core import Broker
from . import handlers

#: (path relative to ``{base_url}api/v1``, handler); the OpenAPI test reads this
ROUTES: list[tuple[str, type[web.RequestHandler]]] = [
    ("/health", handlers.HealthHandler),
    ("/devices", handlers.DevicesHandler),
    ("/devices/{uuid}", handlers.DeviceHandler),
    ("/leases", handlers.LeasesHandler),
    ("/leases/{id}", handlers.LeaseHandler),
    ("/queue", handlers.QueueHandler),
    ("/pools", handlers.PoolsHandler),
    ("/notices", handlers.NoticesHandler),
    ("/quotas", handlers.QuotasHandler),
    ("/quotas/{kind}/{name}", handlers.QuotaHandler),
    ("/openapi.json", handlers.OpenAPIHandler),
]


_PARAMS = {"{id}": r"(\d+)", "{uuid}": r"([^/]+)", "{kind}": "(user|group)", "{name}": r"([^/]+)"}


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
    **settings: Any,
) -> web.Application:
    """Build the API application.

    Args:
        broker: the broker core the handlers call.
        base_url: URL prefix, e.g. ``/services/gpubroker/`` when hub-managed.
        log: logger for handlers and access logs.
        hub_auth: the :class:`jupyterhub.services.auth.HubAuth` that checks
            callers' tokens.
        groups_of: ``async (user) -> list[str] | None``, the user's hub groups.

    Returns:
        the application; routes are ``{base_url}api/v1{path}`` for ROUTES.
    """
    prefix = base_url.rstrip("/") + "/api/v1"
    routes = [(prefix + _pattern(path), handler) for path, handler in ROUTES]
    return web.Application(
        routes,
        broker=broker,
        log=log or logging.getLogger("gpubroker"),
        hub_auth=hub_auth,
        groups_of=groups_of or _no_groups,
        **settings,
    )


async def _no_groups(user: str) -> list[str] | None:
    return None
