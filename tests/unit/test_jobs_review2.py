"""A second review of the batch job service: a job's GPUs go to the next
request only once its process has ended (time limit, preemption, an
admin's release); a cancel answers before the stop's grace is over; stops
run off the supervisor's round, side by side; a notebook gone before its
run fails once, saying so; the notebook's own kernel is checked at submit;
a user's job cannot take a priority class above the default."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest

from gpubroker.engines.base import Handle
from gpubroker.jobs.service import JobService
from gpubroker.model import jobs as model
from gpubroker.store import jobs_repo

from .conftest import failing_stops, job_pid, process_alive

#: the tests' jobs get a short stop grace (:func:`.conftest.short_stop_grace`)
pytestmark = pytest.mark.usefixtures("short_stop_grace")

_pid, _alive = job_pid, process_alive


def _until(jobs: JobService, done: object, timeout: float = 60.0) -> None:
    """Tick until ``done()`` is true (at most ``timeout`` seconds)."""

    async def loop() -> None:
        for _ in range(int(timeout / 0.1)):
            await jobs.tick()
            if done():  # type: ignore[operator]
                return
            await asyncio.sleep(0.1)
        raise AssertionError("not done in time")

    asyncio.run(loop())


def _traps_set(home: Path, user: str) -> None:
    """Wait until a job's shell wrote ``trapped`` (its TERM trap is set)."""
    for _ in range(300):
        if (home / user / "trapped").exists():
            return
        time.sleep(0.05)
    raise AssertionError("the job never set its trap")


#: a job that ignores SIGTERM (so it takes its whole stop grace)
STUBBORN = "trap '' TERM; touch trapped; while true; do sleep 0.1; done"


# --- 3. the devices of a job go on only once its process has ended -------------------


def test_a_timed_out_jobs_gpu_is_not_granted_while_its_process_runs(
    jobs: JobService, home: Path
) -> None:
    broker = jobs.broker
    (home / "ann").mkdir(parents=True)
    holders = [broker.request_lease(f"h{i}", "", 1, holder_kind="external") for i in range(7)]
    job = jobs.submit("ann", {"command": STUBBORN, "gpus": 1, "time": "1s"})
    asyncio.run(jobs.tick())
    assert jobs.get(job["id"])["state"] == "running"
    pid = _pid(jobs, job["id"])
    device = jobs.get(job["id"])["devices"]
    waiting = broker.request_lease("bob", "", 1, holder_kind="external")
    assert waiting["state"] == "pending"
    _traps_set(home, "ann")
    for _ in range(100):  # the pass sees the job lease's time limit passed
        broker.schedule_now()
        if jobs.get(job["id"])["stopping"]:
            break
        time.sleep(0.1)
    assert jobs.get(job["id"])["stopping"]
    assert broker.get_lease(waiting["id"])["state"] == "pending"
    assert _alive(pid)

    def bob_granted() -> bool:
        bob = broker.get_lease(waiting["id"])
        if bob["state"] == "granted":
            assert [d["uuid"] for d in bob["slots"]] == device
            assert not _alive(pid), "bob got the GPU of a job still running"
            return True
        return False

    _until(jobs, bob_granted)
    done = jobs.get(job["id"])
    assert done["state"] == model.TIMED_OUT, done
    released = broker.get_lease(job["lease_id"])
    assert released["release_reason"].endswith("(job stopped)"), released["release_reason"]
    for lease in [*holders, waiting]:
        broker.release_lease(lease["id"], "done")


def test_an_admins_release_of_a_job_lease_stops_the_job_first(jobs: JobService, home: Path) -> None:
    """``DELETE /leases/{id}`` and the panel's release end a granted job
    lease with ``stop_lease``: the lease keeps its devices until the job's
    process has ended, and the job then fails (its lease was taken away)."""
    broker = jobs.broker
    (home / "ann").mkdir(parents=True)
    job = jobs.submit("ann", {"command": STUBBORN, "gpus": 1})
    asyncio.run(jobs.tick())
    pid = _pid(jobs, job["id"])
    _traps_set(home, "ann")
    broker.stop_lease(job["lease_id"], "freed by an admin", actor="admin")
    assert broker.get_lease(job["lease_id"])["state"] == "granted"
    assert jobs.get(job["id"])["stopping"]
    _until(jobs, lambda: jobs.get(job["id"])["state"] in model.FINAL)
    assert not _alive(pid)
    done = jobs.get(job["id"])
    assert done["state"] == model.FAILED and "freed by an admin" in done["reason"], done
    lease = broker.get_lease(job["lease_id"])
    assert lease["state"] == "released"


