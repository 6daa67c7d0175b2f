"""Review of the store on SQLite and PostgreSQL: migrations keep every row
(upgrades from old revisions and downgrades), and the audit log keeps
targets of the longest names whole."""

from __future__ import annotations

import datetime as dt
import itertools
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from gpubroker.store.db import alembic_config, make_engine, upgrade
from gpubroker.store.models import Base

from ..conftest import make_broker

_numbers = itertools.count()


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty database (no tables): a SQLite file, or a new database on the
    test session's PostgreSQL server."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'review.sqlite'}"
        return
    admin_url, _template = request.getfixturevalue("postgres_template")
    name = f"gb_review_{next(_numbers)}"
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE {name}"))
    yield f"{admin_url.rsplit('/', 1)[0]}/{name}"
    with admin.connect() as conn:
        conn.execute(sa.text(f"DROP DATABASE {name} WITH (FORCE)"))
    admin.dispose()


@pytest.fixture
def engines() -> Iterator[Callable[[str], sa.Engine]]:
    """``make_engine``, its engines disposed after the test (before the
    database of ``empty_url`` is dropped, when asked for after it)."""
    made: list[sa.Engine] = []

    def make(url: str) -> sa.Engine:
        made.append(make_engine(url))
        return made[-1]

    yield make
    for engine in made:
        engine.dispose()


def _counts(engine: sa.Engine) -> dict[str, int]:
    names = [t for t in sa.inspect(engine).get_table_names() if t != "alembic_version"]
    with engine.connect() as conn:
        return {t: conn.execute(sa.text(f'SELECT count(*) FROM "{t}"')).scalar_one() for t in names}


def _close(broker: object) -> None:
    """Close a test broker's session and dispose of its engine."""
    broker._world.close()  # type: ignore[attr-defined]
    broker.session_factory.kw["bind"].dispose()  # type: ignore[attr-defined]


def test_upgrade_from_0001_keeps_the_allocations_of_granted_leases(
    empty_url: str, engines: Callable[[str], sa.Engine]
) -> None:
    """SQLite: migration 0002 rebuilds ``leases``; with foreign keys on, the
    rebuild's DROP TABLE cascaded to ``allocations`` and emptied it."""
    upgrade(empty_url, "0001")
    engine = engines(empty_url)
    created = dt.datetime(2026, 11, 30, 12)
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO devices (uuid, node, index, name, memory_total_mib, pci_bus_id,"
                " mig_enabled, present, drained) VALUES ('GPU-1', 'n', 0, 'H100', 81559,"
                " '0000:01:00.0', false, true, false)".replace("index", '"index"')
            )
        )
        conn.execute(
            sa.text(
                'INSERT INTO leases ("user", server_name, holder_kind, gpus, state, created,'
                " version) VALUES ('ann', '', 'server', 1, 'granted', :c, 1)"
            ),
            {"c": created},
        )
        conn.execute(
            sa.text(
                "INSERT INTO allocations (lease_id, device_uuid, active) VALUES (1, 'GPU-1', true)"
            )
        )
    upgrade(empty_url)
    assert _counts(engine)["allocations"] == 1
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == []


def test_a_downgrade_keeps_the_rows_of_the_tables_it_keeps(
    empty_url: str, engines: Callable[[str], sa.Engine]
) -> None:
    """Downgrading one revision (0014 → 0013, 0013 → 0012: columns dropped
    from ``jobs`` and ``leases``) keeps the transition log, the allocations,
    notices and intents (SQLite rebuilt ``leases`` and cascaded)."""
    upgrade(empty_url)
    broker = make_broker(empty_url)
    lease = broker.request_lease("ann", "", gpus=2)
    assert lease["state"] == "granted"
    _close(broker)
    engine = engines(empty_url)
    before = _counts(engine)
    assert before["allocations"] == 2 and before["lease_events"] >= 2
    command.downgrade(alembic_config(empty_url), "0012")
    after = _counts(engine)
    assert after == {t: n for t, n in before.items() if t in after}
    upgrade(empty_url)
    assert _counts(engine) == before


