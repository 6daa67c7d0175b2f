"""Batch jobs on a real broker (SQLite, fake GPUs) and the local engine:
real papermill runs of real notebooks in a real kernel."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import nbformat
import pytest

from gpubroker.core import Broker
from gpubroker.engines.base import Handle
from gpubroker.errors import BadRequest
from gpubroker.jobs.service import JobService
from gpubroker.model import jobs as model
from gpubroker.store import jobs_repo

from ..conftest import make_broker
from ..nbutil import write_notebook as notebook


def run_until_done(jobs: JobService, job_id: int, timeout: float = 120) -> dict:
    async def loop() -> dict:
        for _ in range(int(timeout / 0.2)):
            await jobs.tick()
            view = jobs.get(job_id)
            if view["state"] in model.FINAL:
                return view
            await asyncio.sleep(0.2)
        raise AssertionError(f"job {job_id} still {jobs.get(job_id)['state']}")

    return asyncio.run(loop())


def until_state(jobs: JobService, job_id: int, state: str, timeout: float = 60) -> dict:
    """Tick until the job is in ``state`` (at most ``timeout`` seconds); its view."""

    async def loop() -> dict:
        for _ in range(int(timeout / 0.1)):
            await jobs.tick()
            view = jobs.get(job_id)
            if view["state"] == state:
                return view
            await asyncio.sleep(0.1)
        raise AssertionError(f"job {job_id} still {jobs.get(job_id)['state']}")

    return asyncio.run(loop())


def test_a_notebook_job_runs_on_its_leased_gpu_with_its_parameters(
    jobs: JobService, home: Path
) -> None:
    notebook(
        home / "ann" / "train.ipynb",
        [
            "epochs = 1",
            "import os\nprint('devices', os.environ['CUDA_VISIBLE_DEVICES'])",
            "open('result.txt', 'w').write(str(epochs))",
        ],
    )
    job = jobs.submit(
        "ann", {"notebook": "train.ipynb", "gpus": 1, "time": "10m", "params": ["epochs=2"]}
    )
    assert job["state"] == "queued" and job["spec"]["params"] == {"epochs": 2}
    done = run_until_done(jobs, job["id"])
    assert done["state"] == "succeeded", done
    assert done["exit_code"] == 0 and done["signal"] is None
    assert (home / "ann" / "result.txt").read_text() == "2"
    out = nbformat.read(home / "ann" / f"train.{job['id']}.ipynb", as_version=4)
    injected = [c for c in out.cells if "injected-parameters" in c.metadata.get("tags", [])]
    assert injected and "epochs = 2" in injected[0].source
    printed = "".join(o.get("text", "") for o in out.cells[2].outputs)
    assert printed.startswith("devices GPU-")
    lease = jobs.broker.get_lease(job["id"] and done["lease_id"])
    assert lease["state"] == "released" and lease["holder_kind"] == "job"
    assert lease["priority_class"] == "batch"
    kinds = [e["kind"] for e in jobs.broker.lease_events(done["lease_id"])]
    assert "job-started" in kinds and "job-ended" in kinds


def test_a_notebook_that_raises_in_cell_three_fails_with_its_partial_output(
    jobs: JobService, home: Path
) -> None:
    notebook(home / "bob" / "bad.ipynb", ["x = 1", "y = 2", "raise ValueError('boom')", "z = 3"])
    job = jobs.submit("bob", {"notebook": "bad.ipynb", "gpus": 1})
    done = run_until_done(jobs, job["id"])
    assert done["state"] == "failed" and done["exit_code"] not in (None, 0)
    # the reason says why, as papermill saw it: the cell's error and where
    assert done["reason"] == f'exit code {done["exit_code"]}: ValueError: boom (at "In [3]")'
    out = nbformat.read(home / "bob" / f"bad.{job['id']}.ipynb", as_version=4)
    code = [c for c in out.cells if c.cell_type == "code" and "injected" not in str(c.metadata)]
    assert code[0].execution_count and code[1].execution_count
    assert any(o.get("ename") == "ValueError" for o in code[2].outputs)
    assert code[3].execution_count is None  # never ran
    assert "boom" in jobs.logs(job["id"])["text"]


def test_a_command_job_past_its_time_limit_is_timed_out(jobs: JobService, home: Path) -> None:
    (home / "cy").mkdir(parents=True)
    job = jobs.submit("cy", {"command": "echo started; sleep 60", "gpus": 1, "time": "1s"})
    done = run_until_done(jobs, job["id"])
    assert done["state"] == "timed-out" and done["signal"] is not None
    assert "started" in jobs.logs(job["id"])["text"]
    # an offset past the end, even past any file's largest size: no text
    for offset in (10**6, 10**14, 2**63 - 1):
        assert jobs.logs(job["id"], offset) == {"text": "", "offset": offset, "state": "timed-out"}


def test_cancel_stops_a_running_job_and_frees_its_lease(jobs: JobService, home: Path) -> None:
    (home / "dee").mkdir(parents=True)
    job = jobs.submit("dee", {"command": ["sleep", "60"], "gpus": 1})
    asyncio.run(jobs.tick())
    assert jobs.get(job["id"])["state"] == "running"
    done = asyncio.run(jobs.cancel(job["id"], "not needed", actor="dee"))
    if done["state"] == "running":  # a SIGTERM before its shell ran sleep: the grace
        assert done["stopping"] and done["reason"] == "being cancelled: not needed"
        done = run_until_done(jobs, job["id"])
    assert done["state"] == "cancelled" and done["signal"] is not None
    assert jobs.broker.get_lease(done["lease_id"])["state"] == "released"
    assert asyncio.run(jobs.cancel(job["id"], "again", actor="dee"))["state"] == "cancelled"


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"notebook": "train.ipynb", "gpus": 99}, "gpus"),
        ({"notebook": "train.ipynb", "gpus": 1, "time": "banana"}, "time"),
        ({"notebook": "train.ipynb", "gpus": 1, "params": ["epochs"]}, "param"),
        ({"notebook": "../other/train.ipynb", "gpus": 1}, "notebook"),
        ({"notebook": "/etc/passwd.ipynb", "gpus": 1}, "notebook"),
        ({"notebook": "missing.ipynb", "gpus": 1}, "notebook"),
        ({"notebook": "train.ipynb", "gpus": 1, "kernel": "no-such-kernel"}, "kernel"),
        ({"notebook": "train.ipynb"}, "gpus"),
        ({"command": "true", "gpus": 1, "env": {"CUDA_VISIBLE_DEVICES": "x"}}, "env"),
        ({"command": "true", "gpus": 1, "cwd": "x" * 5000}, "cwd"),
        ({"notebook": "n" * 5000 + ".ipynb", "gpus": 1}, "notebook"),
    ],
)
def test_bad_job_requests_name_the_field_and_queue_nothing(
    jobs: JobService, home: Path, data: dict, field: str
) -> None:
    notebook(home / "eve" / "train.ipynb", ["epochs = 1"])
    with pytest.raises(BadRequest) as err:
        jobs.submit("eve", data)
    assert err.value.message.startswith(f"{field}: "), err.value.message
    assert jobs.list("eve") == [] and jobs.broker.list_leases(user="eve") == []


def test_a_job_queues_with_a_reason_while_gpus_are_held(jobs: JobService, home: Path) -> None:
    (home / "fay").mkdir(parents=True)
    broker: Broker = jobs.broker
    holders = [broker.request_lease(f"h{i}", "", 1, holder_kind="external") for i in range(8)]
    job = jobs.submit("fay", {"command": "true", "gpus": 1})
    assert job["state"] == "queued" and job["queue"]["position"] == 1
    asyncio.run(jobs.tick())
    assert jobs.get(job["id"])["state"] == "queued"
    broker.release_lease(holders[0]["id"], "done")
    assert run_until_done(jobs, job["id"])["state"] == "succeeded"
    assert json.dumps(jobs.list("fay"))  # views are JSON


def test_a_restarted_broker_adopts_a_running_job_and_learns_its_real_outcome(
    db_url: str, jobs: JobService, home: Path
) -> None:
    (home / "gil").mkdir(parents=True)
    job = jobs.submit("gil", {"command": "echo one; sleep 1.5; echo two; exit 3", "gpus": 1})
    asyncio.run(jobs.tick())
    assert jobs.get(job["id"])["state"] == "running"
    # a new broker and job service (a new engine, which never saw the process)
    again = make_broker(db_url)
    service = JobService(again, again.engine, run_as_self=True)
    service.root_dir_template = jobs.root_dir_template
    asyncio.run(service.tick())
    assert service.get(job["id"])["state"] == "running"  # adopted, not run twice
    done = run_until_done(service, job["id"])
    assert done["state"] == "failed" and done["exit_code"] == 3, (done["reason"], done["log"])
    assert service.logs(job["id"])["text"] == "one\ntwo\n"
    assert again.get_lease(done["lease_id"])["state"] == "released"
    with jobs.sessions() as session:  # the first engine reaps the process it started
        row = jobs_repo.get(session, job["id"])
        jobs.engines["local"].poll(Handle(row.handle_engine, row.handle_id, row.handle_node))


def test_a_job_whose_lease_reaches_its_time_limit_first_is_timed_out(
    jobs: JobService, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lease's time limit runs from its grant, the process's from its
    start: when the scheduler ends the lease first, the job is timed-out."""
    import datetime as dt

    import gpubroker.core as core

    (home / "hal").mkdir(parents=True)
    job = jobs.submit("hal", {"command": ["sleep", "60"], "gpus": 1, "time": "30m"})
    asyncio.run(jobs.tick())
    assert jobs.get(job["id"])["state"] == "running"
    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1)
    monkeypatch.setattr(core, "utcnow", lambda: later)
    jobs.broker.schedule_now()  # the pass sees the lease's time limit passed
    # the lease keeps its devices until the job's process has ended
    assert jobs.broker.get_lease(job["lease_id"])["state"] == "granted"
    assert jobs.get(job["id"])["stopping"]
    jobs.stop_grace = 1.0
    done = run_until_done(jobs, job["id"])
    assert done["state"] == "timed-out" and done["signal"] is not None
    assert jobs.broker.get_lease(job["lease_id"])["state"] == "released"


