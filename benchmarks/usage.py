"""Usage ledger benchmarks (#13).

- A monthly report (``--by user``) from 1,000,000 ledger intervals on SQLite,
  against a plain ``SELECT user, SUM(weight * (end_s - start_s)) ... GROUP
  BY user`` over the same rows (goal: at most 2x).
- The broker's lease request + release throughput in this process with the
  ledger and metrics on (the metrics subscriber on every event, the ledger
  writing every 0.5 s and sampling every second: 20 and 30 times more often
  than its defaults) against the same broker with both off (goal: >= 0.9x).
"""

from __future__ import annotations

import datetime as dt
import random
import tempfile
import time
from typing import Any

from . import fake_broker, figure

INTERVALS = 1_000_000
USERS = 300
PAIRS = 2000
ROUNDS = 3


def describe() -> str:
    return (
        f"Usage: a monthly report from {INTERVALS:,} ledger intervals vs plain SQL; "
        f"{PAIRS} lease pairs with the ledger and metrics on vs off"
    )


def _fill(url: str) -> tuple[float, float]:
    """Write ``INTERVALS`` intervals over November 2026; return the month."""
    from sqlalchemy import insert

    from gpubroker.store.db import make_engine
    from gpubroker.store.models import UsageInterval

    start = dt.datetime(2026, 11, 1, tzinfo=dt.timezone.utc).timestamp()
    end = dt.datetime(2026, 12, 1, tzinfo=dt.timezone.utc).timestamp()
    rng = random.Random(13)
    models = ["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "NVIDIA L40S"]
    kinds = [("device", 1.0), ("mig", 1 / 7), ("share", 0.25), ("wait", 0.0)]
    engine = make_engine(url)
    with engine.begin() as conn:
        rows = []
        for i in range(INTERVALS):
            s = rng.uniform(start - 86400, end)
            kind, weight = kinds[i % 4]
            rows.append(
                {
                    "lease_id": i // 2,
                    "user": f"user{rng.randrange(USERS):03d}",
                    "group_name": f"group{rng.randrange(20):02d}",
                    "holder_kind": "server",
                    "holder": "",
                    "priority_class": "interactive",
                    "pool": "default",
                    "slot_kind": kind,
                    "device_uuid": "",
                    "slot_uuid": "",
                    "profile": "",
                    "model": "" if kind == "wait" else models[i % 3],
                    "node": "node",
                    "weight": weight,
                    "start_s": s,
                    "end_s": s + rng.expovariate(1 / 7200),
                    "end_cause": "cull" if i % 50 == 0 else "release",
                    "used_gpu_seconds": 100.0,
                    "sampled_s": 200.0,
                    "idle_s": 60.0 if i % 50 == 0 else 0.0,
                }
            )
            if len(rows) == 50_000:
                conn.execute(insert(UsageInterval.__table__), rows)
                rows = []
        if rows:
            conn.execute(insert(UsageInterval.__table__), rows)
    engine.dispose()
    return start, end


def report_vs_sql() -> dict[str, dict[str, Any]]:
    """Median seconds of ``ROUNDS`` monthly reports and of the plain SQL."""
    from sqlalchemy import text

    from gpubroker.store.db import make_engine, make_session_factory, upgrade
    from gpubroker.usage.query import build_report
    from gpubroker.usage.report import parse_request

    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/ledger.sqlite"
        upgrade(url)
        start, end = _fill(url)
        engine = make_engine(url)
        factory = make_session_factory(engine)
        now = dt.datetime(2026, 12, 1, 12, tzinfo=dt.timezone.utc)
        request = parse_request("2026-11-01", "2026-12-01", "user", "UTC", "json", now)
        plain = text(
            "SELECT user, SUM(weight * (end_s - start_s)) FROM usage_intervals "
            "WHERE start_s < :hi AND end_s > :lo GROUP BY user"
        )
        ours, baseline = [], []
        for _ in range(ROUNDS):
            t0 = time.perf_counter()
            rows = build_report(factory, request, now, {"*": 2.0})
            ours.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            with engine.connect() as conn:
                sums = conn.execute(plain, {"lo": start, "hi": end}).all()
            baseline.append(time.perf_counter() - t0)
        assert len(rows) == len(sums) == USERS
        engine.dispose()
    ours.sort()
    baseline.sort()
    return {
        "usage.report_month.1m_intervals": figure(
            ours[ROUNDS // 2], "s", baseline[ROUNDS // 2], "plain SQL SUM ... GROUP BY user"
        )
    }


def _pairs(on: bool) -> float:
    """Lease pairs per second of an in-process broker (8 fake GPUs)."""
    from gpubroker.observe.metrics import BrokerMetrics
    from gpubroker.usage.ledger import Ledger

    with tempfile.TemporaryDirectory() as tmp:
        broker, engine = fake_broker(tmp)
        ledger = None
        if on:
            ledger = Ledger(broker.session_factory, broker.backend)
            ledger.start()
            metrics = BrokerMetrics(broker, ledger)
            broker.bus.subscribe(metrics.on_event)
        for i in range(4):
            broker.request_lease(f"holder{i}", "", gpus=1, holder_kind="external")
        next_flush = next_sample = time.perf_counter()
        t0 = time.perf_counter()
        for _ in range(PAIRS):
            lease = broker.request_lease("bench", "", gpus=1, holder_kind="external")
            broker.release_lease(lease["id"], "done")
            now = time.perf_counter()
            if ledger is not None and now >= next_flush:
                ledger.flush()
                next_flush = now + 0.5
            if ledger is not None and now >= next_sample:
                ledger.sample()
                metrics.exposition()  # a scrape
                next_sample = now + 1.0
        rate = 2 * PAIRS / (time.perf_counter() - t0)
        broker._world.close()
        engine.dispose()
    return rate


def throughput() -> dict[str, dict[str, Any]]:
    """Best of ``ROUNDS`` alternating runs, on and off."""
    on, off = [], []
    for _ in range(ROUNDS):
        off.append(_pairs(False))
        on.append(_pairs(True))
    return {
        "usage.lease_pair_rps.ledger_and_metrics_on": figure(
            max(on), "requests/s", max(off), "same broker, ledger and metrics off"
        )
    }


def run() -> dict[str, dict[str, Any]]:
    """Both figures."""
    return report_vs_sql() | throughput()


if __name__ == "__main__":
    for name, value in run().items():
        print(name, value)
