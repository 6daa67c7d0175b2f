"""``gpubroker downgrade-db REVISION`` (the Docker trial: the documented
Alembic call ran under a live broker, which then failed every command with
"column … does not exist"; it now takes the writer lock as ``upgrade-db``
does, and refuses what it cannot do)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from gpubroker.store.db import current_revision, head_revision, make_engine, upgrade
from gpubroker.store.lock import WriterLock, describe_self


def _downgrade(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpubroker", "downgrade-db", *args, f"--db-url={url}"],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_downgrade_db_takes_the_schema_down_and_refuses_what_it_cannot(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'b.sqlite'}"
    upgrade(url)
    head = head_revision()
    assert head is not None
    older = f"{int(head) - 1:04d}"
    done = _downgrade(url, older)
    assert done.returncode == 0, done.stderr
    assert current_revision(make_engine(url)) == older
    for args, words in [
        ((), "give one REVISION, e.g. gpubroker downgrade-db 0014"),
        (("0099",), "revision '0099' is not a migration of this gpubroker"),
        (("head",), "revision 'head' is not a migration's number (four digits, e.g. 0014)"),
        (("0014@head",), "is not a migration's number"),
        ((head,), f"at schema revision '{older}', below '{head}' already: use upgrade-db"),
    ]:
        refused = _downgrade(url, *args)
        assert refused.returncode == 2 and words in refused.stderr
    assert current_revision(make_engine(url)) == older  # nothing changed


def test_downgrade_db_refuses_while_a_broker_holds_the_store(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'b.sqlite'}"
    upgrade(url)
    lock = WriterLock(make_engine(url), describe_self())
    lock.acquire()
    try:
        done = _downgrade(url, "0012")
    finally:
        lock.release()
    assert done.returncode == 2, done.stderr
    assert "Not downgrading: another gpubroker is the active broker" in done.stderr
    assert current_revision(make_engine(url)) == head_revision()


def test_downgrade_db_of_a_database_that_does_not_exist_makes_none(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'none.sqlite'}"
    refused = _downgrade(url, "0012")
    assert refused.returncode == 2 and "does not exist" in refused.stderr
    assert list(tmp_path.iterdir()) == []
