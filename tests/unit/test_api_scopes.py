"""Who may call what: every handler method declares its scope, the base
handler checks it in one place, and token checks do not block the event loop
(against a small fake hub API on 127.0.0.1, no JupyterHub started)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from jupyterhub.httpclient import JupyterHubHTTPClient
from jupyterhub.services.auth import HubAuth
from tornado import web
from tornado.httpclient import AsyncHTTPClient, HTTPResponse
from tornado.httpserver import HTTPServer

from gpubroker.api import auth
from gpubroker.api.app import ROUTES, BrokerApplication, make_app
from gpubroker.api.handlers import HTTP_METHODS, APIHandler
from gpubroker.core import Broker

ACCESS = "access:services!service=gpubroker"
ADMIN_NEEDED = "this endpoint needs scope custom:gpubroker:admin"
#: token -> the model the fake hub answers for it
MODELS: dict[str, dict[str, Any]] = {
    "admin-token": {"kind": "service", "name": "gpubroker", "scopes": [ACCESS, auth.ADMIN_SCOPE]},
    "ann-token": {"kind": "user", "name": "ann", "scopes": [ACCESS]},
    "bob-token": {"kind": "user", "name": "bob", "scopes": [ACCESS]},
    "slow-token": {"kind": "user", "name": "sam", "scopes": [ACCESS]},
    "noscope-token": {"kind": "user", "name": "ann", "scopes": ["read:users:name!user=ann"]},
    # a hub service that happens to be named like a user: not that user
    "ann-service-token": {"kind": "service", "name": "ann", "scopes": [ACCESS]},
}
DOCS = Path(__file__).parents[2] / "docs" / "reference" / "rest-api.md"


def declared_methods() -> Iterator[tuple[str, str, type[web.RequestHandler], Any]]:
    """(METHOD, path, handler, function) of every served route and method."""
    for path, handler in ROUTES:
        for method in HTTP_METHODS:
            function = getattr(handler, method)
            if function is not getattr(web.RequestHandler, method):
                yield method.upper(), path, handler, function


def test_every_handler_method_of_every_route_declares_what_it_needs() -> None:
    missing = [
        f"{handler.__name__}.{method.lower()} ({method} {path})"
        for method, path, handler, function in declared_methods()
        if auth.need_of(function) is None
    ]
    assert missing == [], "declare with @auth.needs(...) or @auth.public"
    for _, _, handler, _ in declared_methods():
        assert issubclass(handler, APIHandler)  # whose prepare checks the declaration


def test_the_api_reference_lists_what_each_endpoint_needs() -> None:
    text = DOCS.read_text("utf-8")
    rows = re.findall(r"^\| `(GET|POST|PUT|PATCH|DELETE) (/[^`]*)` \| ([^|]+?) \|", text, re.M)
    documented = {(method, path): needs.strip() for method, path, needs in rows}
    served = {
        (method, path): auth.need_of(function).kind  # type: ignore[union-attr]
        for method, path, _, function in declared_methods()
    }
    assert documented == served


def test_declarations_are_checked_when_made() -> None:
    with pytest.raises(ValueError, match="unless_owner/admin_for need a scope beyond access"):
        auth.needs(auth.ACCESS_SCOPE, unless_owner=lambda h: None)
    with pytest.raises(ValueError, match="admin_for goes with unless_owner"):
        auth.needs(auth.ADMIN_SCOPE, admin_for=lambda h: None)


class FakeHub:
    """``GET /hub/api/user`` of a hub, in its own thread and event loop; the
    answer for ``slow-token`` waits until :attr:`release` is set."""

    def __init__(self) -> None:
        self.received = threading.Event()  # the slow token's check has arrived
        self.release = threading.Event()
        self.asked: list[str] = []
        self.port = 0
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hub/api"

    def _run(self) -> None:
        hub = self

        class User(web.RequestHandler):
            async def get(self) -> None:
                token = self.request.headers.get("Authorization", "").partition(" ")[2]
                hub.asked.append(token)
                if token == "slow-token":
                    hub.received.set()
                    # slow, and bounded: a broker whose loop blocked would
                    # answer this request first, after 10 s
                    await asyncio.get_running_loop().run_in_executor(None, hub.release.wait, 10)
                model = MODELS.get(token)
                if model is None:
                    self.set_status(403)
                    self.finish({"status": 403, "message": "no such token"})
                    return
                self.finish(model)

        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        sock, self.port = _bound()
        server = HTTPServer(web.Application([("/hub/api/user", User)]))
        server.add_sockets([sock])
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            server.stop()
            self._loop.close()


class ServedAPI:
    """The broker's API on 127.0.0.1, its tokens checked by a HubAuth on
    :class:`FakeHub`."""

    def __init__(
        self, broker: Broker, hub: FakeHub, server_running: Any = None, **settings: Any
    ) -> None:
        hub_auth = HubAuth(
            api_url=hub.api_url,
            api_token="broker-secret",
            access_scopes={ACCESS},
            cache_max_age=5,
        )
        self.app = make_app(broker, hub_auth=hub_auth, server_running=server_running, **settings)
        self.server = HTTPServer(self.app)
        sock, self.port = _bound()
        self.server.add_sockets([sock])
        self.client = AsyncHTTPClient()

    async def call(
        self, method: str, path: str, token: str | None = None, body: Any = None
    ) -> HTTPResponse:
        headers = {"Authorization": f"token {token}"} if token else {}
        data = None if body is None else json.dumps(body)
        if data is None and method in ("POST", "PUT", "PATCH"):
            data = "{}"
        response: HTTPResponse = await self.client.fetch(
            f"http://127.0.0.1:{self.port}/api/v1{path}",
            method=method,
            headers=headers,
            body=data,
            allow_nonstandard_methods=True,
            raise_error=False,
            request_timeout=60,
        )
        return response


@pytest.fixture
async def api(broker: Broker) -> AsyncIterator[tuple[ServedAPI, FakeHub]]:
    with FakeHub() as hub:
        served = ServedAPI(broker, hub)
        try:
            yield served, hub
        finally:
            served.server.stop()
            await JupyterHubHTTPClient.loop_instance().close()


def error(response: HTTPResponse) -> tuple[int, str]:
    data = json.loads(response.body)
    assert data["status"] == response.code
    return response.code, data["message"]


async def test_no_token_401_and_a_token_without_access_403_on_every_endpoint(
    api: tuple[ServedAPI, FakeHub],
) -> None:
    served, _ = api
    for method, path, _, function in declared_methods():
        path = path.format(id="1", uuid="GPU-x", kind="user", name="ann")
        if auth.need_of(function) == auth.Need(None):
            assert (await served.call(method, path)).code == 200, path
            continue
        answer = error(await served.call(method, path))
        assert answer == (401, "authentication required: send 'Authorization: token …'")
        for token in ("noscope-token", "no-such-token"):
            answer = error(await served.call(method, path, token))
            assert answer == (403, f"token lacks scope {ACCESS}"), (method, path, token)


async def test_admin_endpoints_name_the_missing_scope(api: tuple[ServedAPI, FakeHub]) -> None:
    served, _ = api
    created = await served.call("POST", "/leases", "ann-token", {"user": "ann", "gpus": 1})
    lease = json.loads(created.body)
    cases = [
        ("GET", "/quotas", None, ADMIN_NEEDED),
        ("PUT", "/quotas/user/ann", {"guaranteed": 1}, ADMIN_NEEDED),
        ("DELETE", "/quotas/group/vision", None, ADMIN_NEEDED),
        ("PATCH", "/devices/GPU-x", {"drained": True}, ADMIN_NEEDED),
        (
            "PATCH",
            f"/leases/{lease['id']}",
            {"priority_class": "batch"},
            "changing a lease needs scope custom:gpubroker:admin",
        ),
    ]
    for method, path, body, message in cases:
        assert error(await served.call(method, path, "ann-token", body)) == (403, message)
    # the admin gets past the check (to the endpoint's own answers)
    assert (await served.call("GET", "/quotas", "admin-token")).code == 200
    answer = await served.call("PATCH", "/devices/GPU-x", "admin-token", {"drained": True})
    assert answer.code == 404


async def test_owners_and_admins_and_nobody_else(api: tuple[ServedAPI, FakeHub]) -> None:
    served, _ = api
    created = await served.call("POST", "/leases", "bob-token", {"user": "bob", "gpus": 1})
    assert created.code == 201
    lease = json.loads(created.body)
    refused = "user: 'ann' may not act on leases of 'bob' (needs scope custom:gpubroker:admin)"
    # a lease of another user, named by its id, is answered as one nobody
    # has: ids can be walked, and neither its existence nor its owner is told
    unseen = f"lease {lease['id']}: no such lease"
    for method, path, body in [
        ("GET", f"/leases/{lease['id']}", None),
        ("GET", f"/leases/{lease['id']}?wait=5", None),
        ("GET", f"/leases/{lease['id']}/events", None),
        ("DELETE", f"/leases/{lease['id']}", {}),
    ]:
        assert error(await served.call(method, path, "ann-token", body)) == (404, unseen)
    assert error(await served.call("GET", "/leases/999999", "ann-token")) == (
        404,
        "lease 999999: no such lease",
    )
    for method, path, body in [
        ("GET", "/leases?user=bob", None),
        ("GET", "/notices?user=bob", None),
        ("GET", "/pools?user=bob", None),
        ("POST", "/leases", {"user": "bob", "gpus": 1}),
    ]:
        assert error(await served.call(method, path, "ann-token", body)) == (403, refused)
    external = {"user": "ann", "gpus": 1, "holder_kind": "external"}
    answer = error(await served.call("POST", "/leases", "ann-token", external))
    assert answer == (403, "holder_kind: 'external' needs custom:gpubroker:admin")
    # the request is checked before who may make it, as before
    answer = error(await served.call("GET", "/leases?user=bob&state=bogus", "ann-token"))
    assert answer == (400, "state: must be 'active' or 'all', got \"bogus\"")
    answer = error(await served.call("POST", "/leases", "ann-token", {"user": "bob", "gpus": 0}))
    assert answer[0] == 400
    assert error(await served.call("GET", "/leases/999999", "ann-token"))[0] == 404

    async def listed(token: str, query: str = "") -> list[str]:
        answer = await served.call("GET", f"/leases{query}", token)
        assert answer.code == 200
        return [x["user"] for x in json.loads(answer.body)["leases"]]

    assert await listed("ann-token") == [] and await listed("ann-token", "?user=ann") == []
    assert await listed("bob-token") == ["bob"] == await listed("bob-token", "?user=bob")
    assert await listed("admin-token", "?user=gpubroker") == []  # its own name: its own
    assert await listed("admin-token") == ["bob"] and await listed("admin-token", "?user=ann") == []
    for path in (f"/leases/{lease['id']}", f"/leases/{lease['id']}/events", "/pools?user=bob"):
        assert (await served.call("GET", path, "bob-token")).code == 200
        assert (await served.call("GET", path, "admin-token")).code == 200
    for token in ("ann-token", "admin-token"):  # open to every caller of the service
        assert (await served.call("GET", "/queue", token)).code == 200
        assert (await served.call("GET", "/devices", token)).code == 200
    released = await served.call("DELETE", f"/leases/{lease['id']}", "bob-token", {})
    assert released.code == 200 and json.loads(released.body)["release_reason"] == "released by bob"


async def test_a_service_named_like_a_user_owns_nothing_of_theirs(
    api: tuple[ServedAPI, FakeHub],
) -> None:
    served, _ = api
    created = await served.call("POST", "/leases", "ann-token", {"user": "ann", "gpus": 1})
    assert created.code == 201
    lease = json.loads(created.body)
    owns_nothing = f"{ADMIN_NEEDED} (a service owns no leases)"
    for path in ("/leases", "/leases?user=ann", "/notices", "/pools", "/usage"):
        answer = error(await served.call("GET", path, "ann-service-token"))
        assert answer[0] == 403, path
        assert answer[1] in (
            owns_nothing,
            "user: 'ann' may not act on leases of 'ann' (needs scope custom:gpubroker:admin)",
        ), (path, answer)
    for path in (f"/leases/{lease['id']}", f"/leases/{lease['id']}/events"):
        assert (await served.call("GET", path, "ann-service-token")).code == 404
    # the device listing is open to every caller, but shows the holders of
    # its own leases only: a service has none
    devices = json.loads((await served.call("GET", "/devices", "ann-service-token")).body)
    assert not any(d["holders"] for d in devices["devices"])
    mine = json.loads((await served.call("GET", "/devices", "ann-token")).body)
    assert [h["user"] for d in mine["devices"] for h in d["holders"]] == ["ann"]


async def test_a_query_argument_given_twice_is_refused(api: tuple[ServedAPI, FakeHub]) -> None:
    served, _ = api
    body = {"user": "ann", "gpus": 1}
    answer = await served.call("POST", "/leases?dry_run=true&dry_run=false", "ann-token", body)
    assert error(answer) == (400, "dry_run: given 2 times; give it once")
    answer = await served.call("GET", "/leases?state=all&state=active", "ann-token")
    assert error(answer) == (400, "state: given 2 times; give it once")
    assert json.loads((await served.call("GET", "/leases", "ann-token")).body)["leases"] == []


async def test_a_slow_token_check_does_not_stall_other_requests(
    api: tuple[ServedAPI, FakeHub],
) -> None:
    served, hub = api
    assert (await served.call("GET", "/queue", "bob-token")).code == 200  # bob's now cached
    asked = len(hub.asked)
    done: list[str] = []

    async def call(name: str, path: str, token: str | None = None) -> HTTPResponse:
        answer = await served.call("GET", path, token)
        done.append(name)
        return answer

    slow = asyncio.ensure_future(call("slow", "/leases", "slow-token"))
    assert await asyncio.to_thread(hub.received.wait, 30)  # its check waits at the hub
    health = await call("health", "/health")
    cached = await call("cached", "/queue", "bob-token")
    missed = await call("other token", "/devices", "ann-token")  # a check of its own
    assert not slow.done()
    hub.release.set()
    answer = await slow
    assert done == ["health", "cached", "other token", "slow"]
    assert (health.code, cached.code, missed.code, answer.code) == (200, 200, 200, 200)
    assert json.loads(answer.body) == {"leases": []}
    assert hub.asked[asked:] == ["slow-token", "ann-token"]  # bob's answer came from the cache


async def test_token_answers_are_cached(api: tuple[ServedAPI, FakeHub]) -> None:
    served, hub = api
    for _ in range(3):
        assert (await served.call("GET", "/queue", "ann-token")).code == 200
    assert hub.asked == ["ann-token"]
    assert served.app.settings["hub_auth"].cache_max_age == 5


async def test_an_oversized_body_is_refused_before_its_token_is_checked(
    api: tuple[ServedAPI, FakeHub],
) -> None:
    served, hub = api
    reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
    writer.write(
        b"POST /api/v1/leases HTTP/1.1\r\nHost: x\r\nAuthorization: token ann-token\r\n"
        b"Content-Length: 1000000000\r\nConnection: close\r\n\r\n"
    )
    await writer.drain()
    answer = await asyncio.wait_for(reader.readuntil(b"}"), 30)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 413")
    assert hub.asked == []


class _Undeclared(APIHandler):
    def get(self) -> None:
        self.write_json({"served": True})


async def test_a_method_without_declaration_is_refused(broker: Broker) -> None:
    app = BrokerApplication(
        [("/x", _Undeclared)], broker=broker, log=logging.getLogger("t"), hub_auth=None
    )
    server = HTTPServer(app)
    sock, port = _bound()
    server.add_sockets([sock])
    try:
        answer = await AsyncHTTPClient().fetch(f"http://127.0.0.1:{port}/x", raise_error=False)
        assert error(answer) == (500, "_Undeclared.get declares no scope")
    finally:
        server.stop()


def _bound() -> tuple[socket.socket, int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    sock.setblocking(False)
    return sock, sock.getsockname()[1]
