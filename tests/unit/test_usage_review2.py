"""A review of usage reports and the audit log: reports are built in
threads of their own with a bound per caller, ``GET /audit`` refuses an
unknown query argument, the audit query reads only what it answers, and no
price or cost is infinite."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from traitlets import TraitError

from gpubroker.core import Broker
from gpubroker.observe import audit
from gpubroker.store import audit_repo
from gpubroker.usage import query
from gpubroker.usage.ledger import Ledger
from gpubroker.usage.render import as_json
from gpubroker.usage.report import combine, parse_request
from gpubroker.usage.workers import ReportWorkers, TooManyReports

from .test_api_scopes import FakeHub, ServedAPI, error


@pytest.fixture
async def api(broker: Broker) -> AsyncIterator[ServedAPI]:
    with FakeHub() as hub:
        served = ServedAPI(broker, hub)
        try:
            yield served
        finally:
            served.server.stop()


async def test_a_report_is_built_in_a_report_thread(api: ServedAPI, monkeypatch: Any) -> None:
    """On the loop's default executor, one user's dozen HTML reports held
    every thread the actuator, the culler and the ledger need."""
    served = api
    threads: list[str] = []
    real = query.build_report

    def build_report(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(query, "build_report", build_report)
    answer = await served.call("GET", "/usage", "ann-token")
    assert answer.code == 200
    assert threads and threads[0].startswith("gpubroker-report")


async def test_a_caller_past_the_bound_gets_429_and_others_go_on() -> None:
    workers = ReportWorkers(workers=2, per_caller=1)
    gate = threading.Event()
    try:
        first = asyncio.ensure_future(workers.run("ann", lambda: gate.wait(10)))
        await asyncio.sleep(0)  # it is in flight
        with pytest.raises(TooManyReports, match="at most 1 reports at once per caller"):
            await workers.run("ann", lambda: "second")
        assert await workers.run("bob", lambda: "bob's") == "bob's"
        gate.set()
        assert await first is True
        assert await workers.run("ann", lambda: "again") == "again"  # the bound is freed
    finally:
        gate.set()
        workers.close()


async def test_usage_answers_429_naming_the_bound(broker: Broker) -> None:
    """And a refused report writes nothing: the ledger is flushed only for
    a report that is admitted."""
    workers = ReportWorkers(workers=1, per_caller=1)
    gate = threading.Event()
    flushes: list[int] = []
    ledger = SimpleNamespace(enabled=True, price_per_gpu_hour={}, flush=lambda: flushes.append(1))
    with FakeHub() as hub:
        served = ServedAPI(broker, hub, reports=workers, ledger=ledger)
        try:
            held = asyncio.ensure_future(workers.run("ann", lambda: gate.wait(10)))
            await asyncio.sleep(0)
            code, message = error(await served.call("GET", "/usage", "ann-token"))
            assert code == 429
            assert message.startswith("usage: at most 1 reports at once per caller")
            assert not flushes
            gate.set()
            await held
            assert (await served.call("GET", "/usage", "ann-token")).code == 200
            assert flushes == [1]
        finally:
            gate.set()
            served.server.stop()
            workers.close()


async def test_audit_refuses_an_unknown_query_argument(api: ServedAPI) -> None:
    """``?usr=bob`` answered every user's entries with 200."""
    served = api
    code, message = error(await served.call("GET", "/audit?usr=bob", "admin-token"))
    assert code == 400 and message.startswith("usr: unknown query argument")
    assert (await served.call("GET", "/audit?user=bob&limit=3", "admin-token")).code == 200


@pytest.mark.parametrize(("kind", "read"), [(None, 7), ("warned", 7), ("cull", audit.MAX_LIMIT)])
def test_the_audit_query_reads_only_the_rows_it_may_answer(
    kind: str | None, read: int, monkeypatch: Any
) -> None:
    """It read 10,000 + 10,000 rows for ``?limit=1``; only a release cause
    is filtered after the store's limit, so only then is more read."""
    asked: list[int] = []

    def entries(session: Any, since: Any, until: Any, user: Any, limit: int, *rest: Any) -> Any:
        asked.append(limit)
        return [], []

    class Session:
        def __enter__(self) -> Session:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

    monkeypatch.setattr(audit_repo, "entries", entries)
    assert audit.query(Session, None, None, None, kind, 7) == []
    assert asked == [read]


@pytest.mark.parametrize("price", [float("inf"), float("nan"), -1.0])
def test_a_price_must_be_a_finite_number(price: float) -> None:
    with pytest.raises(TraitError, match="must be a finite number >= 0"):
        Ledger(None, None, price_per_gpu_hour={"*": price})


def test_a_cost_past_the_float_range_is_none_and_the_report_stays_json() -> None:
    """``"cost": Infinity`` is not JSON (strict clients refuse the report)."""
    import datetime as dt

    now = dt.datetime(2026, 12, 7, tzinfo=dt.timezone.utc)
    sums = [
        (
            "ann",
            {
                "model": "X",
                "allocated": 7200,
                "used": 0,
                "sampled": 0,
                "wait": 0,
                "idle_culled": 0,
            },
        )
    ]
    (row,) = combine(sums, {"X": 1e308}, {})
    assert row.cost is None
    report = as_json(parse_request(None, None, "user", None, "json", now), [row])
    json.dumps(report, allow_nan=False)  # raises on an Infinity
