"""The broker's stop of a hub server leaves a newer server of the same name
alone: the hub API is served by a small Tornado app on 127.0.0.1 that answers
``GET /users/{name}`` and ``DELETE /users/{name}/server`` as JupyterHub does."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from tornado import web
from tornado.httpserver import HTTPServer

from gpubroker.hub import HubClient

from .test_api_scopes import _bound

T0 = dt.datetime(2026, 12, 6, 9, 0, tzinfo=dt.timezone.utc)


class Hub:
    """ann's servers by name (their ``started``), and the stops asked for."""

    def __init__(self) -> None:
        self.servers: dict[str, dict[str, Any]] = {}
        self.stopped: list[str] = []
        hub = self

        class User(web.RequestHandler):
            def get(self, name: str) -> None:
                self.finish(json.dumps({"name": name, "servers": hub.servers}))

        class Server(web.RequestHandler):
            def delete(self, name: str, server: str = "") -> None:
                hub.stopped.append(f"{name}/{server}")
                self.set_status(204)

        app = web.Application(
            [
                (r"/hub/api/users/([^/]+)", User),
                (r"/hub/api/users/([^/]+)/server", Server),
                (r"/hub/api/users/([^/]+)/servers/([^/]+)", Server),
            ]
        )
        self.server = HTTPServer(app)
        sock, port = _bound()
        self.server.add_sockets([sock])
        self.client = HubClient(api_url=f"http://127.0.0.1:{port}/hub/api", api_token="t")


@pytest.fixture
async def hub() -> AsyncIterator[Hub]:
    served = Hub()
    yield served
    served.server.stop()


def started(when: dt.datetime) -> dict[str, Any]:
    return {"started": when.isoformat().replace("+00:00", "Z"), "ready": True}


async def test_a_server_started_after_the_lease_is_not_stopped(hub: Hub) -> None:
    """ann's server died while the broker was down; she started it again
    (perhaps without GPUs). The stop the broker had asked for before is
    resumed at its start: it must not stop the new server."""
    hub.servers = {"": started(T0 + dt.timedelta(minutes=30)), "gpu": started(T0)}
    assert await hub.client.stop_server("ann", "", started_by=T0 + dt.timedelta(minutes=1)) is False
    assert hub.stopped == []
    # the lease's own server (started before it was requested) is stopped
    assert await hub.client.stop_server("ann", "gpu", started_by=T0 + dt.timedelta(minutes=1))
    assert hub.stopped == ["ann/gpu"]
    # a server the hub no longer lists: nothing to stop
    assert await hub.client.stop_server("ann", "gone", started_by=T0) is False
    # without a bound, as before: stopped by name
    assert await hub.client.stop_server("ann", "")
    assert hub.stopped == ["ann/gpu", "ann/"]
