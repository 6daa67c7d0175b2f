"""What an admin trying the demo found in the API and the panel: messages
that name the field and the limit, query arguments checked as sent, one
answer for a quota of an unknown kind, a JSON answer to an oversized
chunked body, and a device summary that agrees with the device states."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from urllib.parse import quote

import pytest
from jupyterhub.httpclient import JupyterHubHTTPClient
from tornado import web
from tornado.httpserver import HTTPServer

from gpubroker import views
from gpubroker.api import app as app_module
from gpubroker.api import auth, validation
from gpubroker.api.app import BrokerApplication
from gpubroker.core import Broker
from gpubroker.errors import BadRequest
from gpubroker.web import pages

from .test_api_scopes import ACCESS, MODELS, FakeHub, ServedAPI, _bound, error
from .test_panel_review import Panel, alert, text

LOG = logging.getLogger("test-admin-trial")


@pytest.fixture
async def served(broker: Broker) -> AsyncIterator[ServedAPI]:
    """The API of ``broker`` on 127.0.0.1 (tokens ``admin-token``, ``ann-token``)."""
    with FakeHub() as hub:
        api = ServedAPI(broker, hub)
        try:
            yield api
        finally:
            api.server.stop()
            await JupyterHubHTTPClient.loop_instance().close()


@pytest.fixture
async def panel(broker: Broker, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Panel]:
    """The panel of ``broker``; ``root-token`` is a broker admin's login."""
    monkeypatch.setitem(
        MODELS, "root-token", {"kind": "user", "name": "root", "scopes": [ACCESS, auth.ADMIN_SCOPE]}
    )
    with FakeHub() as hub:
        served = Panel(broker, hub)
        try:
            yield served
        finally:
            served.server.stop()
            await JupyterHubHTTPClient.loop_instance().close()


# 1 -----------------------------------------------------------------------------


async def test_a_lease_patch_names_the_field_and_what_is_wrong(served: ServedAPI) -> None:
    created = await served.call("POST", "/leases", "ann-token", {"user": "ann", "gpus": 1})
    path = f"/leases/{json.loads(created.body)['id']}"
    cases = [
        ({"priority_class": 5}, "priority_class: must be a string (a class name), got 5"),
        ({"priority_class": None}, "priority_class: must be a string (a class name), got null"),
        ({"priority_class": "batch", "x": 1}, "x: unknown field (allowed: priority_class)"),
        (
            {"server_url": "http://10.0.0.5:8888/", "x": 1},
            "x: unknown field (allowed: container_id, docker_engine, server_url, slurm_job)",
        ),
        (
            {"container_id": "ab" * 6},
            'body: must be {"priority_class": NAME} or {"server_url": URL, ...},'
            ' got "container_id"',
        ),
        (
            {},
            'body: must be {"priority_class": NAME} or {"server_url": URL, ...}, got no field',
        ),
    ]
    for body, message in cases:
        assert error(await served.call("PATCH", path, "admin-token", body)) == (400, message)
    recorded = await served.call("PATCH", path, "admin-token", {"server_url": "http://h:1/"})
    assert recorded.code == 200, recorded.body


# 2 and 7 -------------------------------------------------------------------------


def test_the_panels_quota_numbers_say_the_limit() -> None:
    with pytest.raises(BadRequest) as refused:
        pages._number("-1", "guaranteed")
    assert refused.value.message == 'guaranteed: must be a finite number of GPUs >= 0, got "-1"'
    assert pages._number("+2.5", "limit") == 2.5


