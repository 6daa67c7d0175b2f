"""The local engine with real subprocesses and the fake device backend.

Every process a test starts is ended by the ``launch`` fixture's teardown
(by its pid's process group), whatever the test did.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import timezone
from pathlib import Path

import pytest

from gpubroker.devices.fake import FakeDeviceBackend
from gpubroker.engines import (
    DEFAULT_PATH,
    Engine,
    EngineError,
    Handle,
    LaunchSpec,
    LocalEngine,
    Node,
    Status,
)

#: upper bound of every wait in these tests, seconds (never a speed assertion)
WAIT = 30.0

Launch = Callable[..., Handle]


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def wait_exited(engine: LocalEngine, handle: Handle) -> Status:
    wait_for(lambda: not engine.poll(handle).running, f"{handle} to end")
    return engine.poll(handle)


def gone(pid: int) -> bool:
    """Whether ``pid`` no longer runs (a zombie counts as gone; so does one
    whose ``/proc`` entry went away between the two looks)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rpartition(b")")[2].split()[0] == b"Z"
    except (OSError, IndexError):
        return True


def me() -> str:
    return pwd.getpwuid(os.geteuid()).pw_name


def spec(code: str, cwd: Path, **kwargs: object) -> LaunchSpec:
    """A LaunchSpec running ``python -c code`` as the current user."""
    fields: dict[str, object] = {
        "argv": (sys.executable, "-c", code),
        "env": {},
        "cwd": str(cwd),
        "user": me(),
        "lease_id": 7,
    }
    fields.update(kwargs)
    return LaunchSpec(**fields)  # type: ignore[arg-type]


@pytest.fixture
def backend() -> FakeDeviceBackend:
    return FakeDeviceBackend(inventory=["2 x H100"], node_name="node-a")


@pytest.fixture
def engine(backend: FakeDeviceBackend) -> LocalEngine:
    return LocalEngine(backend)


@pytest.fixture
def launch() -> Iterator[Launch]:
    """``launch(engine, spec)``: launch and remember, to end it (by pid) afterwards."""
    started: list[tuple[LocalEngine, Handle]] = []

    def _launch(engine: LocalEngine, launch_spec: LaunchSpec) -> Handle:
        handle = engine.launch(launch_spec)
        started.append((engine, handle))
        return handle

    yield _launch
    for eng, handle in started:
        if eng.poll(handle).running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(int(handle.id), signal.SIGKILL)
        eng.stop(handle, grace=0)  # reaps it, and ends what is left of its group


def test_satisfies_the_engine_protocol(engine: LocalEngine) -> None:
    assert isinstance(engine, Engine)
    assert engine.name == "local"


def test_nodes_lists_the_backends_devices(engine: LocalEngine, backend: FakeDeviceBackend) -> None:
    nodes = engine.nodes()
    assert len(nodes) == 1
    node = nodes[0]
    assert isinstance(node, Node)
    assert node.name == "node-a"
    assert node.state == "up"
    assert node.devices == tuple(backend.devices())
    assert [d.index for d in node.devices] == [0, 1]
    assert {d.node for d in node.devices} == {"node-a"}
    assert all(d.name.startswith("NVIDIA H100") for d in node.devices)
    assert engine.node_name == "node-a"


def test_node_name_given_overrides_the_devices(backend: FakeDeviceBackend) -> None:
    (node,) = LocalEngine(backend, node_name="gpu-host-1").nodes()
    assert node.name == "gpu-host-1"
    assert {d.node for d in node.devices} == {"gpu-host-1"}


def test_telemetry_asks_the_backend_and_skips_unknown_uuids(
    engine: LocalEngine, backend: FakeDeviceBackend
) -> None:
    first, second = (d.uuid for d in backend.devices())
    backend.set_usage(first, utilization_gpu=80, memory_used_mib=2048)
    usage = engine.telemetry([first, "GPU-00000000-0000-0000-0000-000000000000", second])
    assert list(usage) == [first, second]
    assert usage[first].utilization_gpu == 80
    assert usage[first].memory_used_mib == 2048
    assert usage[second].memory_used_mib == 0
    assert engine.telemetry([]) == {}


