"""Batch jobs review fixes: a launch is idempotent across a broker crash
(launch intents, found again by the engine's tag); a job's python, kernel
and notebook are checked at submit with its user's rights and kernels; a
notebook whose metadata lacks its kernel or language gets a clear 400, or
the kernel and language the request gives."""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import nbformat
import pytest

from gpubroker.engines.base import Handle, LaunchSpec
from gpubroker.engines.local import LocalEngine, _pid_alive
from gpubroker.errors import BadRequest
from gpubroker.jobs.service import JobService
from gpubroker.store import jobs_repo

from ..conftest import make_broker
from ..nbutil import write_notebook as notebook
from .test_jobs import run_until_done


def restarted(db_url: str, jobs: JobService) -> JobService:
    """A new broker and job service on the same database: a new engine,
    which never saw the processes the first one started."""
    again = make_broker(db_url)
    service = JobService(again, again.engine, run_as_self=True, poll_interval=0.2)
    service.root_dir_template = jobs.root_dir_template
    return service


class Crash(BaseException):
    """The broker stops here (a BaseException, as a process's death is no
    error the job supervisor handles: it logs and goes on after those)."""


def crash_after_launch(jobs: JobService, monkeypatch: pytest.MonkeyPatch) -> None:
    """The broker stops after the engine launched, before the launch is recorded."""

    def started(job_id: int, handle: Handle) -> None:
        raise Crash(f"the broker stops before recording job {job_id}'s {handle}")

    monkeypatch.setattr(jobs, "_started", started)


def crashed_launch(jobs: JobService, monkeypatch: pytest.MonkeyPatch) -> int:
    """One tick that launches the queued job and crashes before recording
    it (:func:`crash_after_launch`); the pid the first engine started."""
    crash_after_launch(jobs, monkeypatch)
    with pytest.raises(Crash):
        asyncio.run(jobs.tick())
    engine = jobs.engines["local"]
    with engine._lock:
        (pid,) = engine._procs
    return int(pid)


def reap(jobs: JobService) -> None:
    """The first engine waits for the processes it started (they have ended)."""
    engine = jobs.engines["local"]
    with engine._lock:
        procs = list(engine._procs.values())
    for proc in procs:
        proc.popen.wait(timeout=30)


def row(jobs: JobService, job_id: int) -> tuple[str, str, str]:
    with jobs.sessions() as session:
        job = jobs_repo.get(session, job_id)
        assert job is not None
        return job.state, job.handle_engine, job.handle_id


# --- 1. a launch is idempotent across a crash -------------------------------------


