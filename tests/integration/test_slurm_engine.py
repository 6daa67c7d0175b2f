"""The Slurm engine against a real two-node Slurm cluster (tests/slurmutil.py):
inventory, launch, status, signals, stop, jobs from outside the broker,
drained nodes and failing commands."""

from __future__ import annotations

import dataclasses
import os
import signal
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpubroker.engines import EngineError, Handle, LaunchSpec, OutsideHold, Status
from gpubroker.engines.slurm import SlurmEngine

from ..slurmutil import GPUS_PER_NODE, NODES, SlurmCluster

pytestmark = pytest.mark.slurm


def _wait(check: Callable[[], Any], timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"not true within {timeout}s: {check}")


@pytest.fixture
def engine(slurm_cluster: SlurmCluster) -> Iterator[SlurmEngine]:
    made = SlurmEngine(slurm_conf=str(slurm_cluster.conf), partition="batch")
    yield made
    slurm_cluster.run("scancel", "--full", "--user=root", check=False)
    _wait(lambda: not slurm_cluster.run("squeue", "-h").stdout.strip())


def _spec(
    tmp_path: Path, argv: list[str], devices: tuple[str, ...] = (), **more: Any
) -> LaunchSpec:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "CHOSEN": "by-the-broker"}
    fields: dict[str, Any] = {
        "argv": tuple(argv),
        "env": env,
        "cwd": str(tmp_path),
        "user": "root",
        "lease_id": 7,
        "devices": devices,
        "stdout": str(tmp_path / "out.log"),
        "stderr": str(tmp_path / "out.log"),
    } | more
    return LaunchSpec(**fields)


def _ended_status(engine: SlurmEngine, handle: Handle, timeout: float = 60) -> Status:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = engine.poll(handle)
        if not status.running:
            return status
        time.sleep(0.3)
    raise AssertionError(f"job {handle.id} still running after {timeout}s")


def test_inventory_lists_both_nodes_and_their_gpus_with_stable_uuids(engine: SlurmEngine) -> None:
    nodes = engine.nodes()
    assert [n.name for n in nodes] == list(NODES)
    for node in nodes:
        assert node.state == "up"
        assert [d.index for d in node.devices] == list(range(GPUS_PER_NODE))
        assert all(d.node == node.name and d.uuid.startswith("GPU-") for d in node.devices)
        assert {d.name for d in node.devices} == {"Slurm gpu:h100"}
        assert not node.outside
    again = SlurmEngine(slurm_conf=engine.slurm_conf).nodes()
    assert [d.uuid for n in again for d in n.devices] == [d.uuid for n in nodes for d in n.devices]
    assert len({d.uuid for n in nodes for d in n.devices}) == len(NODES) * GPUS_PER_NODE