def test_launch_poll_running_then_exit_code(
    engine: LocalEngine, launch: Launch, tmp_path: Path
) -> None:
    go = tmp_path / "go"
    code = (
        "import os, sys, time\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.01)\n"
        "sys.exit(3)\n"
    )
    handle = launch(engine, spec(code, tmp_path))
    assert handle.engine == "local"
    assert handle.node == "node-a"
    assert int(handle.id) > 0
    running = engine.poll(handle)
    assert running.state == "running"
    assert running.exit_code is None and running.signal is None and running.ended is None
    assert running.started is not None and running.started.tzinfo is timezone.utc

    go.touch()
    status = wait_exited(engine, handle)
    assert status.state == "exited"
    assert status.exit_code == 3
    assert status.signal is None
    assert status.started == running.started
    assert status.ended is not None and status.ended >= status.started
    assert not status.timed_out
    assert engine.poll(handle) == status  # the end is remembered


def test_killed_by_a_signal_reports_the_signal_and_no_exit_code(
    engine: LocalEngine, launch: Launch, tmp_path: Path
) -> None:
    handle = launch(engine, spec("import time; time.sleep(120)", tmp_path))
    engine.signal(handle, signal.SIGTERM)
    status = wait_exited(engine, handle)
    assert status.state == "exited"
    assert status.signal == signal.SIGTERM
    assert status.exit_code is None
    engine.signal(handle, signal.SIGTERM)  # ended: does nothing


def test_stop_ends_with_sigkill_when_sigterm_is_ignored(
    engine: LocalEngine, launch: Launch, tmp_path: Path
) -> None:
    ready = tmp_path / "ready"
    code = (
        "import signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        f"open({str(ready)!r}, 'w').close()\n"
        "time.sleep(120)\n"
    )
    handle = launch(engine, spec(code, tmp_path))
    wait_for(ready.exists, "the child to ignore SIGTERM")
    status = engine.stop(handle, grace=0.5)
    assert status.state == "exited"
    assert status.signal == signal.SIGKILL
    assert status.exit_code is None
    assert gone(int(handle.id))


def test_stop_lets_a_sigterm_handler_exit_cleanly(
    engine: LocalEngine, launch: Launch, tmp_path: Path
) -> None:
    ready = tmp_path / "ready"
    code = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
        f"open({str(ready)!r}, 'w').close()\n"
        "time.sleep(120)\n"
    )
    handle = launch(engine, spec(code, tmp_path))
    wait_for(ready.exists, "the child to trap SIGTERM")
    status = engine.stop(handle, grace=WAIT)
    assert status.state == "exited"
    assert status.exit_code == 0
    assert status.signal is None
    assert engine.stop(handle, grace=WAIT) == status  # stopping again: same status


def test_stop_ends_the_whole_process_group(
    engine: LocalEngine, launch: Launch, tmp_path: Path
) -> None:
    pid_file = tmp_path / "grandchild"
    code = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(120)\n"
    )
    handle = launch(engine, spec(code, tmp_path))
    wait_for(lambda: pid_file.exists() and pid_file.read_text() != "", "the grandchild")
    grandchild = int(pid_file.read_text())
    try:
        status = engine.stop(handle, grace=WAIT)
        assert status.state == "exited"
        assert status.signal == signal.SIGTERM
        wait_for(lambda: gone(grandchild), "the grandchild to end")
    finally:
        if not gone(grandchild):
            os.kill(grandchild, signal.SIGKILL)


