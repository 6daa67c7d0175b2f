"""The notebook magics' parsing in an IPython shell, against a client that
records what would be sent (the real broker, hub and kernel are in
tests/integration/test_magics_hub.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from gpubroker.magics import GPUMagics, unsaved_cells

from ..nbutil import new_shell, write_notebook


class Recorder:
    """The calls the magics make of :class:`~gpubroker.client_sync.SyncBrokerClient`."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def submit_job(self, body: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(("submit_job", (body,)))
        return {"id": 7, "state": "queued", "queue": {"message": "waiting"}}

    def lease(self, lease_id: int) -> dict[str, Any]:
        self.calls.append(("lease", (lease_id,)))
        slot = {"uuid": "MIG-1", "device": "GPU-A", "kind": "mig", "profile": "1g.10gb"}
        return {
            "id": lease_id,
            "summary": "1 x MIG 1g.10gb",
            "state": "granted",
            "granted_at": "2026-12-01T08:00:00Z",
            "created": "2026-12-01T08:00:00Z",
            "slots": [slot],
        }

    def devices(self) -> list[dict[str, Any]]:
        return [{"uuid": "GPU-A", "usage": {"utilization_gpu": 37, "memory_used_mib": 5120}}]

    def pools(self) -> dict[str, Any]:
        return {"quota": {"held": 0.1429, "pending": 0, "remaining": 1.8571}}

    def notices(self) -> list[dict[str, Any]]:
        return [{"created": "2026-12-01T09:00:00Z", "kind": "job-ended", "message": "job 7"}]

    def release_lease(self, lease_id: int, reason: str) -> dict[str, Any]:
        self.calls.append(("release_lease", (lease_id, reason)))
        return {"id": lease_id, "state": "granted"}