def test_a_command_job_gets_the_warning_signal_before_its_time_limit(
    jobs: JobService, home: Path
) -> None:
    (home / "ida").mkdir(parents=True)
    jobs.warn_before = 2.5
    script = "trap 'echo warned > warned.txt' USR1; while true; do sleep 0.1; done"
    job = jobs.submit("ida", {"command": script, "gpus": 1, "time": "3s"})
    done = run_until_done(jobs, job["id"])
    assert done["state"] == "timed-out"
    assert (home / "ida" / "warned.txt").read_text() == "warned\n"
    kinds = [e["kind"] for e in jobs.broker.lease_events(done["lease_id"])]
    assert "job-warned" in kinds


def test_a_notebook_jobs_kernel_is_interrupted_before_its_time_limit(
    jobs: JobService, home: Path
) -> None:
    """The warning interrupts the running cell (KeyboardInterrupt), which
    saves a checkpoint; the job is then stopped at its limit and timed out,
    its output notebook saved."""
    jobs.warn_before = 6
    notebook(
        home / "ivy" / "train.ipynb",
        [
            "import time",
            "try:\n    while True:\n        time.sleep(0.1)\n"
            "except KeyboardInterrupt:\n    open('warned.txt', 'w').write('interrupted')\n"
            "while True:\n    time.sleep(0.1)",
        ],
    )
    job = jobs.submit("ivy", {"notebook": "train.ipynb", "gpus": 1, "time": "12s"})
    done = run_until_done(jobs, job["id"])
    assert done["state"] == "timed-out"
    assert (home / "ivy" / "warned.txt").read_text() == "interrupted"
    assert "kernel interrupted" in (home / "ivy" / f"train.{job['id']}.log").read_text()
    kinds = [e["kind"] for e in jobs.broker.lease_events(done["lease_id"])]
    assert "job-warned" in kinds


