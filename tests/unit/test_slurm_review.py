"""Review of the Slurm engine on the answers Slurm 22.05 gives in cases the
test cluster cannot easily make: final states that are failures although
their exit status reads 0 (a node failure, a preemption), job states that
are neither pending nor ended (held, requeued, a node powering up), jobs
of others still being set up, and nodes with GPUs of several types.
Slurm's commands are replaced by canned answers (``SlurmEngine._run``)."""

from __future__ import annotations

import json
import os
import pwd
import subprocess
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from gpubroker.engines import EngineError, Handle, LaunchSpec, Status
from gpubroker.engines import slurm_json as sj
from gpubroker.engines.slurm import SlurmEngine
from gpubroker.model.jobs import SUCCEEDED, outcome


def _succeeds(status: Status) -> bool:
    lost = status.state == "lost"
    return outcome(status.exit_code, status.signal, status.timed_out, lost) == SUCCEEDED


@pytest.mark.parametrize("state", ["PREEMPTED", "NODE_FAIL", "BOOT_FAIL", "OUT_OF_MEMORY"])
def test_a_job_slurm_ended_for_a_failure_never_reads_as_a_success(state: str) -> None:
    # sacct shows "PREEMPTED 0:0", "NODE_FAIL 0:0", "BOOT_FAIL 0:0": the job
    # did not run to its end, whatever its exit status says
    squeue = sj.job_status({"job_state": state, "exit_code": 0, "end_time": 1796281690})
    assert squeue.state == "exited" and not _succeeds(squeue)
    sacct = sj.sacct_status(f"{state}|0:0|2026-12-03T07:07:24|2026-12-03T07:08:00")
    assert sacct is not None and sacct.state == "exited" and not _succeeds(sacct)


def test_out_of_memory_is_the_kernels_sigkill_not_signal_125() -> None:
    # sacct's OUT_OF_MEMORY is "0:125": 125 is no signal
    for status in (
        sj.job_status({"job_state": "OUT_OF_MEMORY", "exit_code": 125}),
        sj.sacct_status("OUT_OF_MEMORY|0:125|x|y"),
    ):
        assert status is not None
        assert (status.state, status.exit_code, status.signal) == ("exited", None, 9)


def test_a_job_past_its_deadline_timed_out() -> None:
    assert sj.job_status({"job_state": "DEADLINE", "exit_code": 0}).timed_out
    deadline = sj.sacct_status("DEADLINE|0:0|x|y")
    assert deadline is not None and deadline.timed_out


def test_real_ends_keep_their_exit_status() -> None:
    done = sj.job_status({"job_state": "COMPLETED", "exit_code": 0})
    assert _succeeds(done)
    failed = sj.job_status({"job_state": "FAILED", "exit_code": 3 << 8})
    assert (failed.exit_code, failed.signal) == (3, None)
    node = sj.job_status({"job_state": "NODE_FAIL", "exit_code": 15})
    assert (node.exit_code, node.signal) == (None, 15)


@pytest.mark.parametrize(
    "state", ["RESV_DEL_HOLD", "SPECIAL_EXIT", "REQUEUE_HOLD", "CONFIGURING", "?", "POWER_UP_NODE"]
)
def test_a_job_in_a_state_that_is_no_end_still_runs(state: str) -> None:
    # held when its reservation was deleted, held after a special exit, ...:
    # the job is still in Slurm's queue and may run; its lease must stay
    assert sj.job_status({"job_state": state, "exit_code": 0}).running


# -- the engine on canned answers ------------------------------------------------


class Canned:
    """Slurm's commands answered from a table; every call recorded."""

    def __init__(self, jobs: list[dict[str, Any]], gres: str = "gpu:h100:4") -> None:
        self.jobs = jobs
        self.gres = gres
        self.calls: list[list[str]] = []

    def __call__(self, argv: Sequence[str], stdin: str | None = None, env: Any = None) -> str:
        self.calls.append(list(argv))
        if argv[0] == "sinfo":
            node = {"name": "n1", "address": "10.0.0.1", "state": "mixed", "gres": self.gres}
            return json.dumps({"nodes": [node], "errors": []})
        if argv[0] == "squeue" and "--json" not in argv:  # squeue -h --jobs=ID -o %T
            wanted = next(a.partition("=")[2] for a in argv if a.startswith("--jobs="))
            return "".join(f"{j['job_state']}\n" for j in self.jobs if str(j["job_id"]) == wanted)
        if argv[0] == "squeue":
            return json.dumps({"jobs": self.jobs, "errors": []})
        if argv[0] == "sbatch":
            return "77\n"
        if argv[0] == "scontrol":
            return "KillWait                = 30 sec\n"
        if argv[0] in ("scancel", "sacct"):
            if argv[0] == "scancel" and len(argv) == 2:
                for job in self.jobs:
                    if str(job["job_id"]) == argv[1]:
                        job["job_state"] = "CANCELLED"
            return ""
        raise AssertionError(f"unexpected command {argv}")