# --- 7. a cancel answers before the stop grace is over ------------------------------


def test_a_cancel_answers_before_the_stop_grace_is_over(jobs: JobService, home: Path) -> None:
    """A process that takes its grace: the cancel answers (the job still
    running, ``stopping``, keeping its lease) while the stop goes on; the
    job then ends ``cancelled`` and its lease is released."""
    (home / "ann").mkdir(parents=True)
    jobs.stop_grace = 10.0
    jobs.cancel_wait = 0.5
    job = jobs.submit("ann", {"command": STUBBORN, "gpus": 1})
    asyncio.run(jobs.tick())
    pid = _pid(jobs, job["id"])
    _traps_set(home, "ann")
    view = asyncio.run(jobs.cancel(job["id"], "cancelled by ann", actor="ann"))
    # the old code answered only after the grace: 'cancelled', the process gone
    assert view["state"] == model.RUNNING and view["stopping"], view
    assert view["reason"] == "being cancelled: cancelled by ann"
    assert _alive(pid)
    assert jobs.broker.get_lease(job["lease_id"])["state"] == "granted"
    # a second cancel meanwhile answers the same
    again = asyncio.run(jobs.cancel(job["id"], "again", actor="ann"))
    assert again["state"] == model.RUNNING and again["stopping"]
    _until(jobs, lambda: jobs.get(job["id"])["state"] in model.FINAL)
    done = jobs.get(job["id"])
    assert done["state"] == model.CANCELLED and done["reason"] == "cancelled by ann", done
    assert not _alive(pid)
    lease = jobs.broker.get_lease(job["lease_id"])
    assert lease["state"] == "released" and lease["release_reason"] == "cancelled by ann"


# --- 13. stops run off the supervisor's round, side by side -------------------------


def test_stopping_jobs_does_not_hold_up_the_other_jobs(jobs: JobService, home: Path) -> None:
    for user in ("ann", "bob", "cy"):
        (home / user).mkdir(parents=True)
    jobs.stop_grace = 5.0
    a = jobs.submit("ann", {"command": STUBBORN, "gpus": 1})
    b = jobs.submit("bob", {"command": STUBBORN, "gpus": 1})
    asyncio.run(jobs.tick())
    _traps_set(home, "ann")
    _traps_set(home, "bob")
    for job in (a, b):
        jobs.broker.stop_lease(job["lease_id"], "freed by an admin", actor="admin")
    c = jobs.submit("cy", {"command": ["sleep", "60"], "gpus": 1})
    asyncio.run(jobs.tick())
    # one round started cy's job and both stops, and waited for neither stop
    assert jobs.get(c["id"])["state"] == model.RUNNING
    for job in (a, b):
        view = jobs.get(job["id"])
        assert view["state"] == model.RUNNING and view["stopping"], view
        assert jobs._stop_in_flight(job["id"])  # both at once
    _until(jobs, lambda: all(jobs.get(j["id"])["state"] in model.FINAL for j in (a, b)))
    for job in (a, b):
        assert jobs.get(job["id"])["state"] == model.FAILED
        assert jobs.broker.get_lease(job["lease_id"])["state"] == "released"
    asyncio.run(jobs.cancel(c["id"], "done", actor="cy"))


def test_a_failing_stop_keeps_the_lease_and_is_tried_again(jobs: JobService, home: Path) -> None:
    """A stop whose engine fails is logged and started again at a later
    round; meanwhile the job keeps its lease (its GPUs)."""
    (home / "ann").mkdir(parents=True)
    job = jobs.submit("ann", {"command": ["sleep", "60"], "gpus": 1})
    asyncio.run(jobs.tick())
    with failing_stops(jobs) as calls:
        jobs.broker.stop_lease(job["lease_id"], "freed by an admin", actor="admin")
        _until(jobs, lambda: len(calls) >= 2)
        assert jobs.get(job["id"])["state"] == model.RUNNING
        assert jobs.broker.get_lease(job["lease_id"])["state"] == "granted"
    _until(jobs, lambda: jobs.get(job["id"])["state"] in model.FINAL)
    assert jobs.broker.get_lease(job["lease_id"])["state"] == "released"


# --- 8. a notebook gone before its run fails once, saying so -------------------------


