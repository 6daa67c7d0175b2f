"""``gpubroker jobs submit``'s body, without a broker: what it sends, and
what it refuses before sending."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpubroker.client_sync import job_body
from gpubroker.jobs.cli import SubmitCommand
from gpubroker.model.jobs import JobError, parse_spec, parse_time


def submitted(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    sent: list[dict[str, Any]] = []
    monkeypatch.setattr(SubmitCommand, "run", lambda self, call: sent.append(call) or {})
    monkeypatch.setattr(SubmitCommand, "show", lambda self, job: None)
    monkeypatch.setattr(
        SubmitCommand,
        "client",
        lambda self: type("C", (), {"submit_job": staticmethod(lambda body: body)})(),
    )
    app = SubmitCommand()
    app.initialize(argv)
    app.start()
    (call,) = sent
    return dict(call())


def test_a_zero_is_sent_so_the_broker_names_its_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    body = submitted(["train.ipynb", "--gpus=0"], monkeypatch)
    assert body == {"notebook": "train.ipynb", "params": [], "gpus": 0}
    assert job_body({"command": "x"}, gpus=None, time="", retries=0) == {
        "command": "x",
        "retries": 0,
    }


@pytest.mark.parametrize(
    "argv",
    [
        ["train.ipynb", "--command=echo hi", "--gpus=1"],
        ["--command=echo hi", "--param=epochs=2", "--gpus=1"],
    ],
)
def test_a_notebook_or_param_with_a_command_is_refused_not_dropped(
    argv: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(SystemExit) as ended:
        submitted(argv, monkeypatch)
    assert ended.value.code == 2


# --- a researcher's trial of the demo --------------------------------------------


def _job(**fields: Any) -> dict[str, Any]:
    job = {
        "id": 3,
        "user": "alice",
        "state": "queued",
        "reason": None,
        "kind": "command",
        "spec": {"command": ["/bin/sh", "-c", "python train.py --name 'run a'"]},
        "queue": {"message": "waiting: …"},
        "devices": [],
        "exit_code": None,
        "signal": None,
    }
    return job | fields


def test_show_prints_no_python_none_and_quotes_the_command(
    capsys: pytest.CaptureFixture[str],
) -> None:
    app = SubmitCommand()
    app.show(_job())
    assert capsys.readouterr().out == (
        "job 3 of alice: queued\n"
        "  command: /bin/sh -c 'python train.py --name '\"'\"'run a'\"'\"''\n"
        "  waiting: …\n"
        "  devices: -\n"
    )
    app.show(_job(state="failed", reason="exit code 1", devices=["GPU-a"], exit_code=1))
    out = capsys.readouterr().out
    assert out.startswith("job 3 of alice: failed (exit code 1)\n")
    assert out.endswith("  devices: GPU-a; exit code 1\n")


@pytest.mark.parametrize(
    ("command", "words"),
    [
        ("", "command: must not be empty"),
        ("   ", "command: must not be empty"),
        (["", "x"], "command: its first argument (the program) must not be empty"),
    ],
)
def test_an_empty_command_is_refused(command: Any, words: str) -> None:
    with pytest.raises(JobError) as refused:
        parse_spec({"command": command})
    assert str(refused.value) == words


@pytest.mark.parametrize(
    ("data", "words"),
    [
        # a %%gpu_job cell of 180 KB: the launch failed (E2BIG) after the job
        # had waited for and held its GPUs
        (
            {"command": ["python", "-c", "x = 1\n" * 30000]},
            "command: an argument may take at most 131071 bytes, got 180000",
        ),
        (
            {"notebook": "a.ipynb", "params": {"data": [1] * 40000}},
            "param: the parameters may take at most 65536 bytes as JSON, got 120010",
        ),
        # silently dropped or taken as none before
        ({"command": "echo", "kernel": "python3"}, "kernel: is for notebook jobs"),
        ({"notebook": "a.ipynb", "kernel": 0}, "kernel: not a kernel name: 0"),
        ({"notebook": "a.ipynb", "env": []}, "env: must map variable names to strings"),
    ],
)
def test_what_cannot_run_as_given_is_refused_at_submit(data: Any, words: str) -> None:
    with pytest.raises(JobError) as refused:
        parse_spec(data)
    assert str(refused.value) == words


def test_the_time_limits_bound_is_said_in_days() -> None:
    with pytest.raises(JobError) as refused:
        parse_time(0)
    assert (
        str(refused.value) == "time: must be more than 0 s and at most 30 days (2592000 s), got 0 s"
    )


def test_show_says_why_a_job_has_not_started(capsys: pytest.CaptureFixture[str]) -> None:
    """A new admin's trial of the Slurm demo: `show` printed `running` for a
    job Slurm held PENDING (only `list` said why), and a bare `waiting` for
    a job whose GPUs were granted but whose launch had not happened."""
    app = SubmitCommand()
    app.show(_job(state="running", devices=["GPU-a"], engine_wait="PENDING (Resources)"))
    assert "  held by its engine: PENDING (Resources)\n" in capsys.readouterr().out
    app.show(_job(queue={}, devices=["GPU-a"]))
    assert "  its GPUs are granted; waiting for its launch\n" in capsys.readouterr().out
    app.show(_job(queue={}))
    assert "  waiting\n" in capsys.readouterr().out


def _into_closed_pipe(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` with its standard output a pipe whose reader is gone."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(
            argv, stdout=write, stderr=subprocess.PIPE, text=True, timeout=60, cwd=cwd
        )
    finally:
        os.close(write)


def test_help_into_a_closed_pipe_ends_without_a_traceback(tmp_path: Path) -> None:
    """`gpubroker jobs list | head` ended in a BrokenPipeError traceback;
    --help and --help-all print too, while the command line is read, before
    the command starts."""
    done = _into_closed_pipe([sys.executable, "-m", "gpubroker", "--help-all"], tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr


def test_show_prints_a_reason_and_a_notebook_on_their_lines(
    capsys: pytest.CaptureFixture[str],
) -> None:
    job = _job(state="failed", reason="x\nFORGED \x1b[2J", kind="notebook")
    SubmitCommand().show(job | {"spec": {"notebook": "a\nb.ipynb"}})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "job 3 of alice: failed (x\\nFORGED \\x1b[2J)"
    assert lines[1] == "  notebook: a\\nb.ipynb"


@pytest.mark.parametrize("word", ["²", "٣", "-1", "1" * 19])
def test_a_job_id_is_ascii_digits(word: str) -> None:
    """``gpubroker jobs show ²`` crashed: ``"²".isdigit()`` is true, and
    ``int()`` refuses it. It now exits 2 with the usage line."""
    from gpubroker.jobs.cli import ShowCommand

    app = ShowCommand()
    app.extra_args = [word]
    with pytest.raises(SystemExit) as ended:
        app.job_id()
    assert ended.value.code == 2


def test_submit_reads_a_notebook_and_runs_a_command_from_the_shells_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From ``~/proj``, ``submit train.ipynb`` sent ``train.ipynb``, which the
    broker reads as ``~/train.ipynb``; ``--command`` ran in ``~``."""
    sent: list[dict[str, Any]] = []

    class Client:
        def submit_job(self, body: dict[str, Any]) -> dict[str, Any]:
            sent.append(body)
            return {"id": 1, "state": "queued", "user": "ann", "queue": {}}

    (tmp_path / "proj").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path / "proj")
    for argv in (["train.ipynb", "--gpus=1"], ["--command=python t.py", "--gpus=1"]):
        app = SubmitCommand()
        app.client = lambda: Client()  # type: ignore[method-assign]
        app.show = lambda job: None  # type: ignore[method-assign]
        app.parse_command_line(argv)
        app.start()
    assert sent[0]["notebook"] == "proj/train.ipynb"
    assert sent[1]["command"] == "python t.py" and sent[1]["cwd"] == "proj"


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_a_memory_that_is_no_number_of_gib_is_refused_by_name(
    value: str, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """JSON has no NaN or infinity, so the broker answered "body: not valid
    JSON" and never named ``--memory``; the command now says which option
    is wrong and sends nothing."""
    with pytest.raises(SystemExit) as ended:
        submitted(["train.ipynb", f"--memory={value}"], monkeypatch)
    assert ended.value.code == 2
    assert "--memory: must be a finite number of GiB" in capfd.readouterr().err
