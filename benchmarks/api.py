"""Lease request/release pairs through the broker's HTTP API on loopback,
against a bare Tornado handler doing nothing (the baseline, same client).

The broker runs as in production: a hub-managed service of a real JupyterHub
(demo config, fake GPUs), called directly on its service port with the
spawner's kind of token (HubAuth caches token checks, as in production).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests

from tests.hubutil import RunningHub, free_port

PAIRS = 1000


def _percentile(samples: list[float], q: float) -> float:
    return statistics.quantiles(samples, n=100, method="inclusive")[int(q) - 1]


def _measure(session: requests.Session, post_url: str, body: dict, delete_url) -> dict[str, Any]:
    latencies: list[float] = []
    started = time.perf_counter()
    for _ in range(PAIRS):
        t0 = time.perf_counter()
        r = session.post(post_url, json=body, timeout=30)
        t1 = time.perf_counter()
        r.raise_for_status()
        session.delete(delete_url(r.json()), timeout=30).raise_for_status()
        t2 = time.perf_counter()
        latencies += [t1 - t0, t2 - t1]
    elapsed = time.perf_counter() - started
    return {
        "rps": 2 * PAIRS / elapsed,
        "p50_ms": 1000 * _percentile(latencies, 50),
        "p99_ms": 1000 * _percentile(latencies, 99),
    }


def bench_broker(hub: RunningHub) -> dict[str, Any]:
    session = requests.Session()
    session.headers["Authorization"] = f"token {hub.token}"
    base = f"http://127.0.0.1:{hub.broker_port}/services/gpubroker/api/v1"
    body = {"user": "bench", "gpus": 1, "holder_kind": "external"}
    session.post(f"{base}/leases", json=body, timeout=30)  # warm the HubAuth cache
    for lease in session.get(f"{base}/leases", timeout=30).json()["leases"]:
        session.delete(f"{base}/leases/{lease['id']}", timeout=30)
    return _measure(session, f"{base}/leases", body, lambda lease: f"{base}/leases/{lease['id']}")


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


def run() -> dict[str, dict[str, Any]]:
    """Run both and return figures: name -> {value, unit, baseline, ratio}."""
    with tempfile.TemporaryDirectory() as tmp:
        hub = RunningHub(Path(tmp)).start()
        try:
            broker = bench_broker(hub)
        finally:
            hub.stop()
    bare = bench_bare()
    results = {}
    for key, unit in (("rps", "requests/s"), ("p50_ms", "ms"), ("p99_ms", "ms")):
        results[f"api.lease_pair.{key}"] = {
            "value": round(broker[key], 3),
            "unit": unit,
            "baseline": round(bare[key], 3),
            "baseline_name": "bare Tornado handler",
            "ratio": round(broker[key] / bare[key], 3),
        }
    return results