@pytest.fixture
def shell(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[InteractiveShell, Recorder]:
    """A shell in its home directory (``tmp_path``), as a single-user server's kernel."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    ip = new_shell()
    recorder = Recorder()
    ip.register_magics(GPUMagics(ip, client=recorder))  # type: ignore[arg-type]
    yield ip, recorder
    InteractiveShell.clear_instance()


def test_a_cell_job_runs_the_cell_with_this_kernels_python(shell: Any) -> None:
    ip, recorder = shell
    ip.run_cell_magic("gpu_job", "--gpus 1 --time 1h --retries 2", "print('hi')\n")
    (name, (body,)), *_ = recorder.calls
    assert name == "submit_job"
    assert body["command"] == [sys.executable, "-c", "print('hi')\n"]
    assert (body["gpus"], body["time"], body["retries"]) == (1, "1h", 2)
    with pytest.raises(UsageError, match="give exactly one of --gpus"):
        ip.run_cell_magic("gpu_job", "--time 1h", "print('hi')")
    with pytest.raises(UsageError, match="the cell is empty"):
        ip.run_cell_magic("gpu_job", "--gpus 1", "  \n")
    assert len(recorder.calls) == 1


def test_submit_sends_this_kernels_python_unless_a_kernel_is_named(shell: Any) -> None:
    ip, recorder = shell
    ip.run_line_magic("gpu_submit", "train.ipynb --gpus 1 --param epochs=2")
    ip.run_line_magic("gpu_submit", "train.ipynb --gpus 1 --kernel julia-1.10")
    first, second = (call[1][0] for call in recorder.calls)
    assert first["python"] == sys.executable and first["params"] == ["epochs=2"]
    assert "python" not in second and second["kernel"] == "julia-1.10"


def test_release_asks_first_and_ends_the_lease_after_the_job_is_accepted(
    shell: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    ip, recorder = shell
    monkeypatch.setenv("GPUBROKER_LEASE_ID", "42")
    asked: list[str] = []
    monkeypatch.setattr("builtins.input", lambda prompt: asked.append(prompt) or "n")
    with pytest.raises(UsageError, match="not submitted"):
        ip.run_line_magic("gpu_submit", "train.ipynb --gpus 1 --release")
    assert recorder.calls == [] and "Release lease 42" in asked[0]
    monkeypatch.setattr("builtins.input", lambda prompt: "y")
    ip.run_line_magic("gpu_submit", "train.ipynb --gpus 1 --release")
    assert [c[0] for c in recorder.calls] == ["submit_job", "release_lease"]
    assert recorder.calls[1][1] == (42, "released for job 7 (%gpu_submit)")
    ip.run_line_magic("gpu_submit", "train.ipynb --gpus 1 --release --yes")  # no question
    assert [c[0] for c in recorder.calls][-2:] == ["submit_job", "release_lease"]
    monkeypatch.delenv("GPUBROKER_LEASE_ID")
    with pytest.raises(UsageError, match="holds no GPU lease"):
        ip.run_line_magic("gpu_submit", "train.ipynb --gpus 1 --release --yes")


def test_cells_run_but_not_saved_are_counted(tmp_path: Path) -> None:
    path = tmp_path / "nb.ipynb"
    write_notebook(path, ["x = 1", "print(x)"])

    class History:
        input_hist_raw = ["", "x = 1", "print(x)", "%gpu", "y = 2", "y = 2", "  "]

    class Shell:
        history_manager = History()

    assert unsaved_cells(Shell(), str(path)) == 1  # "y = 2" (magics and blanks left out)
    assert unsaved_cells(Shell(), str(tmp_path / "missing.ipynb")) == 0


def test_gpu_shows_the_slots_with_their_use_the_quota_left_and_notices(
    shell: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ip, recorder = shell
    monkeypatch.setenv("GPUBROKER_LEASE_ID", "5")
    lease = ip.run_line_magic("gpu", "")
    out = capsys.readouterr().out
    assert lease["id"] == 5 and ("lease", (5,)) in recorder.calls
    assert "lease 5: 1 x MIG 1g.10gb, granted since 2026-12-01T08:00:00Z (" in out
    assert "MIG-1" in out and "37%" in out and "5.0 GiB" in out
    assert "quota: 0.1429 held, 0 pending, 1.8571 left (device units)" in out
    assert "job-ended" in out


def test_gpu_logs_prints_a_finished_jobs_whole_log_read_in_parts(
    shell: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """A read is at most 1 MiB: the magic reads on while text comes, also
    once the job has ended (it used to stop after the first part)."""
    ip, recorder = shell
    parts = ["a" * 10, "b" * 10, "c" * 5, ""]

    def job_logs(job_id: int, offset: int, wait: float) -> dict[str, Any]:
        text = parts.pop(0)
        recorder.calls.append(("job_logs", (job_id, offset, wait)))
        return {"text": text, "offset": offset + len(text), "state": "succeeded"}

    recorder.job_logs = job_logs  # type: ignore[attr-defined]
    ip.run_line_magic("gpu_logs", "7")
    assert capsys.readouterr().out == "a" * 10 + "b" * 10 + "c" * 5
    assert [c[1][1] for c in recorder.calls] == [0, 10, 20, 25]


def test_a_magic_as_a_cells_last_line_shows_its_answer_once(
    shell: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a magic printed is not repeated as the cell's value: a lease or a
    job shows as one line there (still a plain dict or list to code)."""
    from IPython.lib.pretty import pretty

    ip, recorder = shell
    monkeypatch.setenv("GPUBROKER_LEASE_ID", "4")
    monkeypatch.delenv("GPUBROKER_JOB_ID", raising=False)
    recorder.jobs = lambda: [  # type: ignore[attr-defined]
        {"id": 7, "state": "running", "kind": "command", "command": ["sleep", "1"]},
        {"id": 6, "state": "succeeded", "kind": "command", "command": ["true"]},
    ]
    lease = ip.run_line_magic("gpu", "")
    job = ip.run_cell_magic("gpu_job", "--gpus 1", "print('hi')\n")
    jobs = ip.run_line_magic("gpu_jobs", "")
    assert pretty(lease) == "<gpubroker lease 4: granted>"
    assert pretty(job) == "<gpubroker job 7: queued>"
    assert pretty(jobs) == "<gpubroker: 2 jobs>"
    # the data is the broker's answer, as before
    assert isinstance(job, dict) and job["queue"] == {"message": "waiting"}
    assert dict(lease)["summary"] == "1 x MIG 1g.10gb" and [j["id"] for j in jobs] == [7, 6]


def test_submit_says_when_the_jobs_gpus_are_granted_at_once(
    shell: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """A researcher's trial: free GPUs printed `job 1 queued: starting`,
    while the job only waited for its launch."""
    ip, recorder = shell
    recorder.submit_job = lambda body: {  # type: ignore[method-assign]
        "id": 1,
        "state": "queued",
        "queue": None,
        "devices": ["GPU-A"],
    }
    ip.run_line_magic("gpu_submit", "train.ipynb --gpus 1")
    assert "job 1 queued: its GPUs are granted; waiting for its launch" in capsys.readouterr().out
