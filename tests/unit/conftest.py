"""Fixtures shared by the unit tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpubroker.engines.base import EngineError, Handle, Status
from gpubroker.jobs.service import JobService
from gpubroker.store import jobs_repo

from ..conftest import make_broker
from .test_enforce_mps import StandIn


@pytest.fixture
def standin(tmp_path: Path) -> Iterator[StandIn]:
    """A stand-in ``nvidia-cuda-mps-control``; every daemon it left is
    ended by its pid afterwards."""
    fake = StandIn(tmp_path)
    try:
        yield fake
    finally:
        for pid in fake.daemon_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """Where the job tests' users have their home folders."""
    return tmp_path / "home"


@pytest.fixture
def jobs(db_url: str, home: Path) -> Iterator[JobService]:
    """A job service running jobs as the test's own account, users' folders
    under ``home``; afterwards every process the test's jobs left is ended
    (by its recorded pid) and the service closed."""
    broker = make_broker(db_url)
    service = JobService(broker, broker.engine, run_as_self=True, poll_interval=0.2)
    service.root_dir_template = str(home / "{username}")
    yield service
    with service.sessions() as session:
        handles = [
            Handle(j.handle_engine, j.handle_id, j.handle_node)
            for j in jobs_repo.listed(session, None)
            if j.handle_id.isdigit()
        ]
    for handle in handles:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(int(handle.id), signal.SIGKILL)
        with contextlib.suppress(EngineError):
            service.engines["local"].stop(handle, 0.1)  # reaps it
    service.close()


@pytest.fixture
def short_stop_grace(jobs: JobService) -> None:
    """The test's job service gives a stopped job 1 s, not 30, before SIGKILL."""
    jobs.stop_grace = 1.0


@contextlib.contextmanager
def failing_stops(jobs: JobService) -> Iterator[list[Handle]]:
    """Inside the block the local engine cannot stop a process (Docker or
    Slurm unreachable for a moment): every stop raises ``EngineError``.
    Yields the handles of the stops asked for."""
    engine = jobs.engines["local"]
    asked: list[Handle] = []
    real_stop = engine.stop

    def failing_stop(handle: Handle, grace: float) -> Status:
        asked.append(handle)
        raise EngineError("cannot stop: engine unreachable")

    engine.stop = failing_stop
    try:
        yield asked
    finally:
        engine.stop = real_stop


def job_pid(jobs: JobService, job_id: int) -> int:
    """The pid (process group) of a local job's process."""
    with jobs.sessions() as session:
        return int(jobs_repo.get(session, job_id).handle_id)


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    out = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True)
    return out.stdout.strip() not in ("", "Z")
