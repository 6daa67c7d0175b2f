"""Fixtures shared by the unit tests."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

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
