"""What a new user sees of jobs: the list's devices and queue (as one job's
view has them), a command job's output, the order of ``%gpu_submit``'s
warning and release message, and commands on one line in the tables."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from IPython.core.interactiveshell import InteractiveShell
from sqlalchemy import event

from gpubroker.api.handlers import load_openapi
from gpubroker.jobs import cli
from gpubroker.jobs.service import JobService
from gpubroker.jobs.text import WHAT_WIDTH, job_what
from gpubroker.magics import GPUMagics
from gpubroker.store import jobs_repo

from ..nbutil import new_shell, write_notebook
from .test_jobs import run_until_done

#: a ``%%gpu_job`` cell of three lines
CELL = "import torch\nx = torch.ones(1)\nprint(x)\n"


def job_schema() -> dict[str, Any]:
    return dict(load_openapi()["components"]["schemas"]["Job"])


def statements(jobs: JobService) -> list[str]:
    """The SQL statements the job service's sessions run, recorded from now on."""
    seen: list[str] = []
    engine = jobs.sessions.kw["bind"]
    event.listen(engine, "before_cursor_execute", lambda *a: seen.append(a[2]))
    return seen


# --- 1. GET /jobs: devices and queue, as GET /jobs/{id} ----------------------------


def test_the_list_shows_each_jobs_devices_and_queue_as_its_own_view_does(
    jobs: JobService, home: Path
) -> None:
    """``list`` built every row without its lease: ``%gpu_jobs`` and
    ``gpubroker jobs list`` never showed devices or the queue's reason."""
    (home / "ann").mkdir(parents=True)
    ended = [jobs.submit("ann", {"command": "true", "gpus": 1}) for _ in range(3)]
    for job in ended:
        assert run_until_done(jobs, job["id"])["state"] == "succeeded"
    granted = jobs.submit("ann", {"command": "true", "gpus": 2})  # not started: no tick
    others = [jobs.broker.request_lease(f"h{i}", "", 1, holder_kind="external") for i in range(6)]
    queued = jobs.submit("ann", {"command": "true", "gpus": 1})
    assert others and queued["queue"]["reason"]

    listed = {j["id"]: j for j in jobs.list("ann")}
    for job in (*ended, granted, queued):
        one = jobs.get(job["id"])
        assert listed[job["id"]] == one
        jsonschema.validate(listed[job["id"]], job_schema())
    assert len(listed[granted["id"]]["devices"]) == 2 and listed[granted["id"]]["queue"] is None
    assert listed[queued["id"]]["devices"] == []
    assert listed[queued["id"]]["queue"]["reason"] == queued["queue"]["reason"]
    assert all(len(listed[j["id"]]["devices"]) == 1 for j in ended)  # what they ran on
    assert jobs.list("bob") == []
    assert {j["id"] for j in jobs.list(None)} == set(listed)


