"""Second review of the Slurm parts, on canned Slurm answers
(``SlurmEngine._run``): a submit Slurm queued although ``sbatch`` failed,
a submit whose outcome cannot be told, output paths Slurm would not keep,
jobs that have not started or never will, and server jobs named by their
lease."""

from __future__ import annotations

import os
import pwd
from collections.abc import Sequence
from typing import Any

import pytest

from gpubroker.engines import EngineError, Handle, LaunchSpec, LaunchUnknown
from gpubroker.engines import slurm_json as sj
from gpubroker.engines.slurm import SlurmEngine

from .test_slurm_review import Canned, _engine

ME = pwd.getpwuid(os.getuid()).pw_name
SOCKET = (
    "sbatch failed (exit 1): Batch job submission failed: Socket timed out on send/recv operation"
)


def _spec(**more: Any) -> LaunchSpec:
    fields: dict[str, Any] = dict(
        argv=("true",), env={}, cwd="/tmp", user=ME, lease_id=5, tag="job5-0-ab"
    )
    return LaunchSpec(**(fields | more))


def _failing_sbatch(
    monkeypatch: pytest.MonkeyPatch,
    engine: SlurmEngine,
    canned: Canned,
    queued: bool,
    squeue_down: bool = False,
) -> None:
    """``sbatch`` exits 1 ("Socket timed out": slurmctld's answer was
    lost); with ``queued`` the job was queued all the same; with
    ``squeue_down`` Slurm cannot be asked either."""

    def run(argv: Sequence[str], stdin: str | None = None, env: Any = None) -> str:
        canned.calls.append(list(argv))
        if argv[0] == "sbatch":
            if queued:
                comment = next(a for a in argv if a.startswith("--comment="))
                job = {"job_id": 88, "name": "gpubroker-lease-5", "job_state": "PENDING"}
                job |= {"user_name": ME, "nodes": "", "comment": comment.partition("=")[2]}
                canned.jobs.append(job)
            raise EngineError(SOCKET)
        if argv[0] == "squeue" and squeue_down:
            raise EngineError("squeue failed (exit 1): Unable to contact slurm controller")
        canned.calls.pop()
        return canned(argv, stdin, env)

    monkeypatch.setattr(engine, "_run", run)


def test_a_submit_slurm_queued_although_sbatch_failed_is_that_job(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # nextflow-io/nextflow#970: sbatch exits 1 with "Socket timed out" and
    # the job runs; taking the launch for failed released its lease while
    # the job ran on its GPUs
    canned = Canned([])
    engine = _engine(monkeypatch, canned)
    _failing_sbatch(monkeypatch, engine, canned, queued=True)
    assert engine.launch(_spec()).id == "88"


def test_a_submit_that_really_failed_is_its_error_and_an_unknown_one_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    canned = Canned([])
    engine = _engine(monkeypatch, canned)
    _failing_sbatch(monkeypatch, engine, canned, queued=False)
    with pytest.raises(EngineError, match="Socket timed out") as failed:
        engine.launch(_spec())
    assert not isinstance(failed.value, LaunchUnknown)
    _failing_sbatch(monkeypatch, engine, canned, queued=True, squeue_down=True)
    with pytest.raises(LaunchUnknown, match="whether Slurm queued the job of launch job5-0-ab"):
        engine.launch(_spec())
    # without a tag nothing can be looked for: the error as it was
    with pytest.raises(EngineError, match="Socket timed out") as untagged:
        engine.launch(_spec(tag=""))
    assert not isinstance(untagged.value, LaunchUnknown)


def test_an_output_path_with_a_backslash_is_refused_before_sbatch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Slurm reads a backslash in --output as "no patterns" and drops it:
    # the log went to another path (or nowhere, "signal 53")
    canned = Canned([])
    engine = _engine(monkeypatch, canned)
    with pytest.raises(EngineError, match=r"output path '/tmp/run\\\\1/job.log' has a backslash"):
        engine.launch(_spec(stdout="/tmp/run\\1/job.log", stderr="/tmp/run\\1/job.log"))
    assert not [c for c in canned.calls if c[0] == "sbatch"]


def test_a_pending_job_is_waiting_and_a_hopeless_one_never_starts() -> None:
    pending = sj.job_status({"job_state": "PENDING", "state_reason": "Resources"})
    assert pending.running and pending.waiting == "PENDING (Resources)"
    assert not pending.never_starts
    hopeless = sj.job_status({"job_state": "PENDING", "state_reason": "PartitionTimeLimit"})
    assert hopeless.running and hopeless.never_starts
    assert hopeless.waiting == "PENDING (PartitionTimeLimit)"
    # an admin's hold (maintenance) is waited through by batch jobs
    held = sj.job_status({"job_state": "PENDING", "state_reason": "JobHeldAdmin"})
    assert held.waiting == "PENDING (JobHeldAdmin)" and not held.never_starts
    running = sj.job_status({"job_state": "RUNNING", "state_reason": "None"})
    assert running.running and running.waiting == "" and not running.never_starts
    # the view a spawner reads keeps them, with the bound GPUs of a running job
    view = sj.job_view({"job_id": 3, "job_state": "PENDING", "state_reason": "Priority"}, "c")
    assert view.status.waiting == "PENDING (Priority)"


def test_a_server_job_is_the_one_named_by_its_lease_not_another_of_that_id(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # after a reset slurmctld reuses job ids: job 60 is now someone else's
    # server job (another lease's name); it is not lease 6's
    job = {
        "job_id": 60,
        "name": "gpubroker-lease-9",
        "job_state": "RUNNING",
        "user_name": "bob",
        "nodes": "n1",
    }
    engine = _engine(monkeypatch, Canned([job]))
    engine.expect({"60": "gpubroker-lease-6"})
    assert engine.poll_many([Handle("slurm", "60", "")], claim=False)["60"].state == "lost"
    engine.expect({"60": "gpubroker-lease-9"})
    assert engine.poll_many([Handle("slurm", "60", "")], claim=False)["60"].running