def test_a_notebook_job_interrupted_by_the_warning_says_so_when_it_fails(
    jobs: JobService, home: Path
) -> None:
    """A cell that does not catch the warning's interrupt fails the job;
    its reason said ``KeyboardInterrupt: (at "In [2]")`` (a stray colon,
    and nothing of the warning), and the lease's note spoke of a signal."""
    jobs.warn_before = 6
    notebook(home / "ivy" / "train.ipynb", ["import time", "while True:\n    time.sleep(0.1)"])
    job = jobs.submit("ivy", {"notebook": "train.ipynb", "gpus": 1, "time": "12s"})
    done = run_until_done(jobs, job["id"])
    assert done["state"] == "failed"
    assert done["reason"] == (
        "exit code 1: interrupted on the broker's warning (time limit or preemption near): "
        'KeyboardInterrupt (at "In [2]")'
    )
    notes = [e for e in jobs.broker.lease_events(done["lease_id"]) if e["kind"] == "job-warned"]
    assert [e["reason"] for e in notes] == [
        f"job {job['id']} had its kernel interrupted: its time limit is near"
    ]


def test_a_notebook_runs_in_a_kernel_of_the_python_it_was_submitted_from(
    jobs: JobService, home: Path
) -> None:
    """``python`` (what %gpu_submit sends: the submitting kernel's
    sys.executable) makes the kernel, whatever the notebook's metadata says;
    a kernel named wins; a path that is not an executable here is not used;
    a value that is not an absolute path is a 400."""
    import sys

    env = home / "ann" / "env"
    env.mkdir(parents=True)
    python = env / "python"
    python.write_text(f'#!/bin/sh\necho "$0" > "{env}/used"\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    notebook(home / "ann" / "nb.ipynb", ["print('ran')"])
    job = jobs.submit("ann", {"notebook": "nb.ipynb", "gpus": 1, "python": str(python)})
    assert run_until_done(jobs, job["id"])["state"] == "succeeded"
    assert (env / "used").read_text().strip() == str(python)
    # a path that is not here (a server in a container sent its own): the
    # notebook's kernel runs it, and the job says so
    elsewhere = jobs.submit("ann", {"notebook": "nb.ipynb", "gpus": 1, "python": "/opt/x/python"})
    assert elsewhere["spec"]["python"] == ""
    assert elsewhere["reason"].startswith("python /opt/x/python is not on the broker's host")
    assert run_until_done(jobs, elsewhere["id"])["state"] == "succeeded"
    for bad_value in ("python3", [], 0, False, "/" + "x" * 5000):
        with pytest.raises(BadRequest) as bad:
            jobs.submit("ann", {"notebook": "nb.ipynb", "gpus": 1, "python": bad_value})
        assert bad.value.message.startswith("python: must be an absolute path")
        assert len(bad.value.message) < 300
    assert {j["id"] for j in jobs.list("ann")} == {job["id"], elsewhere["id"]}


def test_a_failed_job_is_retried_with_its_restart_count(jobs: JobService, home: Path) -> None:
    (home / "jay").mkdir(parents=True)
    script = 'echo "$GPUBROKER_RESTART_COUNT" >> runs.txt; exit 1'
    job = jobs.submit("jay", {"command": script, "gpus": 1, "retries": 2})
    done = run_until_done(jobs, job["id"])
    assert done["state"] == "failed" and done["exit_code"] == 1
    assert (home / "jay" / "runs.txt").read_text() == "0\n1\n2\n"
    assert jobs.get(job["id"])["restarts"] == 2
    with pytest.raises(BadRequest) as bad:
        jobs.submit("jay", {"command": "true", "gpus": 1, "retries": 99})
    assert bad.value.message.startswith("retries: ")


def reclaiming_service(db_url: str, home: Path, grace: float) -> tuple[Broker, JobService]:
    """Groups A and B are guaranteed 4 GPUs each, and B's users hold 7 of 8:
    a job of B's borrows above B's guarantee, so a request of A's reclaims
    it (batch's grace period: ``grace`` seconds)."""
    from .test_core import quota_broker

    broker = quota_broker(
        db_url,
        group_quotas={"A": {"guaranteed": 4}, "B": {"guaranteed": 4}},
        priority_classes=[
            {"name": "interactive", "rank": 100},
            {"name": "batch", "rank": 50, "grace": grace},
        ],
    )
    service = JobService(broker, broker.engine, run_as_self=True)
    service.root_dir_template = str(home / "{username}")
    for i in range(7):
        broker.request_lease(f"b{i}", "", 1, holder_kind="external", groups=["B"], group="B")
    return broker, service


def test_a_preempted_job_is_warned_requeued_and_resumes_from_its_checkpoint(
    db_url: str, home: Path
) -> None:
    """A job borrowing above its group's guarantee is reclaimed for a user
    within hers: it gets the warning signal when the grace period starts, is
    queued again, and runs later with GPUBROKER_RESTART_COUNT=1 and the
    checkpoint it wrote."""
    import time

    broker, service = reclaiming_service(db_url, home, grace=0.5)
    (home / "kim").mkdir(parents=True)
    script = (
        'echo "run $GPUBROKER_RESTART_COUNT" >> runs.txt; '
        'if [ -f "$GPUBROKER_CHECKPOINT_DIR/state" ]; then echo resumed >> runs.txt; exit 0; fi; '
        "trap 'echo saved > \"$GPUBROKER_CHECKPOINT_DIR/state\"' USR1; "
        "while true; do sleep 0.1; done"
    )
    job = service.submit("kim", {"command": script, "gpus": 1, "group": "B"}, groups=["B"])
    asyncio.run(service.tick())
    assert service.get(job["id"])["state"] == "running"
    alice = broker.request_lease("alice", "", 1, holder_kind="external", groups=["A"], group="A")
    assert alice["queue"]["reason"] == "Preempting"
    asyncio.run(service.tick())  # the grace period started: the warning
    time.sleep(0.6)
    broker.schedule_now()  # grace over: the job's process is stopped first
    assert broker.get_lease(alice["id"])["state"] == "pending"
    again = until_state(service, job["id"], "queued")  # stopped, queued again
    assert broker.get_lease(alice["id"])["state"] == "granted"
    assert again["state"] == "queued" and again["restarts"] == 1, again["reason"]
    assert again["lease_id"] != job["lease_id"]
    broker.release_lease(alice["id"], "done")
    done = run_until_done(service, job["id"])
    assert done["state"] == "succeeded"
    assert (home / "kim" / "runs.txt").read_text() == "run 0\nrun 1\nresumed\n"


def test_a_preempted_notebook_checkpoints_on_the_interrupt_and_is_requeued(
    db_url: str, home: Path
) -> None:
    """The grace period's warning interrupts the notebook's cell, which saves
    a checkpoint and stops; the job ended in its grace period, so it is
    queued again and resumes from the checkpoint."""
    import time

    broker, service = reclaiming_service(db_url, home, grace=60)
    notebook(
        home / "kim" / "train.ipynb",
        [
            "import os, pathlib, time\n"
            "state = pathlib.Path(os.environ['GPUBROKER_CHECKPOINT_DIR']) / 'state'\n"
            "open('started', 'w').write('yes')",
            "if state.exists():\n    open('runs.txt', 'a').write('resumed\\n')\n"
            "else:\n    try:\n        while True:\n            time.sleep(0.1)\n"
            "    except KeyboardInterrupt:\n        state.write_text('saved')\n"
            "        open('runs.txt', 'a').write('saved\\n')\n        raise",
        ],
    )
    job = service.submit("kim", {"notebook": "train.ipynb", "gpus": 1, "group": "B"}, ["B"])
    asyncio.run(service.tick())
    for _ in range(300):  # the kernel runs the loop
        if (home / "kim" / "started").exists():
            break
        time.sleep(0.1)
    alice = broker.request_lease("alice", "", 1, holder_kind="external", groups=["A"], group="A")
    assert alice["queue"]["reason"] == "Preempting"
    for _ in range(300):  # warned, interrupted, ended in its grace period: queued again
        asyncio.run(service.tick())
        if service.get(job["id"])["state"] == "queued":
            break
        time.sleep(0.2)
    again = service.get(job["id"])
    assert again["state"] == "queued" and again["restarts"] == 1, again["reason"]
    broker.schedule_now()
    assert broker.get_lease(alice["id"])["state"] == "granted"
    broker.release_lease(alice["id"], "done")
    done = run_until_done(service, job["id"])
    assert done["state"] == "succeeded"
    assert (home / "kim" / "runs.txt").read_text() == "saved\nresumed\n"


def test_a_link_in_place_of_a_jobs_log_is_not_followed(jobs: JobService, home: Path) -> None:
    """The log lies in the user's directory; a link there to another file is
    never read with the broker's rights."""
    (home / "lee").mkdir(parents=True)
    secret = home / "secret.txt"
    secret.write_text("the broker's secret")
    job = jobs.submit("lee", {"command": "true", "gpus": 1})
    Path(job["log"]).symlink_to(secret)
    assert jobs.logs(job["id"])["text"] == ""


def test_a_job_lease_no_job_holds_is_released_at_start(jobs: JobService, home: Path) -> None:
    """A broker that stopped between making a job's lease and recording it
    leaves a lease no job holds; the next start releases it."""
    (home / "max").mkdir(parents=True)
    kept = jobs.submit("max", {"command": ["sleep", "60"], "gpus": 1})
    orphan = jobs.broker.request_lease("max", "", 1, holder_kind="job")
    assert jobs.release_orphans() == [orphan["id"]]
    assert jobs.broker.get_lease(orphan["id"])["state"] == "released"
    assert jobs.broker.get_lease(kept["lease_id"])["state"] == "granted"
    asyncio.run(jobs.cancel(kept["id"], "done", actor="max"))


def test_the_warning_file_is_never_made_or_removed_through_a_link(tmp_path: Path) -> None:
    """The broker (maybe root) makes and removes a notebook job's warning
    file in the user's directory: a link anywhere on the way is not followed
    (found by a review)."""
    from gpubroker.jobs.service import _flag, _unlink

    root = tmp_path / "home" / "ann"
    root.mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "x.7.log.warn").write_text("keep")
    (root / "proj").symlink_to(victim)
    with pytest.raises(OSError):
        _flag(root, str(root / "proj" / "y.7.log.warn"))
    assert not (victim / "y.7.log.warn").exists()
    _unlink(root, str(root / "proj" / "x.7.log.warn"))
    assert (victim / "x.7.log.warn").read_text() == "keep"
    with pytest.raises(OSError):
        _flag(root, str(tmp_path / "outside.warn"))
    (root / "real" / "deep").mkdir(parents=True)
    _flag(root, str(root / "real" / "deep" / "z.warn"))
    _flag(root, str(root / "real" / "deep" / "z.warn"))  # already there: fine
    assert (root / "real" / "deep" / "z.warn").exists()
    _unlink(root, str(root / "real" / "deep" / "z.warn"))
    assert not (root / "real" / "deep" / "z.warn").exists()