def test_environment_is_exactly_the_specs(
    engine: LocalEngine, launch: Launch, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUBROKER_TEST_LEAK_MARKER", "must-not-leak")
    out = tmp_path / "env.txt"
    env = {"LEASE_VAR": "x=y z", "CUDA_VISIBLE_DEVICES": "GPU-1"}
    # "env" is found through the PATH the engine adds (DEFAULT_PATH)
    handle = launch(engine, spec("", tmp_path, argv=("env",), env=env, stdout=str(out)))
    status = wait_exited(engine, handle)
    assert status.exit_code == 0
    seen = dict(line.split("=", 1) for line in out.read_text().splitlines())
    assert seen.pop("GPUBROKER_LAUNCH_TAG").startswith("untagged-")  # every launch's tag
    assert seen == {**env, "PATH": DEFAULT_PATH}
    assert "GPUBROKER_TEST_LEAK_MARKER" not in seen
    assert not set(seen) - set(env) - {"PATH"}


def test_a_path_in_the_spec_is_kept(engine: LocalEngine, launch: Launch, tmp_path: Path) -> None:
    out = tmp_path / "path.txt"
    code = "import os; print(os.environ['PATH'])"
    handle = launch(engine, spec(code, tmp_path, env={"PATH": "/opt/x/bin"}, stdout=str(out)))
    assert wait_exited(engine, handle).exit_code == 0
    assert out.read_text() == "/opt/x/bin\n"


def test_output_files_are_appended_and_cwd_is_used(
    engine: LocalEngine, launch: Launch, tmp_path: Path
) -> None:
    out, err = tmp_path / "out.log", tmp_path / "err.log"
    out.write_text("before\n")
    code = "import os, sys; print(os.getcwd()); print('oops', file=sys.stderr)"
    for _ in range(2):
        handle = launch(engine, spec(code, tmp_path, stdout=str(out), stderr=str(err)))
        assert wait_exited(engine, handle).exit_code == 0
    assert out.read_text() == f"before\n{tmp_path}\n{tmp_path}\n"
    assert err.read_text() == "oops\noops\n"

    both = tmp_path / "both.log"
    handle = launch(engine, spec(code, tmp_path, stdout=str(both), stderr=str(both)))
    assert wait_exited(engine, handle).exit_code == 0
    assert sorted(both.read_text().splitlines()) == sorted([str(tmp_path), "oops"])


def test_time_limit_ends_the_process(
    backend: FakeDeviceBackend, launch: Launch, tmp_path: Path
) -> None:
    engine = LocalEngine(backend, time_limit_grace=WAIT)
    handle = launch(engine, spec("import time; time.sleep(120)", tmp_path, time_limit=0.2))
    status = wait_exited(engine, handle)
    assert status.timed_out
    assert status.signal == signal.SIGTERM
    assert status.exit_code is None


def test_unknown_handle_after_a_restart_is_polled_by_pid(
    backend: FakeDeviceBackend, launch: Launch, tmp_path: Path
) -> None:
    old = LocalEngine(backend)
    handle = launch(old, spec("import time; time.sleep(120)", tmp_path))
    new = LocalEngine(backend)  # the broker restarted
    status = new.poll(handle)
    assert status == Status(state="running")  # no start time known
    old.stop(handle, grace=WAIT)  # the old one reaps it
    assert new.poll(handle) == Status(state="lost")
    assert new.stop(handle, grace=0) == Status(state="lost")
    new.signal(handle, signal.SIGTERM)  # gone: does nothing


def test_a_restarted_engine_never_signals_a_process_that_reused_a_launchs_pid(
    backend: FakeDeviceBackend, tmp_path: Path
) -> None:
    """After a reboot (or a long outage) a job's stored pid may belong to
    another process, e.g. a daemon that leads its own process group. It
    counted as the job ``running``, and a cancel or time limit sent SIGTERM
    and SIGKILL to its group, as root. A process without the launch tag
    every launch carries is no launch of this engine: ``lost``, untouched."""
    stranger = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)"],
        start_new_session=True,  # leads its own process group, as a daemon does
        env={k: v for k, v in os.environ.items() if not k.startswith("GPUBROKER_")},
    )
    try:
        engine = LocalEngine(backend)
        handle = Handle(engine="local", id=str(stranger.pid), node="node-a")
        assert engine.poll(handle) == Status(state="lost")
        assert engine.stop(handle, grace=0) == Status(state="lost")
        engine.signal(handle, signal.SIGKILL)
        # never signalled: it ends by the test's own SIGTERM (a SIGKILL from
        # the engine, delivered late, would have made it -SIGKILL)
        os.kill(stranger.pid, signal.SIGTERM)
        assert stranger.wait(10) == -signal.SIGTERM
    finally:
        stranger.kill()
        stranger.wait()


def test_every_launch_carries_a_tag(engine: LocalEngine, launch: Launch, tmp_path: Path) -> None:
    out = tmp_path / "tag"
    code = f"import os; open({str(out)!r}, 'w').write(os.environ['GPUBROKER_LAUNCH_TAG'])"
    handle = launch(engine, spec(code, tmp_path))
    wait_exited(engine, handle)
    assert out.read_text().startswith("untagged-")


