"""The job service and what its engine cannot tell or will not do: a launch
whose outcome is unknown (it may run: asked again, never launched twice), a
job its engine holds and has not started (no warning), and one its engine
says will never start (it fails, saying why). On the local engine, with
its answers changed where a Slurm cluster would give them."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest

from gpubroker.engines import Handle, LaunchSpec, LaunchUnknown, Status
from gpubroker.jobs.service import JobService

from .test_jobs import run_until_done, until_state


def test_a_launch_whose_outcome_is_unknown_is_found_next_time_and_runs_once(
    jobs: JobService, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (home / "ann").mkdir(parents=True)
    engine = jobs.engines["local"]
    real_launch = engine.launch
    launches: list[LaunchSpec] = []

    def lost_answer(spec: LaunchSpec) -> Handle:
        launches.append(spec)
        real_launch(spec)  # it started, but the answer never came back
        raise LaunchUnknown("sbatch failed (exit 1): Socket timed out; squeue failed")

    monkeypatch.setattr(engine, "launch", lost_answer)
    job = jobs.submit("ann", {"command": ["sh", "-c", "echo ran >> runs.txt"], "gpus": 1})
    asyncio.run(jobs.tick())
    view = jobs.get(job["id"])
    # not failed, its lease kept: it may run
    assert view["state"] == "queued", view
    assert jobs.broker.get_lease(view["lease_id"])["state"] == "granted"
    done = run_until_done(jobs, job["id"])
    assert done["state"] == "succeeded", done
    assert len(launches) == 1  # found by its tag, never launched again
    assert (home / "ann" / "runs.txt").read_text() == "ran\n"


def _polled_as(monkeypatch: pytest.MonkeyPatch, jobs: JobService, **fields: Any) -> None:
    """The local engine's poll says the job still waits in its engine."""
    engine = jobs.engines["local"]
    real_poll = engine.poll

    def poll(handle: Handle, *args: Any, **kwargs: Any) -> Status:
        status = real_poll(handle, *args, **kwargs)
        return dataclasses.replace(status, **fields) if status.running else status

    monkeypatch.setattr(engine, "poll", poll)


def test_a_job_its_engine_will_never_start_fails_saying_why(
    jobs: JobService, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (home / "bo").mkdir(parents=True)
    _polled_as(monkeypatch, jobs, waiting="PENDING (PartitionTimeLimit)", never_starts=True)
    job = jobs.submit("bo", {"command": ["sleep", "60"], "gpus": 1, "retries": 2})
    done = run_until_done(jobs, job["id"])
    assert done["state"] == "failed", done
    assert done["reason"] == (
        "its engine will never start it: PENDING (PartitionTimeLimit); ask your "
        "administrator (partition, account, QOS, time limit)"
    )
    assert done["restarts"] == 0  # not retried: it would wait the same way
    lease = jobs.broker.get_lease(done["lease_id"])
    assert lease["state"] == "released"


def test_a_job_its_engine_has_not_started_is_not_warned(
    jobs: JobService, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Slurm holds it pending: scancel --signal on it hangs until the
    # command's timeout, holding up every job's check, and no program gets it
    (home / "cy").mkdir(parents=True)
    jobs.warn_before = 3599.0  # due a second after its start
    _polled_as(monkeypatch, jobs, waiting="PENDING (Resources)")
    signalled: list[Handle] = []
    monkeypatch.setattr(jobs.engines["local"], "signal", lambda h, s: signalled.append(h))
    job = jobs.submit("cy", {"command": ["sleep", "60"], "gpus": 1, "time": "1h"})
    until_state(jobs, job["id"], "running")
    for _ in range(3):
        time.sleep(0.6)
        asyncio.run(jobs.tick())
    kinds = [e["kind"] for e in jobs.broker.lease_events(jobs.get(job["id"])["lease_id"])]
    assert signalled == [] and "job-warned" not in kinds
    assert jobs.get(job["id"])["warned_at"] is None


def test_a_job_its_engine_holds_shows_why_until_it_starts(
    jobs: JobService, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpubroker.jobs.text import job_cells

    (home / "di").mkdir(parents=True)
    waits = ["PENDING (Resources)"]
    engine = jobs.engines["local"]
    real_poll = engine.poll

    def poll(handle: Handle, *args: Any, **kwargs: Any) -> Status:
        status = real_poll(handle, *args, **kwargs)
        return dataclasses.replace(status, waiting=waits[0]) if status.running else status

    monkeypatch.setattr(engine, "poll", poll)
    job = jobs.submit("di", {"command": ["sleep", "60"], "gpus": 1})
    until_state(jobs, job["id"], "running")
    asyncio.run(jobs.tick())
    view = jobs.get(job["id"])
    assert view["engine_wait"] == "PENDING (Resources)"
    assert job_cells(view)["reason"] == "held by its engine: PENDING (Resources)"
    waits[0] = ""  # Slurm started it
    asyncio.run(jobs.tick())
    view = jobs.get(job["id"])
    assert view["engine_wait"] is None and "engine_wait" not in view["spec"]
    assert job_cells(view)["reason"] == ""


def test_a_cancel_while_a_launch_is_unknown_keeps_the_gpus(
    jobs: JobService, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the review of the LaunchUnknown change: the cancel took "cannot tell"
    # for "never started", ended the job and gave its GPUs away while its
    # process ran
    from gpubroker.engines import EngineError
    from gpubroker.errors import Unavailable

    (home / "ed").mkdir(parents=True)
    engine = jobs.engines["local"]
    real_launch, real_find = engine.launch, engine.find

    def lost_answer(spec: LaunchSpec) -> Handle:
        real_launch(spec)
        raise LaunchUnknown("sbatch failed; squeue failed")

    def blind(tag: str, user: str) -> Handle | None:
        raise EngineError("squeue failed (exit 1): Unable to contact slurm controller")

    monkeypatch.setattr(engine, "launch", lost_answer)
    monkeypatch.setattr(engine, "find", blind)
    job = jobs.submit("ed", {"command": ["sleep", "60"], "gpus": 1})
    asyncio.run(jobs.tick())
    with pytest.raises(Unavailable, match="whether its launch started cannot be told now"):
        asyncio.run(jobs.cancel(job["id"], "no longer needed", "ed"))
    view = jobs.get(job["id"])
    assert view["state"] == "queued"
    assert jobs.broker.get_lease(view["lease_id"])["state"] == "granted"
    # the engine answers again: the cancel finds the process and stops it
    monkeypatch.setattr(engine, "find", real_find)
    done = asyncio.run(jobs.cancel(job["id"], "no longer needed", "ed"))
    if done["state"] != "cancelled":
        done = run_until_done(jobs, job["id"])
    assert done["state"] == "cancelled", done
    assert jobs.broker.get_lease(done["lease_id"])["state"] == "released"