def _engine(monkeypatch: pytest.MonkeyPatch, canned: Canned) -> SlurmEngine:
    engine = SlurmEngine(cluster="c")
    monkeypatch.setattr(engine, "_run", canned)
    return engine


@pytest.mark.parametrize("state", ["RESV_DEL_HOLD", "REQUEUE_HOLD", "CONFIGURING"])
def test_stop_cancels_a_job_that_has_not_started_without_signalling_it(
    monkeypatch: pytest.MonkeyPatch, state: str
) -> None:
    # scancel --signal on a job without processes hangs on 22.05 (the
    # command timeout, then an error): such a job is cancelled at once
    job = {
        "job_id": 41,
        "name": "gpubroker-lease-4",
        "job_state": state,
        "nodes": "",
        "exit_code": 0,
    }
    canned = Canned([job])
    engine = _engine(monkeypatch, canned)
    status = engine.stop(Handle("slurm", "41", ""), grace=0.0)
    assert not status.running
    scancels = [c for c in canned.calls if c[0] == "scancel"]
    assert scancels == [["scancel", "41"]]


def test_gpus_of_a_job_being_set_up_are_outside(monkeypatch: pytest.MonkeyPatch) -> None:
    # a job of someone else's that Slurm has allocated GPUs to, while its
    # node boots or its prolog runs (CONFIGURING), holds them already
    jobs = [
        {
            "job_id": 50,
            "job_state": "CONFIGURING",
            "user_name": "bob",
            "nodes": "n1",
            "gres_detail": ["gpu:h100:1(IDX:2)"],
        },
        {  # ended a moment ago: its GPUs are free again
            "job_id": 51,
            "job_state": "COMPLETED",
            "user_name": "bob",
            "nodes": "n1",
            "gres_detail": ["gpu:h100:1(IDX:3)"],
        },
    ]
    engine = _engine(monkeypatch, Canned(jobs))
    (node,) = engine.nodes()
    held = {d.index for d in node.devices if d.uuid in node.outside}
    assert held == {2}


def test_a_launch_asks_for_the_type_of_the_leased_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    # a node with two GPU types: --gres=gpu:2 lets Slurm bind the a100s for
    # a lease of the h100s
    canned = Canned([], gres="gpu:a100:2,gpu:h100:2")
    engine = _engine(monkeypatch, canned)
    (node,) = engine.nodes()
    h100s = tuple(d.uuid for d in node.devices if d.name == "Slurm gpu:h100")
    assert len(h100s) == 2
    me = pwd.getpwuid(os.getuid()).pw_name
    spec = LaunchSpec(argv=("true",), env={}, cwd="/tmp", user=me, lease_id=3, devices=h100s)
    engine.launch(spec)
    (sbatch,) = [c for c in canned.calls if c[0] == "sbatch"]
    assert [a for a in sbatch if a.startswith("--gres=")] == ["--gres=gpu:h100:2"]
    both = (h100s[0], next(d.uuid for d in node.devices if d.name == "Slurm gpu:a100"))
    engine.launch(LaunchSpec(argv=("true",), env={}, cwd="/tmp", user=me, lease_id=4, devices=both))
    sbatch = [c for c in canned.calls if c[0] == "sbatch"][-1]
    assert [a for a in sbatch if a.startswith("--gres=")] == ["--gres=gpu:a100:1,gpu:h100:1"]


