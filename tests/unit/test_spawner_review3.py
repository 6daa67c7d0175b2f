"""A review of the spawner as users meet it: a start after a stop that
failed does not hand the devices of a holder that may still run to anyone
else; the broker stops that holder first."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from jupyterhub.services.auth import HubAuth
from jupyterhub.spawner import LocalProcessSpawner
from tornado.httpserver import HTTPServer

from gpubroker.api.app import make_app
from gpubroker.client import BrokerClient
from gpubroker.core import Broker
from gpubroker.devices.fake import FakeDeviceBackend
from gpubroker.store.db import make_engine, make_session_factory, upgrade

from .test_spawner_review import ACCESS, bound, hub_api, make_spawner, start  # noqa: F401

#: the Docker container the broker follows for ann's server
CONTAINER = "ab" * 32


@pytest.fixture
async def service_broker(tmp_path: Any, hub_api: str) -> AsyncIterator[str]:  # noqa: F811
    """A broker on 2 fake GPUs that, as the service does, asks for a
    server's stop before its lease is released (``on_evict``; the ask goes
    nowhere here, so a stop lasts until the test ends it)."""
    url = f"sqlite:///{tmp_path / 'broker.sqlite'}"
    upgrade(url)
    backend = FakeDeviceBackend(inventory=["2 x H100"], node_name="node-a")
    broker = Broker(session_factory=make_session_factory(make_engine(url)), backend=backend)
    broker.sync_inventory()
    broker.adopt()
    broker.on_evict = lambda view: None
    hub_auth = HubAuth(
        api_url=hub_api, api_token="broker-secret", access_scopes={ACCESS}, cache_max_age=5
    )
    server = HTTPServer(make_app(broker, base_url="/b/", hub_auth=hub_auth))
    sock, port = bound()
    server.add_sockets([sock])
    yield f"http://127.0.0.1:{port}/b/"
    server.stop()


async def _failed_stop(url: str, monkeypatch: pytest.MonkeyPatch) -> int:
    """ann's server in a followed container on one GPU, whose stop fails:
    its lease is kept, as designed (the container may still run). Returns
    the lease id."""
    admin = BrokerClient(url, "admin-token")
    first = make_spawner(url)
    first.user_options = {"gpus": 1}
    await start(first)
    old = first.gpu_lease_id
    assert old is not None
    await admin.set_server_url(old, "http://10.0.0.5:8888/user/ann/", CONTAINER, "e-1")

    async def refuse(self: Any, now: bool = False) -> None:
        raise RuntimeError("the engine does not answer")

    with monkeypatch.context() as patch:
        patch.setattr(LocalProcessSpawner, "stop", refuse)
        with pytest.raises(RuntimeError):
            await first.stop()
    assert (await admin.get_lease(old))["state"] == "granted"
    return old


async def test_a_start_after_a_failed_stop_leaves_the_devices_to_the_old_holder(
    service_broker: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The start released the old lease as "holder stopped", so its GPU went
    to the next request while the container might still use it."""
    admin = BrokerClient(service_broker, "admin-token")
    old = await _failed_stop(service_broker, monkeypatch)
    await admin.request_lease("carl", "", gpus=1, holder_kind="external")
    bob = await admin.request_lease("bob", "", gpus=1, holder_kind="external")
    again = make_spawner(service_broker, queue_timeout=2, poll_wait=1)
    again.user_options = {"gpus": 1}
    with pytest.raises(Exception, match=rf"previous run \(lease {old}\) was still being stopped"):
        await start(again)
    assert (await admin.get_lease(old))["state"] == "granted"  # stopped first
    assert (await admin.get_lease(bob["id"]))["state"] == "pending"


async def test_the_start_goes_on_once_the_old_holder_is_stopped(
    service_broker: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    admin = BrokerClient(service_broker, "admin-token")
    old = await _failed_stop(service_broker, monkeypatch)
    again = make_spawner(service_broker, queue_timeout=30, poll_wait=1)
    again.user_options = {"gpus": 1}
    started = asyncio.ensure_future(start(again))
    for _ in range(100):  # the start has asked for the old holder's stop
        if any("previous run" in e["message"] for e in again._gpu_feed.events):
            break
        await asyncio.sleep(0.05)
    assert (await admin.get_lease(old))["state"] == "granted"
    # the container's stop is reported (as the Docker engine's follower does)
    await admin.release_lease(old, "container stopped", holder_stopped=True)
    await asyncio.wait_for(started, 30)
    lease = await admin.get_lease(again.gpu_lease_id)
    assert lease["state"] == "granted" and lease["id"] != old


async def test_a_short_start_timeout_ends_the_wait_with_the_queues_message(
    service_broker: str,
) -> None:
    """With ``start_timeout`` under ``queue_timeout``, the hub cancelled the
    waiting spawn first and the user read "Spawn failed: " and nothing
    more; the wait now ends 5 s before, with the queue's own message."""
    admin = BrokerClient(service_broker, "admin-token")
    for user in ("carl", "dora"):
        await admin.request_lease(user, "", gpus=1, holder_kind="external")
    spawner = make_spawner(service_broker, start_timeout=7, poll_wait=1)
    assert spawner.queue_timeout == 3600
    spawner.user_options = {"gpus": 1}
    with pytest.raises(Exception, match=r"Waited 2 s in the GPU queue without a grant"):
        await start(spawner)
    leases = await admin.list_leases(user="ann", state="all")
    assert [x["state"] for x in leases] == ["released"]


def test_several_shares_are_not_said_to_be_free_now() -> None:
    """A profile of two 10 GiB shares said "free now" when only one GPU had
    room, and the spawn queued."""
    from gpubroker_spawner import form

    pools = {
        "pools": [
            {
                "name": "shared",
                "mode": "timeslice",
                "purpose": "interactive",
                "free": {"gpus": 0, "share_gib": 77.6474609375, "shares_total_gib": 85.2949},
            }
        ],
        "quota": {"remaining": None},
    }

    def profile(request: dict[str, Any]) -> dict[str, Any]:
        return {
            "display_name": "Shares",
            "slug": "s",
            "description": "",
            "request": request,
            "default": False,
            "spawner_override": {},
            "guarantee": "g",
        }

    (two,) = form.profile_choices([profile({"memory_gib": 10, "count": 2})], pools, {})
    assert two["availability"] == (
        "may queue: 2 shares need 2 GPUs with 10 GiB free each; up to 77.65 GiB on one GPU"
    )
    (one,) = form.profile_choices([profile({"memory_gib": 10})], pools, {})
    assert one["availability"] == "free now: up to 77.65 GiB on one GPU"