def test_a_notebook_gone_before_its_run_fails_once_with_a_reason(
    jobs: JobService, home: Path
) -> None:
    from ..nbutil import write_notebook

    nb = write_notebook(home / "ann" / "gone.ipynb", ["x = 1"])
    job = jobs.submit("ann", {"notebook": "gone.ipynb", "gpus": 1, "retries": 2})
    nb.unlink()
    _until(jobs, lambda: jobs.get(job["id"])["state"] in model.FINAL)
    done = jobs.get(job["id"])
    assert done["state"] == model.FAILED and done["restarts"] == 0, done
    assert done["reason"].startswith("could not start: notebook: no such notebook"), done
    assert jobs.broker.get_lease(job["lease_id"])["state"] == "released"


# --- 12. the notebook's own kernel is checked at submit ------------------------------


def test_a_notebook_whose_metadata_kernel_is_missing_is_a_400(jobs: JobService, home: Path) -> None:
    import nbformat

    from gpubroker.errors import BadRequest

    from ..nbutil import write_notebook

    path = write_notebook(home / "ann" / "k.ipynb", ["x = 1"])
    nb = nbformat.read(path, as_version=4)
    nb.metadata["kernelspec"]["name"] = "conda-env-elsewhere-py"
    nbformat.write(nb, path)
    with pytest.raises(BadRequest, match=r"^notebook: its metadata's kernelspec.name "):
        jobs.submit("ann", {"notebook": "k.ipynb", "gpus": 1})
    assert jobs.list("ann") == []
    # a kernel named in the request, or the submitting kernel's python, runs it
    named = jobs.submit("ann", {"notebook": "k.ipynb", "gpus": 1, "kernel": "python3"})
    assert named["state"] == model.QUEUED
    import sys

    own = jobs.submit("ann", {"notebook": "k.ipynb", "gpus": 1, "python": sys.executable})
    assert own["state"] == model.QUEUED


# --- 10. a user's job cannot take a class above the jobs' default --------------------


def test_a_users_job_cannot_take_a_class_above_the_jobs_default(
    jobs: JobService, home: Path
) -> None:
    from gpubroker.errors import Forbidden

    (home / "ann").mkdir(parents=True)
    with pytest.raises(Forbidden, match=r"^priority_class: 'interactive' \(rank 100\) is above"):
        jobs.submit(
            "ann", {"command": "true", "gpus": 1, "priority_class": "interactive"}, admin=False
        )
    assert jobs.list("ann") == []
    # the default class or lower is the user's; an admin chooses freely
    low = jobs.submit("ann", {"command": "true", "gpus": 1, "priority_class": "batch"}, admin=False)
    assert low["state"] == model.QUEUED
    high = jobs.submit(
        "ann", {"command": "true", "gpus": 1, "priority_class": "interactive"}, admin=True
    )
    assert high["state"] in (model.QUEUED, model.RUNNING)


# -- a third review: how a job ends is read from how it ended and from the cause
# the broker recorded for its lease's end -----------------------------------------


def _exited_by_itself(jobs: JobService, home: Path, command: str, **extra: object) -> dict:
    """Start a job and wait, without a check of the supervisor, until its
    process has ended by itself."""
    (home / "ann").mkdir(parents=True, exist_ok=True)
    job = jobs.submit("ann", {"command": command, "gpus": 1, **extra})
    asyncio.run(jobs.tick())
    assert jobs.get(job["id"])["state"] == model.RUNNING
    with jobs.sessions() as session:
        row = jobs_repo.get(session, job["id"])
        handle = Handle(row.handle_engine, row.handle_id, row.handle_node)
    for _ in range(1200):
        if not jobs.engines["local"].poll(handle).running:
            return job
        time.sleep(0.05)
    raise AssertionError("the job's process never ended")


def _until_not_running(jobs: JobService, job_id: int) -> dict:
    _until(jobs, lambda: jobs.get(job_id)["state"] != model.RUNNING)
    return jobs.get(job_id)


def test_a_job_that_succeeded_before_its_preemption_was_seen_is_not_run_again(
    jobs: JobService, home: Path
) -> None:
    """The process exited 0, then an admin preempted the lease, before the
    supervisor's next check: the job succeeded (it is not queued again)."""
    job = _exited_by_itself(jobs, home, "echo done > out.txt")
    jobs.broker.preempt_lease(job["lease_id"], "maintenance", actor="admin")
    asyncio.run(jobs.tick())
    done = jobs.get(job["id"])
    assert done["state"] == model.SUCCEEDED and done["restarts"] == 0, done
    assert jobs.broker.get_lease(job["lease_id"])["state"] == "released"


