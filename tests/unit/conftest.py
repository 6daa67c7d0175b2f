"""Fixtures shared by the unit tests."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpubroker.jobs.service import JobService

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
def jobs(db_url: str, home: Path) -> JobService:
    """A job service running jobs as the test's own account, users' folders under ``home``."""
    broker = make_broker(db_url)
    service = JobService(broker, broker.engine, run_as_self=True, poll_interval=0.2)
    service.root_dir_template = str(home / "{username}")
    return service
