"""Job logs are read off the event loop: a log sits in the user's directory,
which may be on a slow or hung network file system."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from gpubroker.errors import Unavailable
from gpubroker.jobs import service
from gpubroker.jobs.service import JobService

from .test_jobs import run_until_done


def test_a_log_read_off_the_loop_gives_what_a_direct_read_gives(
    jobs: JobService, home: Path
) -> None:
    (home / "ann").mkdir(parents=True)
    job = jobs.submit("ann", {"command": "echo héllo", "gpus": 1})
    run_until_done(jobs, job["id"])
    read = asyncio.run(jobs.logs_off_loop(job["id"]))
    assert "héllo" in read["text"] and read == jobs.logs(job["id"])
    assert asyncio.run(jobs.logs_off_loop(job["id"], 3, limit=1)) == jobs.logs(job["id"], 3, 1)


def test_a_hung_log_read_answers_503_and_the_loop_runs_on(
    jobs: JobService, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (home / "bob").mkdir(parents=True)
    job = jobs.submit("bob", {"command": "echo hi", "gpus": 1})
    run_until_done(jobs, job["id"])
    release = threading.Event()
    reads: list[str] = []

    def hung(path: str, user: str, offset: int, limit: int) -> bytes:
        reads.append(threading.current_thread().name)
        release.wait(30)
        return b"late"

    monkeypatch.setattr(jobs, "_read_log", hung)
    monkeypatch.setattr(service, "LOG_READ_TIMEOUT", 0.5)

    async def main() -> int:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        task = asyncio.create_task(ticker())
        try:
            with pytest.raises(Unavailable, match=r"its log could not be read within 0\.5 s"):
                await jobs.logs_off_loop(job["id"])
        finally:
            task.cancel()
            release.set()
        return ticks

    assert asyncio.run(main()) > 1  # the loop ran while the read hung
    assert reads and reads[0].startswith("gpubroker-job-log")


def test_close_stops_the_workers(jobs: JobService) -> None:
    jobs.close()
    with pytest.raises(RuntimeError):
        jobs._log_reads.submit(print)
    with pytest.raises(RuntimeError):
        jobs._checks.submit(print)


def test_a_launch_clears_the_last_runs_files_off_the_event_loop(
    jobs: JobService, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launch removed the last run's warning, exit and error files in
    the user's folder on the broker's event loop: a hung home file system
    (stale NFS) froze every API call (a review of the jobs)."""
    seen: list[bool] = []
    real = service._unlink

    def unlink(root: Path, path: str) -> None:
        seen.append(asyncio._get_running_loop() is not None)
        real(root, path)

    monkeypatch.setattr(service, "_unlink", unlink)
    (home / "ann").mkdir(parents=True)
    job = jobs.submit("ann", {"command": "true", "gpus": 1})
    assert run_until_done(jobs, job["id"])["state"] == "succeeded"
    assert seen and not any(seen)
