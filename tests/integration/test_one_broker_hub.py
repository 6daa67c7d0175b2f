"""One active broker per database, against real hubs: a second broker on the
same store refuses and names the holder; a broker whose hub was SIGKILLed
exits, and the restarted hub's broker takes over only then."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from gpubroker.store.db import make_engine, upgrade
from gpubroker.store.lock import WriterLock, describe_self

from ..hubutil import RunningHub, _pid_alive, free_port
from .test_spawn import wait_until


def _serve_command(db: Path, port: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "gpubroker",
        "serve",
        f"--db-url=sqlite:///{db}",
        "--ip=127.0.0.1",
        f"--port={port}",
        "--device-backend=fake",
        *extra,
    ]


def _serve(db: Path, port: int, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JUPYTERHUB_")}
    return subprocess.run(
        _serve_command(db, port),
        env=env,
        cwd=db.parent,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_a_second_broker_on_the_same_database_refuses_and_names_the_holder(
    clean_hub: RunningHub,
) -> None:
    hub = clean_hub
    held = hub.broker_api(
        "POST", "/leases", json={"user": "h", "gpus": 1, "holder_kind": "external"}
    )
    assert held.status_code == 201
    before = hub.leases()
    db = hub.workdir / "gpubroker.sqlite"
    port = free_port()
    done = _serve(db, port)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "another gpubroker is the active broker" in done.stderr
    assert f"pid {hub.broker_pid()} on " in done.stderr
    with pytest.raises(requests.ConnectionError):
        requests.get(f"http://127.0.0.1:{port}/api/v1/health", timeout=2)
    assert hub.leases() == before
    hub.broker_api("DELETE", f"/leases/{held.json()['id']}")


def test_the_database_file_is_private(clean_hub: RunningHub) -> None:
    mode = (clean_hub.workdir / "gpubroker.sqlite").stat().st_mode & 0o777
    assert mode == 0o600
    for suffix in ("-wal", "-shm", ".lock"):
        path = clean_hub.workdir / f"gpubroker.sqlite{suffix}"
        if path.exists():
            assert path.stat().st_mode & 0o077 == 0, suffix


@pytest.fixture(scope="module")
def orphan_hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningHub]:
    hub = RunningHub(tmp_path_factory.mktemp("orphan-hub")).start()
    yield hub
    hub.stop()


def test_a_sigkilled_hubs_broker_exits_and_the_new_hubs_broker_takes_over(
    orphan_hub: RunningHub,
) -> None:
    hub = orphan_hub
    lease = hub.broker_api(
        "POST", "/leases", json={"user": "keeper", "gpus": 2, "holder_kind": "external"}
    ).json()
    old = hub.broker_pid()
    assert old and hub.proc is not None
    hub.proc.kill()  # the hub only: proxy, broker and servers live on
    hub.proc.wait(10)
    hub.log.close()
    hub.start()  # at once: the old broker may still hold the store
    wait_until(lambda: not _pid_alive(old), timeout=30)  # it exits within seconds
    log = (hub.workdir / "hub.log").read_text(errors="replace")
    assert "that started this broker exited; exiting" in log
    new = wait_until(lambda: (pid := hub.broker_pid()) and pid != old and pid, timeout=90)
    assert new != old
    wait_until(lambda: hub.broker_api("GET", "/health").status_code == 200, timeout=30)
    assert hub.proc.poll() is None  # the hub did not give up on its service
    again = hub.broker_api("GET", f"/leases/{lease['id']}").json()
    assert again["state"] == "granted"
    assert again["devices"] == lease["devices"]
    held = [d["uuid"] for x in hub.leases() for d in x["devices"]]
    assert len(held) == len(set(held)) == 2
    hub.broker_api("DELETE", f"/leases/{lease['id']}")


def test_a_hub_managed_broker_waits_for_the_lock_of_one_that_is_exiting(
    tmp_path: Path,
) -> None:
    """A hub stops when its managed service fails at start: a broker started
    by a hub waits (bounded) for the previous broker's lock instead."""
    db = tmp_path / "b.sqlite"
    upgrade(f"sqlite:///{db}")
    held = WriterLock(make_engine(f"sqlite:///{db}"), describe_self("http://old/"))
    held.acquire()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("JUPYTERHUB_")}
    env.update(JUPYTERHUB_SERVICE_NAME="gpubroker", JUPYTERHUB_API_URL="http://127.0.0.1:9/hub/api")
    log = open(tmp_path / "broker.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        _serve_command(db, port, "--GPUBrokerApp.lock_wait_timeout=60"),
        env=env,
        cwd=tmp_path,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_until(
            lambda: "Waiting for the database lock" in (tmp_path / "broker.log").read_text(),
            timeout=30,
        )
        assert proc.poll() is None
        held.release()  # the old broker exits
        wait_until(lambda: _health(port), timeout=30)
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def _health(port: int) -> bool:
    try:
        return requests.get(f"http://127.0.0.1:{port}/api/v1/health", timeout=2).ok
    except requests.RequestException:
        return False