async def test_a_quota_of_an_unknown_kind_is_a_400_naming_kind(
    served: ServedAPI, panel: Panel
) -> None:
    message = 'kind: must be user or group, got "team"'
    assert error(await served.call("PUT", "/quotas/team/x", "admin-token", {"guaranteed": 1})) == (
        400,
        message,
    )
    assert error(await served.call("DELETE", "/quotas/team/x", "admin-token")) == (400, message)
    # who may call it is checked first, as on every admin endpoint
    answer = error(await served.call("PUT", "/quotas/team/x", "ann-token", {"guaranteed": 1}))
    assert answer == (403, "this endpoint needs scope custom:gpubroker:admin")
    assert (
        await served.call("PUT", "/quotas/user/ann", "admin-token", {"guaranteed": 1})
    ).code == 200
    assert (await served.call("DELETE", "/quotas/user/ann", "admin-token")).code == 200
    form = {"action": "set", "kind": "team", "name": "x", "guaranteed": "1"}
    refused = await panel.post("quotas", form)
    assert refused.code == 400 and alert(refused) == message.replace('"', "&#34;")
    form = {"action": "set", "kind": "user", "name": "ann", "guaranteed": "-1"}
    refused = await panel.post("quotas", form)
    assert refused.code == 400
    assert alert(refused) == "guaranteed: must be a finite number of GPUs &gt;= 0, got &#34;-1&#34;"


# 3 -------------------------------------------------------------------------------


async def test_the_audit_limit_message_gives_the_real_range(served: ServedAPI) -> None:
    for raw in ("abc", "0", "10001", "-1"):
        answer = error(await served.call("GET", f"/audit?limit={raw}", "admin-token"))
        assert answer == (400, f'limit: must be an integer from 1 to 10000, got "{raw}"')
    assert (await served.call("GET", "/audit?limit=10000", "admin-token")).code == 200
    answer = error(
        await served.call("GET", "/audit?since=2026-12-02&until=2026-12-01", "admin-token")
    )
    assert answer == (
        400,
        "since: must be before until (2026-12-02T00:00:00.000000Z is not before "
        "2026-12-01T00:00:00.000000Z)",
    )


def test_optional_int_takes_a_range() -> None:
    assert validation.optional_int("5", "limit", 1, 10) == 5
    assert validation.optional_int(None, "limit", 1, 10) is None
    with pytest.raises(BadRequest, match='limit: must be an integer from 1 to 10, got "11"'):
        validation.optional_int("11", "limit", 1, 10)


# 4 and 5 -------------------------------------------------------------------------


async def test_user_arguments_are_checked_as_sent(served: ServedAPI, panel: Panel) -> None:
    rule = "must be 1-255 characters without '/', control characters or a leading space"
    answer = error(await served.call("GET", "/leases?user=%00", "admin-token"))
    assert answer == (400, f"user: {rule}, and not '.' or '..', got \"\\u0000\"")
    for path in ("/notices", "/leases", "/pools", "/jobs", "/usage", "/audit"):
        for value in ("%20x", "%00", "a%01b"):
            answer = error(await served.call("GET", f"{path}?user={value}", "admin-token"))
            assert answer[0] == 400 and answer[1].startswith(f"user: {rule}"), (path, answer)
    answer = error(await served.call("GET", "/notices?user=%20x", "admin-token"))
    assert answer[1].endswith('got " x"')
    # a well-formed name still works, and other arguments keep theirs
    assert (await served.call("GET", "/notices?user=ann", "admin-token")).code == 200
    answer = error(await served.call("GET", "/leases?state=%00", "admin-token"))
    assert answer == (400, "state: must be 'active' or 'all', got \"\\u0000\"")
    answer = error(await served.call("GET", "/leases?user=%FF", "admin-token"))
    assert answer == (400, "user: not UTF-8 (invalid start byte at byte 0)")
    for value in ("%00", "%20x"):
        refused = await panel.get(f"leases?user={value}")
        assert refused.code == 400, text(refused)
        assert alert(refused).startswith("user: must be 1-255 characters")
    assert (await panel.get("leases?user=")).code == 200  # an empty filter: none


def test_query_arguments_are_read_as_sent() -> None:
    args = {"user": [b"\x00"], "two": [b"a", b"b"], "bad": [b"\xff"], "x": [b" x "]}
    assert validation.query_argument(args, "user") == "\x00"
    assert validation.query_argument(args, "x") == " x "
    assert validation.query_argument(args, "absent") is None
    with pytest.raises(BadRequest, match="two: given 2 times; give it once"):
        validation.query_argument(args, "two")
    with pytest.raises(BadRequest, match="bad: not UTF-8"):
        validation.query_argument(args, "bad")


# 6 -------------------------------------------------------------------------------


