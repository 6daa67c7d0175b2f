"""MPS control: a stand-in ``nvidia-cuda-mps-control`` (a real executable
that records its argv, environment and stdin, and on ``-d`` leaves a real
background process behind as the daemon, with the ``control`` FIFO and the
pid file the real daemon creates) drives real subprocesses and real files."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpubroker.enforce import EnforcementError
from gpubroker.enforce.mps import PID_FILE, MPSControl, safe_name

UUID = "GPU-5d8b4c1e-2f3a-4b5c-9d6e-7f8091a2b3c4"
UUID2 = "GPU-0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9"

STAND_IN = """\
#!{python}
import json, os, subprocess, sys, time
stdin = "" if "-d" in sys.argv[1:] else sys.stdin.read()
record = {{
    "argv": sys.argv[1:],
    "env": {{k: v for k, v in os.environ.items() if k.startswith("CUDA_")}},
    "stdin": stdin,
}}
with open({log!r}, "a") as f:
    f.write(json.dumps(record) + "\\n")
pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
if os.environ.get("STANDIN_SLOW"):
    time.sleep(30)
if os.environ.get("STANDIN_FAIL"):
    sys.stderr.write("boom: cannot start the MPS control daemon\\n")
    sys.exit(3)
if sys.argv[1:] == ["-d"]:
    daemon = subprocess.Popen(
        ["sleep", "300"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True,
    )
    os.mkfifo(os.path.join(pipe, "control"))
    with open(os.path.join(pipe, "nvidia-cuda-mps-control.pid"), "w") as f:
        f.write(str(daemon.pid))
elif stdin == "quit\\n":
    pid_file = os.path.join(pipe, "nvidia-cuda-mps-control.pid")
    with open(pid_file) as f:
        os.kill(int(f.read()), 15)
    os.unlink(pid_file)
    os.unlink(os.path.join(pipe, "control"))
"""


class StandIn:
    """The stand-in control command and what it recorded."""

    def __init__(self, tmp_path: Path) -> None:
        self.log = tmp_path / "calls.jsonl"
        self.path = tmp_path / "bin" / "fake-mps-control"
        self.path.parent.mkdir()
        self.path.write_text(STAND_IN.format(python=sys.executable, log=str(self.log)))
        self.path.chmod(self.path.stat().st_mode | stat.S_IXUSR)
        self.root = tmp_path / "mps"

    def calls(self) -> list[dict[str, object]]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]

    def control(self, **kwargs: object) -> MPSControl:
        return MPSControl(
            control_command=str(self.path), pipe_root=str(self.root), enabled=True, **kwargs
        )

    def daemon_pids(self) -> list[int]:
        return [int(p.read_text()) for p in self.root.glob(f"*/pipe/{PID_FILE}")]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_gone(pid: int, timeout: float = 5) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_ensure_daemon_starts_once_with_the_device_env(standin: StandIn) -> None:
    mps = standin.control()
    mps.ensure_daemon(UUID)
    mps.ensure_daemon(UUID)
    calls = standin.calls()
    assert len(calls) == 1
    assert calls[0]["argv"] == ["-d"]
    pipe = standin.root / UUID / "pipe"
    log = standin.root / UUID / "log"
    assert calls[0]["env"] == {
        "CUDA_VISIBLE_DEVICES": UUID,
        "CUDA_MPS_PIPE_DIRECTORY": str(pipe),
        "CUDA_MPS_LOG_DIRECTORY": str(log),
    }
    assert pipe.is_dir() and log.is_dir()
    assert stat.S_ISFIFO((pipe / "control").stat().st_mode)
    assert mps.daemon_state(UUID) == "running"
    assert mps.started == {UUID}
    (pid,) = standin.daemon_pids()
    assert alive(pid)


def test_a_running_daemon_is_adopted_not_restarted(standin: StandIn) -> None:
    standin.control().ensure_daemon(UUID)
    again = standin.control()  # e.g. the broker restarted
    again.ensure_daemon(UUID)
    assert len(standin.calls()) == 1
    assert again.started == {UUID}


def test_inherited_client_settings_do_not_reach_the_daemon(
    standin: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "10")
    monkeypatch.setenv("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=1M")
    standin.control().ensure_daemon(UUID)
    env = standin.calls()[0]["env"]
    assert isinstance(env, dict)
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in env


def test_stop_daemon_writes_quit_with_the_same_env(standin: StandIn) -> None:
    mps = standin.control()
    mps.ensure_daemon(UUID)
    (pid,) = standin.daemon_pids()
    mps.stop_daemon(UUID)
    stop = standin.calls()[-1]
    assert stop["argv"] == []
    assert stop["stdin"] == "quit\n"
    assert stop["env"] == standin.calls()[0]["env"]
    assert wait_gone(pid)
    assert mps.daemon_state(UUID) == "absent"
    assert mps.started == set()
    mps.stop_daemon(UUID)  # nothing left to stop: no call
    assert len(standin.calls()) == 2


def test_stop_all_stops_every_device(standin: StandIn) -> None:
    mps = standin.control()
    mps.ensure_daemon(UUID)
    mps.ensure_daemon(UUID2)
    pids = standin.daemon_pids()
    assert len(pids) == 2
    mps.stop_all()
    quits = [c for c in standin.calls() if c["stdin"] == "quit\n"]
    devices = sorted(c["env"]["CUDA_VISIBLE_DEVICES"] for c in quits)  # type: ignore[index]
    assert devices == sorted([UUID, UUID2])
    assert all(wait_gone(pid) for pid in pids)
    assert mps.started == set()


def test_a_stale_pipe_directory_gets_a_new_daemon(standin: StandIn) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    pipe = standin.root / UUID / "pipe"
    pipe.mkdir(parents=True)
    os.mkfifo(pipe / "control")
    (pipe / PID_FILE).write_text(str(dead.pid))
    mps = standin.control()
    assert mps.daemon_state(UUID) == "stale"
    mps.ensure_daemon(UUID)
    assert [c["argv"] for c in standin.calls()] == [["-d"]]
    assert mps.daemon_state(UUID) == "running"


def test_client_env_formats() -> None:
    mps = MPSControl(pipe_root="/run/gpubroker-mps")
    env = mps.client_env(UUID, 10240, 50)
    assert env == {
        "CUDA_MPS_PIPE_DIRECTORY": f"/run/gpubroker-mps/{UUID}/pipe",
        "CUDA_MPS_LOG_DIRECTORY": f"/run/gpubroker-mps/{UUID}/log",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=10240M",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50",
    }
    assert mps.client_env(UUID, 1, 100)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "100"


def test_old_style_mig_uuids_get_a_safe_directory() -> None:
    mig = "MIG-GPU-5d8b4c1e-2f3a-4b5c-9d6e-7f8091a2b3c4/1/0"
    assert safe_name(mig) == "MIG-GPU-5d8b4c1e-2f3a-4b5c-9d6e-7f8091a2b3c4_1_0"
    mps = MPSControl(pipe_root="/tmp/r")
    assert mps.pipe_dir(mig).parent.name == safe_name(mig)


@pytest.mark.parametrize(
    ("uuid", "memory", "threads", "field"),
    [
        (UUID, 0, 50, "memory_mib"),
        (UUID, -5, 50, "memory_mib"),
        (UUID, 1.5, 50, "memory_mib"),
        (UUID, True, 50, "memory_mib"),
        (UUID, "1024", 50, "memory_mib"),
        (UUID, 1024, 0, "thread_percentage"),
        (UUID, 1024, 101, "thread_percentage"),
        (UUID, 1024, 50.0, "thread_percentage"),
        ("", 1024, 50, "device_uuid"),
        ("../../etc", 1024, 50, "device_uuid"),
        ("GPU-1 2", 1024, 50, "device_uuid"),
        ("x" * 129, 1024, 50, "device_uuid"),
    ],
)
def test_client_env_rejects_bad_input(uuid: str, memory: int, threads: int, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        MPSControl().client_env(uuid, memory, threads)


def test_bad_device_uuid_is_refused_before_running_anything(standin: StandIn) -> None:
    with pytest.raises(ValueError, match="device_uuid"):
        standin.control().ensure_daemon("../escape")
    assert standin.calls() == []
    assert not standin.root.exists()


def test_missing_command_is_a_clear_error(tmp_path: Path) -> None:
    for command in (str(tmp_path / "no-such-mps-control"), "no-such-mps-control-on-path"):
        mps = MPSControl(control_command=command, pipe_root=str(tmp_path / "mps"))
        with pytest.raises(EnforcementError, match="not found"):
            mps.ensure_daemon(UUID)
        assert mps.started == set()


def test_failing_command_reports_its_stderr(
    standin: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STANDIN_FAIL", "1")
    mps = standin.control()
    with pytest.raises(EnforcementError, match=r"exited 3: boom: cannot start"):
        mps.ensure_daemon(UUID)
    assert mps.started == set()


def test_failing_quit_reports_its_stderr(standin: StandIn, monkeypatch: pytest.MonkeyPatch) -> None:
    mps = standin.control()
    mps.ensure_daemon(UUID)
    monkeypatch.setenv("STANDIN_FAIL", "1")
    with pytest.raises(EnforcementError, match="boom"):
        mps.stop_all()
    assert mps.started == {UUID}  # still running; a later stop may succeed


def test_a_hanging_command_times_out(standin: StandIn, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STANDIN_SLOW", "1")
    mps = standin.control(start_timeout=1.0)
    with pytest.raises(EnforcementError, match=r"took longer than start_timeout=1 s"):
        mps.ensure_daemon(UUID)
    assert mps.started == set()


def test_an_unwritable_pipe_root_is_a_clear_error(standin: StandIn, tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    mps = MPSControl(control_command=str(standin.path), pipe_root=str(blocker / "mps"))
    with pytest.raises(EnforcementError, match="cannot create MPS directories"):
        mps.ensure_daemon(UUID)
    assert standin.calls() == []


@pytest.fixture
def live_pid() -> Iterator[int]:
    """A live process of its own (the stand-in's teardown ends the pids in
    the pid files it finds)."""
    proc = subprocess.Popen(["sleep", "300"])
    yield proc.pid
    proc.kill()
    proc.wait()


def _planted(standin: StandIn, pid: int) -> Path:
    """A device's directory made beforehand, with a daemon's ``control``
    endpoint and a pid file naming a live process."""
    pipe = standin.root / safe_name(UUID) / "pipe"
    pipe.mkdir(parents=True)
    os.mkfifo(pipe / "control")
    (pipe / PID_FILE).write_text(str(pid))
    return pipe


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another account needs root")
def test_a_daemon_planted_by_another_account_is_not_adopted(
    standin: StandIn, live_pid: int
) -> None:
    """With pipe_root in a world-writable place, a user could make the
    device's pipe directory first, with a control endpoint and a pid file of
    a live process: the broker adopted that 'daemon' and pointed every
    share of the device at it. Now refused, naming the directory."""
    pipe = _planted(standin, live_pid)
    for path in (standin.root, pipe.parent, pipe):
        os.chown(path, 65534, 65534)
    mps = standin.control()
    with pytest.raises(EnforcementError, match=r"mps belongs to uid 65534, not to the broker"):
        mps.ensure_daemon(UUID)
    assert mps.started == set() and standin.calls() == []


def test_a_directory_others_can_write_is_refused(standin: StandIn, live_pid: int) -> None:
    pipe = _planted(standin, live_pid)
    pipe.parent.chmod(0o777)
    mps = standin.control()
    with pytest.raises(EnforcementError, match=r"can be written by group or others \(mode 0777\)"):
        mps.ensure_daemon(UUID)
    assert mps.started == set() and standin.calls() == []


def test_a_linked_log_directory_is_refused(standin: StandIn, tmp_path: Path) -> None:
    """A log directory linked elsewhere had the daemon, run as the broker,
    write its log wherever the link pointed."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    device = standin.root / safe_name(UUID)
    device.mkdir(parents=True)
    (device / "log").symlink_to(elsewhere)
    mps = standin.control()
    with pytest.raises(EnforcementError, match=r"log is not a directory \(a link or a file\)"):
        mps.ensure_daemon(UUID)
    assert standin.calls() == [] and list(elsewhere.iterdir()) == []


def test_the_directories_it_makes_are_0755_whatever_the_umask(standin: StandIn) -> None:
    """Also pipe_root's parents that it makes: one writable by others would
    let them move pipe_root away and put their own in its place."""
    standin.root = standin.root / "a" / "b"
    old = os.umask(0)
    try:
        standin.control().ensure_daemon(UUID)
    finally:
        os.umask(old)
    device = standin.root / safe_name(UUID)
    made = (standin.root.parent.parent, standin.root.parent, standin.root)
    for path in (*made, device, device / "pipe", device / "log"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o755, path
    for pid in standin.daemon_pids():
        os.kill(pid, 15)