def test_a_job_runs_on_the_node_of_its_devices_with_only_its_environment(
    engine: SlurmEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BROKER_SECRET", "never-in-a-job")
    n2 = next(n for n in engine.nodes() if n.name == "n2")
    asked = (n2.devices[2].uuid, n2.devices[3].uuid)
    script = "env > env.txt; sleep 3; exit 3"
    handle = engine.launch(_spec(tmp_path, ["/bin/sh", "-c", script], asked, time_limit=90))
    assert (handle.engine, handle.node) == ("slurm", "n2")
    running = _wait(lambda: (s := engine.poll(handle)).running and s.devices and s)
    assert len(running.devices) == 2
    assert {engine._where[u] for u in running.devices} <= {("n2", i) for i in range(4)}
    ended = _ended_status(engine, handle)
    assert (ended.state, ended.exit_code, ended.signal) == ("exited", 3, None)
    env = dict(
        line.split("=", 1)
        for line in (tmp_path / "env.txt").read_text().splitlines()
        if "=" in line
    )
    assert env["CHOSEN"] == "by-the-broker"
    assert "BROKER_SECRET" not in env
    assert env["SLURMD_NODENAME"] == "n2"
    bound = sorted(engine._where[u][1] for u in running.devices)
    assert env["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, bound))
    info = _job(engine, handle)
    assert info["partition"] == "batch"
    assert info["name"] == "gpubroker-lease-7"
    assert info["time_limit"] == 2  # minutes: 90 s rounded up


def test_a_jobs_environment_reaches_the_job_never_sbatch(
    engine: SlurmEngine, tmp_path: Path
) -> None:
    """sbatch may run as root: variables from a user's job (which sbatch or
    the loader would read) must not change how it submits; the job gets
    them all, values exactly as given."""
    odd = 'it\'s "quoted" $HOME `id`\nsecond line'
    user_env = {
        "SBATCH_RESERVATION": "admins-only",  # would make sbatch fail: no such reservation
        "SLURM_CONF": "/nonexistent/slurm.conf",  # would make sbatch fail: no config
        "LD_PRELOAD": "/nonexistent/evil.so",
        "ODD": odd,
    }
    script = ["/bin/sh", "-c", 'printf %s "$ODD" > odd.txt; env > env.txt']
    spec = _spec(tmp_path, script)
    handle = engine.launch(dataclasses.replace(spec, env={**spec.env, **user_env}))
    assert _ended_status(engine, handle).exit_code == 0
    env = (tmp_path / "env.txt").read_text()
    for name in ("SBATCH_RESERVATION", "SLURM_CONF", "LD_PRELOAD"):
        assert f"{name}={user_env[name]}" in env
    assert (tmp_path / "odd.txt").read_text() == odd
    with pytest.raises(EngineError, match="cannot export"):
        engine.launch(dataclasses.replace(spec, env={**spec.env, "A.B": "x"}))


def test_a_job_launched_without_devices_gets_none(engine: SlurmEngine, tmp_path: Path) -> None:
    handle = engine.launch(_spec(tmp_path, ["/bin/sh", "-c", "env > env.txt"]))
    status = _ended_status(engine, handle)
    assert status.exit_code == 0
    assert "CUDA_VISIBLE_DEVICES" not in (tmp_path / "env.txt").read_text()


def test_jobs_from_outside_the_broker_hold_their_gpus(
    engine: SlurmEngine, slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    n1 = next(n for n in engine.nodes() if n.name == "n1")
    ours = engine.launch(_spec(tmp_path, ["sleep", "60"], (n1.devices[0].uuid,)))
    _wait(lambda: engine.poll(ours).devices)
    theirs = slurm_cluster.run(
        "sbatch", "--parsable", "-w", "n1", "--gres=gpu:2", "-o", "/dev/null", "--wrap", "sleep 60"
    ).stdout.strip()
    nodes = _wait(lambda: (lambda ns: ns if ns[0].outside else None)(engine.nodes()))
    outside = nodes[0].outside
    assert len(outside) == 2
    assert set(outside.values()) == {OutsideHold(f"Slurm job {theirs}", "root")}
    assert engine.poll(ours).devices[0] not in outside
    assert not nodes[1].outside


def test_a_drained_node_is_drained_with_slurms_reason(
    engine: SlurmEngine, slurm_cluster: SlurmCluster
) -> None:
    slurm_cluster.run("scontrol", "update", "nodename=n2", "state=drain", "reason=new fans")
    try:
        nodes = {n.name: n for n in engine.nodes()}
        assert (nodes["n2"].state, nodes["n2"].reason) == ("drained", "new fans")
        assert nodes["n1"].state == "up"
    finally:
        slurm_cluster.run("scontrol", "update", "nodename=n2", "state=resume")
    _wait(lambda: {n.name: n.state for n in engine.nodes()}["n2"] == "up")


def test_signal_reaches_the_program_and_stop_ends_it(engine: SlurmEngine, tmp_path: Path) -> None:
    script = (
        "trap 'echo warned >> got.txt' USR1; trap 'echo term >> got.txt; exit 0' TERM; "
        "echo ready > ready.txt; while :; do sleep 0.2; done"
    )
    handle = engine.launch(_spec(tmp_path, ["/bin/sh", "-c", script]))
    _wait(lambda: (tmp_path / "ready.txt").exists())
    engine.signal(handle, signal.SIGUSR1)
    _wait(lambda: "warned" in _text(tmp_path / "got.txt"))
    status = engine.stop(handle, grace=10)
    assert not status.running
    assert "term" in _text(tmp_path / "got.txt")
    engine.signal(handle, signal.SIGUSR1)  # ended: nothing happens
    assert engine.stop(handle, grace=1).state == "exited"


def test_stop_kills_a_job_that_ignores_sigterm(engine: SlurmEngine, tmp_path: Path) -> None:
    script = "trap '' TERM; echo ready > ready.txt; while :; do sleep 0.2; done"
    handle = engine.launch(_spec(tmp_path, ["/bin/sh", "-c", script]))
    _wait(lambda: (tmp_path / "ready.txt").exists())
    status = engine.stop(handle, grace=1)
    assert status.state == "exited"
    assert status.signal is not None or status.exit_code != 0


def test_the_engine_waits_by_the_clusters_own_kill_wait(
    engine: SlurmEngine, tmp_path: Path
) -> None:
    # the test cluster's slurm.conf says KillWait=5 (Slurm's default is 30):
    # a stop waits that long after its scancel, plus stop_margin
    assert engine.kill_wait() == 5.0
    # without scontrol (or while it fails): Slurm's default, read again later
    blind = SlurmEngine(slurm_conf=engine.slurm_conf, bin_dir=str(tmp_path))
    assert blind.kill_wait() == 30.0


def test_stop_cancels_a_job_still_pending_at_once(
    engine: SlurmEngine, slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    # MaxTime below the job's limit: it pends for ever (EnforcePartLimits off)
    slurm_cluster.run("scontrol", "update", "PartitionName=batch", "MaxTime=1")
    try:
        handle = engine.launch(_spec(tmp_path, ["sleep", "30"], time_limit=3600))
        view = _wait(lambda: (v := engine.describe(handle)) and v.state == "PENDING" and v)
        assert view.reason.startswith("Partition"), view
        signalled: list[int] = []
        signal_now = engine.signal

        def recorded(h: Handle, signum: int) -> None:
            signalled.append(signum)
            signal_now(h, signum)

        engine.signal = recorded  # type: ignore[method-assign]
        status = engine.stop(handle, grace=30)  # no processes to warn: no grace
        assert not status.running
        assert signalled == []  # cancelled at once, no SIGTERM and its grace
    finally:
        slurm_cluster.run("scontrol", "update", "PartitionName=batch", "MaxTime=INFINITE")


def test_a_failing_status_command_is_an_error_not_an_end(
    engine: SlurmEngine, tmp_path: Path
) -> None:
    handle = engine.launch(_spec(tmp_path, ["sleep", "30"]))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("squeue", "sinfo", "sacct"):
        fake = bin_dir / name
        fake.write_text(
            "#!/bin/sh\necho 'slurm_load_jobs error: Unable to contact controller' >&2\nexit 1\n"
        )
        fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    broken = SlurmEngine(slurm_conf=engine.slurm_conf, bin_dir=str(bin_dir))
    with pytest.raises(EngineError, match=r"squeue failed .*Unable to contact"):
        broken.poll(handle)
    with pytest.raises(EngineError, match="sinfo failed"):
        broken.nodes()
    slow = SlurmEngine(slurm_conf=engine.slurm_conf, bin_dir=str(bin_dir), command_timeout=0.5)
    (bin_dir / "squeue").write_text("#!/bin/sh\nexec sleep 5\n")
    with pytest.raises(EngineError, match=r"took over 0\.5s"):
        slow.poll(handle)
    assert engine.poll(handle).running


def test_bad_launches_are_refused_with_the_reason(engine: SlurmEngine, tmp_path: Path) -> None:
    n1, n2 = engine.nodes()
    with pytest.raises(EngineError, match="several nodes"):
        engine.launch(_spec(tmp_path, ["true"], (n1.devices[0].uuid, n2.devices[0].uuid)))
    with pytest.raises(EngineError, match="not on any Slurm node"):
        engine.launch(_spec(tmp_path, ["true"], ("GPU-not-there",)))
    with pytest.raises(EngineError, match="no such user"):
        engine.launch(_spec(tmp_path, ["true"], user="no-such-user-here"))
    wrong = SlurmEngine(slurm_conf=engine.slurm_conf, partition="nope")
    with pytest.raises(EngineError, match=r"sbatch failed .*[Pp]artition"):
        wrong.launch(_spec(tmp_path, ["true"]))
    with pytest.raises(EngineError, match="not a Slurm job handle"):
        engine.poll(Handle("local", "123", "n1"))


def _job(engine: SlurmEngine, handle: Handle) -> dict[str, Any]:
    """The job's entry in ``squeue --json`` (22.05 lists every job: pick it)."""
    jobs = engine._json(["squeue", "--json", "--states=all"])["jobs"]
    return next(j for j in jobs if str(j["job_id"]) == handle.id)


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def test_environment_of_the_broker_is_not_passed_to_sbatch(
    engine: SlurmEngine, tmp_path: Path
) -> None:
    """The job's environment is the spec's even for variables Slurm's own
    commands read (SBATCH_* in the broker's environment)."""
    os.environ["SBATCH_TIMELIMIT"] = "1"
    try:
        handle = engine.launch(_spec(tmp_path, ["true"]))
    finally:
        del os.environ["SBATCH_TIMELIMIT"]
    info = _job(engine, handle)
    assert info["time_limit"] in (None, 0) or info["time_limit"] > 1
