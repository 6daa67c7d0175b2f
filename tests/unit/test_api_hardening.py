"""The API's guards against exhaustion and leaks: long-poll limit per caller,
redacted request logs, request bodies refused from their headers."""

from __future__ import annotations

import asyncio
import json
import logging
import socket

import pytest
from tornado import web
from tornado.httpserver import HTTPServer

from gpubroker.api.app import BrokerApplication
from gpubroker.api.longpoll import LongPollRegistry
from gpubroker.api.redact import redact_uri


async def test_one_poll_beyond_the_limit_ends_the_callers_oldest() -> None:
    registry = LongPollRegistry(limit=2)
    forever = [asyncio.Event() for _ in range(3)]

    async def wait(i: int) -> str:
        await forever[i].wait()
        return f"changed {i}"

    first = asyncio.ensure_future(registry.wait("user:ann", wait(0)))
    second = asyncio.ensure_future(registry.wait("user:ann", wait(1)))
    other = asyncio.ensure_future(registry.wait("user:bob", wait(2)))
    await asyncio.sleep(0)
    assert (registry.count("user:ann"), registry.count("user:bob")) == (2, 1)
    third = asyncio.ensure_future(registry.wait("user:ann", wait(1)))
    assert await asyncio.wait_for(first, 5) is None  # ended early: answer as it stands
    assert not second.done() and not other.done()
    forever[1].set()
    assert await second == "changed 1" and await third == "changed 1"
    assert registry.count("user:ann") == 0
    gone = asyncio.Event()
    fourth = asyncio.ensure_future(registry.wait("user:ann", wait(0), gone))
    await asyncio.sleep(0)
    gone.set()  # the client went away
    assert await asyncio.wait_for(fourth, 5) is None
    forever[2].set()
    assert await other == "changed 2"
    assert registry.count("user:bob") == 0


def test_limit_must_be_positive() -> None:
    with pytest.raises(ValueError, match="limit: must be at least 1"):
        LongPollRegistry(limit=0)


@pytest.mark.parametrize(
    ("uri", "logged"),
    [
        ("/api/v1/leases?token=abc123", "/api/v1/leases?token=[redacted]"),
        ("/x?user=ann&token=abc&wait=5", "/x?user=ann&token=[redacted]&wait=5"),
        ("/x?Access_Token=abc;_xsrf=q", "/x?Access_Token=[redacted];_xsrf=[redacted]"),
        ("/x?%74oken=abc", "/x?%74oken=[redacted]"),
        ("/x?api_key=1&authorization=2", "/x?api_key=[redacted]&authorization=[redacted]"),
        ("/plain/path", "/plain/path"),
    ],
)
def test_secret_query_values_are_redacted(uri: str, logged: str) -> None:
    assert redact_uri(uri) == logged


def test_logged_uris_are_cut() -> None:
    logged = redact_uri("/x?user=" + "a" * 10_000 + "&token=abc")
    assert len(logged) == 301 and logged.endswith("…") and "abc" not in logged


class _Echo(web.RequestHandler):
    def post(self) -> None:
        self.write({"got": len(self.request.body)})


async def test_oversized_bodies_get_413_from_the_headers() -> None:
    app = BrokerApplication([("/echo", _Echo)], max_body_bytes=1024, log=logging.getLogger("t"))
    server = HTTPServer(app, max_body_size=1024)
    sock, port = _bound()
    server.add_sockets([sock])
    try:
        small = await _post(port, b"x" * 1000, send_body=True)
        assert small.startswith(b"HTTP/1.1 200") and b'{"got": 1000}' in small
        # headers only: the answer comes before any byte of the body is sent
        big = await _post(port, b"x" * 10**9, send_body=False)
        head, _, body = big.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 413")
        assert json.loads(body) == {
            "status": 413,
            "message": "body: at most 1024 bytes (GPUBrokerApp.max_body_bytes),"
            " got Content-Length 1000000000",
        }
    finally:
        server.stop()


def _bound() -> tuple[socket.socket, int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    sock.setblocking(False)
    return sock, sock.getsockname()[1]


async def _post(port: int, body: bytes, send_body: bool) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = f"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
    writer.write((head + "Connection: close\r\n\r\n").encode())
    if send_body:
        writer.write(body)
    await writer.drain()
    # the whole answer (a JSON object), without waiting for the lingering close
    answer = await asyncio.wait_for(reader.readuntil(b"}"), 10)
    writer.close()
    return answer
