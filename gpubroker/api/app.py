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
    ("/leases", handlers.LeasesHandler),
    ("/leases/{id}", handlers.LeaseHandler),
    ("/openapi.json", handlers.OpenAPIHandler),
]


def _pattern(path: str) -> str:
    return path.replace("{id}", r"(\d+)")


def make_app(
    broker: Broker,
    base_url: str = "/",
    log: logging.Logger | None = None,
    hub_auth: Any = None,
    **settings: Any,
) -> web.Application:
    """Build the API application.

    Args:
        broker: the broker core the handlers call.
        base_url: URL prefix, e.g. ``/services/gpubroker/`` when hub-managed.
        log: logger for handlers and access logs.
        hub_auth: the :class:`jupyterhub.services.auth.HubAuth` that checks
            callers' tokens.

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
        **settings,
    )