def test_jobs_never_run_as_root_or_a_system_account(jobs: JobService, home: Path) -> None:
    """A hub user named like root or a system account gets no job (rule 7:
    every runner starts the job as the user's POSIX account); nothing is
    queued, no lease is made. ``min_uid = 0`` lets root through."""
    import pwd

    from gpubroker.errors import Forbidden

    jobs.run_as_self = False
    (home / "root").mkdir(parents=True)
    for user, said in [
        ("root", "user: jobs do not run as 'root' (uid 0): accounts below JobService.min_uid"),
        ("daemon", "user: jobs do not run as 'daemon' (uid 1)"),
        (
            "nobody",
            "user: jobs do not run as 'nobody' (uid 65534): a shared account "
            "(JobService.shared_uids)",
        ),
        ("no-such-account-x", "user: 'no-such-account-x' has no POSIX account"),
    ]:
        with pytest.raises(Forbidden, match=f"^{said}".replace("(", r"\(").replace(")", r"\)")):
            jobs.submit(user, {"command": "id -u", "gpus": 1})
    assert jobs.list(None) == [] and jobs.broker.list_leases() == []
    jobs.min_uid = 0
    job = jobs.submit("root", {"command": "id -u > uid.txt", "gpus": 1})
    done = run_until_done(jobs, job["id"])
    assert done["state"] == "succeeded", done
    assert (home / "root" / "uid.txt").read_text().strip() == str(pwd.getpwnam("root").pw_uid)


