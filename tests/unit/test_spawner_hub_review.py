"""A review of the spawner against the hub's own behaviour: JupyterHub's
``group_overrides`` survive the undoing of the last spawn's profile; a
spawn cancelled while its lease request is on its way leaves no lease;
saved options the broker now refuses (quota) fall back to the default."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
from jupyterhub.objects import Hub
from jupyterhub.spawner import LocalProcessSpawner
from tornado import web
from tornado.httpserver import HTTPServer

from gpubroker.client import BrokerClient
from gpubroker_spawner import SimpleLocalGPUSpawner

from .test_spawner_profiles import StubBroker, broker  # noqa: F401
from .test_spawner_review import broker_url, fake_start, forwarding_proxy, hub_api  # noqa: F401
from .test_spawner_review import make_spawner as make_served_spawner

PROFILES = [
    {
        "display_name": "Big",
        "slug": "big",
        "request": {"gpus": 1},
        "spawner_override": {"mem_limit": "32G"},
    },
    {"display_name": "Plain", "slug": "plain", "request": {"gpus": 1}},
]


def make_spawner(url: str, **kwargs: Any) -> SimpleLocalGPUSpawner:
    user = SimpleNamespace(name="ann", url="/user/ann/", escaped_name="ann", groups=[])
    hub = Hub(ip="127.0.0.1", port=8081, base_url="/hub/")
    return SimpleLocalGPUSpawner(user=user, hub=hub, broker_url=url, **kwargs)


async def test_a_group_override_survives_the_previous_profiles_undo(
    broker: StubBroker,  # noqa: F811
) -> None:
    spawner = make_spawner(broker.url, gpu_profiles=PROFILES)
    # spawn 1, in JupyterHub's order: group overrides, then the user options
    await spawner.apply_group_overrides()
    await spawner.check_user_options({"profile": "big"})
    assert spawner.mem_limit == 32 * 1024**3
    # ann joins a group whose override sets mem_limit
    spawner.user.groups = [SimpleNamespace(name="big-mem")]
    spawner.group_overrides = {
        "01-big": {"groups": ["big-mem"], "spawner_override": {"mem_limit": "64G"}}
    }
    # spawn 2, with a profile that does not touch mem_limit
    await spawner.apply_group_overrides()
    assert spawner.mem_limit == 64 * 1024**3
    await spawner.check_user_options({"profile": "plain"})
    assert spawner.mem_limit == 64 * 1024**3
    # and out of the group again: back to the setting of before any profile
    spawner.user.groups = []
    await spawner.apply_group_overrides()
    await spawner.check_user_options({"profile": "plain"})
    assert spawner.mem_limit == 64 * 1024**3  # the group's own change stays, as in JupyterHub


def slow_proxy(target: str, delay: float, seen: asyncio.Event) -> tuple[HTTPServer, str]:
    """Forwards to ``target``; the answer to ``POST /leases`` (not a dry
    run) comes ``delay`` seconds after the broker made the lease."""

    async def late(handler: web.RequestHandler) -> bool:
        seen.set()
        await asyncio.sleep(delay)
        return False

    return forwarding_proxy(target, late)


async def test_a_spawn_cancelled_while_its_request_is_on_its_way_leaves_no_lease(
    broker_url: str,  # noqa: F811
) -> None:
    seen = asyncio.Event()
    proxy, url = slow_proxy(broker_url, 1.0, seen)
    admin = BrokerClient(broker_url, "admin-token")
    try:
        spawner = make_served_spawner(url)
        spawner.user_options = {"gpus": 1}
        await spawner.check_user_options({"gpus": 1})
        with mock.patch.object(LocalProcessSpawner, "start", fake_start):
            task = asyncio.ensure_future(spawner.start())
            await asyncio.wait_for(seen.wait(), 5)
            # "Stop Server" on the pending page: JupyterHub cancels start()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        # released before the cancelled start ended: no later start can race it
        assert await admin.list_leases(user="ann") == []
        (released,) = await admin.list_leases(user="ann", state="all")
        assert released["release_reason"] == (
            "spawn cancelled while the GPU request was on its way"
        )
    finally:
        proxy.stop()


def api_handler(body: bytes) -> Any:
    """A hub REST API handler of ``POST /users/ann/server`` with ``body``."""
    from jupyterhub.apihandlers.users import UserServerAPIHandler

    handler = UserServerAPIHandler.__new__(UserServerAPIHandler)
    handler.request = SimpleNamespace(body=body, method="POST", query_arguments={})
    return handler


async def test_saved_options_the_broker_refuses_fall_back_to_the_default(
    broker: StubBroker,  # noqa: F811
) -> None:
    """docs/user.md: saved options the hub refused when they were posted do
    not leave the user stuck; a quota refusal (403) of the dry run too."""
    broker.refuse = (403, "quota: user ann holds or waits for 1 GPU; 2 more would exceed")
    posted = make_spawner(broker.url)
    posted.handler = api_handler(b'{"gpus": 2}')
    with pytest.raises(web.HTTPError) as info:  # refused when posted (the hub saves them)
        await posted.check_user_options({"gpus": 2})
    assert info.value.status_code == 403
    spawner = make_spawner(broker.url)  # default_gpus = 0: the default asks for nothing
    spawner.orm_spawner = SimpleNamespace(user_options={"gpus": 2}, server=None, name="")
    spawner.user_options = {"gpus": 2}
    spawner.handler = api_handler(b"{}")  # a later spawn naming no options
    assert await spawner.check_user_options(spawner.user_options) == {}
    assert spawner.user_options == {} and spawner.orm_spawner.user_options == {}
