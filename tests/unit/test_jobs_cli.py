"""``gpubroker jobs submit``'s body, without a broker: what it sends, and
what it refuses before sending."""

from __future__ import annotations

from typing import Any

import pytest

from gpubroker.client_sync import job_body
from gpubroker.jobs.cli import SubmitCommand


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
