"""A review of the batch job supervisor: one job's failing step does not
stall the others; the exit file a restarted broker reads (the user can
write it) gives at most 0-255, 128 + N read as signal N; a parameter named
like a Python keyword is refused; a preempted job with no restarts left
ends failed however it ended."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import pytest

from gpubroker.engines.base import EngineError, Handle
from gpubroker.jobs.service import JobService
from gpubroker.store import jobs_repo

from ..conftest import make_broker
from .conftest import failing_stops, job_pid, process_alive
from .test_jobs_review2 import _traps_set

#: the tests' jobs get a short stop grace (:func:`.conftest.short_stop_grace`)
pytestmark = pytest.mark.usefixtures("short_stop_grace")

_pid, _alive = job_pid, process_alive


def _after_the_process_died(jobs: JobService, job_id: int, db_url: str) -> JobService:
    """Wait (at most 10 s) until the job's process has died, then give a
    second job service on the same store, as a restarted broker has."""
    pid = _pid(jobs, job_id)
    for _ in range(100):
        if not _alive(pid):
            break
        time.sleep(0.1)
    again = make_broker(db_url)
    service = JobService(again, again.engine, run_as_self=True)
    service.root_dir_template = jobs.root_dir_template
    return service


def test_one_jobs_failing_stop_does_not_stall_the_other_jobs(jobs: JobService, home: Path) -> None:
    """Job A runs; an admin releases its lease; stopping A's process fails
    (Docker/Slurm unreachable for a moment, a pid the local engine refuses
    to signal). Job B, submitted later and granted, must still start: the
    supervisor's loop must not abort at A on every tick."""
    for user in ("ann", "bob"):
        (home / user).mkdir(parents=True)
    a = jobs.submit("ann", {"command": ["sleep", "60"], "gpus": 1})
    asyncio.run(jobs.tick())
    assert jobs.get(a["id"])["state"] == "running"
    with failing_stops(jobs):
        jobs.broker.release_lease(a["lease_id"], "freed by an admin", actor="admin")
        b = jobs.submit("bob", {"command": ["sleep", "60"], "gpus": 1})

        async def ticks() -> None:
            for _ in range(3):
                with contextlib.suppress(EngineError):  # what run() logs and swallows
                    await jobs.tick()

        asyncio.run(ticks())
        assert jobs.get(b["id"])["state"] == "running", jobs.get(b["id"])


def test_a_restarted_broker_records_a_signal_apart_from_the_exit_code(
    db_url: str, jobs: JobService, home: Path
) -> None:
    """The exit code and the signal are recorded apart (docs/jobs.md). A job
    its process ended by a signal while the broker was away is read from the
    exit file, where the shell wrote 128 + N: it must read as signal N, as
    the first broker (and the docker engine's _status) would record it."""
    (home / "ann").mkdir(parents=True)
    job = jobs.submit("ann", {"command": "sleep 1; kill -KILL $$", "gpus": 1})
    asyncio.run(jobs.tick())
    assert jobs.get(job["id"])["state"] == "running"
    service = _after_the_process_died(jobs, job["id"], db_url)
    asyncio.run(service.tick())
    done = service.get(job["id"])
    assert done["state"] == "failed", done
    assert (done["exit_code"], done["signal"]) == (None, 9), (done["exit_code"], done["signal"])
    with jobs.sessions() as session:  # the first engine reaps its child
        row = jobs_repo.get(session, job["id"])
        jobs.engines["local"].poll(Handle(row.handle_engine, row.handle_id, row.handle_node))


def test_a_parameter_named_like_a_python_keyword_is_a_400(jobs: JobService, home: Path) -> None:
    """``class=1`` passes the NAME check, papermill injects ``class = 1``,
    and the job fails at run time with a SyntaxError in the injected cell
    instead of a 400 naming ``param``."""
    from gpubroker.errors import BadRequest

    from ..nbutil import write_notebook

    write_notebook(home / "ann" / "p.ipynb", ["x = 1"])
    for name in ("class", "lambda", "None"):
        with pytest.raises(BadRequest, match=r"^param: "):
            jobs.submit("ann", {"notebook": "p.ipynb", "gpus": 1, "params": [f"{name}=1"]})


