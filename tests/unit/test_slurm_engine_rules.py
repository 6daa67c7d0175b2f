"""The Slurm engine's rules in cases the test cluster cannot make: a job id
Slurm reused (after a reset of slurmctld's state ids start again at
``FirstJobId``), which needs accounting (``sacct``, slurmdbd), absent from
the test cluster. Slurm's commands are answered by a fake that behaves as
Slurm 22.05 documents (``SlurmEngine._run`` replaced)."""

from __future__ import annotations

import datetime as dt
import itertools
import json
import os
import pwd
from collections.abc import Sequence
from typing import Any

import pytest

from gpubroker.engines import EngineError, Handle, LaunchSpec
from gpubroker.engines.slurm import SlurmEngine


def _stamp(when: dt.datetime) -> str:
    """A time as ``sacct`` prints it with ``TZ=UTC``."""
    return when.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")


class FakeSlurm:
    """``squeue`` lists ``jobs``; ``sacct`` answers from ``records`` as
    sacct(1) says: with ``--jobs`` only the newest record of each id (by
    submit time) unless ``-D``/``--duplicates``; the fields that ``-o``
    names, ``|``-separated (``-P``). Every call is recorded."""

    def __init__(self) -> None:
        self.jobs: list[dict[str, Any]] = []
        self.records: list[dict[str, str]] = []
        self.calls: list[list[str]] = []
        self.next_id = 77

    def __call__(self, argv: Sequence[str], stdin: str | None = None, env: Any = None) -> str:
        self.calls.append(list(argv))
        if argv[0] == "squeue" and "--json" in argv:
            return json.dumps({"jobs": self.jobs, "errors": []})
        if argv[0] == "squeue":
            return self._squeue_text(argv)
        if argv[0] == "sinfo":
            node = {"name": "n1", "address": "10.0.0.1", "state": "idle", "gres": "gpu:h100:4"}
            return json.dumps({"nodes": [node], "errors": []})
        if argv[0] == "sbatch":
            return f"{self.next_id}\n"
        if argv[0] == "sacct":
            return self._sacct(argv)
        raise AssertionError(f"unexpected command {argv}")

    def _squeue_text(self, argv: Sequence[str]) -> str:
        """``squeue -h --jobs=IDS -o %T``: the state of each job listed;
        one id Slurm does not know is an error (exit 1), as on 22.05."""
        assert list(argv[-2:]) == ["-o", "%T"], argv
        ids = next(a.partition("=")[2] for a in argv if a.startswith("--jobs=")).split(",")
        known = [j for j in self.jobs if str(j["job_id"]) in ids]
        if not known and len(ids) == 1:
            raise EngineError("squeue failed (exit 1): slurm_load_jobs error: Invalid job id")
        return "".join(f"{j['job_state']}\n" for j in known)

    def _sacct(self, argv: Sequence[str]) -> str:
        ids = {a.partition("=")[2] for a in argv if a.startswith("--jobs=")}
        fields = argv[list(argv).index("-o") + 1].split(",")
        chosen = [r for r in self.records if r["JobID"] in ids]
        if "-D" not in argv and "--duplicates" not in argv:
            newest: dict[str, dict[str, str]] = {}
            for record in sorted(chosen, key=lambda r: r["Submit"]):
                newest[record["JobID"]] = record
            chosen = list(newest.values())
        return "".join("|".join(r[f] for f in fields) + "\n" for r in chosen)


def _engine(monkeypatch: pytest.MonkeyPatch, fake: FakeSlurm) -> SlurmEngine:
    engine = SlurmEngine(cluster="c")
    monkeypatch.setattr(engine, "_run", fake)
    return engine


