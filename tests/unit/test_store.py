"""The store: migrations match the models, SQLite runs in WAL mode, UTC round trip."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import text

from gpubroker.store.db import current_revision, head_revision, make_engine
from gpubroker.store.models import Base, Lease, UTCDateTime


def test_migrations_create_exactly_the_models(db_url: str) -> None:
    engine = make_engine(db_url)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == []
    assert current_revision(engine) == head_revision() == "0016"


def test_migrations_go_down_to_an_empty_database_and_up_again(db_url: str) -> None:
    from alembic import command
    from sqlalchemy import inspect

    from gpubroker.store.db import alembic_config, upgrade

    engine = make_engine(db_url)
    command.downgrade(alembic_config(db_url), "base")
    assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
    assert current_revision(engine) is None
    upgrade(db_url)
    with engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
    assert current_revision(engine) == head_revision()
    engine.dispose()


@pytest.mark.sqlite_only
def test_sqlite_uses_wal_and_foreign_keys(db_url: str) -> None:
    with make_engine(db_url).connect() as conn:
        assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
        assert conn.execute(text("PRAGMA foreign_keys")).scalar() == 1


def test_times_are_stored_utc_and_read_back_aware(db_url: str) -> None:
    from sqlalchemy.orm import Session

    tz = dt.timezone(dt.timedelta(hours=-5))
    local = dt.datetime(2026, 3, 8, 1, 30, tzinfo=tz)
    engine = make_engine(db_url)
    with Session(engine) as session, session.begin():
        session.add(Lease(user="u", server_name="", gpus=1, state="released", created=local))
    with Session(engine) as session:
        created = session.query(Lease).one().created
    assert created == local and created.tzinfo == dt.timezone.utc


def test_naive_datetimes_are_refused() -> None:
    with pytest.raises(ValueError, match="naive"):
        UTCDateTime().process_bind_param(dt.datetime(2026, 1, 1), None)


def test_upgrade_db_command(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'cli.sqlite'}"
    run = subprocess.run(
        [sys.executable, "-m", "gpubroker", "upgrade-db", f"--db-url={url}"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert current_revision(make_engine(url)) == head_revision()


def test_upgrade_from_0001_keeps_leases_and_fills_new_columns(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'old.sqlite'}"
    from gpubroker.store.db import upgrade

    upgrade(url, "0001")
    engine = make_engine(url)
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO leases (user, server_name, holder_kind, gpus, state, created, version)"
                " VALUES ('ann', '', 'server', 1, 'pending', '2026-11-30 12:00:00', 1)"
            )
        )
    upgrade(url)
    with engine.connect() as conn:
        row = conn.execute(text("SELECT user, priority_class, reclaimable FROM leases")).one()
    assert tuple(row) == ("ann", "interactive", 0)
