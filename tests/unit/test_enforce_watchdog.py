"""The share watchdog: the pure judgement, and the OS part on real processes."""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from gpubroker.enforce.watchdog import (
    Overuse,
    ProcessSample,
    ShareCap,
    ShareWatchdog,
    Terminate,
    Withdrawn,
    end_process,
    lease_of_pid,
    parent_pid,
)

GPU = "GPU-11111111-2222-3333-4444-555555555555"
OTHER_GPU = "GPU-66666666-7777-8888-9999-000000000000"
T0 = dt.datetime(2001, 2, 3, 4, 5, 6, tzinfo=dt.timezone.utc)  # far from the real clock


def at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def owners(mapping: dict[int, int]) -> dict[int, int]:
    return mapping


CAPS = {
    1: ShareCap(lease_id=1, user="ann", device_uuid=GPU, cap_mib=1000),
    2: ShareCap(lease_id=2, user="bob", device_uuid=GPU, cap_mib=4000),
}
PIDS = {100: 1, 101: 1, 102: 1, 200: 2}


@pytest.fixture
def dog() -> ShareWatchdog:
    return ShareWatchdog(grace=60, tolerance_mib=0)


def sample(pid: int, mib: int, device: str = GPU) -> ProcessSample:
    return ProcessSample(device_uuid=device, pid=pid, used_memory_mib=mib)


# -- the judgement -----------------------------------------------------------------------


def test_warn_then_terminate_after_grace(dog: ShareWatchdog) -> None:
    over = [sample(100, 2000)]
    first = dog.judge(over, CAPS, PIDS.get, at(0))
    assert first == [Overuse(1, "ann", GPU, 100, 2000, 1000, at(60), 2000)]
    assert dog.judge(over, CAPS, PIDS.get, at(59.9)) == []
    (end,) = dog.judge(over, CAPS, PIDS.get, at(60))
    assert isinstance(end, Terminate)
    assert (end.lease_id, end.user, end.device_uuid, end.pid) == (1, "ann", GPU, 100)
    assert (end.used_mib, end.cap_mib, end.lease_used_mib) == (2000, 1000, 2000)
    assert "2000 MiB of 1000 MiB" in end.reason and "process 100" in end.reason
    # NVML may still list it while it dies: ended once, not again
    assert dog.judge(over, CAPS, PIDS.get, at(120)) == []


def test_withdrawn_when_back_under_cap(dog: ShareWatchdog) -> None:
    assert len(dog.judge([sample(100, 2000)], CAPS, PIDS.get, at(0))) == 1
    assert dog.judge([sample(100, 900)], CAPS, PIDS.get, at(30)) == [Withdrawn(1, 100)]
    assert dog.judge([sample(100, 900)], CAPS, PIDS.get, at(90)) == []
    # over again later: a new warning with a new deadline, not an immediate end
    again = dog.judge([sample(100, 2000)], CAPS, PIDS.get, at(100))
    assert again == [Overuse(1, "ann", GPU, 100, 2000, 1000, at(160), 2000)]


def test_tolerance_is_slack_over_the_cap() -> None:
    dog = ShareWatchdog(grace=60, tolerance_mib=256)
    assert dog.judge([sample(100, 1256)], CAPS, PIDS.get, at(0)) == []
    (warn,) = dog.judge([sample(100, 1257)], CAPS, PIDS.get, at(1))
    assert isinstance(warn, Overuse)


def test_other_share_on_the_same_device_is_untouched(dog: ShareWatchdog) -> None:
    samples = [sample(100, 2000), sample(200, 3000)]  # bob's 3000 MiB is within his 4000
    actions = [a for t in (0, 60, 120) for a in dog.judge(samples, CAPS, PIDS.get, at(t))]
    assert actions  # ann's overuse is acted on ...
    assert all(a.lease_id == 1 and a.pid == 100 for a in actions)  # ... bob's share is not