def _launched_for_lease_5(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[FakeSlurm, SlurmEngine, dt.datetime, Handle]:
    """A fake cluster and its engine, with the broker's job 77 of lease 5
    launched now (UTC): (fake, engine, now, handle)."""
    me = pwd.getpwuid(os.getuid()).pw_name
    fake = FakeSlurm()
    engine = _engine(monkeypatch, fake)
    now = dt.datetime.now(dt.timezone.utc)
    handle = engine.launch(
        LaunchSpec(argv=("true",), env={}, cwd="/tmp", user=me, lease_id=5, devices=())
    )
    return fake, engine, now, handle


def _record(
    job_id: str, name: str, submitted: dt.datetime, state: str, code: str
) -> dict[str, str]:
    start = submitted + dt.timedelta(seconds=5)
    end = submitted + dt.timedelta(minutes=3)
    return {
        "JobID": job_id,
        "JobName": name,
        "Submit": _stamp(submitted),
        "State": state,
        "ExitCode": code,
        "Start": _stamp(start),
        "End": "Unknown" if state == "RUNNING" else _stamp(end),
    }


def test_sacct_reads_this_engines_job_not_a_newer_one_that_reused_its_id(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the broker submits job 77 (lease 5); slurmctld's state is then reset
    # (ids start again at FirstJobId) and someone's later job gets id 77
    # too. squeue no longer lists ours; sacct --jobs=77 gives the newest
    # record of that id, the other job's success, unless asked for all
    fake, engine, now, handle = _launched_for_lease_5(monkeypatch)
    assert handle.id == "77"
    fake.records = [
        _record("77", "gpubroker-lease-5", now, "FAILED", "3:0"),
        _record("77", "train", now + dt.timedelta(hours=2), "COMPLETED", "0:0"),
    ]
    status = engine.poll(handle)
    assert (status.state, status.exit_code) == ("exited", 3)
    assert engine.poll_many([handle])["77"].exit_code == 3


def test_sacct_after_a_restart_takes_only_a_record_of_a_job_the_engine_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a restarted broker (nothing in memory) polls job 77 of its lease 5,
    # gone from squeue; the newest record of id 77 is another user's job
    # (running): that is not ours, and ours ended with status 0
    fake = FakeSlurm()
    engine = _engine(monkeypatch, fake)
    then = dt.datetime(2026, 12, 1, 7, 0, tzinfo=dt.timezone.utc)
    fake.records = [
        _record("77", "gpubroker-lease-5", then, "COMPLETED", "0:0"),
        _record("77", "bash", then + dt.timedelta(days=1), "RUNNING", "0:0"),
    ]
    status = engine.poll(Handle("slurm", "77", ""))
    assert (status.state, status.exit_code) == ("exited", 0)
    # only others' records: lost, not theirs
    fake.records = [_record("77", "bash", then, "COMPLETED", "0:0")]
    assert engine.poll(Handle("slurm", "77", "")).state == "lost"


def test_sacct_skips_an_older_record_of_the_same_name_submitted_before_ours(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # squeue told the engine when job 78 (lease 9) was submitted; an older
    # record with the same id and name (before a reset, from a broker whose
    # lease ids started over too) is not it, even where it is the newest
    fake = FakeSlurm()
    engine = _engine(monkeypatch, fake)
    submitted = dt.datetime(2026, 12, 5, 9, 0, tzinfo=dt.timezone.utc)
    fake.jobs = [
        {
            "job_id": 78,
            "name": "gpubroker-lease-9",
            "job_state": "RUNNING",
            "submit_time": int(submitted.timestamp()),
            "start_time": int(submitted.timestamp()) + 3,
            "nodes": "n1",
            "exit_code": 0,
        }
    ]
    assert engine.poll(Handle("slurm", "78", "")).running
    fake.jobs = []  # purged from squeue (MinJobAge)
    fake.records = [
        _record("78", "gpubroker-lease-9", submitted, "TIMEOUT", "0:15"),
        _record("78", "gpubroker-lease-9", submitted - dt.timedelta(days=30), "COMPLETED", "0:0"),
    ]
    status = engine.poll(Handle("slurm", "78", ""))
    assert status.timed_out
    fake.records = [
        _record("78", "gpubroker-lease-9", submitted - dt.timedelta(days=30), "COMPLETED", "0:0")
    ]
    assert engine.poll(Handle("slurm", "78", "")).state == "lost"


class Clock:
    """A monotonic clock that ``sleep`` moves on: waits take no time."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class StubbornJob(FakeSlurm):
    """Job 90 runs and ignores SIGTERM; after ``scancel`` Slurm ends it
    ``kill_wait`` seconds later (SIGKILL) plus 2 s of cleanup. ``scontrol
    show config`` says ``KillWait = kill_wait sec`` as 22.05 prints it."""

    def __init__(self, clock: Clock, kill_wait: int) -> None:
        super().__init__()
        self.clock = clock
        self.kill_wait = kill_wait
        self.killed_at: float | None = None
        #: its node hangs: Slurm never ends it
        self.hung = False

    def _state(self) -> str:
        if self.killed_at is not None and self.clock.now >= self.killed_at:
            return "CANCELLED"
        return "RUNNING"

    def __call__(self, argv: Sequence[str], stdin: str | None = None, env: Any = None) -> str:
        if argv[0] == "scontrol" and list(argv[1:3]) == ["show", "config"]:
            self.calls.append(list(argv))
            return (
                "Configuration data as of 2026-12-06T20:00:00\n"
                "JobAcctGatherType       = jobacct_gather/none\n"
                f"KillWait                = {self.kill_wait} sec\n"
                "MinJobAge               = 300 sec\n"
            )
        if argv[0] == "scancel":
            self.calls.append(list(argv))
            if not any(a.startswith("--signal") for a in argv) and not self.hung:
                self.killed_at = self.clock.now + self.kill_wait + 2
            return ""
        state = self._state()
        self.jobs = [
            {
                "job_id": 90,
                "name": "gpubroker-lease-3",
                "job_state": state,
                "nodes": "n1",
                "batch_host": "n1",
                "exit_code": 0 if state == "RUNNING" else 9,
                "start_time": 1796281000,
                "end_time": 0 if state == "RUNNING" else 1796281690,
            }
        ]
        return super().__call__(argv, stdin, env)


def _stubborn(monkeypatch: pytest.MonkeyPatch, kill_wait: int) -> tuple[StubbornJob, SlurmEngine]:
    """A cluster with ``KillWait`` ``kill_wait`` s whose job 90 ends only at
    SIGKILL, on a fake clock the engine reads (``fake.clock``): (fake, engine)."""
    from gpubroker.engines import slurm as slurm_module

    clock = Clock()
    monkeypatch.setattr(slurm_module, "time", clock)
    fake = StubbornJob(clock, kill_wait=kill_wait)
    return fake, _engine(monkeypatch, fake)


def test_stop_waits_for_the_clusters_kill_wait_not_a_fixed_30s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # KillWait=60 on this cluster: Slurm sends SIGKILL 60 s after scancel's
    # SIGTERM. A stop that gives up after 30 s reports a job running that
    # Slurm is about to end (its lease is then kept or the job's end lost)
    fake, engine = _stubborn(monkeypatch, kill_wait=60)
    status = engine.stop(Handle("slurm", "90", ""), grace=1.0)
    assert not status.running and status.signal == 9
    assert engine.kill_wait() == 60.0
    # read once and kept
    assert [c for c in fake.calls if c[0] == "scontrol"] == [["scontrol", "show", "config"]]


def test_a_stop_asks_about_its_own_job_only_and_less_often_as_it_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a stop used to read the whole queue (squeue --json, every job of the
    # cluster) twice a second for as long as it waited; several stops at
    # once (orphaned servers) multiplied that load on slurmctld
    fake, engine = _stubborn(monkeypatch, kill_wait=30)
    times: list[float] = []
    real_call = fake.__call__

    def timed(argv: Sequence[str], stdin: str | None = None, env: Any = None) -> str:
        if argv[0] == "squeue" and "--json" not in argv:
            times.append(fake.clock.now)
        return real_call(argv, stdin, env)

    monkeypatch.setattr(engine, "_run", timed)
    status = engine.stop(Handle("slurm", "90", ""), grace=5.0)
    assert not status.running
    squeues = [c for c in fake.calls if c[0] == "squeue"]
    whole = [c for c in squeues if "--json" in c]
    # one to start, one at the end of each wait: never one per look
    assert len(whole) <= 3, len(whole)
    assert all("--jobs=90" in c for c in squeues if "--json" not in c)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert gaps and max(gaps) <= 2.0 + 1e-9
    assert len(times) <= 30, len(times)  # 37 s of waiting: backed off to 2 s


def _gpu_job(job_id: int, user: str, state: str, index: int) -> dict[str, Any]:
    return {
        "job_id": job_id,
        "name": "gpubroker-lease-5" if user != "bob" else "train",
        "user_name": user,
        "job_state": state,
        "nodes": "n1",
        "batch_host": "n1",
        "gres_detail": [f"gpu:h100:1(IDX:{index})"],
        "exit_code": 0,
        "start_time": 1796281000,
        "end_time": 0 if state == "RUNNING" else 1796281690,
    }


def _outside(engine: SlurmEngine) -> set[int]:
    (node,) = engine.nodes()
    return {d.index for d in node.devices if d.uuid in node.outside}


def test_a_batch_job_stops_being_the_brokers_once_it_has_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # job 77 of the broker ends; slurmctld's state is reset and bob's new
    # job gets id 77 on GPU 2. It is bob's, outside the broker: counted as
    # the broker's own for ever, its GPU would be granted a second time
    me = pwd.getpwuid(os.getuid()).pw_name
    fake = FakeSlurm()
    engine = _engine(monkeypatch, fake)
    (node,) = engine.nodes()
    handle = engine.launch(
        LaunchSpec(
            argv=("true",), env={}, cwd="/tmp", user=me, lease_id=5, devices=(node.devices[0].uuid,)
        )
    )
    fake.jobs = [_gpu_job(77, me, "RUNNING", 0)]
    assert _outside(engine) == set()
    assert engine.poll(handle).running
    fake.jobs = [_gpu_job(77, me, "COMPLETED", 0)]
    assert not engine.poll(handle).running
    fake.jobs = [_gpu_job(77, "bob", "RUNNING", 2)]
    assert _outside(engine) == {2}
    # the same through poll_many (the job service's tick)
    fake.jobs = [_gpu_job(77, me, "RUNNING", 0)]
    assert engine.poll_many([handle])["77"].running
    assert _outside(engine) == set()
    fake.jobs = [_gpu_job(77, me, "FAILED", 0)]
    assert not engine.poll_many([handle])["77"].running
    fake.jobs = [_gpu_job(77, "bob", "RUNNING", 2)]
    assert _outside(engine) == {2}


def test_a_batch_job_a_stop_could_not_end_is_outside_the_broker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the job service ends the job and its lease whatever the stop gave
    # (JobService._tick_running, _stop_quietly): a job Slurm did not end
    # holds its GPUs outside the broker, which must not grant them again
    fake, engine = _stubborn(monkeypatch, kill_wait=10)
    fake.hung = True  # Slurm does not end it (a node that hangs)
    handle = Handle("slurm", "90", "")
    assert engine.poll(handle).running  # claimed: the broker's own
    real_call = fake.__call__

    def with_gpus(argv: Sequence[str], stdin: str | None = None, env: Any = None) -> str:
        out = real_call(argv, stdin, env)
        if argv[0] == "squeue" and "--json" in argv:
            answer = json.loads(out)
            for job in answer["jobs"]:
                job["gres_detail"] = ["gpu:h100:1(IDX:3)"]
            out = json.dumps(answer)
        return out

    monkeypatch.setattr(engine, "_run", with_gpus)
    assert _outside(engine) == set()
    assert engine.stop(handle, grace=1.0).running
    assert _outside(engine) == {3}

    # a stop that fails (slurmctld not answering scancel) too
    engine.poll(handle)
    assert _outside(engine) == set()

    def refusing(argv: Sequence[str], stdin: str | None = None, env: Any = None) -> str:
        if argv[0] == "scancel":
            raise EngineError("scancel failed (exit 1): Unable to contact slurm controller")
        return with_gpus(argv, stdin, env)

    monkeypatch.setattr(engine, "_run", refusing)
    with pytest.raises(EngineError, match="Unable to contact"):
        engine.stop(handle, grace=1.0)
    assert _outside(engine) == {3}


def test_squeue_lists_a_job_that_reused_the_id_as_another_jobs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the broker's job 77 (lease 5) failed; slurmctld's state is reset and
    # someone's later job gets id 77 and runs: squeue lists that one under
    # our id. It is not ours: our job's end comes from sacct
    fake, engine, now, handle = _launched_for_lease_5(monkeypatch)
    later = int((now + dt.timedelta(hours=2)).timestamp())
    impostor = {"job_id": 77, "name": "train", "job_state": "RUNNING", "submit_time": later}
    fake.jobs = [impostor]
    fake.records = [
        _record("77", "gpubroker-lease-5", now, "FAILED", "3:0"),
        _record("77", "train", now + dt.timedelta(hours=2), "RUNNING", "0:0"),
    ]
    status = engine.poll(handle)
    assert (status.state, status.exit_code) == ("exited", 3)
    assert engine.poll_many([handle])["77"].exit_code == 3
    assert engine.describe(handle) is None
    # another lease's name under our id, or ours submitted before our sbatch
    fake.jobs = [impostor | {"name": "gpubroker-lease-6"}]
    assert engine.poll(handle).exit_code == 3
    early = int((now - dt.timedelta(hours=5)).timestamp())
    fake.jobs = [impostor | {"name": "gpubroker-lease-5", "submit_time": early}]
    assert engine.poll(handle).exit_code == 3
    # our own job as squeue lists it is read from there
    fake.jobs = [impostor | {"name": "gpubroker-lease-5", "submit_time": int(now.timestamp())}]
    assert engine.poll(handle).running