def test_a_preempted_job_past_max_restarts_ends_failed_however_it_ended(
    db_url: str, home: Path
) -> None:
    """max_restarts: 'Most times a preempted job is queued again (then it
    ends failed)'. Stopped at the end of the grace period it does; but when
    it ends itself on the warning (docs: counted as the preemption), the
    failure branch requeues it again, spending a failure retry."""
    from .test_jobs import reclaiming_service

    broker, service = reclaiming_service(db_url, home, grace=60)
    service.max_restarts = 0
    (home / "kim").mkdir(parents=True)
    script = "trap 'exit 1' USR1; touch trapped; while true; do sleep 0.1; done"
    job = service.submit(
        "kim", {"command": script, "gpus": 1, "group": "B", "retries": 1}, groups=["B"]
    )
    asyncio.run(service.tick())
    assert service.get(job["id"])["state"] == "running"
    _traps_set(home, "kim")
    alice = broker.request_lease("alice", "", 1, holder_kind="external", groups=["A"], group="A")
    assert alice["queue"]["reason"] == "Preempting"
    asyncio.run(service.tick())  # the warning: it exits 1 in its grace period
    for _ in range(100):  # until the check sees its end (it exits at once)
        asyncio.run(service.tick())
        if service.get(job["id"])["state"] != "running":
            break
        time.sleep(0.1)
    view = service.get(job["id"])
    try:
        assert view["state"] == "failed", (view["state"], view["reason"])
    finally:
        asyncio.run(service.cancel(job["id"], "done", actor="kim"))


def test_an_exit_file_with_a_huge_number_does_not_wedge_the_supervisor(
    db_url: str, jobs: JobService, home: Path
) -> None:
    """The exit file is in the user's directory and the job may write it.
    A restarted broker reads it (``_recorded``/``_launched``: ``int(text)``,
    unbounded) and stores it in ``jobs.exit_code`` (INTEGER): a number past
    64 bits (SQLite; past 32 bits on PostgreSQL) makes the commit raise, so
    tick() fails at that job on every round and no later job is handled."""
    for user in ("ann", "bob"):
        (home / user).mkdir(parents=True)
    script = 'echo 99999999999999999999 > "$GPUBROKER_JOB_EXIT_FILE"; kill -KILL $PPID'
    job = jobs.submit("ann", {"command": script, "gpus": 1})
    asyncio.run(jobs.tick())
    service = _after_the_process_died(jobs, job["id"], db_url)
    other = service.submit("bob", {"command": ["sleep", "60"], "gpus": 1})
    try:
        with contextlib.suppress(Exception):  # what run() logs and swallows
            asyncio.run(service.tick())
        assert service.get(job["id"])["state"] == "failed", service.get(job["id"])["state"]
        assert service.get(other["id"])["state"] == "running"
    finally:
        asyncio.run(service.cancel(other["id"], "done", actor="bob"))
        with jobs.sessions() as session:
            row = jobs_repo.get(session, job["id"])
            jobs.engines["local"].poll(Handle(row.handle_engine, row.handle_id, row.handle_node))


def test_a_cancel_that_cannot_stop_the_process_does_not_free_its_devices(
    jobs: JobService, home: Path
) -> None:
    from gpubroker.errors import Unavailable

    (home / "ann").mkdir(parents=True)
    job = jobs.submit("ann", {"command": ["sleep", "60"], "gpus": 1})
    asyncio.run(jobs.tick())
    assert jobs.get(job["id"])["state"] == "running"
    pid = _pid(jobs, job["id"])
    with failing_stops(jobs), pytest.raises(Unavailable, match="cancel it again later"):
        asyncio.run(jobs.cancel(job["id"], "cancelled by ann", actor="ann"))
    assert _alive(pid)
    assert jobs.get(job["id"])["state"] == "running"
    assert jobs.broker.get_lease(job["lease_id"])["state"] == "granted"
    # once its engine answers, the cancel goes through
    assert asyncio.run(jobs.cancel(job["id"], "cancelled by ann", actor="ann"))["state"] == (
        "cancelled"
    )
    assert jobs.broker.get_lease(job["lease_id"])["state"] == "released"
