"""Shared fixtures: a migrated store, a broker on fake GPUs.

The store is a temporary SQLite file; in the modules of
:data:`BOTH_DATABASES` every test that uses ``db_url`` runs twice, on
SQLite and on a real PostgreSQL server (one per test session,
tests/pgutil.py; a fresh database per test, copied from a migrated
template). Tests marked ``sqlite_only`` run on SQLite alone.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, text

from gpubroker.core import Broker
from gpubroker.devices.fake import FakeDeviceBackend
from gpubroker.store import db
from gpubroker.store.db import make_engine, make_session_factory, upgrade

# every broker in the tests checks its invariants after every command
# (Broker.check_state; the hub tests' brokers get --Broker.check_state=raise)
Broker.check_state.default_value = "raise"  # type: ignore[attr-defined]


#: test modules whose ``db_url`` tests also run on PostgreSQL (store and core)
BOTH_DATABASES = {
    "test_store",
    "test_core",
    "test_admin_preempt",
    "test_core_memory",
    "test_lifecycle",
    "test_broker_fixes",
    "test_actuator",
    "test_sharing_core",
    "test_mig",
    "test_usage_ledger",
    "test_usage_review",
    "test_ledger_rebind",
    "test_jobs",
}
_numbers = itertools.count()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "db_url" not in metafunc.fixturenames:
        return
    module = metafunc.module.__name__.rsplit(".", 1)[-1]
    both = module in BOTH_DATABASES and not metafunc.definition.get_closest_marker("sqlite_only")
    metafunc.parametrize("db_url", ["sqlite", "postgresql"] if both else ["sqlite"], indirect=True)


@pytest.fixture(scope="session")
def postgres_template() -> Iterator[tuple[str, str]]:
    """A PostgreSQL server for the session and a migrated template database:
    (URL of the server's admin database, name of the template)."""
    from .pgutil import RunningPostgres

    server = RunningPostgres().start()
    base = server.url.rsplit("/", 1)[0]
    admin = make_engine(server.url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text("CREATE DATABASE gb_template"))
    upgrade(f"{base}/gb_template")
    admin.dispose()
    yield server.url, "gb_template"
    server.stop()


@pytest.fixture
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A migrated store: a SQLite file in a temporary directory, or (param
    ``postgresql``) a new PostgreSQL database copied from the template."""
    if getattr(request, "param", "sqlite") == "sqlite":
        url = f"sqlite:///{tmp_path / 'broker.sqlite'}"
        upgrade(url)
        yield url
        return
    admin_url, template = request.getfixturevalue("postgres_template")
    name = f"gb_test_{next(_numbers)}"
    admin = make_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"CREATE DATABASE {name} TEMPLATE {template}"))
    # the engines the test makes are disposed after it (their pooled
    # connections closed), before the database is dropped
    made: list[Engine] = []

    def recording(*args: Any, **kwargs: Any) -> Engine:
        made.append(create_engine(*args, **kwargs))
        return made[-1]

    request.getfixturevalue("monkeypatch").setattr(db, "create_engine", recording)
    yield f"{admin_url.rsplit('/', 1)[0]}/{name}"
    for engine in made:
        engine.dispose()
    with admin.connect() as conn:
        conn.execute(text(f"DROP DATABASE {name} WITH (FORCE)"))
    admin.dispose()


def make_broker(db_url: str, inventory: list[str] | None = None) -> Broker:
    """A broker over ``db_url`` with fake devices, inventory synced and leases adopted."""
    backend = FakeDeviceBackend(inventory=inventory or ["8 x H100"], node_name="node-a")
    engine = make_engine(db_url)
    broker = Broker(session_factory=make_session_factory(engine), backend=backend)
    broker.sync_inventory()
    broker.adopt()
    return broker


@pytest.fixture
def broker(db_url: str) -> Iterator[Broker]:
    """A broker with 8 fake H100s on one node."""
    yield make_broker(db_url)