async def test_an_unknown_usage_argument_is_a_400_naming_it(served: ServedAPI) -> None:
    allowed = "by, format, from, to, token, tz, user"
    answer = error(await served.call("GET", "/usage?limit=5", "admin-token"))
    assert answer == (400, f"limit: unknown query argument (allowed: {allowed})")
    answer = error(await served.call("GET", "/usage?" + quote("a\x01") + "=1", "ann-token"))
    assert answer == (400, f'"a\\u0001": unknown query argument (allowed: {allowed})')
    every = "from=2026-01-01&to=2026-02-01&by=pool&tz=UTC&format=csv&user=ann"
    answered = await served.call("GET", f"/usage?{every}", "admin-token")
    assert answered.code == 200 and answered.headers["Content-Type"].startswith("text/csv")


# 8 -------------------------------------------------------------------------------


class _Echo(web.RequestHandler):
    def post(self) -> None:
        self.write({"got": len(self.request.body)})


async def _chunked(port: int, chunks: list[bytes]) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
    for chunk in chunks:
        writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    writer.write(b"0\r\n\r\n")
    await writer.drain()
    answer = await asyncio.wait_for(reader.readuntil(b"}"), 10)
    writer.close()
    return answer


async def test_a_chunked_body_past_the_limit_gets_a_json_400() -> None:
    app = BrokerApplication([("/echo", _Echo)], max_body_bytes=1024, log=LOG)
    server = HTTPServer(app, max_body_size=1024)
    sock, port = _bound()
    server.add_sockets([sock])
    try:
        small = await _chunked(port, [b"x" * 600, b"y" * 400])
        assert small.startswith(b"HTTP/1.1 200") and small.endswith(b'{"got": 1000}')
        big = await _chunked(port, [b"x" * 1000] * 5)
        head, _, body = big.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400")
        assert json.loads(body) == {
            "status": 400,
            "message": "body: at most 1024 bytes (GPUBrokerApp.max_body_bytes),"
            " got a larger chunked body",
        }
    finally:
        server.stop()


async def test_a_chunked_body_that_goes_on_is_answered_after_the_drain_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(app_module, "DRAIN_SECONDS", 0.2)
    app = BrokerApplication([("/echo", _Echo)], max_body_bytes=1024, log=LOG)
    server = HTTPServer(app, max_body_size=1024)
    sock, port = _bound()
    server.add_sockets([sock])
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        writer.write(b"%x\r\n" % 10**6 + b"x" * 2000)  # and never the rest
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)  # read to the close
        writer.close()
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400") and b"Connection: close" in head
        assert json.loads(body)["message"].startswith("body: at most 1024 bytes")
    finally:
        server.stop()


# 9 -------------------------------------------------------------------------------


def test_the_device_summary_counts_every_device_by_its_state(broker: Broker) -> None:
    broker.request_lease("ann", "", gpus=2)
    uuids = [row[0].uuid for row in broker.device_rows()]
    broker.set_drained(uuids[-1], True)
    listing = views.device_listing(broker, True, "", LOG)
    states = [d["state"] for d in listing["devices"]]
    summary = listing["summary"]
    assert {s: summary[s] for s in views.DEVICE_STATES} == {
        s: states.count(s) for s in views.DEVICE_STATES
    }
    assert summary["free"] + summary["leased"] + summary["drained"] == summary["total"] == 8
    assert summary["leased"] == 2 and summary["drained"] == 1 and summary["free"] == 5
    assert summary["free_whole"] == 5 and summary["absent"] == 0


def test_free_counts_free_devices_of_every_pool(db_url: str, tmp_path: object) -> None:
    from pathlib import Path

    from .test_sharing_core import sharing_broker

    broker = sharing_broker(db_url, Path(str(tmp_path)))
    broker.request_lease("ann", "", memory_gib=10.0)
    listing = views.device_listing(broker, True, "", LOG)
    summary = listing["summary"]
    states = {(d["pool_mode"], d["state"]) for d in listing["devices"]}
    assert ("timeslice", "shared") in states and ("mig", "free") in states
    # 2 MIG, 1 timeslice and 4 exclusive devices free; 1 shared
    assert summary["free"] == 7 and summary["shared"] == 1 and summary["free_whole"] == 4
    assert sum(summary[s] for s in views.DEVICE_STATES) == summary["total"] == 8