def test_a_job_slurmctld_no_longer_lists_is_not_kept_running_by_a_stale_sacct_record(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a "runaway" job: slurmdbd never got its end (slurmdbd down, slurmctld
    # state lost) and sacct says RUNNING for ever; squeue, which answered,
    # no longer lists it, so it runs nowhere and its lease must not be kept
    canned = Canned([])
    engine = _engine(monkeypatch, canned)

    def sacct(argv: Sequence[str], stdin: str | None = None, env: Any = None) -> str:
        if argv[0] == "sacct":
            canned.calls.append(list(argv))
            return "RUNNING|0:0|2026-12-03T07:07:24|Unknown\n"
        return canned(argv, stdin, env)

    monkeypatch.setattr(engine, "_run", sacct)
    assert not engine.poll(Handle("slurm", "42", "")).running
    assert not engine.poll_many([Handle("slurm", "42", "")])["42"].running
    assert any(c[0] == "sacct" for c in canned.calls)


def test_a_server_job_the_broker_failed_to_stop_is_outside_once_its_lease_is_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # SlurmServers cancels an orphaned server job with engine.stop; Slurm
    # refuses (not answering); the lease is later released some other way
    # (an admin): the job still runs and holds its GPUs, which must count as
    # outside, not as the broker's own for ever
    job = {
        "job_id": 60,
        "name": "gpubroker-lease-6",
        "job_state": "RUNNING",
        "user_name": "ann",
        "nodes": "n1",
        "gres_detail": ["gpu:h100:2(IDX:0-1)"],
    }
    canned = Canned([job])
    engine = _engine(monkeypatch, canned)

    def refusing(argv: Sequence[str], stdin: str | None = None, env: Any = None) -> str:
        if argv[0] == "scancel":
            raise EngineError("scancel failed (exit 1): Unable to contact slurm controller")
        return canned(argv, stdin, env)

    monkeypatch.setattr(engine, "_run", refusing)
    engine.adopt(["60"])
    (node,) = engine.nodes()
    assert not node.outside
    with pytest.raises(EngineError, match="Unable to contact"):
        engine.stop(Handle("slurm", "60", ""), grace=0.0)
    engine.adopt([])  # its lease was released
    (node,) = engine.nodes()
    assert {d.index for d in node.devices if d.uuid in node.outside} == {0, 1}


def _slow_sbatch(
    monkeypatch: pytest.MonkeyPatch, engine: SlurmEngine, canned: Canned, queued: bool
) -> None:
    """``sbatch`` runs past ``command_timeout`` (the real ``_run`` sees
    ``subprocess.TimeoutExpired``); with ``queued``, slurmctld had queued
    the job all the same."""
    real_run: Callable[..., str] = SlurmEngine._run.__get__(engine)

    def timing_out(*args: Any, **kwargs: Any) -> Any:
        raise subprocess.TimeoutExpired(args[0], engine.command_timeout)

    def run(argv: Sequence[str], stdin: str | None = None, env: Any = None) -> str:
        if argv[0] != "sbatch":
            return canned(argv, stdin, env)
        canned.calls.append(list(argv))
        if queued:
            comment = next(a for a in argv if a.startswith("--comment="))
            user = pwd.getpwuid(os.getuid()).pw_name
            job = {"job_id": 88, "name": "gpubroker-lease-8", "job_state": "PENDING"}
            job |= {"user_name": user, "nodes": ""}
            canned.jobs.append(job | {"comment": comment.partition("=")[2]})
        with monkeypatch.context() as patch:
            patch.setattr(subprocess, "run", timing_out)
            return real_run(argv, stdin, env)

    monkeypatch.setattr(engine, "_run", run)


def test_a_submit_that_timed_out_but_reached_slurm_is_found_not_failed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # slurmctld was slow: sbatch ran past command_timeout and was killed,
    # but slurmctld had queued the job. The launch must give that job's
    # handle (found by its tag), not an error: on an error the job service
    # fails the job and releases its lease while the job runs on its GPUs
    me = pwd.getpwuid(os.getuid()).pw_name
    canned = Canned([])
    engine = _engine(monkeypatch, canned)
    (node,) = engine.nodes()
    _slow_sbatch(monkeypatch, engine, canned, queued=True)
    spec = LaunchSpec(
        argv=("true",),
        env={},
        cwd="/tmp",
        user=me,
        lease_id=5,
        devices=(node.devices[0].uuid,),
        tag="job5-0-ab",
    )
    handle = engine.launch(spec)
    assert (handle.id, handle.node) == ("88", "n1")


def test_a_submit_that_timed_out_and_reached_nothing_is_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    me = pwd.getpwuid(os.getuid()).pw_name
    canned = Canned([])
    engine = _engine(monkeypatch, canned)
    _slow_sbatch(monkeypatch, engine, canned, queued=False)
    spec = LaunchSpec(argv=("true",), env={}, cwd="/tmp", user=me, lease_id=5, tag="job5-0-cd")
    with pytest.raises(EngineError, match="took over"):
        engine.launch(spec)


def test_another_users_job_that_copies_a_launchs_tag_does_not_hide_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # comments are public (squeue) and a job's owner may rewrite its own
    # (scontrol update JobId=N Comment=...): mallory copies ann's tag onto
    # an older job of hers; the broker, finding ann's launch after a crash,
    # takes ann's job and never mallory's, and is not stopped by hers
    me = pwd.getpwuid(os.getuid()).pw_name
    comment = "gpubroker lease 5 launch job5-0-ab"
    jobs = [
        {"job_id": 10, "job_state": "RUNNING", "user_name": "mallory", "comment": comment},
        {"job_id": 11, "job_state": "PENDING", "user_name": me, "comment": comment, "nodes": ""},
    ]
    engine = _engine(monkeypatch, Canned(jobs))
    handle = engine.find("job5-0-ab", me)
    assert handle is not None and handle.id == "11"
    with pytest.raises(EngineError, match="not 'nobody-else'"):  # only others' jobs
        engine.find("job5-0-ab", "nobody-else")


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")
def test_the_testbeds_fake_gpus_are_no_door_to_real_ones(tmp_path: Any) -> None:
    # a fake GPU is a character device of NVIDIA's major number 195 and
    # minor N: on a machine with real GPUs it opens /dev/nvidiaN. Made
    # world read-writable, it would let every local user reach GPUs the
    # admin keeps from them (make demo-slurm, the tests on a GPU machine)
    import stat

    from gpubroker.engines import slurm_testbed

    slurm_testbed._write_config(tmp_path / "c", {"n1": 1, "n2": 2}, 3)
    devices = sorted((tmp_path / "c" / "dev").iterdir())
    assert devices
    for device in devices:
        mode = device.stat().st_mode
        assert stat.S_ISCHR(mode)
        assert stat.S_IMODE(mode) & 0o077 == 0, f"{device.name}: {oct(stat.S_IMODE(mode))}"


def test_a_node_slurm_powered_down_to_save_power_takes_new_work() -> None:
    # power saving (SuspendTime, cloud nodes): an idle node is powered off
    # ("idle~") and Slurm powers it up for the next job sent to it; it is
    # not down. A node down, drained or failing while powered off still is
    assert sj.node_state("idle", ["POWERED_DOWN"]) == "up"
    assert sj.node_state("idle", ["CLOUD", "POWERED_DOWN"]) == "up"
    assert sj.node_state("idle", ["POWERING_UP"]) == "up"
    assert sj.node_state("down", ["POWERED_DOWN"]) == "down"
    assert sj.node_state("idle", ["POWERED_DOWN", "DRAIN"]) == "drained"


def test_json_of_a_newer_slurm_is_read_not_misread() -> None:
    """Slurm 23.02+ gives states as lists and numbers as objects: read as
    strings, a drained node looked up (``"['IDLE', 'DRAIN']"`` matched no
    state) and an ended job looked running. They are read into 22.05's
    shape (tests/unit/test_slurm_json_versions.py has whole answers); a
    shape still unknown is refused, not misread."""
    from gpubroker.engines import slurm_json

    newer_sinfo = slurm_json.as_v38(
        {
            "meta": {"slurm": {"release": "23.11.4"}},
            "nodes": [{"name": "n1", "state": ["IDLE", "DRAIN"], "gres": "gpu:h100:4"}],
        }
    )
    node = newer_sinfo["nodes"][0]
    assert slurm_json.node_state(node["state"], node["state_flags"]) == "drained"
    assert slurm_json.unsupported_format(newer_sinfo) == ""
    newer_squeue = slurm_json.as_v38(
        {"jobs": [{"job_id": 4, "job_state": ["COMPLETED"], "exit_code": {"number": 0}}]}
    )
    assert not slurm_json.job_status(newer_squeue["jobs"][0]).running
    unknown = {"meta": {"slurm": {"release": "99.1"}}, "nodes": [{"state": {"base": "IDLE"}}]}
    said = slurm_json.unsupported_format(slurm_json.as_v38(unknown))
    assert "nodes[].state is a dict" in said and "Slurm 99.1" in said
    v38 = {
        "nodes": [{"name": "n1", "state": "idle", "state_flags": ["DRAIN"]}],
        "jobs": [{"job_id": 4, "job_state": "RUNNING", "exit_code": 0, "start_time": 1}],
    }
    assert slurm_json.as_v38(v38) == v38
    assert slurm_json.unsupported_format(v38) == ""