def test_the_audit_log_finds_actions_on_the_longest_user_and_group_names(
    empty_url: str,
) -> None:
    """A user name may have 255 characters (the API's limit), so the target
    ``user:NAME`` has up to 260: it was cut to 255 and ``?user=`` missed it."""
    from gpubroker.observe import audit

    upgrade(empty_url)
    broker = make_broker(empty_url)
    name = "ü" * 255
    broker.set_quota("user", name, 1.0, 2.0, actor="root")
    broker.set_quota("group", name, 1.0, 2.0, actor="root")
    found = audit.query(broker.session_factory, user=name)
    assert [e["target"] for e in found] == [f"user:{name}"]
    every = audit.query(broker.session_factory, kind="quota-set")
    assert sorted(e["target"] for e in every) == [f"group:{name}", f"user:{name}"]
    _close(broker)


def test_migration_0015_keeps_audit_entries_and_widens_the_target(
    empty_url: str, engines: Callable[[str], sa.Engine]
) -> None:
    upgrade(empty_url, "0014")
    engine = engines(empty_url)
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO audit_entries (at, actor, action, target, reason, stimulus)"
                " VALUES (:at, 'root', 'quota-set', 'user:ann', 'why', 's1')"
            ),
            {"at": dt.datetime(2026, 12, 1, 9)},
        )
    upgrade(empty_url)
    with engine.begin() as conn:
        row = conn.execute(sa.text("SELECT actor, target, reason FROM audit_entries")).one()
        assert tuple(row) == ("root", "user:ann", "why")
        long_target = "group:" + "g" * 300
        conn.execute(
            sa.text(
                "INSERT INTO audit_entries (at, actor, action, target, reason, stimulus)"
                " VALUES (:at, 'root', 'quota-set', :t, '', '')"
            ),
            {"at": dt.datetime(2026, 12, 1, 10), "t": long_target},
        )
    with engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
    command.downgrade(alembic_config(empty_url), "0014")
    with engine.connect() as conn:
        targets = sorted(conn.execute(sa.text("SELECT target FROM audit_entries")).scalars())
    assert targets == [long_target[:255], "user:ann"]


def test_a_refused_broker_is_told_the_holder_of_its_own_database(
    postgres_template: tuple[str, str],
) -> None:
    """Advisory locks belong to one database: with brokers on two databases
    of one server, the refusal named the first holder found on any of them
    (and told the admin to stop the wrong broker)."""
    from gpubroker.store.lock import DatabaseLocked, WriterLock

    admin_url, _template = postgres_template
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    names = [f"gb_lock_{next(_numbers)}" for _ in range(2)]
    with admin.connect() as conn:
        for name in names:
            conn.execute(sa.text(f"CREATE DATABASE {name}"))
    base = admin_url.rsplit("/", 1)[0]
    engines = [make_engine(f"{base}/{name}") for name in (*names, names[1])]
    locks = [
        WriterLock(engines[0], {"pid": 1111, "host": "host-a", "since": "t"}),
        WriterLock(engines[1], {"pid": 2222, "host": "host-b", "since": "t"}),
    ]
    try:
        for lock in locks:
            lock.acquire()
        with pytest.raises(DatabaseLocked, match="pid=2222 host=host-b"):
            WriterLock(engines[2]).acquire()
    finally:
        for lock in locks:
            lock.release()
        for engine in engines:
            engine.dispose()
        with admin.connect() as conn:
            for name in names:
                conn.execute(sa.text(f"DROP DATABASE {name} WITH (FORCE)"))
        admin.dispose()


def test_a_schema_from_a_newer_release_is_refused_with_a_clear_message(
    tmp_path: Path,
) -> None:
    """Going back to an older release without taking the schema down first
    failed with alembic's bare "Can't locate revision identified by ..."."""

    url = f"sqlite:///{tmp_path / 'newer.sqlite'}"
    upgrade(url)
    _newer_is_refused_unchanged(url, upgrade)


def _newer_is_refused_unchanged(url: str, check: Callable[[str], object]) -> None:
    """The store at ``url`` (at this release's newest schema) is put at a
    newer release's revision; ``check(url)`` refuses it and changes nothing."""
    from gpubroker.store.db import UnknownSchema, head_revision

    engine = make_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE alembic_version SET version_num = '0099'"))
    with pytest.raises(UnknownSchema, match=rf"'0099'.*newest revision '{head_revision()}'"):
        check(url)
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalar() == "0099"
    engine.dispose()