def test_a_crash_between_launch_and_its_record_adopts_the_process_not_a_second_one(
    db_url: str, jobs: JobService, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (home / "ann").mkdir(parents=True)
    job = jobs.submit("ann", {"command": "echo run >> runs.txt; sleep 2; exit 3", "gpus": 1})
    crash_after_launch(jobs, monkeypatch)
    with pytest.raises(Crash):
        asyncio.run(jobs.tick())
    state, engine, handle_id = row(jobs, job["id"])
    assert (state, engine) == ("queued", "local") and handle_id.startswith("launch:")
    service = restarted(db_url, jobs)
    asyncio.run(service.tick())
    assert service.get(job["id"])["state"] == "running"  # adopted
    done = run_until_done(service, job["id"])
    assert (home / "ann" / "runs.txt").read_text() == "run\n"  # ran once
    assert done["state"] == "failed" and done["exit_code"] == 3, done["reason"]
    assert service.broker.get_lease(done["lease_id"])["state"] == "released"
    kinds = [e["kind"] for e in service.broker.lease_events(done["lease_id"])]
    assert kinds.count("job-started") == 1
    reap(jobs)


def test_a_crash_after_the_intent_before_the_launch_starts_the_job_once(
    db_url: str, jobs: JobService, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (home / "bob").mkdir(parents=True)
    job = jobs.submit("bob", {"command": "echo run >> runs.txt", "gpus": 1})

    def launch(spec: LaunchSpec) -> Handle:
        raise Crash("the broker stops before the engine launches")

    monkeypatch.setattr(jobs.engines["local"], "launch", launch)
    with pytest.raises(Crash):
        asyncio.run(jobs.tick())
    assert row(jobs, job["id"])[2].startswith("launch:")
    service = restarted(db_url, jobs)
    done = run_until_done(service, job["id"])
    assert done["state"] == "succeeded", done["reason"]
    assert (home / "bob" / "runs.txt").read_text() == "run\n"


def test_a_launch_that_ended_while_the_broker_was_down_is_not_run_again(
    db_url: str, jobs: JobService, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (home / "cy").mkdir(parents=True)
    job = jobs.submit("cy", {"command": "echo run >> runs.txt; exit 4", "gpus": 1})
    pid = crashed_launch(jobs, monkeypatch)
    engine = jobs.engines["local"]
    engine._procs[pid].popen.wait(timeout=30)  # it ends (and is reaped) meanwhile
    service = restarted(db_url, jobs)
    done = run_until_done(service, job["id"])
    assert (home / "cy" / "runs.txt").read_text() == "run\n"
    assert done["state"] == "failed" and done["exit_code"] == 4, done["reason"]
    assert service.broker.get_lease(done["lease_id"])["state"] == "released"


def test_an_exit_record_is_read_only_from_a_file_of_the_jobs_account(tmp_path: Path) -> None:
    """The exit file lies in the user's directory: a link to a directory on
    the way led the broker (root) to any file, whose first bytes, if a
    number, became her job's exit code. Only a file of the account the job
    ran as is read now (its shell made it)."""
    from gpubroker.jobs.service import _exit_record

    record = tmp_path / "job.log.exit"
    record.write_text("7\n")
    me = os.geteuid()
    assert _exit_record(str(record), me) == "7"
    assert _exit_record(str(record), me + 1) is None  # not the job's account's file
    assert _exit_record(str(record), None) is None  # no account: nothing read
    (tmp_path / "link").symlink_to(record)
    assert _exit_record(str(tmp_path / "link"), me) is None  # a link at the end


@pytest.mark.parametrize("how", ["lease-ended", "cancel"])
def test_an_orphan_whose_job_or_lease_ended_meanwhile_is_stopped(
    db_url: str, jobs: JobService, home: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    (home / "dee").mkdir(parents=True)
    job = jobs.submit("dee", {"command": "echo run >> runs.txt; exec sleep 60", "gpus": 1})
    pid = crashed_launch(jobs, monkeypatch)
    engine = jobs.engines["local"]
    service = restarted(db_url, jobs)
    service.stop_grace = 2.0
    if how == "cancel":
        done = asyncio.run(service.cancel(job["id"], "not needed", actor="dee"))
    else:
        service.broker.release_lease(job["lease_id"], "an admin freed it", actor="admin")
        asyncio.run(service.tick())
        done = service.get(job["id"])
    assert done["state"] == "cancelled", done
    engine._procs[pid].popen.wait(timeout=10)  # the orphan was stopped
    assert not _pid_alive(pid)
    assert service.broker.get_lease(done["lease_id"])["state"] == "released"
    assert (home / "dee" / "runs.txt").read_text() == "run\n"


def test_the_local_engine_finds_a_tagged_launch_from_a_new_engine(
    jobs: JobService, tmp_path: Path
) -> None:
    first: LocalEngine = jobs.engines["local"]
    me = pwd.getpwuid(os.geteuid()).pw_name
    spec = LaunchSpec(
        argv=("sleep", "30"), env={}, cwd=str(tmp_path), user=me, lease_id=1, tag="t-1.a"
    )
    handle = first.launch(spec)
    try:
        second = LocalEngine(first.backend)
        assert second.find("t-1.a", me) == handle
        assert first.find("t-1.a", me) == handle  # one it remembers
        assert second.find("t-1.b", me) is None
        if os.geteuid() == 0:  # another user's processes are never it
            assert second.find("t-1.a", "nobody") is None
        second.stop(handle, 1.0)
        first.poll(handle)  # reaped
        assert second.find("t-1.a", me) is None  # ended, and not the second's
    finally:
        first.stop(handle, 0.5)
    with pytest.raises(ValueError, match="tag"):
        LaunchSpec(argv=("true",), env={}, cwd="/", user=me, lease_id=1, tag="-bad tag")


# --- 2. python is checked with the user's rights ----------------------------------


@pytest.fixture
def nobody_home() -> Iterator[Path]:
    """A directory others may enter, with nobody's root directory in it."""
    if os.geteuid() != 0:
        pytest.skip("needs root to check as another user")
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user 'nobody'")
    if not os.access("/usr/bin/python3", os.X_OK):
        pytest.skip("no /usr/bin/python3 that nobody may run")
    top = Path(tempfile.mkdtemp(prefix="gpubroker-jobs-"))
    os.chmod(top, 0o755)
    mine = top / "nobody"
    mine.mkdir()
    os.chown(mine, nobody.pw_uid, nobody.pw_gid)
    try:
        yield top
    finally:
        shutil.rmtree(top, ignore_errors=True)


def as_nobody(jobs: JobService, top: Path) -> JobService:
    # nobody (65534) is the one unprivileged account every host has; a real
    # deployment refuses it (shared_uids), the test lets it through
    service = JobService(jobs.broker, jobs.broker.engine, run_as_self=False, shared_uids=[])
    service.root_dir_template = str(top / "{username}")
    service.python = "/usr/bin/python3"  # one nobody may run (the venv's is under /root)
    return service


def test_a_jobs_python_is_checked_with_its_users_rights_not_the_brokers(
    jobs: JobService, nobody_home: Path
) -> None:
    service = as_nobody(jobs, nobody_home)
    nb = notebook(nobody_home / "nobody" / "nb.ipynb", ["x = 1"])
    nobody = pwd.getpwnam("nobody")
    os.chown(nb, nobody.pw_uid, nobody.pw_gid)
    hidden = nobody_home / "root-only"  # root may enter, nobody may not
    hidden.mkdir(mode=0o700)
    (hidden / "python").write_text("#!/bin/sh\n")
    (hidden / "python").chmod(0o755)
    owners = nobody_home / "owner-x"  # executable by its owner (root) only
    owners.write_text("#!/bin/sh\n")
    owners.chmod(0o744)
    for python in (hidden / "python", owners):
        assert os.access(python, os.X_OK)  # the broker (root) would accept it
        job = service.submit("nobody", {"notebook": "nb.ipynb", "gpus": 1, "python": str(python)})
        assert job["spec"]["python"] == "", python
        assert job["reason"].startswith(
            f"python {python} is not on the broker's host as a program nobody may run"
        ), job["reason"]
    usable = service.submit(
        "nobody", {"notebook": "nb.ipynb", "gpus": 1, "python": "/usr/bin/python3"}
    )
    assert usable["spec"]["python"] == "/usr/bin/python3" and usable["reason"] == ""


def test_a_notebook_its_user_cannot_read_is_refused_at_submit(
    jobs: JobService, nobody_home: Path
) -> None:
    service = as_nobody(jobs, nobody_home)
    notebook(nobody_home / "nobody" / "secret.ipynb", ["x = 1"]).chmod(0o600)  # root's
    with pytest.raises(BadRequest, match=r"^notebook: cannot read it as a notebook: Permission"):
        service.submit("nobody", {"notebook": "secret.ipynb", "gpus": 1})
    assert service.list("nobody") == [] and service.broker.list_leases(user="nobody") == []


# --- 3. kernels are the user's -----------------------------------------------------


def kernelspec(where: Path, name: str, language: str = "python") -> None:
    spec = where / "kernels" / name
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    kernel = {"argv": argv, "display_name": name, "language": language}
    (spec / "kernel.json").write_text(json.dumps(kernel))


def test_kernels_are_the_users_not_the_brokers(
    jobs: JobService, home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    notebook(home / "ann" / "nb.ipynb", ["x = 1", "open('x.txt', 'w').write(str(x))"])
    kernelspec(home / "ann" / ".local" / "share" / "jupyter", "ann-env")
    kernelspec(tmp_path / "broker-jupyter", "broker-only")
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "broker-jupyter"))  # the broker's own
    with pytest.raises(BadRequest) as err:
        jobs.submit("ann", {"notebook": "nb.ipynb", "gpus": 1, "kernel": "broker-only"})
    message = err.value.message
    assert message.startswith('kernel: no such kernel: "broker-only" (the kernels ann has')
    assert "ann-env" in message and "python3" in message and "broker-only (" not in message
    assert jobs.list("ann") == []
    job = jobs.submit(
        "ann", {"notebook": "nb.ipynb", "gpus": 1, "kernel": "ann-env", "params": ["x=5"]}
    )
    done = run_until_done(jobs, job["id"])
    assert done["state"] == "succeeded", jobs.logs(job["id"])["text"][-2000:]
    assert (home / "ann" / "x.txt").read_text() == "5"


def test_a_kernel_of_the_users_own_jupyter_path_counts(jobs: JobService, home: Path) -> None:
    notebook(home / "bo" / "nb.ipynb", ["x = 1"])
    kernelspec(home / "bo" / "kernels-here", "bo-env")
    env = {"JUPYTER_PATH": str(home / "bo" / "kernels-here")}
    job = jobs.submit("bo", {"notebook": "nb.ipynb", "gpus": 1, "kernel": "bo-env", "env": env})
    assert job["spec"]["kernel"] == "bo-env"


# --- 4. a notebook without its kernel or language ------------------------------------


def bare_notebook(path: Path, cells: list[str]) -> Path:
    """A notebook whose metadata says neither kernel nor language."""
    notebook(path, cells)
    nb = nbformat.read(path, as_version=4)
    nb.metadata = {}
    nbformat.write(nb, path)
    return path


def test_a_notebook_without_a_kernel_is_a_400_naming_the_field(
    jobs: JobService, home: Path
) -> None:
    bare_notebook(home / "eve" / "nb.ipynb", ["x = 1"])
    with pytest.raises(BadRequest, match=r"^notebook: its metadata has no kernelspec\.name"):
        jobs.submit("eve", {"notebook": "nb.ipynb", "gpus": 1})
    (home / "eve" / "junk.ipynb").write_text("not json")
    with pytest.raises(BadRequest, match=r"^notebook: cannot read it as a notebook"):
        jobs.submit("eve", {"notebook": "junk.ipynb", "gpus": 1})
    assert jobs.list("eve") == [] and jobs.broker.list_leases(user="eve") == []


def test_a_notebook_without_a_language_runs_with_the_named_kernels(
    jobs: JobService, home: Path
) -> None:
    bare_notebook(home / "fay" / "nb.ipynb", ["x = 1", "open('x.txt', 'w').write(repr(x))"])
    job = jobs.submit(
        "fay", {"notebook": "nb.ipynb", "gpus": 1, "kernel": "python3", "params": ["x=7"]}
    )
    assert job["spec"]["language"] == "python"
    done = run_until_done(jobs, job["id"])
    assert done["state"] == "succeeded", jobs.logs(job["id"])["text"][-2000:]
    assert (home / "fay" / "x.txt").read_text() == "7"


def test_a_notebook_without_a_language_runs_in_the_submitting_python(
    jobs: JobService, home: Path
) -> None:
    bare_notebook(home / "gil" / "nb.ipynb", ["x = 1", "open('x.txt', 'w').write(repr(x))"])
    job = jobs.submit(
        "gil", {"notebook": "nb.ipynb", "gpus": 1, "python": sys.executable, "params": ["x=8"]}
    )
    done = run_until_done(jobs, job["id"])
    assert done["state"] == "succeeded", jobs.logs(job["id"])["text"][-2000:]
    assert (home / "gil" / "x.txt").read_text() == "8"


def test_a_notebook_whose_language_nothing_says_is_a_400_when_it_has_params(
    jobs: JobService, home: Path
) -> None:
    jobs.runner = "docker"  # the image's kernels: not known here
    bare_notebook(home / "hal" / "nb.ipynb", ["x = 1"])
    data = {"notebook": "nb.ipynb", "gpus": 1, "kernel": "python3"}
    with pytest.raises(BadRequest, match=r"^notebook: its metadata has no language_info\.name"):
        jobs.submit("hal", {**data, "params": ["x=2"]})
    assert jobs.submit("hal", data)["state"] == "queued"  # nothing to inject: fine


def test_the_check_as_the_user_queues_a_good_notebook(jobs: JobService, home: Path) -> None:
    notebook(home / "ivy" / "nb.ipynb", ["x = 1"])
    job = jobs.submit("ivy", {"notebook": "nb.ipynb", "gpus": 1})
    assert job["state"] == "queued" and job["spec"]["notebook"] == "nb.ipynb"


def test_a_job_keeps_its_lease_until_the_processes_it_left_have_ended(
    jobs: JobService, home: Path
) -> None:
    """A command that left ``sleep 300 &`` behind ended ``succeeded`` and
    its lease was released while the sleep ran on, on its GPU (a review of
    the jobs): the job's end now ends what it left first."""
    from .conftest import process_alive

    (home / "ann").mkdir(parents=True)
    job = jobs.submit("ann", {"command": "sleep 300 & echo $! > bg.pid; exit 0", "gpus": 1})
    done = run_until_done(jobs, job["id"])
    pid = int((home / "ann" / "bg.pid").read_text())
    try:
        assert done["state"] == "succeeded" and done["exit_code"] == 0
        assert jobs.broker.get_lease(done["lease_id"])["state"] == "released"
        assert not process_alive(pid)
    finally:
        if process_alive(pid):
            os.kill(pid, 9)


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"command": "true", "env": {"X": "a\x00b"}}, "env: a value must not contain a NUL"),
        ({"command": ["true", "a\x00b"]}, "command: must not contain a NUL"),
        ({"notebook": "nb.ipynb", "params": ["a=" + "[" * 320 + "]" * 320]}, "param: "),
        ({"notebook": "nb.ipynb", "params": ["a=" + "[" * 9000 + "]" * 9000]}, "param: "),
        ({"notebook": "nb.ipynb", "params": ["a=" + "[" * 33 + "]" * 33]}, "param: "),
    ],
)
def test_a_job_that_could_never_launch_is_refused_at_submit(
    jobs: JobService, home: Path, body: dict, words: str
) -> None:
    """A NUL in the environment or the command, or a parameter nested
    hundreds deep, was accepted (201); the job then took its GPUs and
    failed at launch, or (the parameter) never launched and held them."""
    from gpubroker.errors import BadRequest

    notebook(home / "ann" / "nb.ipynb", ["x = 1"])
    with pytest.raises(BadRequest) as err:
        jobs.submit("ann", {"gpus": 1, **body})
    assert err.value.message.startswith(words), err.value.message
    if words == "param: ":
        assert "may nest at most 32 lists or maps" in err.value.message
    assert jobs.list(None) == [] and jobs.broker.list_leases() == []


def test_max_uid_is_off_by_default_and_refuses_above_it(
    jobs: JobService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Directory-service accounts have uids far above login.defs' UID_MAX
    (SSSD's start at 200000): no upper limit by default; where one is set,
    the uids above it are refused, and the shared accounts always are."""
    from gpubroker.errors import Forbidden
    from gpubroker.jobs import service

    uids = {"ldap-ann": 200001, "nobody": 65534}
    monkeypatch.setattr(service, "_uid_of", uids.get)
    jobs.run_as_self = False
    assert jobs.max_uid == 0
    jobs._check_account("ldap-ann")  # no upper limit
    with pytest.raises(Forbidden, match=r"a shared account \(JobService.shared_uids\)"):
        jobs._check_account("nobody")
    jobs.max_uid = 200000
    with pytest.raises(Forbidden, match=r"accounts above JobService\.max_uid \(200000\)"):
        jobs._check_account("ldap-ann")
