"""The panel's routes and its OAuth callback."""

from __future__ import annotations

from importlib import resources
from typing import Any

from jupyterhub.services.auth import HubOAuthCallbackHandler


def panel_routes(base_url: str) -> list[tuple[str, Any, dict[str, Any]]]:
    """The panel's routes below ``base_url`` (e.g. ``/services/gpubroker/``):
    ``oauth_callback``, the pages and ``static/``."""
    from . import pages

    base = base_url.rstrip("/") + "/"
    static = str(resources.files("gpubroker.web").joinpath("static"))
    named: list[tuple[str, Any]] = [
        ("", pages.RootHandler),
        ("overview", pages.OverviewHandler),
        ("queue", pages.QueueHandler),
        ("leases", pages.LeasesHandler),
        ("devices", pages.DevicesHandler),
        ("quotas", pages.QuotasHandler),
        ("usage", pages.UsageHandler),
        ("usage.csv", pages.UsageCSVHandler),
        ("audit", pages.AuditHandler),
        ("me", pages.MeHandler),
    ]
    routes: list[tuple[str, Any, dict[str, Any]]] = [
        (base + "oauth_callback", _Callback, {}),
        (base + r"static/(.*)", pages.StaticHandler, {"path": static}),
    ]
    routes += [(base + path.replace(".", r"\."), handler, {}) for path, handler in named]
    return routes


class _Callback(HubOAuthCallbackHandler):  # type: ignore[misc]
    """The end of the hub's OAuth login: sets the panel's cookie."""

    @property
    def hub_auth(self) -> Any:
        return self.settings["panel_auth"]

    @hub_auth.setter
    def hub_auth(self, value: Any) -> None:
        raise AttributeError("hub_auth comes from the application settings")
