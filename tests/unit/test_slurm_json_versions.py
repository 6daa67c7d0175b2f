"""The Slurm engine reads the JSON of every Slurm release it may meet, from
fixtures in ``tests/data/slurm/`` (the test cluster runs Debian's 22.05
only; later shapes follow Slurm's own data_parser source, SchedMD/slurm
``src/plugins/data_parser/v0.0.NN/parsers.c`` at the release's tag):

* ``*-22.05.json``: real answers of the test cluster (Slurm 22.05.8,
  OpenAPI plugin v0.0.38), trimmed to the fields the engine reads; the
  user renamed.
* ``*-23.02.json``: Slurm 23.02 (data_parser v0.0.39, tag
  ``slurm-23-02-7-1``): ``job_state`` one word, ``exit_code`` the raw wait
  status as ``{"set", "infinite", "number"}``, times plain numbers; a
  node's ``state`` a list of flags (``scontrol show nodes --json``).
* ``*-24.11.json``: Slurm 24.11 (data_parser v0.0.42, tag
  ``slurm-24-11-0-1``; v0.0.40 of 23.11 and v0.0.41 of 24.05 are alike):
  ``job_state`` a list of flags, ``exit_code`` ``{"status", "return_code",
  "signal"}``, times ``{"set", "infinite", "number"}``; ``sinfo --json``
  lists grouped rows under ``"sinfo"`` (so nodes are read from ``scontrol
  show nodes --json``), as it does from 23.02 on.

Every release's answers describe the same cluster: n1 up with GPUs 0-1
held by someone else's running job 2, n2 drained ("fan failure"), job 3
failed with status 3, job 4 cancelled (SIGTERM)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from gpubroker.engines import Handle
from gpubroker.engines import slurm_json as sj
from gpubroker.engines.slurm import SlurmEngine

DATA = Path(__file__).resolve().parent.parent / "data" / "slurm"

#: which fixture answers which command, per Slurm release
ANSWERS = {
    "22.05": {"sinfo": "sinfo-22.05.json", "squeue": "squeue-22.05.json"},
    "23.02": {
        "sinfo": "sinfo-24.11.json",  # rows under "sinfo", as from 23.02 on
        "scontrol": "scontrol-nodes-23.02.json",
        "squeue": "squeue-23.02.json",
    },
    "24.11": {
        "sinfo": "sinfo-24.11.json",
        "scontrol": "scontrol-nodes-24.11.json",
        "squeue": "squeue-24.11.json",
    },
}


def _engine(monkeypatch: pytest.MonkeyPatch, release: str) -> tuple[SlurmEngine, list[str]]:
    asked: list[str] = []

    def run(argv: Sequence[str], stdin: str | None = None, env: Any = None) -> str:
        asked.append(" ".join(argv))
        if list(argv[:3]) == ["scontrol", "show", "nodes"]:
            return (DATA / ANSWERS[release]["scontrol"]).read_text()
        if argv[0] in ("sinfo", "squeue") and "--json" in argv:
            return (DATA / ANSWERS[release][argv[0]]).read_text()
        if argv[0] == "sacct":
            return ""
        raise AssertionError(f"unexpected command {argv}")

    engine = SlurmEngine(cluster="c")
    monkeypatch.setattr(engine, "_run", run)
    return engine, asked


@pytest.mark.parametrize("release", sorted(ANSWERS))
def test_every_releases_json_gives_the_same_nodes_and_jobs(
    monkeypatch: pytest.MonkeyPatch, release: str
) -> None:
    engine, asked = _engine(monkeypatch, release)
    n1, n2 = engine.nodes()
    assert (n1.name, n1.state, n2.name, n2.state) == ("n1", "up", "n2", "drained")
    assert n2.reason == "fan failure"
    assert [d.index for d in n1.devices] == [0, 1, 2, 3]
    held = {d.index for d in n1.devices if d.uuid in n1.outside}
    assert held == {0, 1}
    assert not n2.outside
    assert ("scontrol show nodes --json" in asked) == (release != "22.05")

    statuses = engine.poll_many([Handle("slurm", j, "") for j in ("2", "3", "4")])
    running = statuses["2"]
    assert running.running
    assert running.devices == (n1.devices[0].uuid, n1.devices[1].uuid)
    assert (statuses["3"].state, statuses["3"].exit_code, statuses["3"].signal) == (
        "exited",
        3,
        None,
    )
    assert (statuses["4"].state, statuses["4"].signal) == ("exited", 15)
    assert statuses["3"].ended is not None and statuses["3"].ended.year == 2026


def test_releases_agree_field_by_field() -> None:
    old = json.loads((DATA / "squeue-22.05.json").read_text())["jobs"]
    for name in ("squeue-23.02.json", "squeue-24.11.json"):
        new = sj.as_v38(json.loads((DATA / name).read_text()))["jobs"]
        assert [sj.job_status(j) for j in new] == [sj.job_status(j) for j in old], name
        assert sj.unsupported_format({"jobs": new}) == ""


def test_state_flag_lists_read_as_slurm_names_them() -> None:
    # Slurm's job_state_string(): a flag such as COMPLETING names the job
    # before its base state; a cancelled job still completing holds its GPUs
    assert sj.job_state_word(["CANCELLED", "COMPLETING"]) == "COMPLETING"
    assert sj.is_active(sj.job_state_word(["CANCELLED", "COMPLETING"]))
    assert sj.job_state_word(["PENDING", "REQUEUE_HOLD"]) == "REQUEUE_HOLD"
    assert sj.job_state_word(["COMPLETED"]) == "COMPLETED"
    assert sj.job_state_word("RUNNING") == "RUNNING"
    assert sj.number({"set": False, "infinite": False, "number": 0}) is None
    assert sj.number({"set": True, "infinite": True, "number": 0}) is None
    assert sj.number(7) == 7
    killed = {
        "status": ["SIGNALED"],
        "return_code": {"set": False, "infinite": False, "number": 0},
        "signal": {"id": {"set": True, "infinite": False, "number": 9}, "name": "KILL"},
    }
    assert sj.raw_exit_code(killed) == 9
    node = sj.as_v38({"nodes": [{"name": "n1", "state": ["DOWN", "NOT_RESPONDING"]}]})
    assert sj.node_state(node["nodes"][0]["state"], node["nodes"][0]["state_flags"]) == "down"