def test_unknown_pids_and_non_share_leases_are_ignored(
    dog: ShareWatchdog, caplog: pytest.LogCaptureFixture
) -> None:
    samples = [sample(300, 50000), sample(400, 50000)]
    lookup = {400: 9}.get  # lease 9 is no share (e.g. a whole device)
    caplog.set_level("DEBUG")
    assert dog.judge(samples, CAPS, lookup, at(0)) == []
    assert dog.judge(samples, CAPS, lookup, at(600)) == []
    assert "Process 300 on" in caplog.text and "belongs to no lease" in caplog.text


def test_a_leases_processes_on_another_device_do_not_count(dog: ShareWatchdog) -> None:
    assert dog.judge([sample(100, 900), sample(101, 900, OTHER_GPU)], CAPS, PIDS.get, at(0)) == []


def test_sum_of_a_leases_processes_and_only_the_largest_are_ended(dog: ShareWatchdog) -> None:
    samples = [sample(101, 500), sample(100, 600)]  # 1100 MiB together, cap 1000
    assert dog.judge(samples, CAPS, PIDS.get, at(0)) == [
        Overuse(1, "ann", GPU, 100, 600, 1000, at(60), 1100)
    ]
    (end,) = dog.judge(samples, CAPS, PIDS.get, at(60))
    assert isinstance(end, Terminate) and end.pid == 100 and end.lease_used_mib == 1100
    # pid 100 still listed while it dies: left out of the sum, so 101 is fine
    assert dog.judge(samples, CAPS, PIDS.get, at(61)) == []
    assert dog.judge([sample(101, 500)], CAPS, PIDS.get, at(62)) == []


def test_as_many_processes_as_needed_largest_first(dog: ShareWatchdog) -> None:
    samples = [sample(100, 500), sample(101, 700), sample(102, 600)]  # 1800 MiB, cap 1000
    warned = dog.judge(samples, CAPS, PIDS.get, at(0))
    assert [(type(a), a.pid) for a in warned] == [(Overuse, 101), (Overuse, 102)]
    ended = dog.judge(samples, CAPS, PIDS.get, at(60))
    assert [(type(a), a.pid) for a in ended] == [(Terminate, 101), (Terminate, 102)]


def test_state_of_vanished_processes_and_leases_is_forgotten(dog: ShareWatchdog) -> None:
    dog.judge([sample(100, 2000)], CAPS, PIDS.get, at(0))
    assert dog.judge([], CAPS, PIDS.get, at(10)) == []  # the process exited: no withdrawal
    assert dog.warned == {}
    # the pid comes back (reused or restarted): a fresh warning
    (warn,) = dog.judge([sample(100, 2000)], CAPS, PIDS.get, at(70))
    assert isinstance(warn, Overuse) and warn.deadline == at(130)
    # the lease is released: forgotten
    assert dog.judge([sample(100, 2000)], {2: CAPS[2]}, PIDS.get, at(200)) == []
    assert dog.warned == {} and dog.ended == set()


def test_lease_of_pid_is_asked_once_per_pid(dog: ShareWatchdog) -> None:
    asked: list[int] = []

    def lookup(pid: int) -> int | None:
        asked.append(pid)
        return PIDS.get(pid)

    samples = [sample(100, 400), sample(100, 400, OTHER_GPU), sample(200, 10)]
    dog.judge(samples, CAPS, lookup, at(0))
    assert sorted(asked) == [100, 200]