def test_jobs_never_run_as_the_brokers_own_account(
    jobs: JobService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A broker run as an ordinary account (here: as if ``nobody``, uid
    65534, were the broker's) would start the job of a hub user named like
    that account as itself, with the broker's database and token. Refused,
    unless ``run_as_self`` (which means exactly that) or ``min_uid = 0``."""
    import os
    import pwd

    from gpubroker.errors import Forbidden

    try:
        nobody = pwd.getpwnam("nobody").pw_uid
    except KeyError:
        pytest.skip("needs the account 'nobody'")
    if nobody < 1000:
        pytest.skip("needs 'nobody' with a uid of at least 1000")
    jobs.run_as_self, jobs.shared_uids = False, []  # nobody is a shared account too
    monkeypatch.setattr(os, "geteuid", lambda: nobody)
    with pytest.raises(Forbidden, match=r"^user: jobs do not run as 'nobody' .*broker's own"):
        jobs.submit("nobody", {"command": "id -u", "gpus": 1})
    assert jobs.list(None) == [] and jobs.broker.list_leases() == []


def test_a_job_queued_before_min_uid_was_raised_does_not_start(
    jobs: JobService, home: Path
) -> None:
    jobs.run_as_self, jobs.min_uid = False, 0
    (home / "root").mkdir(parents=True)
    job = jobs.submit("root", {"command": "touch ran", "gpus": 1})
    jobs.min_uid = 1000
    done = run_until_done(jobs, job["id"])
    assert done["state"] == "failed" and "JobService.min_uid (1000)" in done["reason"], done
    assert not (home / "root" / "ran").exists()
    assert jobs.broker.get_lease(done["lease_id"])["state"] == "released"


def test_a_kernel_is_checked_on_the_host_unless_jobs_run_in_containers(
    jobs: JobService, home: Path
) -> None:
    """The local runner uses the host's kernels, so an unknown one is a 400
    at submit; a container has its image's kernels, which the broker cannot
    list, so the docker runner leaves the check to papermill there."""
    notebook(home / "ann" / "a.ipynb", ["1"])
    kernels_here = r"\(the kernels ann has on the broker's host: .*python3.*\)$"
    with pytest.raises(BadRequest, match=rf'^kernel: no such kernel: "image-only" {kernels_here}'):
        jobs.submit("ann", {"notebook": "a.ipynb", "gpus": 1, "kernel": "image-only"})
    jobs.runner = "docker"
    job = jobs.submit("ann", {"notebook": "a.ipynb", "gpus": 1, "kernel": "image-only"})
    assert job["spec"]["kernel"] == "image-only"


def test_notebook_parameters_keep_their_json_types_in_the_notebook(
    jobs: JobService, home: Path
) -> None:
    """Papermill reads its -y as YAML 1.1, where ``1e-05`` is a string: the
    broker writes the parameters so that each reads back as its own type."""
    notebook(
        home / "ann" / "p.ipynb",
        [
            "lr = 0.1\nbig = 1\nflag = False\nname = ''\nsizes = []",
            "open('types.txt', 'w').write(' '.join(type(v).__name__ + ':' + repr(v) "
            "for v in (lr, big, flag, name, sizes)))",
        ],
    )
    params = ["lr=1e-5", "big=1e20", "flag=true", "name=yes", "sizes=[1, 2.5]"]
    job = jobs.submit("ann", {"notebook": "p.ipynb", "gpus": 1, "params": params})
    done = run_until_done(jobs, job["id"])
    assert done["state"] == "succeeded", done
    assert (home / "ann" / "types.txt").read_text().split() == [
        "float:1e-05",
        "float:1e+20",
        "bool:True",
        "str:'yes'",
        "list:[1,",
        "2.5]",
    ]


def test_a_number_that_is_not_finite_is_refused_and_nan_is_text(
    jobs: JobService, home: Path
) -> None:
    notebook(home / "ann" / "p.ipynb", ["x = 1"])
    for params in (["x=1e999"], {"x": float("inf")}, ["x=[1, -1e400]"]):
        with pytest.raises(BadRequest, match=r"^param: .*a number must be finite"):
            jobs.submit("ann", {"notebook": "p.ipynb", "gpus": 1, "params": params})
    assert jobs.list(None) == [] and jobs.broker.list_leases() == []
    assert model.parse_params(["x=NaN", "y=Infinity"]) == {"x": "NaN", "y": "Infinity"}


def test_a_notebook_jobs_missing_cwd_is_refused_at_submit(jobs: JobService, home: Path) -> None:
    notebook(home / "ann" / "p.ipynb", ["x = 1"])
    with pytest.raises(BadRequest, match=r'^cwd: no such directory: "no/such"$'):
        jobs.submit("ann", {"notebook": "p.ipynb", "gpus": 1, "cwd": "no/such"})
    assert jobs.list(None) == [] and jobs.broker.list_leases() == []


def test_a_log_read_ends_at_a_whole_character(jobs: JobService, home: Path) -> None:
    """Parts of a log read with a limit reassemble into the same text: a
    character the limit cuts comes whole with the next read."""
    text = "é€😀x" * 50
    (home / "ann").mkdir(parents=True)
    job = jobs.submit("ann", {"command": f"printf '%s' '{text}'", "gpus": 1})
    done = run_until_done(jobs, job["id"])
    assert done["state"] == "succeeded", done
    got, offset = "", 0
    for _ in range(1000):
        part = jobs.logs(job["id"], offset, limit=7)
        if not part["text"]:
            break
        got, offset = got + part["text"], part["offset"]
    assert got == text and "\ufffd" not in got


def test_a_share_jobs_own_pythonpath_follows_the_caps_hook(db_url: str, tmp_path: Path) -> None:
    from gpubroker.enforce.caps import STARTUP_DIR

    from .test_sharing_core import sharing_broker

    broker = sharing_broker(db_url, tmp_path)
    service = JobService(broker, broker.engine, run_as_self=True, poll_interval=0.2)
    service.root_dir_template = str(tmp_path / "home" / "{username}")
    (tmp_path / "home" / "ann").mkdir(parents=True)
    job = service.submit(
        "ann",
        {
            "command": 'echo "$PYTHONPATH" > pp.txt',
            "memory_gib": 10,
            "pool": "shared",
            "env": {"PYTHONPATH": "/home/ann/lib"},
        },
    )
    done = run_until_done(service, job["id"])
    assert done["state"] == "succeeded", done
    seen = (tmp_path / "home" / "ann" / "pp.txt").read_text().strip()
    assert seen == f"{STARTUP_DIR}:/home/ann/lib"


def test_a_cancel_during_a_preemptions_stop_leaves_no_lease(jobs: JobService, home: Path) -> None:
    """The supervisor stops a preempted job (its grace) and requeues it on a
    new lease; a cancel meanwhile waits for that step, then ends the job
    and releases the lease the requeue made."""
    jobs.stop_grace = 2.0
    (home / "kim").mkdir(parents=True)
    job = jobs.submit("kim", {"command": "trap '' TERM; sleep 600", "gpus": 1})

    async def main() -> None:
        await jobs.tick()
        view = jobs.get(job["id"])
        assert view["state"] == "running"
        jobs.broker.preempt_lease(view["lease_id"], "maintenance")
        tick = asyncio.create_task(jobs.tick())
        for _ in range(200):  # until the tick has begun the stop
            await asyncio.sleep(0.05)
            if jobs.get(job["id"])["stopping"]:
                break
        assert jobs.get(job["id"])["stopping"]
        cancelled = await jobs.cancel(job["id"], "cancelled by kim", actor="kim")
        assert cancelled["state"] == "cancelled"
        await tick

    asyncio.run(main())
    active = [x for x in jobs.broker.list_leases() if x["state"] in ("granted", "pending")]
    assert active == []


def test_a_cancel_during_a_launch_stops_the_launched_process(jobs: JobService, home: Path) -> None:
    import subprocess
    import time

    (home / "kim").mkdir(parents=True)
    engine = jobs.engines["local"]
    launch = engine.launch
    entered = threading.Event()

    def slow_launch(spec: Any) -> Any:  # as docker create or sbatch can take
        entered.set()
        time.sleep(1.0)
        return launch(spec)

    engine.launch = slow_launch
    job = jobs.submit("kim", {"command": "echo $$ > pid.txt; exec sleep 600", "gpus": 1})

    async def main() -> None:
        tick = asyncio.create_task(jobs.tick())
        assert await asyncio.to_thread(entered.wait, 30)  # the launch is under way
        cancelled = await jobs.cancel(job["id"], "cancelled by kim", actor="kim")
        assert cancelled["state"] == "cancelled"
        await tick

    asyncio.run(main())
    assert jobs.broker.get_lease(jobs.get(job["id"])["lease_id"])["state"] == "released"
    pid = (home / "kim" / "pid.txt").read_text().strip()
    alive = subprocess.run(["ps", "-o", "stat=", "-p", pid], capture_output=True, text=True)
    assert alive.stdout.strip() in ("", "Z"), alive.stdout


def test_a_preemption_does_not_use_up_a_retry(jobs: JobService, home: Path) -> None:
    """``retries`` limits the requeues after failures, ``max_restarts`` those
    after preemptions: a job with one retry, preempted once, still gets its
    retry when the next run fails."""
    jobs.stop_grace = 1.0
    (home / "kim").mkdir(parents=True)
    script = (
        'echo "run $GPUBROKER_RESTART_COUNT" >> runs.txt; '
        'if [ "$GPUBROKER_RESTART_COUNT" = 0 ]; then sleep 60; else exit 1; fi'
    )
    job = jobs.submit("kim", {"command": script, "gpus": 1, "retries": 1})

    async def main() -> None:
        await jobs.tick()
        assert jobs.get(job["id"])["state"] == "running"
        jobs.broker.preempt_lease(jobs.get(job["id"])["lease_id"], "maintenance")

    asyncio.run(main())
    done = run_until_done(jobs, job["id"])
    assert (done["state"], done["restarts"]) == ("failed", 2), done
    runs = (home / "kim" / "runs.txt").read_text().split()
    assert runs == ["run", "0", "run", "1", "run", "2"]