def test_the_list_reads_the_leases_of_all_its_jobs_at_once(
    jobs: JobService, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No lease is read one job at a time: the pending and granted ones come
    from the broker's memory, the released ones in one read for all."""
    (home / "cy").mkdir(parents=True)
    first = jobs.submit("cy", {"command": "true", "gpus": 1})
    run_until_done(jobs, first["id"])
    jobs.submit("cy", {"command": "true", "gpus": 1})  # granted, not started
    seen = statements(jobs)
    jobs.list("cy")
    few = len(seen)
    for _ in range(3):
        job = jobs.submit("cy", {"command": "true", "gpus": 1})
        run_until_done(jobs, job["id"])
        jobs.submit("cy", {"command": "true", "gpus": 1})
    monkeypatch.setattr(jobs.broker, "get_lease", lambda *a: pytest.fail("a read per job"))
    seen.clear()
    views = jobs.list("cy")
    assert len(views) == 8 and all("devices" in v for v in views)
    assert len(seen) == few, seen


# --- 2. a command job has no output notebook ----------------------------------------


def test_a_command_job_has_no_output_and_a_notebook_job_has_its_notebook(
    jobs: JobService, home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A command job's output was ``"."`` (``str(Path(""))``), shown by
    ``gpubroker jobs submit/show`` as ``output: .``."""
    write_notebook(home / "dee" / "train.ipynb", ["epochs = 1"])
    command = jobs.submit("dee", {"command": ["true"], "gpus": 1})
    notebook = jobs.submit("dee", {"notebook": "train.ipynb", "gpus": 1})
    assert command["output"] is None and jobs.get(command["id"])["output"] is None
    assert notebook["output"] == str(home / "dee" / f"train.{notebook['id']}.ipynb")
    for view in (command, notebook, *jobs.list("dee")):
        jsonschema.validate(view, job_schema())
    cli.ShowCommand().show(jobs.get(command["id"]))
    shown = capsys.readouterr().out
    assert "output" not in shown and f"job {command['id']} of dee" in shown
    cli.ShowCommand().show(jobs.get(notebook["id"]))
    assert f"output: {notebook['output']}" in capsys.readouterr().out


def test_a_command_job_stored_with_the_old_dot_output_shows_none(
    jobs: JobService, home: Path
) -> None:
    """Command jobs submitted before the fix keep ``"."`` in the store."""
    (home / "eve").mkdir(parents=True)
    job = jobs.submit("eve", {"command": "true", "gpus": 1})
    with jobs.sessions.begin() as session:
        jobs_repo.get(session, job["id"]).output_path = "."
    assert jobs.get(job["id"])["output"] is None
    assert jobs.list("eve")[0]["output"] is None


# --- 3. %gpu_submit: the unsaved-cells warning before the release -------------------


class Frontend:
    """What a notebook shows: a kernel's stdout and stderr are two streams,
    each sent on its own when flushed (as ipykernel's ``OutStream``)."""

    def __init__(self) -> None:
        self.shown: list[tuple[str, str]] = []

    def stream(self, name: str) -> Any:
        frontend = self

        class Stream:
            def __init__(self) -> None:
                self.buffer: list[str] = []

            def write(self, text: str) -> int:
                self.buffer.append(text)
                return len(text)

            def flush(self) -> None:
                if self.buffer:
                    frontend.shown.append((name, "".join(self.buffer)))
                    self.buffer.clear()

        return Stream()


class Recorder:
    def submit_job(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"id": 7, "state": "queued", "queue": {"message": "waiting"}}

    def release_lease(self, lease_id: int, reason: str) -> dict[str, Any]:
        return {"id": lease_id, "state": "released"}

    def jobs(self) -> list[dict[str, Any]]:
        return [
            {
                "id": 9,
                "user": "ann",
                "state": "running",
                "kind": "command",
                "spec": {"command": [sys.executable, "-c", CELL]},
                "devices": ["GPU-a"],
                "created": "2026-12-01T08:00:00Z",
                "reason": "",
            },
            {
                "id": 8,
                "user": "ann",
                "state": "queued",
                "kind": "notebook",
                "spec": {"notebook": "train.ipynb"},
                "queue": {"reason": "no-capacity"},
                "created": "2026-12-01T07:00:00Z",
                "reason": "",
            },
        ]


@pytest.fixture
def shell() -> Any:
    ip = new_shell()
    ip.register_magics(GPUMagics(ip, client=Recorder()))  # type: ignore[arg-type]
    yield ip
    InteractiveShell.clear_instance()


def test_the_unsaved_cells_warning_is_shown_before_the_release_message(
    shell: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The warning (stderr) reached the notebook after the release message
    (stdout): each stream is sent when flushed, stdout first here."""
    path = write_notebook(tmp_path / "nb.ipynb", ["x = 1"])
    monkeypatch.setenv("JPY_SESSION_NAME", str(path))
    monkeypatch.setenv("GPUBROKER_LEASE_ID", "3")
    monkeypatch.setattr(shell.history_manager, "input_hist_raw", ["", "x = 1", "y = 2"])
    frontend = Frontend()
    out, err = frontend.stream("stdout"), frontend.stream("stderr")
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    shell.run_line_magic("gpu_submit", "--gpus 1 --release --yes")
    out.flush()  # the end of the cell: stdout happens to go first
    err.flush()
    monkeypatch.undo()
    said = [(name, line) for name, text in frontend.shown for line in text.splitlines()]
    assert [name for name, _ in said] == ["stderr", "stdout", "stdout"], said
    assert said[0][1].startswith("Warning: 1 cell(s) run in this kernel are not in")
    assert said[1][1] == "job 7 queued: waiting"
    assert said[2][1] == "lease 3 released: this server stops now"


# --- 4. a multi-line command on one line of the tables ------------------------------


def test_gpu_jobs_shows_a_multi_line_command_on_one_line(
    shell: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    shown: list[dict[str, str]] = []
    monkeypatch.setattr("gpubroker.magics.display", lambda data, raw: shown.append(data))
    jobs = shell.run_line_magic("gpu_jobs", "")
    (table,) = shown
    lines = table["text/plain"].splitlines()
    assert len(lines) == 3, table["text/plain"]  # the header and one line per job
    assert "\\n" in lines[1] and "import torch" in lines[1] and "GPU-a" in lines[1]
    assert "no-capacity" in lines[2]  # the queue's reason
    assert "<td>" in table["text/html"] and "\n" not in table["text/html"]
    assert jobs[0]["spec"]["command"][2] == CELL  # what it returns is as stored


def test_jobs_list_on_the_shell_prints_one_line_per_job(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli.ListCommand, "client", lambda self: Recorder())
    app = cli.ListCommand()
    app.initialize([])
    app.start()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].split()[:3] == ["9", "ann", "running"] and "\\n" in lines[0]
    assert "GPU-a" in lines[0] and "no-capacity" in lines[1]


@pytest.mark.parametrize(
    ("spec", "shown"),
    [
        ({"notebook": "train.ipynb"}, "train.ipynb"),
        ({"command": ["/bin/sh", "-c", "echo hi"]}, "/bin/sh -c 'echo hi'"),
        ({"command": ["py", "-c", "a\nb\tc\x1b[2J"]}, "py -c 'a\\nb\\tc\\x1b[2J'"),
        ({"command": ["x" * 200]}, "x" * (WHAT_WIDTH - 3) + "..."),
        ({}, ""),
    ],
)
def test_a_jobs_what_is_one_line_of_printable_text(spec: dict[str, Any], shown: str) -> None:
    assert job_what({"spec": spec}) == shown
    assert len(job_what({"spec": spec})) <= WHAT_WIDTH


def test_the_stored_command_keeps_its_lines(jobs: JobService, home: Path) -> None:
    (home / "fay").mkdir(parents=True)
    job = jobs.submit("fay", {"command": [sys.executable, "-c", CELL], "gpus": 1})
    assert jobs.get(job["id"])["spec"]["command"][2] == CELL
    assert jobs.list("fay")[0]["spec"]["command"][2] == CELL
