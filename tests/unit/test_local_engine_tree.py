"""The local engine ends every process of a launch, not only its process group.

A notebook job's kernel runs in a session of its own (jupyter_client starts
it so), and so do its children (``!python train.py``, DataLoader workers):
a ``killpg`` of the launch's group never reaches them. They carry the
launch's tag in their environment, and the engine ends them by it.

Every process a test starts is killed by pid in its ``finally``, whatever
the test did.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpubroker.devices.fake import FakeDeviceBackend
from gpubroker.engines import Handle, LaunchSpec, LocalEngine

from .test_engines_local import gone, wait_for

#: upper bound of every wait in these tests, seconds (never a speed assertion)
WAIT = 30.0

#: the launched program: a child in a NEW session (as jupyter_client starts a
#: kernel) with the launch's environment, its pid written to ``argv[1]``
ESCAPING_CHILD = (
    "import os, subprocess, sys, time\n"
    "child = subprocess.Popen(['sleep', '600'], start_new_session=True)\n"
    "open(sys.argv[1] + '.tmp', 'w').write(str(child.pid))\n"
    "os.rename(sys.argv[1] + '.tmp', sys.argv[1])\n"
    "time.sleep(600)\n"
)


def kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


@pytest.fixture
def pids() -> Iterator[list[int]]:
    """Pids a test started (directly or through the engine): SIGKILLed at the end."""
    started: list[int] = []
    yield started
    for pid in started:
        kill(pid)


@pytest.fixture
def engine() -> LocalEngine:
    return LocalEngine(
        FakeDeviceBackend(inventory=["1 x H100"], node_name="node-a"), time_limit_grace=WAIT
    )


def launch_escaping(
    engine: LocalEngine, tmp_path: Path, pids: list[int], **kwargs: object
) -> tuple[Handle, int]:
    """Launch :data:`ESCAPING_CHILD`; its handle and its child's pid (both in ``pids``)."""
    pid_file = tmp_path / "child.pid"
    fields: dict[str, object] = {
        "argv": (sys.executable, "-c", ESCAPING_CHILD, str(pid_file)),
        "env": {"CUDA_VISIBLE_DEVICES": "GPU-0"},
        "cwd": str(tmp_path),
        "user": pwd.getpwuid(os.geteuid()).pw_name,
        "lease_id": 7,
        "tag": f"tree-test-{os.getpid()}-{time.monotonic_ns()}",
    }
    fields.update(kwargs)
    handle = engine.launch(LaunchSpec(**fields))  # type: ignore[arg-type]
    pids.append(int(handle.id))
    wait_for(pid_file.exists, "the launch's child to start")
    child = int(pid_file.read_text())
    pids.append(child)
    assert os.getsid(child) != os.getsid(int(handle.id))  # out of the launch's group
    return handle, child


def test_stop_ends_a_child_in_another_session(
    engine: LocalEngine, tmp_path: Path, pids: list[int]
) -> None:
    handle, child = launch_escaping(engine, tmp_path, pids)
    status = engine.stop(handle, grace=WAIT)
    assert status.state == "exited"
    assert status.signal == signal.SIGTERM
    wait_for(lambda: gone(child), "the child in its own session to end", timeout=5.0)


def test_a_time_limit_ends_a_child_in_another_session(
    engine: LocalEngine, tmp_path: Path, pids: list[int]
) -> None:
    handle, child = launch_escaping(engine, tmp_path, pids, time_limit=1.0)
    wait_for(lambda: not engine.poll(handle).running, "the time limit")
    assert engine.poll(handle).timed_out
    wait_for(lambda: gone(child), "the child in its own session to end", timeout=5.0)


def test_a_restarted_engine_stops_a_child_in_another_session(
    engine: LocalEngine, tmp_path: Path, pids: list[int]
) -> None:
    handle, child = launch_escaping(engine, tmp_path, pids)
    new = LocalEngine(engine.backend)  # the broker restarted
    assert new.stop(handle, grace=WAIT).state == "lost"
    wait_for(lambda: gone(child), "the child in its own session to end", timeout=5.0)
    engine.stop(handle, grace=0)  # the old one reaps it


def test_stop_spares_processes_without_the_launchs_tag(
    engine: LocalEngine, tmp_path: Path, pids: list[int]
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUBROKER_")}
    bystanders = [
        subprocess.Popen(["sleep", "600"], start_new_session=True, env=env),
        subprocess.Popen(
            ["sleep", "600"],
            start_new_session=True,
            env={**env, "GPUBROKER_LAUNCH_TAG": "another-launch"},
        ),
    ]
    pids.extend(p.pid for p in bystanders)
    handle, child = launch_escaping(engine, tmp_path, pids)
    engine.stop(handle, grace=WAIT)
    wait_for(lambda: gone(child), "the launch's child to end", timeout=5.0)
    for bystander in bystanders:
        assert bystander.poll() is None, "a process of no launch, or another, was signalled"
        bystander.kill()
        bystander.wait()