def test_a_restarted_engine_can_stop_an_old_process(
    backend: FakeDeviceBackend, launch: Launch, tmp_path: Path
) -> None:
    old = LocalEngine(backend)
    handle = launch(old, spec("import time; time.sleep(120)", tmp_path))
    new = LocalEngine(backend)
    status = new.stop(handle, grace=WAIT)
    assert status.state == "lost"  # ended, but how is not known to the new engine
    final = wait_exited(old, handle)
    assert final.signal == signal.SIGTERM


def test_unknown_pid_that_is_no_group_leader_is_refused(
    backend: FakeDeviceBackend, launch: Launch, tmp_path: Path
) -> None:
    old = LocalEngine(backend)
    pid_file = tmp_path / "grandchild"
    code = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(120)\n"
    )
    handle = launch(old, spec(code, tmp_path))
    wait_for(lambda: pid_file.exists() and pid_file.read_text() != "", "the grandchild")
    grandchild = int(pid_file.read_text())
    try:
        new = LocalEngine(backend)
        stranger = Handle(engine="local", id=str(grandchild), node="node-a")
        assert new.poll(stranger).state == "running"
        with pytest.raises(EngineError, match="not a process-group leader"):
            new.signal(stranger, signal.SIGTERM)
        with pytest.raises(EngineError, match="not a process-group leader"):
            new.stop(stranger, grace=0)
        assert not gone(grandchild)
        old.stop(handle, grace=WAIT)
        wait_for(lambda: gone(grandchild), "the grandchild to end")
    finally:
        if not gone(grandchild):
            os.kill(grandchild, signal.SIGKILL)


@pytest.mark.parametrize(
    "handle, message",
    [
        (Handle(engine="docker", id="1", node="node-a"), "not a handle of the local engine"),
        (Handle(engine="local", id="1", node="node-b"), "node 'node-b'"),
        (Handle(engine="local", id="abc", node="node-a"), "not a pid"),
        (Handle(engine="local", id="0", node="node-a"), "not a pid"),
    ],
)
def test_foreign_handles_are_refused(engine: LocalEngine, handle: Handle, message: str) -> None:
    for call in (
        lambda: engine.poll(handle),
        lambda: engine.signal(handle, signal.SIGTERM),
        lambda: engine.stop(handle, grace=0),
    ):
        with pytest.raises(EngineError, match=message):
            call()


def test_launch_failures_name_the_cause(
    engine: LocalEngine, backend: FakeDeviceBackend, tmp_path: Path
) -> None:
    with pytest.raises(EngineError, match="No such file") as missing_program:
        engine.launch(spec("", tmp_path, argv=(str(tmp_path / "no-such-program"),)))
    if engine.cgroups is None:  # the broker exec'd it: the OSError is chained
        assert isinstance(missing_program.value.__cause__, OSError)
    else:  # the helper exec'd it in the launch's cgroup, and reports the error
        assert "FileNotFoundError: [Errno 2]" in str(missing_program.value)
    with pytest.raises(EngineError, match="no-such-dir"):
        engine.launch(spec("pass", tmp_path / "no-such-dir"))
    with pytest.raises(EngineError, match="no user 'no-such-user-xyz'"):
        engine.launch(spec("pass", tmp_path, user="no-such-user-xyz"))
    with pytest.raises(EngineError, match="cannot open output file"):
        engine.launch(spec("pass", tmp_path, stdout=str(tmp_path / "no-dir" / "out")))
    with pytest.raises(EngineError, match="devices not on node node-a: GPU-nope"):
        engine.launch(spec("pass", tmp_path, devices=("GPU-nope",)))


def test_launch_accepts_the_nodes_devices(
    engine: LocalEngine, backend: FakeDeviceBackend, launch: Launch, tmp_path: Path
) -> None:
    uuids = tuple(d.uuid for d in backend.devices())
    handle = launch(engine, spec("pass", tmp_path, devices=uuids))
    assert wait_exited(engine, handle).exit_code == 0