def test_a_job_that_succeeded_before_an_admins_release_was_seen_succeeded(
    jobs: JobService, home: Path
) -> None:
    job = _exited_by_itself(jobs, home, "true")
    jobs.broker.stop_lease(job["lease_id"], "freed by an admin", actor="admin")
    asyncio.run(jobs.tick())
    assert jobs.get(job["id"])["state"] == model.SUCCEEDED
    assert jobs.broker.get_lease(job["lease_id"])["state"] == "released"


def test_a_job_that_succeeded_just_before_its_time_limit_succeeded(
    jobs: JobService, home: Path
) -> None:
    job = _exited_by_itself(jobs, home, "true", time="2s")
    for _ in range(400):  # the lease's time limit passes: a pass opens its stop
        jobs.broker.schedule_now()
        if jobs.get(job["id"])["stopping"]:
            break
        time.sleep(0.05)
    assert jobs.get(job["id"])["stopping"]
    asyncio.run(jobs.tick())
    done = jobs.get(job["id"])
    assert done["state"] == model.SUCCEEDED and done["exit_code"] == 0, done


def test_a_release_worded_like_a_preemption_does_not_requeue_the_job(
    jobs: JobService, home: Path
) -> None:
    """The user's own words in a release (DELETE /leases/{id}) are not the
    broker's cause: her job's lease was taken away, so it fails; it is not
    queued again because the reason starts with 'preempted'."""
    (home / "ann").mkdir(parents=True)
    job = jobs.submit("ann", {"command": ["sleep", "60"], "gpus": 1})
    asyncio.run(jobs.tick())
    jobs.broker.stop_lease(job["lease_id"], "preempted myself, please rerun", actor="ann")
    done = _until_not_running(jobs, job["id"])
    assert done["state"] == model.FAILED and done["restarts"] == 0, done


def test_a_release_worded_like_a_time_limit_is_no_timeout(jobs: JobService, home: Path) -> None:
    (home / "ann").mkdir(parents=True)
    job = jobs.submit("ann", {"command": ["sleep", "60"], "gpus": 1})
    asyncio.run(jobs.tick())
    jobs.broker.stop_lease(job["lease_id"], "time limit for this project is over", actor="admin")
    done = _until_not_running(jobs, job["id"])
    assert done["state"] == model.FAILED, done


def test_a_job_preempted_before_its_launch_is_queued_again(jobs: JobService, home: Path) -> None:
    """docs/jobs.md: a preempted job is queued again on a new lease; also
    one whose lease was preempted after its grant, before it started."""
    (home / "ann").mkdir(parents=True)
    job = jobs.submit("ann", {"command": ["sleep", "60"], "gpus": 1})
    assert jobs.broker.get_lease(job["lease_id"])["state"] == "granted"
    jobs.broker.preempt_lease(job["lease_id"], "node maintenance", actor="admin")
    asyncio.run(jobs.tick())
    view = jobs.get(job["id"])
    assert view["state"] == model.QUEUED and view["restarts"] == 1, view
    assert view["lease_id"] != job["lease_id"]
    assert jobs.broker.get_lease(job["lease_id"])["state"] == "released"


def test_a_link_in_the_notebooks_place_to_a_file_elsewhere_reads_as_gone(
    jobs: JobService, home: Path, tmp_path: Path
) -> None:
    """The check before the launch runs as the broker (root in production):
    a link the user put in the notebook's place after the submit is followed
    only within her directory, so it tells her nothing of files elsewhere."""
    (home / "ann").mkdir(parents=True)
    notebook = home / "ann" / "train.ipynb"
    notebook.write_text(
        '{"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}', encoding="utf-8"
    )
    secret = tmp_path / "elsewhere" / "secret.ipynb"
    secret.parent.mkdir()
    secret.write_text(notebook.read_text(), encoding="utf-8")
    job = jobs.submit("ann", {"notebook": "train.ipynb", "gpus": 1, "python": sys.executable})
    notebook.unlink()
    notebook.symlink_to(secret)
    asyncio.run(jobs.tick())
    done = jobs.get(job["id"])
    assert done["state"] == model.FAILED and "no such notebook" in done["reason"], done
