"""A failed job's reason says why it failed: the line its run wrote to its
error file (``$GPUBROKER_JOB_ERROR_FILE``), read as the broker reads the
user's files (no link followed, only the user's own file)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpubroker.jobs.service import ERROR_WIDTH, JobService, _error_record

from ..nbutil import write_notebook as notebook
from .test_jobs import run_until_done


def test_a_notebook_that_cannot_be_read_fails_saying_so(jobs: JobService, home: Path) -> None:
    notebook(home / "ann" / "nb.ipynb", ["x = 1"])
    job = jobs.submit("ann", {"notebook": "nb.ipynb", "gpus": 1})
    # overwritten before the launch with what is not a notebook (a save
    # gone wrong): papermill cannot read it
    (home / "ann" / "nb.ipynb").write_text("{ not json")
    done = run_until_done(jobs, job["id"])
    assert done["state"] == "failed", done
    assert done["reason"].startswith("exit code 1: NotJSONError: "), done["reason"]


def test_a_command_may_say_why_it_failed_and_a_retry_does_not_repeat_an_old_reason(
    jobs: JobService, home: Path
) -> None:
    (home / "cy").mkdir(parents=True)
    said = 'echo "disk full" > "$GPUBROKER_JOB_ERROR_FILE"; exit 3'
    job = jobs.submit("cy", {"command": ["sh", "-c", said], "gpus": 1})
    done = run_until_done(jobs, job["id"])
    assert done["reason"] == "exit code 3: disk full", done["reason"]
    # the first run says why and fails, the retry fails without a word
    script = f"if [ ! -e once ]; then touch once; {said}; fi; exit 4"
    job = jobs.submit("cy", {"command": ["sh", "-c", script], "gpus": 1, "retries": 1})
    done = run_until_done(jobs, job["id"])
    assert done["state"] == "failed" and done["exit_code"] == 4, done
    assert done["restarts"] == 1 and done["reason"] == "exit code 4", done["reason"]


def test_the_error_line_is_one_printable_line_of_bounded_length(tmp_path: Path) -> None:
    path = tmp_path / "job.log.error"
    path.write_text("KeyError: 'x'\x1b[31m\tmore\nsecond line\n")
    assert _error_record(str(path), os.getuid()) == "KeyError: 'x'\\x1b[31m\\tmore"
    path.write_text("E" * 5000)
    line = _error_record(str(path), os.getuid())
    assert len(line) == ERROR_WIDTH and line.endswith("...")
    path.write_bytes(b"bad \xff byte")
    assert _error_record(str(path), os.getuid()) == "bad \ufffd byte"


def test_an_error_file_that_is_a_link_or_another_owners_is_not_read(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("root's secret\n")
    link = tmp_path / "job.log.error"
    link.symlink_to(secret)
    assert _error_record(str(link), os.getuid()) == ""  # a link is not followed
    assert _error_record(str(secret), os.getuid() + 1) == ""  # not the job user's
    assert _error_record(str(secret), None) == ""  # no such account
    assert _error_record(str(tmp_path / "none"), os.getuid()) == ""


def test_an_error_file_on_a_hung_file_system_holds_up_the_round_once(
    jobs: JobService, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the supervisor's round waits for the read: at most ERROR_READ_TIMEOUT,
    # and not again while that read still hangs (a hung NFS home)
    import threading

    from gpubroker.jobs import service

    hang = threading.Event()
    reads: list[str] = []

    def hung(path: str, owner: int | None) -> str:
        reads.append(path)
        hang.wait(30)
        return "never seen"

    monkeypatch.setattr(service, "_error_record", hung)
    monkeypatch.setattr(service, "ERROR_READ_TIMEOUT", 0.2)
    (home / "fay").mkdir(parents=True)
    try:
        first = jobs.submit("fay", {"command": ["sh", "-c", "exit 3"], "gpus": 1})
        second = jobs.submit("fay", {"command": ["sh", "-c", "exit 4"], "gpus": 1})
        assert run_until_done(jobs, first["id"])["reason"] == "exit code 3"
        assert run_until_done(jobs, second["id"])["reason"] == "exit code 4"
        assert len(reads) == 1  # the second was not tried while the first hung
    finally:
        hang.set()