# -- the OS part ---------------------------------------------------------------------

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]
#: says "ready" once it runs (its /proc/<pid>/environ is then the new one)
READY_SLEEPER = [sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"]


def start_ready(env: dict[str, str]) -> subprocess.Popen[bytes]:
    """A sleeper with ``env``, returned once it runs."""
    proc = subprocess.Popen(READY_SLEEPER, env=env, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == b"ready"
    proc.stdout.close()
    return proc


def kill_quietly(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Children started by a test; each killed and reaped by pid at the end."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        yield procs
    finally:
        for proc in procs:
            kill_quietly(proc.pid)
            proc.wait(timeout=10)


def test_lease_of_pid_reads_the_environment(children: list[subprocess.Popen[bytes]]) -> None:
    child = start_ready({**os.environ, "GPUBROKER_LEASE_ID": "42"})
    children.append(child)
    assert lease_of_pid(child.pid) == 42
    other = start_ready({**os.environ, "GPUBROKER_LEASE_ID": "not-a-number"})
    children.append(other)
    assert lease_of_pid(other.pid) is None


def test_lease_of_pid_walks_up_to_the_parent(children: list[subprocess.Popen[bytes]]) -> None:
    env = {k: v for k, v in os.environ.items() if k != "GPUBROKER_LEASE_ID"}
    shell = subprocess.Popen(
        [
            "sh",
            "-c",
            f"env -u GPUBROKER_LEASE_ID {sys.executable} -c "
            "'import time; print(\"ready\", flush=True); time.sleep(60)' & echo $!; wait",
        ],
        env={**env, "GPUBROKER_LEASE_ID": "42"},
        stdout=subprocess.PIPE,
    )
    children.append(shell)
    assert shell.stdout is not None
    grandchild = int(shell.stdout.readline())
    try:
        assert shell.stdout.readline().strip() == b"ready"  # env has exec'd python
        shell.stdout.close()
        with open(f"/proc/{grandchild}/environ", "rb") as f:
            assert b"GPUBROKER_LEASE_ID=" not in f.read()
        assert parent_pid(grandchild) == shell.pid
        assert lease_of_pid(grandchild) == 42
        assert lease_of_pid(grandchild, max_depth=0) is None
    finally:
        kill_quietly(grandchild)


def test_lease_of_pid_without_a_lease_or_process() -> None:
    assert lease_of_pid(1) is None
    done = subprocess.Popen([sys.executable, "-c", "pass"], env={"GPUBROKER_LEASE_ID": "7"})
    done.wait(timeout=30)
    assert lease_of_pid(done.pid) is None  # gone


def test_end_process_terminates(
    children: list[subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A zombie counts as ended: SIGTERM alone, no SIGKILL after waiting the
    zombie out (the child stays unreaped until ``wait``)."""
    child = subprocess.Popen(SLEEPER)
    children.append(child)
    sent: list[int] = []
    kill = os.kill

    def recorded(pid: int, signum: int) -> None:
        if pid == child.pid and signum:
            sent.append(signum)
        kill(pid, signum)

    monkeypatch.setattr(os, "kill", recorded)
    end_process(child.pid, term_timeout=30.0)
    assert sent == [signal.SIGTERM]
    assert child.wait(timeout=10) == -signal.SIGTERM


def test_end_process_kills_what_ignores_sigterm(children: list[subprocess.Popen[bytes]]) -> None:
    code = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    children.append(child)
    assert child.stdout is not None
    assert child.stdout.readline().strip() == b"ready"
    child.stdout.close()
    started = time.monotonic()
    end_process(child.pid, term_timeout=0.5)
    assert time.monotonic() - started >= 0.5  # SIGTERM's time was given
    assert child.wait(timeout=10) == -signal.SIGKILL


def test_end_process_tolerates_a_process_already_gone() -> None:
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait(timeout=30)
    end_process(done.pid, term_timeout=0.1)


@pytest.mark.parametrize("pid", [0, 1, -1, True])
def test_end_process_refuses_dangerous_pids(pid: int) -> None:
    with pytest.raises(ValueError, match="pid"):
        end_process(pid)


def test_end_process_refuses_itself_and_negative_timeouts() -> None:
    with pytest.raises(ValueError, match="pid"):
        end_process(os.getpid())
    with pytest.raises(ValueError, match="term_timeout"):
        end_process(999999, term_timeout=-1)


def test_a_lease_with_shares_on_two_devices_is_capped_on_each(dog: ShareWatchdog) -> None:
    caps = [
        ShareCap(lease_id=7, user="cat", device_uuid=GPU, cap_mib=1000),
        ShareCap(lease_id=7, user="cat", device_uuid=OTHER_GPU, cap_mib=1000),
    ]
    pids = {700: 7, 701: 7}
    samples = [sample(700, 900), sample(701, 3000, OTHER_GPU)]
    (warning,) = dog.judge(samples, caps, pids.get, at(0))
    assert isinstance(warning, Overuse)
    assert (warning.pid, warning.device_uuid) == (701, OTHER_GPU)
    (ended,) = dog.judge(samples, caps, pids.get, at(61))
    assert isinstance(ended, Terminate) and ended.pid == 701