def test_another_user_needs_root(
    engine: LocalEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip(reason="no user 'nobody'")
    monkeypatch.setattr(os, "geteuid", lambda: nobody.pw_uid)  # the broker runs as nobody
    with pytest.raises(EngineError, match=r"runs as 'nobody'.*run it as root"):
        engine.launch(spec("pass", tmp_path, user="root"))


def test_launch_as_another_user(
    backend: FakeDeviceBackend, launch: Launch, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if os.geteuid() != 0:
        pytest.skip(reason="needs root to switch users")
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip(reason="no user 'nobody'")
    helper = shutil.which("python3", path="/usr/bin:/bin")
    if helper is None:
        pytest.skip(reason="no /usr/bin/python3 for the as-user helper")
    monkeypatch.setenv("GPUBROKER_TEST_LEAK_MARKER", "must-not-leak")
    engine = LocalEngine(backend, helper_python=helper)
    home = Path(tempfile.mkdtemp(prefix="gpubroker-engine-"))
    try:
        os.chmod(home, 0o700)
        os.chown(home, nobody.pw_uid, nobody.pw_gid)
        out = home / "env.txt"
        argv = ("sh", "-c", "id -u; pwd; exec env >&2")
        env = {"LEASE_VAR": "1"}
        handle = launch(
            engine,
            LaunchSpec(
                argv=argv,
                env=env,
                cwd=str(home),
                user="nobody",
                lease_id=1,
                stdout=str(out),
                stderr=str(home / "err.txt"),
            ),
        )
        assert wait_exited(engine, handle).exit_code == 0
        assert out.read_text().splitlines() == [str(nobody.pw_uid), str(home)]
        assert out.stat().st_uid == nobody.pw_uid  # opened as the user
        seen = dict(line.split("=", 1) for line in (home / "err.txt").read_text().splitlines())
        seen.pop("PWD", None)  # sh's own
        assert seen.pop("GPUBROKER_LAUNCH_TAG").startswith("untagged-")
        assert seen == {**env, "PATH": DEFAULT_PATH}

        # the user's rights decide: nobody may not enter root's tmp_path
        os.chmod(tmp_path, 0o700)
        with pytest.raises(EngineError, match="Permission denied"):
            engine.launch(
                LaunchSpec(argv=("true",), env={}, cwd=str(tmp_path), user="nobody", lease_id=1)
            )
    finally:
        shutil.rmtree(home, ignore_errors=True)


def test_launch_spec_validation_and_read_only_env() -> None:
    with pytest.raises(ValueError, match="argv"):
        LaunchSpec(argv=(), env={}, cwd="/", user="u", lease_id=1)
    with pytest.raises(ValueError, match="time_limit"):
        LaunchSpec(argv=("x",), env={}, cwd="/", user="u", lease_id=1, time_limit=0)
    with pytest.raises(ValueError, match="str to str"):
        LaunchSpec(argv=("x",), env={"A": 1}, cwd="/", user="u", lease_id=1)  # type: ignore[dict-item]
    source = {"A": "1"}
    launch_spec = LaunchSpec(argv=["x"], env=source, cwd="/", user="u", lease_id=1)  # type: ignore[arg-type]
    source["B"] = "2"
    assert dict(launch_spec.env) == {"A": "1"}
    assert launch_spec.argv == ("x",)
    with pytest.raises(TypeError):
        launch_spec.env["C"] = "3"  # type: ignore[index]
    with pytest.raises(ValueError, match="state"):
        Status(state="finished")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="state"):
        Node(name="n", state="broken")  # type: ignore[arg-type]


def test_stop_reaps_without_warnings(engine: LocalEngine, launch: Launch, tmp_path: Path) -> None:
    """A stopped process leaves no zombie (subprocess would warn of one)."""
    handle = launch(engine, spec("import time; time.sleep(120)", tmp_path))
    engine.stop(handle, grace=WAIT)
    with pytest.raises(ChildProcessError):
        os.waitpid(int(handle.id), os.WNOHANG)


def _child_code(pid_file: Path, child: str, then: str = "") -> str:
    """Code that starts ``child`` (Python code) in a session of its own,
    writes its pid to ``pid_file``, then runs ``then`` and exits 0."""
    return (
        "import subprocess, sys\n"
        f"c = subprocess.Popen([sys.executable, '-c', {child!r}], start_new_session=True)\n"
        f"open({str(pid_file)!r}, 'w').write(str(c.pid))\n" + then
    )


def _stubborn(ready: Path) -> str:
    """Python code that ignores SIGTERM, creates ``ready``, then sleeps."""
    return (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        f"open({str(ready)!r}, 'w').close(); time.sleep(120)"
    )


def _wait_for_file(path: Path) -> str:
    """Python code that waits until ``path`` exists."""
    return f"import os, time\nwhile not os.path.exists({str(path)!r}): time.sleep(0.01)\n"


def test_a_launch_runs_until_the_processes_its_leader_left_have_ended(
    backend: FakeDeviceBackend, launch: Launch, tmp_path: Path
) -> None:
    """A job whose leader exits but leaves a process behind (``cmd &``, a
    notebook's ``Popen(start_new_session=True)``) ended at once, and its
    lease was released while that process ran on its GPU (a review of
    the jobs). Now the launch runs until the processes it left have
    ended: SIGTERM at the leader's exit, SIGKILL ``time_limit_grace``
    seconds later to one that ignores it; the leader's exit code stays."""
    engine = LocalEngine(backend, time_limit_grace=0.5)
    pid_file, ready = tmp_path / "left", tmp_path / "ready"
    # the leader exits once its child ignores SIGTERM
    code = _child_code(pid_file, _stubborn(ready), _wait_for_file(ready))
    handle = launch(engine, spec(code, tmp_path))
    wait_for(lambda: pid_file.exists() and pid_file.read_text() != "", "the child")
    left = int(pid_file.read_text())
    try:
        wait_for(lambda: engine._procs[int(handle.id)].popen.poll() is not None, "the leader")
        assert engine.poll(handle).running  # its child still runs: so does the launch
        status = wait_exited(engine, handle)
        assert gone(left)
        assert (status.state, status.exit_code, status.signal) == ("exited", 0, None)
    finally:
        if not gone(left):
            os.kill(left, signal.SIGKILL)


def test_stop_ends_a_process_that_forks_away_from_each_kill(
    engine: LocalEngine, launch: Launch, tmp_path: Path
) -> None:
    """One SIGKILL pass over ``/proc`` missed a process that ignores SIGTERM
    and forks again and again in a session of its own: its new pid was not
    listed yet. Its whole group is now killed, until none is left. (One
    that forks without pause lives too briefly to be seen in ``/proc`` at
    all: docs/jobs.md says so.)"""
    pid_file = tmp_path / "hopper"
    hopper = (
        "import os, signal, sys\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "import time\n"
        "while True:\n"
        "    time.sleep(0.2)\n"
        "    if os.fork():\n"
        "        os._exit(0)\n"
        f"    open({str(pid_file)!r} + '.tmp', 'w').write(str(os.getpid()))\n"
        f"    os.replace({str(pid_file)!r} + '.tmp', {str(pid_file)!r})\n"
    )
    handle = launch(
        engine,
        spec(_child_code(tmp_path / "first", hopper, "import time; time.sleep(120)"), tmp_path),
    )
    wait_for(lambda: pid_file.exists(), "the hopper")
    mark = engine._procs[int(handle.id)].mark
    try:
        engine.stop(handle, grace=0.2)
        assert not LocalEngine._launch_alive(int(handle.id), mark)
        last = pid_file.read_text()
        time.sleep(0.6)  # a hopper left would have written a new pid (every 0.2 s)
        assert pid_file.read_text() == last
    finally:
        LocalEngine._kill_until_gone(int(handle.id), mark, set())


@contextlib.contextmanager
def _adopted_leader_exits(
    backend: FakeDeviceBackend, launch: Launch, tmp_path: Path, grace: float
) -> Iterator[tuple[LocalEngine, Handle, int]]:
    """A launch of an engine before a broker restart whose leader leaves a
    child that ignores SIGTERM; a new engine (``time_limit_grace`` ``grace``)
    polls it while the leader runs, then the leader exits. Yields the new
    engine, the handle and the child's pid (killed at the end if left)."""
    old = LocalEngine(backend)
    pid_file, ready, go = tmp_path / "left", tmp_path / "ready", tmp_path / "go"
    code = _child_code(pid_file, _stubborn(ready), _wait_for_file(go))
    handle = launch(old, spec(code, tmp_path))
    wait_for(lambda: ready.exists() and pid_file.read_text() != "", "the child")
    left = int(pid_file.read_text())
    try:
        new = LocalEngine(backend, time_limit_grace=grace)  # the broker restarted
        assert new.poll(handle) == Status(state="running")  # the leader runs
        go.touch()
        wait_for(lambda: old._procs[int(handle.id)].popen.poll() is not None, "the leader")
        yield new, handle, left
    finally:
        if not gone(left):
            os.kill(left, signal.SIGKILL)


def test_a_restarted_engine_ends_what_an_adopted_launchs_leader_left(
    backend: FakeDeviceBackend, launch: Launch, tmp_path: Path
) -> None:
    """After a broker restart, a job's leader that exited leaving a
    process behind was ``lost`` at once, and its lease released while
    that process ran on its GPU (stop 45's leftover). The new engine reads
    the launch's mark while the leader runs; once the leader exits, the
    launch runs until what it left has ended (SIGTERM, then SIGKILL
    ``time_limit_grace`` later to one that ignores it), then is ``lost``
    (its exit status is the old engine's)."""
    with _adopted_leader_exits(backend, launch, tmp_path, 0.5) as (new, handle, left):
        assert new.poll(handle) == Status(state="running")  # what it left runs on
        wait_for(lambda: new.poll(handle) == Status(state="lost"), "the end of the launch")
        assert gone(left)


def test_a_restarted_engine_stops_what_an_adopted_launchs_leader_left(
    backend: FakeDeviceBackend, launch: Launch, tmp_path: Path
) -> None:
    """A cancel after the adopted leader has exited ends what it left, one
    that ignores SIGTERM included (the leader's pid is no longer
    adoptable: before, nothing was signalled)."""
    with _adopted_leader_exits(backend, launch, tmp_path, 60) as (new, handle, left):
        assert new.poll(handle).running  # SIGTERM sent, ignored
        assert new.stop(handle, grace=0.2) == Status(state="lost")
        assert gone(left)


# -- one cgroup per launch (where the host has cgroup v2) -----------------------------

needs_cgroups = pytest.mark.skipif(
    LocalEngine(FakeDeviceBackend()).cgroups is None,
    reason="no writable cgroup v2 hierarchy here: launches are tracked through /proc alone",
)


@needs_cgroups
def test_stop_ends_a_process_that_forks_without_pause(
    engine: LocalEngine, launch: Launch, tmp_path: Path
) -> None:
    """A process that ignores SIGTERM and forks continuously in a session of
    its own lived too briefly to be seen in ``/proc`` and escaped a stop
    (stop 45's documented limit). Every process of a launch is in the
    launch's cgroup, which ``cgroup.kill`` empties at once."""
    count = tmp_path / "count"
    hopper = (
        "import os, signal\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "n = 0\n"
        "while True:\n"
        "    if os.fork():\n"
        "        os._exit(0)\n"
        "    n += 1\n"
        "    if n % 500 == 0:\n"
        f"        open({str(count)!r}, 'w').write(str(n))\n"
    )
    handle = launch(
        engine,
        spec(_child_code(tmp_path / "first", hopper, "import time; time.sleep(120)"), tmp_path),
    )
    wait_for(lambda: count.exists(), "the hopper")
    group = Path(engine._procs[int(handle.id)].mark.cgroup)
    assert group.parent == engine.cgroups.root  # type: ignore[union-attr]
    engine.stop(handle, grace=0.2)
    assert not group.exists()  # emptied, then removed
    last = count.read_text()
    time.sleep(0.5)  # a hopper left would have counted on
    assert count.read_text() == last


@needs_cgroups
def test_a_process_that_drops_the_tag_still_ends_with_its_launch(
    backend: FakeDeviceBackend, launch: Launch, tmp_path: Path
) -> None:
    """A process started with an environment of its own (``env -i``) drops
    the launch's tag, so a look through ``/proc`` cannot find it; it stays
    in the launch's cgroup, so the launch runs until it has ended."""
    engine = LocalEngine(backend, time_limit_grace=0.5)
    pid_file, ready = tmp_path / "left", tmp_path / "ready"
    leader = (
        "import subprocess, sys\n"
        f"c = subprocess.Popen(['env', '-i', sys.executable, '-c', {_stubborn(ready)!r}],"
        " start_new_session=True)\n"
        f"open({str(pid_file)!r}, 'w').write(str(c.pid))\n"
        + _wait_for_file(ready)  # the leader exits once its child ignores SIGTERM
    )
    handle = launch(engine, spec(leader, tmp_path))
    wait_for(lambda: pid_file.exists() and pid_file.read_text() != "", "the child")
    left = int(pid_file.read_text())
    try:
        wait_for(lambda: engine._procs[int(handle.id)].popen.poll() is not None, "the leader")
        assert engine.poll(handle).running  # its tagless child still runs
        status = wait_exited(engine, handle)
        assert gone(left)
        assert (status.state, status.exit_code) == ("exited", 0)
    finally:
        if not gone(left):
            os.kill(left, signal.SIGKILL)


@needs_cgroups
def test_two_launches_with_one_tag_never_share_a_cgroup(
    engine: LocalEngine, launch: Launch, tmp_path: Path
) -> None:
    """``mkdir(exist_ok=True)`` put a second launch with the same tag in the
    first's cgroup, whatever its user: stopping one killed the other. A
    launch's cgroup is named by its first process's pid and its tag; a
    cgroup in use gets a new name; an empty one is used again."""
    first = launch(engine, spec("import time; time.sleep(120)", tmp_path, tag="same"))
    taken = Path(engine._procs[int(first.id)].mark.cgroup)
    assert taken.name == f"pid-{first.id}-same"
    cgroups = engine.cgroups
    assert cgroups is not None
    other = cgroups.create(taken.name)
    try:
        assert other != taken and other.name.startswith(f"{taken.name}-")
        assert cgroups.create(other.name) == other  # empty: used again
    finally:
        cgroups.remove(other)
    engine.stop(first, grace=WAIT)


@needs_cgroups
def test_a_launch_never_starts_outside_its_cgroup(
    engine: LocalEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The helper went on to the program when the broker failed between the
    fork and the move (its gate's pipe closed): the job ran outside any
    cgroup, and the empty cgroup was left behind. Now it starts only once
    the broker says so."""
    ran = tmp_path / "ran"

    def broker_fails(group: Path, pid: int) -> bool:
        raise RuntimeError("the broker failed here")

    monkeypatch.setattr(engine, "_move_into", broker_fails)
    before = set(engine.cgroups.root.iterdir())  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="the broker failed here"):
        engine.launch(spec(f"open({str(ran)!r}, 'w').close()", tmp_path, tag="gated"))
    time.sleep(0.5)  # a helper that went on would have run the program by now
    assert not ran.exists()
    assert set(engine.cgroups.root.iterdir()) == before  # type: ignore[union-attr]


@needs_cgroups
def test_a_restarted_engine_ends_what_a_launch_left_while_no_broker_ran(
    backend: FakeDeviceBackend, launch: Launch, tmp_path: Path
) -> None:
    """A job's first process that exited while no broker ran counted as lost
    at once: what it left ran on, in its cgroup, for ever. The cgroup is
    named by the first process's pid, so the restarted engine finds it,
    ends what is left (SIGTERM, then SIGKILL), and removes it."""
    old = LocalEngine(backend)
    pid_file, ready = tmp_path / "left", tmp_path / "ready"
    code = _child_code(pid_file, _stubborn(ready), _wait_for_file(ready))
    handle = launch(old, spec(code, tmp_path))
    group = Path(old._procs[int(handle.id)].mark.cgroup)
    assert group.name.startswith(f"pid-{handle.id}-")
    wait_for(lambda: ready.exists() and pid_file.read_text() != "", "the child")
    left = int(pid_file.read_text())
    try:
        # the broker is down while the first process exits (nobody polls it)
        wait_for(lambda: gone(int(handle.id)), "the first process")
        new = LocalEngine(backend, time_limit_grace=0.5)  # the broker restarted
        assert new.poll(handle) == Status(state="running")  # what it left runs on
        wait_for(lambda: new.poll(handle) == Status(state="lost"), "the end of the launch")
        assert gone(left)
        assert not group.exists()
    finally:
        if not gone(left):
            os.kill(left, signal.SIGKILL)
