"""Lease request/release pairs through the broker's HTTP API on loopback.

- one client, empty queue, against a bare Tornado handler doing nothing
  (the baseline, same client);
- one client while 1,000 requests wait and every device is held, against
  the empty-queue figure (queue independence);
- 64 concurrent clients in one asyncio loop, against one client of the
  same kind;
- SQL statements per pair, counted on the broker's own engine in this
  process (same commands, no HTTP), empty queue and with 1,000 waiting.

The broker runs as in production: a hub-managed service of a real JupyterHub
(demo config, 8 fake GPUs, invariant checks off as by default), called
directly on its service port with the spawner's kind of token (HubAuth
caches token checks, as in production).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import requests
from tornado.httpclient import AsyncHTTPClient

from tests.hubutil import RunningHub, free_port

from . import fake_broker, figure

PAIRS = 1000
QUEUE_PAIRS = 500
WAITING = 1000
CLIENTS = 64
CLIENT_PAIRS = 16
SQL_PAIRS = 50


def _percentile(samples: list[float], q: float) -> float:
    return statistics.quantiles(samples, n=100, method="inclusive")[int(q) - 1]


def _pairs(
    session: requests.Session, post_url: str, body: dict, delete_url: Callable, n: int
) -> list[float]:
    """Latencies (s) of ``n`` request/release pairs, two per pair."""
    latencies: list[float] = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = session.post(post_url, json=body, timeout=30)
        t1 = time.perf_counter()
        r.raise_for_status()
        session.delete(delete_url(r.json()), timeout=30).raise_for_status()
        t2 = time.perf_counter()
        latencies += [t1 - t0, t2 - t1]
    return latencies


def _measure(session: requests.Session, post_url: str, body: dict, delete_url, n: int = PAIRS):
    started = time.perf_counter()
    latencies = _pairs(session, post_url, body, delete_url, n)
    elapsed = time.perf_counter() - started
    return {
        "rps": 2 * n / elapsed,
        "p50_ms": 1000 * _percentile(latencies, 50),
        "p99_ms": 1000 * _percentile(latencies, 99),
    }


class _Broker:
    """The broker API of a running hub, as the spawner calls it."""

    def __init__(self, hub: RunningHub) -> None:
        self.base = f"http://127.0.0.1:{hub.broker_port}/services/gpubroker/api/v1"
        self.token = hub.token
        self.session = self.client()

    def client(self) -> requests.Session:
        session = requests.Session()
        session.headers["Authorization"] = f"token {self.token}"
        return session

    def lease_url(self, lease: dict) -> str:
        return f"{self.base}/leases/{lease['id']}"

    def request(self, user: str, session: requests.Session | None = None) -> dict:
        body = {"user": user, "gpus": 1, "holder_kind": "external"}
        r = (session or self.session).post(f"{self.base}/leases", json=body, timeout=30)
        r.raise_for_status()
        return r.json()

    def release_all(self) -> None:
        for lease in self.session.get(f"{self.base}/leases", timeout=60).json()["leases"]:
            self.session.delete(self.lease_url(lease), timeout=30)

    def pairs(self, user: str, n: int, session: requests.Session | None = None):
        body = {"user": user, "gpus": 1, "holder_kind": "external"}
        return _measure(session or self.session, f"{self.base}/leases", body, self.lease_url, n)


def bench_broker(hub: RunningHub) -> dict[str, dict[str, Any]]:
    """Empty queue, then 1,000 waiting, then 64 clients (same hub)."""
    broker = _Broker(hub)
    broker.request("bench")  # warm the HubAuth cache
    broker.release_all()
    out = {"empty": broker.pairs("bench", PAIRS)}
    for i in range(8):
        broker.request(f"holder{i}")
    for i in range(WAITING):
        broker.request(f"waiting{i % 100}")
    out["queue"] = broker.pairs("bench", QUEUE_PAIRS)
    broker.release_all()
    out["one_async"] = _concurrent(broker, 1)
    out["concurrent"] = _concurrent(broker, CLIENTS)
    broker.release_all()
    return out


def _concurrent(broker: _Broker, clients: int) -> dict[str, Any]:
    """``clients`` concurrent clients in one asyncio loop (Tornado's HTTP
    client: no thread per client, so the client side costs the same per
    request however many there are), each ``CLIENT_PAIRS`` pairs as its own
    user."""
    return asyncio.run(_clients(broker, clients))


async def _clients(broker: _Broker, clients: int) -> dict[str, Any]:
    http = AsyncHTTPClient(force_instance=True, max_clients=clients)
    headers = {"Authorization": f"token {broker.token}", "Content-Type": "application/json"}
    latencies: list[float] = []

    async def call(method: str, url: str, body: dict | None = None) -> dict:
        t0 = time.perf_counter()
        r = await http.fetch(
            url,
            method=method,
            headers=headers,
            body=None if body is None else json.dumps(body),
            request_timeout=60,
            allow_nonstandard_methods=True,
        )
        latencies.append(time.perf_counter() - t0)
        return json.loads(r.body) if r.body else {}

    async def client(i: int) -> None:
        body = {"user": f"client{i}", "gpus": 1, "holder_kind": "external"}
        for _ in range(CLIENT_PAIRS):
            lease = await call("POST", f"{broker.base}/leases", body)
            await call("DELETE", broker.lease_url(lease))

    started = time.perf_counter()
    try:
        await asyncio.gather(*(client(i) for i in range(clients)))
    finally:
        http.close()
    elapsed = time.perf_counter() - started
    return {
        "rps": 2 * clients * CLIENT_PAIRS / elapsed,
        "p50_ms": 1000 * _percentile(latencies, 50),
        "p99_ms": 1000 * _percentile(latencies, 99),
    }


def bench_bare() -> dict[str, Any]:
    port = free_port()
    server = Path(__file__).with_name("bare_server.py")
    proc = subprocess.Popen([sys.executable, str(server), str(port)])
    try:
        url = f"http://127.0.0.1:{port}/leases"
        session = requests.Session()
        for _ in range(100):
            try:
                session.get(url, timeout=1)
                break
            except requests.ConnectionError:
                time.sleep(0.1)
        return _measure(session, url, {}, lambda _: f"{url}/1")
    finally:
        proc.terminate()
        proc.wait(10)


def sql_per_pair(waiting: int) -> float:
    """SQL statements per request + release of one lease, on a broker in
    this process (8 fake GPUs, all held when ``waiting`` > 0)."""
    from sqlalchemy import event

    with tempfile.TemporaryDirectory() as tmp:
        broker, engine = fake_broker(tmp)
        if waiting:
            for i in range(8):
                broker.request_lease(f"holder{i}", "", gpus=1, holder_kind="external")
            for i in range(waiting):
                broker.request_lease(f"waiting{i % 100}", "", gpus=1, holder_kind="external")
        count = [0]

        def counted(*_: Any) -> None:
            count[0] += 1

        event.listen(engine, "before_cursor_execute", counted)
        for _ in range(SQL_PAIRS):
            lease = broker.request_lease("bench", "", gpus=1, holder_kind="external")
            broker.release_lease(lease["id"], "done")
        event.remove(engine, "before_cursor_execute", counted)
        broker._world.close()
        engine.dispose()
    return count[0] / SQL_PAIRS


def run() -> dict[str, dict[str, Any]]:
    """Run them all and return figures: name -> {value, unit, baseline, ratio}."""
    with tempfile.TemporaryDirectory() as tmp:
        # the ledger at its defaults (the tests write it every 0.5 s)
        hub = RunningHub(
            Path(tmp), GPUBROKER_DEMO_CHECK_STATE="off", GPUBROKER_DEMO_LEDGER_INTERVAL="10"
        ).start()
        try:
            broker = bench_broker(hub)
        finally:
            hub.stop()
    bare = bench_bare()
    empty, queue, many = broker["empty"], broker["queue"], broker["concurrent"]
    one = broker["one_async"]
    results = {}
    for key, unit in (("rps", "requests/s"), ("p50_ms", "ms"), ("p99_ms", "ms")):
        results[f"api.lease_pair.{key}"] = figure(
            empty[key], unit, bare[key], "bare Tornado handler"
        )
    for key, unit in (("rps", "requests/s"), ("p50_ms", "ms"), ("p99_ms", "ms")):
        results[f"api.lease_pair.queue_{WAITING}.{key}"] = figure(
            queue[key], unit, empty[key], "same pairs, empty queue"
        )
    for key, unit in (("rps", "requests/s"), ("p50_ms", "ms"), ("p99_ms", "ms")):
        results[f"api.lease_pair.clients_{CLIENTS}.{key}"] = figure(
            many[key], unit, one[key], "one client (same asynchronous HTTP client)"
        )
    for waiting in (0, WAITING):
        results[f"core.lease_pair.sql_statements.queue_{waiting}"] = figure(
            sql_per_pair(waiting), "statements", 6, "target of the core v2 issue (today ~25)"
        )
    return results
