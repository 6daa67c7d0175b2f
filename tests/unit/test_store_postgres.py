"""The store and the writer lock on a real PostgreSQL server: migrations to
the newest schema, a second broker refused with the holder named, and the
lock freed when its holder is SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest
from sqlalchemy import Engine, text

from gpubroker.core import Broker
from gpubroker.devices.fake import FakeDeviceBackend
from gpubroker.store.db import (
    current_revision,
    head_revision,
    make_engine,
    make_session_factory,
    upgrade,
)
from gpubroker.store.lock import DatabaseLocked, WriterLock, describe_self

from ..pgutil import RunningPostgres


@pytest.fixture(scope="module")
def pg() -> Iterator[RunningPostgres]:
    server = RunningPostgres().start()
    yield server
    server.stop()


@pytest.fixture
def engines() -> Iterator[Callable[[str], Engine]]:
    """``make_engine`` whose engines are disposed after the test."""
    made: list[Engine] = []

    def make(url: str) -> Engine:
        made.append(make_engine(url))
        return made[-1]

    yield make
    for engine in made:
        engine.dispose()


def test_migrations_reach_the_newest_schema_and_a_broker_runs(
    pg: RunningPostgres, engines: Callable[[str], Engine]
) -> None:
    upgrade(pg.url)
    engine = engines(pg.url)
    assert current_revision(engine) == head_revision()
    backend = FakeDeviceBackend(inventory=["8 x H100"], node_name="node-a")
    broker = Broker(session_factory=make_session_factory(engine), backend=backend)
    broker.sync_inventory()
    broker.adopt()
    lease = broker.request_lease("ann", "", gpus=2)
    assert lease["state"] == "granted"
    again = broker.request_lease("ann", "", gpus=2, restart_of=lease["id"])
    assert again["restarts"] == 1 and again["devices"] == lease["devices"]
    broker.release_lease(again["id"], "done")


def test_a_second_broker_is_refused_and_told_who_holds_the_database(
    pg: RunningPostgres, engines: Callable[[str], Engine]
) -> None:
    first = WriterLock(engines(pg.url), describe_self())
    first.acquire()
    second = WriterLock(engines(pg.url))
    with pytest.raises(DatabaseLocked, match=rf"gpubroker pid={os.getpid()} host="):
        second.acquire()
    assert first.check()
    first.release()
    second.acquire()
    second.release()


HOLDER = """
import sys, time
from gpubroker.store.db import make_engine
from gpubroker.store.lock import WriterLock
WriterLock(make_engine(sys.argv[1])).acquire()
print("held", flush=True)
time.sleep(600)
"""


def test_the_lock_frees_when_its_holder_is_killed(
    pg: RunningPostgres, engines: Callable[[str], Engine]
) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, pg.url], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(DatabaseLocked, match=rf"pid={holder.pid} "):
            WriterLock(engines(pg.url)).acquire()
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(10)
        if holder.stdout is not None:
            holder.stdout.close()
    lock = WriterLock(engines(pg.url))
    deadline = time.monotonic() + 30
    while True:  # the server sees the connection close at once on one host
        try:
            lock.acquire()
            break
        except DatabaseLocked:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    lock.release()


def test_a_lost_lock_session_is_noticed(
    pg: RunningPostgres, engines: Callable[[str], Engine]
) -> None:
    lock = WriterLock(engines(pg.url))
    lock.acquire()
    admin = engines(pg.url)
    with admin.connect() as conn:
        conn.execute(
            text(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE application_name LIKE 'gpubroker pid=%'"
            )
        )
        conn.commit()
    assert lock.check() is False
    lock.release()


def test_the_usage_ledger_reports_and_audit_log_on_postgresql(
    pg: RunningPostgres, engines: Callable[[str], Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ledger's fold, its report SQL (clipping, distinct counts, days of
    a time zone) and the audit log on PostgreSQL, as on SQLite."""
    import datetime as dt

    import gpubroker.core as core
    from gpubroker.observe import audit
    from gpubroker.usage.ledger import Ledger
    from gpubroker.usage.query import build_report
    from gpubroker.usage.report import parse_request

    upgrade(pg.url)
    now = [dt.datetime(2026, 10, 24, 22, 0, tzinfo=dt.timezone.utc)]  # Berlin: 25 Oct, 00:00
    monkeypatch.setattr(core, "utcnow", lambda: now[0])
    engine = engines(pg.url)
    backend = FakeDeviceBackend(inventory=["8 x H100"], node_name="node-pg")
    broker = Broker(session_factory=make_session_factory(engine), backend=backend)
    broker.sync_inventory()
    broker.adopt()
    ledger = Ledger(broker.session_factory, backend, clock=lambda: now[0].timestamp())
    ledger.start()
    lease = broker.request_lease("pg-user", "", gpus=2, holder_kind="external")
    broker.set_quota("group", "pg-group", 1.0, 2.0, actor="pg-admin")
    now[0] += dt.timedelta(hours=25)  # the whole local day of the clock change
    broker.release_lease(lease["id"], "done")
    ledger.flush()
    request = parse_request("2026-10-25", "2026-10-26", "day", "Europe/Berlin", "json", now[0])
    (day,) = build_report(broker.session_factory, request, now[0], {}, user="pg-user")
    assert day.key == "2026-10-25" and day.gpu_hours_allocated == 50.0 and day.leases == 1
    entries = audit.query(broker.session_factory, user="pg-user")
    assert ("granted", "scheduler") in {(e["action"], e["actor"]) for e in entries}
    quota = audit.query(broker.session_factory, kind="quota-set")
    assert quota[0]["actor"] == "pg-admin" and quota[0]["target"] == "group:pg-group"
    broker.delete_quota("group", "pg-group")


async def test_a_standby_waits_while_the_database_is_unreachable_and_others_refuse(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import asyncio
    import logging

    from gpubroker.app import GPUBrokerApp
    from gpubroker.service import BrokerService
    from gpubroker.store.lock import DatabaseUnavailable

    from ..hubutil import free_port

    monkeypatch.delenv("JUPYTERHUB_SERVICE_NAME", raising=False)
    nowhere = f"postgresql+psycopg://gpubroker:s3cret@127.0.0.1:{free_port()}/gpubroker"
    app = GPUBrokerApp(db_url=nowhere, standby=True)
    service = BrokerService(app=app, log=logging.getLogger("test-standby"))
    with caplog.at_level(logging.WARNING, "test-standby"), pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(service._take_lock(), 2.5)  # still waiting
    assert "Waiting for the database lock: cannot reach" in caplog.text
    assert "s3cret" not in caplog.text
    service.engine.dispose()
    app.standby = False
    with pytest.raises(DatabaseUnavailable, match="cannot reach") as refused:
        await service._take_lock()
    assert "s3cret" not in str(refused.value)
    service.engine.dispose()
