"""GET /queue shows other users' waiting requests without who asked, to a
caller who is not a broker admin (a review of the trust boundary: the
queue named every waiting user, server and group, and gave their lease ids,
which the lease routes hide from others; the panel and GET /devices show
a researcher only her own)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from jupyterhub.httpclient import JupyterHubHTTPClient

from gpubroker.core import Broker
from gpubroker.views import QUEUED_REQUEST_KEYS

from .test_api_scopes import FakeHub, ServedAPI

Listed = Callable[..., Awaitable[list[dict[str, Any]]]]


@pytest.fixture
async def queue(broker: Broker) -> AsyncIterator[tuple[Listed, dict[str, Any], dict[str, Any]]]:
    broker.request_lease("carol", "", 8, holder_kind="external")  # every GPU held
    ann = broker.request_lease("ann", "", 2, holder_kind="external")
    bob = broker.request_lease("bob", "big", 4, holder_kind="external", time_limit=600)
    with FakeHub() as hub:
        served: dict[bool, ServedAPI] = {}

        async def listed(token: str, private: bool = True) -> list[dict[str, Any]]:
            if private not in served:
                served[private] = ServedAPI(broker, hub, private_queue=private)
            response = await served[private].call("GET", "/queue", token)
            assert response.code == 200
            return list(json.loads(response.body)["queue"])

        try:
            yield listed, ann, bob
        finally:
            for api in served.values():
                api.server.stop()
            await JupyterHubHTTPClient.loop_instance().close()


async def test_a_user_sees_her_own_request_in_full_and_others_without_who_asked(
    queue: tuple[Listed, dict[str, Any], dict[str, Any]],
) -> None:
    listed, ann, bob = queue
    mine, theirs = await listed("ann-token")
    assert mine["id"] == ann["id"] and mine["user"] == "ann"
    assert set(theirs) == {*QUEUED_REQUEST_KEYS, "queue"}
    assert "bob" not in json.dumps(theirs) and bob["id"] not in theirs.values()
    assert theirs["summary"] == "4 x GPU" and theirs["time_limit"] == 600
    assert theirs["queue"]["position"] == 2 and theirs["queue"]["reason"]
    assert set(theirs["queue"]) == {"position", "reason", "eta"}  # no message in words


async def test_an_admin_and_an_open_queue_show_every_request_in_full(
    queue: tuple[Listed, dict[str, Any], dict[str, Any]],
) -> None:
    listed, ann, bob = queue
    for token, private in (("admin-token", True), ("ann-token", False), ("bob-token", False)):
        rows = await listed(token, private)
        assert [(r["id"], r["user"]) for r in rows] == [(ann["id"], "ann"), (bob["id"], "bob")]
