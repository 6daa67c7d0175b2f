"""The spawner against a real broker (fake GPUs, SQLite) served over HTTP on
127.0.0.1, its tokens checked by a tiny fake hub API: the progress of a
failed GPU step, the limit named for bad ``gpus`` values, and a start that
meets this server's own stale lease."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
from jupyterhub.objects import Hub
from jupyterhub.services.auth import HubAuth
from jupyterhub.spawner import LocalProcessSpawner
from tornado import web
from tornado.httpclient import AsyncHTTPClient, HTTPRequest
from tornado.httpserver import HTTPServer

from gpubroker.api import auth
from gpubroker.api.app import make_app
from gpubroker.client import BrokerClient, BrokerClientError
from gpubroker.core import Broker
from gpubroker.devices.fake import FakeDeviceBackend
from gpubroker.store.db import make_engine, make_session_factory, upgrade
from gpubroker_spawner import SimpleLocalGPUSpawner
from gpubroker_spawner.mixin import REPLACED_REASON

ACCESS = "access:services!service=gpubroker"
MODELS = {
    "admin-token": {"kind": "service", "name": "gpubroker", "scopes": [ACCESS, auth.ADMIN_SCOPE]}
}


def bound() -> tuple[socket.socket, int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    sock.setblocking(False)
    return sock, sock.getsockname()[1]


@pytest.fixture
def hub_api() -> Iterator[str]:
    """``GET /hub/api/user`` in its own thread (HubAuth checks tokens synchronously)."""

    class User(web.RequestHandler):
        def get(self) -> None:
            token = self.request.headers.get("Authorization", "").partition(" ")[2]
            if token not in MODELS:
                self.set_status(403)
            self.finish(MODELS.get(token, {"status": 403, "message": "no such token"}))

    ready = threading.Event()
    port: list[int] = []
    loop = asyncio.new_event_loop()

    def run() -> None:
        asyncio.set_event_loop(loop)
        sock, number = bound()
        server = HTTPServer(web.Application([("/hub/api/user", User)]))
        server.add_sockets([sock])
        port.append(number)
        ready.set()
        loop.run_forever()
        server.stop()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(10)
    yield f"http://127.0.0.1:{port[0]}/hub/api"
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def serve_broker(tmp_path: Any, hub_api: str, inventory: list[str]) -> tuple[HTTPServer, str]:
    url = f"sqlite:///{tmp_path / 'broker.sqlite'}"
    upgrade(url)
    backend = FakeDeviceBackend(inventory=inventory, node_name="node-a")
    broker = Broker(session_factory=make_session_factory(make_engine(url)), backend=backend)
    broker.sync_inventory()
    broker.adopt()
    hub_auth = HubAuth(
        api_url=hub_api, api_token="broker-secret", access_scopes={ACCESS}, cache_max_age=5
    )
    server = HTTPServer(make_app(broker, base_url="/b/", hub_auth=hub_auth))
    sock, port = bound()
    server.add_sockets([sock])
    return server, f"http://127.0.0.1:{port}/b/"


@pytest.fixture
async def broker_url(tmp_path: Any, hub_api: str) -> AsyncIterator[str]:
    """A broker on one fake H100 node with 2 GPUs."""
    server, url = serve_broker(tmp_path, hub_api, ["2 x H100"])
    yield url
    server.stop()


@pytest.fixture
async def one_gpu_url(tmp_path: Any, hub_api: str) -> AsyncIterator[str]:
    server, url = serve_broker(tmp_path, hub_api, ["1 x H100"])
    yield url
    server.stop()


#: run on an answer of the broker to ``POST /leases`` before the proxy passes
#: it on; True: it answered the client itself
LeasePostHook = Callable[[web.RequestHandler], Awaitable[bool]]


def forwarding_proxy(target: str, on_lease_post: LeasePostHook) -> tuple[HTTPServer, str]:
    """A proxy at ``/b/`` that forwards every call to ``target``; once the
    broker has answered a lease request (``POST /leases``, the lease made),
    ``on_lease_post`` runs before the answer is passed on."""

    class Forward(web.RequestHandler):
        async def _any(self) -> None:
            path = self.request.uri.split("/b/", 1)[1]
            method = self.request.method
            answer = await AsyncHTTPClient().fetch(
                HTTPRequest(
                    target + path,
                    method=method,
                    headers=dict(self.request.headers),
                    body=self.request.body if method != "GET" else None,
                    allow_nonstandard_methods=True,
                ),
                raise_error=False,
            )
            if method == "POST" and path == "api/v1/leases" and await on_lease_post(self):
                return
            self.set_status(answer.code)
            self.set_header("Content-Type", "application/json")
            self.finish(answer.body)

        get = post = delete = _any

    server = HTTPServer(web.Application([(r"/b/.*", Forward)]))
    sock, port = bound()
    server.add_sockets([sock])
    return server, f"http://127.0.0.1:{port}/b/"


def lossy_proxy(target: str) -> tuple[HTTPServer, str]:
    """Forwards to ``target``, but answers the first lease request 502
    after the broker made it (its answer lost, as while the broker restarts)."""
    lost: list[int] = []

    async def lose_first(handler: web.RequestHandler) -> bool:
        if lost:
            return False
        lost.append(1)
        handler.set_status(502)
        handler.finish(json.dumps({"status": 502, "message": "bad gateway"}))
        return True

    return forwarding_proxy(target, lose_first)


def make_spawner(url: str, **kwargs: Any) -> SimpleLocalGPUSpawner:
    user = SimpleNamespace(name="ann", url="/user/ann/", escaped_name="ann")
    hub = Hub(ip="127.0.0.1", port=8081, base_url="/hub/")
    kwargs.setdefault("broker_retry_interval", 0.1)
    return SimpleLocalGPUSpawner(
        user=user, hub=hub, broker_url=url, broker_api_token="admin-token", **kwargs
    )


async def fake_start(self: Any) -> tuple[str, int]:
    return ("127.0.0.1", 1234)


async def start(spawner: SimpleLocalGPUSpawner) -> None:
    await spawner.check_user_options(spawner.user_options)
    with mock.patch.object(LocalProcessSpawner, "start", fake_start):
        await spawner.start()


# -- 1: progress of a failed GPU step ------------------------------------------------


async def test_a_spawn_that_times_out_in_the_queue_shows_no_server_start(
    one_gpu_url: str,
) -> None:
    admin = BrokerClient(one_gpu_url, "admin-token")
    assert (await admin.request_lease("bob", "", gpus=1))["state"] == "granted"
    spawner = make_spawner(one_gpu_url, queue_timeout=1, poll_wait=1)
    spawner.user_options = {"gpus": 1}
    await spawner.check_user_options({"gpus": 1})
    events: list[dict[str, Any]] = []

    async def follow() -> None:
        async for event in spawner.progress():
            events.append(event)

    follower = asyncio.ensure_future(follow())
    with pytest.raises(web.HTTPError, match="in the GPU queue without a grant"):
        await spawner.start()
    await asyncio.wait_for(follower, 5)  # the feed ends with the failure
    messages = [e["message"] for e in events]
    assert messages and all(m.startswith("Queued for 1 x GPU") for m in messages), messages


# -- 2: bad gpus values name the real limit ------------------------------------------


@pytest.mark.parametrize("value", [False, "", {}, [], 0.0, 1.5, "1"])
async def test_a_bad_gpus_value_names_the_servers_limit(broker_url: str, value: Any) -> None:
    spawner = make_spawner(broker_url, max_gpus=2)
    with pytest.raises(web.HTTPError) as info:
        await spawner.check_user_options({"gpus": value})
    assert info.value.status_code == 400
    assert info.value.log_message == (
        f"gpus: must be an integer between 0 and 2, got {json.dumps(value)}"
    )


async def test_a_form_value_of_many_digits_is_refused_naming_the_limit(broker_url: str) -> None:
    spawner = make_spawner(broker_url, max_gpus=2)
    options = spawner.options_from_form({"gpus": ["9" * 5000]})
    with pytest.raises(web.HTTPError) as info:
        await spawner.check_user_options(options)
    message = info.value.log_message
    assert info.value.status_code == 400
    assert message.startswith('gpus: must be an integer between 0 and 2, got "9999')
    assert len(message) < 120
    assert spawner.options_from_form({"gpus": [" 2 "]}) == {"gpus": 2}


# -- 3: this server's stale lease ----------------------------------------------------


async def test_a_start_replaces_this_servers_stale_lease(broker_url: str, caplog: Any) -> None:
    # e.g. left by a start cancelled while its request was on the way, or
    # by a stop whose release the broker never got (another spawner object)
    admin = BrokerClient(broker_url, "admin-token")
    stale = await admin.request_lease("ann", "", gpus=1)
    spawner = make_spawner(broker_url)
    spawner.user_options = {"gpus": 1}
    await start(spawner)
    assert spawner.gpu_lease_id not in (None, stale["id"])
    old = await admin.get_lease(stale["id"])
    assert (old["state"], old["release_reason"]) == ("released", REPLACED_REASON)
    active = await admin.list_leases(user="ann")
    assert [lease["id"] for lease in active] == [spawner.gpu_lease_id]
    assert f"already has active lease {stale['id']} for this server" in caplog.text


async def test_a_lost_answer_to_the_lease_request_does_not_fail_the_spawn(
    broker_url: str,
) -> None:
    proxy, url = lossy_proxy(broker_url)
    try:
        spawner = make_spawner(url)
        spawner.user_options = {"gpus": 1}
        await start(spawner)
        admin = BrokerClient(broker_url, "admin-token")
        active = await admin.list_leases(user="ann")
        assert [lease["id"] for lease in active] == [spawner.gpu_lease_id]
        everything = await admin.list_leases(user="ann", state="all")
        assert [
            lease["release_reason"] for lease in everything if lease["state"] == "released"
        ] == [REPLACED_REASON]
    finally:
        proxy.stop()


async def test_another_servers_lease_or_another_conflict_is_still_refused(
    broker_url: str,
) -> None:
    spawner = make_spawner(broker_url)
    spawner.orm_spawner = SimpleNamespace(name="gpu", user_options=None, server=None)
    mine = "server_name: ann/gpu already has active lease 7; one active lease per server"
    assert spawner._own_active_lease(BrokerClientError(409, mine)) == 7
    for status, message in [
        (409, "server_name: ann/(default) already has active lease 7; one active lease per server"),
        (409, "server_name: bob/gpu already has active lease 7; one active lease per server"),
        (409, "something else clashes"),
        (400, mine),
    ]:
        assert spawner._own_active_lease(BrokerClientError(status, message)) is None
    # a lease of the user's other server is not touched
    admin = BrokerClient(broker_url, "admin-token")
    other = await admin.request_lease("ann", "", gpus=1)
    spawner.user_options = {"gpus": 1}
    await start(spawner)
    assert (await admin.get_lease(other["id"]))["state"] == "granted"


def _named(url: str, name: str, state: dict[str, Any]) -> SimpleLocalGPUSpawner:
    """The hub's spawner of ann's server ``name``, its saved ``state`` loaded."""
    spawner = SimpleLocalGPUSpawner(
        user=SimpleNamespace(name="ann", url="/user/ann/", escaped_name="ann"),
        hub=Hub(ip="127.0.0.1", port=8081, base_url="/hub/"),
        broker_url=url,
        broker_api_token="admin-token",
        broker_retry_interval=0.1,
    )
    spawner.orm_spawner = SimpleNamespace(name=name, user_options={}, state=state, server=None)
    spawner.user_options = {"gpus": 1}
    spawner.load_state(state)
    return spawner


async def test_a_server_renamed_after_its_run_died_starts_afresh(broker_url: str) -> None:
    """A named server whose last run died keeps that run's lease as
    ``gpu_restart_of``; renamed (JupyterHub 6), every start of it sent
    that lease, which the broker refuses for the new name: the server could
    never start again (a review of the spawner). The rename drops it, and
    a refusal of it (a broker database replaced) starts afresh."""
    import subprocess
    import sys

    a = _named(broker_url, "a", {})
    with mock.patch.object(LocalProcessSpawner, "start", fake_start):
        await a.start()
    a.proc = subprocess.Popen([sys.executable, "-c", "pass"])
    a.proc.wait()
    a.pid = a.proc.pid
    assert await a.poll() is not None  # died: its lease released, kept as restart_of
    a.clear_state()
    a.orm_spawner.state = a.get_state()
    assert a.orm_spawner.state == {"gpu_restart_of": 1}
    await a.rename("a", "b")
    assert a.orm_spawner.state == {}  # what the hub builds server "b" from
    # a state that still names it (the database was replaced): the broker's
    # refusal drops it, at the check of the options and at the start
    b = _named(broker_url, "b", {"gpu_restart_of": 1})
    await b.check_user_options({"gpus": 1})
    assert b.gpu_restart_of is None
    c = _named(broker_url, "c", {"gpu_restart_of": 1})
    with mock.patch.object(LocalProcessSpawner, "start", fake_start):
        await c.start()
    assert c.gpu_lease_id is not None and c.gpu_restart_of is None


def test_an_option_name_reaches_no_message_raw() -> None:
    """An unknown option's name or profile slug with a line break went raw
    into the 400 and the hub's log (a forged log line)."""
    from gpubroker_spawner import form

    forged = "x\n[W 2026-01-01 hub] forged line"
    with pytest.raises(form.OptionsError) as err:
        form.check_gpu_options({forged: 1}, 8)
    assert "\n" not in str(err.value) and str(err.value).startswith('"x\\n[W 2026-01-01 hub]')
    with pytest.raises(form.OptionsError) as err:
        form.check_gpu_options({"gpu": 1}, 8)
    assert str(err.value).startswith("gpu: unknown option")