@pytest.mark.parametrize("command", ["upgrade-db", "serve"])
def test_the_commands_refuse_a_newer_schema_with_its_message_and_status_2(
    tmp_path: Path, command: str
) -> None:
    """``gpubroker serve`` and ``upgrade-db`` on a schema of a newer release
    end with the refusal's sentence and status 2, not a traceback."""

    url = f"sqlite:///{tmp_path / 'newer.sqlite'}"
    upgrade(url)
    engine = make_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE alembic_version SET version_num = '0099'"))
    engine.dispose()
    run = _gpubroker(tmp_path, command, f"--db-url={url}")
    said = run.stderr + run.stdout
    assert run.returncode == 2, said
    assert "schema revision '0099'" in said and "Traceback" not in said


def test_without_upgrade_db_only_this_releases_schema_is_run_on(tmp_path: Path) -> None:
    """With ``upgrade_db`` off the broker checked no schema at all: an older
    release started on a newer release's schema and wrote to it (the docs
    promised a refusal). Now any schema but this release's newest is
    refused, saying what to do, and nothing is changed."""
    from gpubroker.store.db import UnknownSchema, check_schema

    url = f"sqlite:///{tmp_path / 's.sqlite'}"
    with pytest.raises(UnknownSchema, match=r"has no gpubroker schema.*gpubroker upgrade-db"):
        check_schema(url)
    upgrade(url, "0001")
    with pytest.raises(UnknownSchema, match=r"revision '0001'.*needs '\d{4}'.*upgrade_db is off"):
        check_schema(url)
    upgrade(url)
    check_schema(url)  # this release's newest: runs
    _newer_is_refused_unchanged(url, check_schema)
    run = _gpubroker(
        tmp_path,
        "serve",
        f"--db-url={url}",
        "--GPUBrokerApp.upgrade_db=False",
        "--device-backend=fake",
        "--port=0",
    )
    said = run.stderr + run.stdout
    assert run.returncode == 2, said
    assert "Not starting: the database" in said and "'0099'" in said
    assert "Traceback" not in said


def test_a_priority_class_name_fits_the_store_or_is_refused_at_load(db_url: str) -> None:
    """The store keeps a lease's class in 64 characters: a longer class name
    was accepted at load, and on PostgreSQL every request of that class
    then failed with a raw DataError (a 500)."""
    from traitlets import TraitError
    from traitlets.config import Config

    from gpubroker.core import Broker
    from gpubroker.devices.fake import FakeDeviceBackend
    from gpubroker.policy_config import MAX_CLASS_NAME, SchedulingPolicy
    from gpubroker.store.db import make_session_factory

    long = "c" * (MAX_CLASS_NAME + 1)
    with pytest.raises(TraitError, match=r"at most 64 characters.*\(65 characters\)"):
        SchedulingPolicy(
            priority_classes=[{"name": "interactive", "rank": 1}, {"name": long, "rank": 2}]
        )
    longest = "c" * MAX_CLASS_NAME
    config = Config(
        {
            "SchedulingPolicy": {
                "priority_classes": [
                    {"name": "interactive", "rank": 100},
                    {"name": longest, "rank": 50},
                ]
            }
        }
    )
    engine = make_engine(db_url)
    broker = Broker(
        session_factory=make_session_factory(engine),
        backend=FakeDeviceBackend(inventory=["2 x H100"], node_name="node-a"),
        config=config,
    )
    broker.sync_inventory()
    broker.adopt()
    lease = broker.request_lease("ann", "", gpus=1, priority_class=longest)
    assert lease["state"] == "granted" and lease["priority_class"] == longest
    _close(broker)


def test_serve_with_a_wrong_setting_says_which_with_status_2(tmp_path: Path) -> None:
    """A policy setting the configuration file got wrong (the admin's trial:
    a ``default_priority_class`` no class has) ended in ~100 lines of
    traceback; the broker now names the setting and exits 2."""

    config = tmp_path / "gpubroker_config.py"
    config.write_text('c.SchedulingPolicy.default_priority_class = "nope"\n')
    run = _gpubroker(
        tmp_path,
        "serve",
        f"--config={config}",
        f"--db-url=sqlite:///{tmp_path / 'b.sqlite'}",
        "--device-backend=fake",
        "--port=0",
    )
    said = run.stderr + run.stdout
    assert run.returncode == 2, said
    assert "Not starting: a setting is wrong: default_priority_class: must be one of" in said
    assert "Traceback" not in said


def _gpubroker(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m gpubroker ARGS`` in ``cwd`` (60 s at most), its output kept."""
    return subprocess.run(
        [sys.executable, "-m", "gpubroker", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=60,
    )
