"""``gpubroker simulate`` end to end, on the Philly slice in tests/data."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpubroker.app import GPUBrokerApp
from gpubroker.simulate.cli import SimulateCommand, parse_duration, summary_table

DATA = Path(__file__).resolve().parents[1] / "data"
PHILLY = DATA / "philly_first300.csv"


@pytest.fixture(autouse=True)
def _fresh_apps() -> Iterator[None]:
    yield
    SimulateCommand.clear_instance()
    GPUBrokerApp.clear_instance()


def run(argv: list[str]) -> None:
    app = GPUBrokerApp()
    app.initialize(["simulate", *argv])
    assert isinstance(app.subapp, SimulateCommand)
    app.start()


def test_philly_slice_replays_under_all_three_policies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run(
        [
            f"--trace={PHILLY}",
            "--format=philly",
            "--cluster=16x8xA100-80GB",
            f"--out={tmp_path}",
            "--quiet",
        ]
    )
    data = json.loads((tmp_path / "metrics.json").read_text())
    assert set(data["runs"]) == {"broker", "fifo", "slurm-like"}
    assert data["trace"] == {
        "source": str(PHILLY),
        "format": "philly",
        "jobs": 295,
        "problems": 5,
        "fractional": False,
    }
    assert [p["line"] for p in data["problems"]] == [289, 290, 291, 292, 293]
    assert all("16 GPUs on one node" in p["reason"] for p in data["problems"])
    for run_ in data["runs"].values():
        assert run_["jobs"]["finished"] == 295
        assert run_["queueing_delay_s"]["median"] <= run_["queueing_delay_s"]["p95"]
        assert 0 < run_["allocation"]["ratio"] <= 1
        assert 0 < run_["fairness"]["jain_index"] <= 1
        assert len(run_["allocation"]["series"]["ratio"]) == 500
    ratios = data["ratios_to_fifo"]
    assert ratios["fifo"]["queueing_delay_s.mean"] == 1.0
    assert ratios["broker"]["queueing_delay_s.mean"] < 1.0  # backfill beats FIFO here
    assert any("group" in note for note in data["notes"])
    assert any("time limits" in note and "1.5" in note for note in data["notes"])
    assert (tmp_path / "allocation.png").stat().st_size > 1000
    assert (tmp_path / "queueing_delay_cdf.png").stat().st_size > 1000
    out = capsys.readouterr().out
    assert "ratios to FIFO" in out and "slurm-like" in out


def test_policy_file_configures_the_policy_and_the_simulator(tmp_path: Path) -> None:
    policy = tmp_path / "policy.py"
    policy.write_text(
        "c.SchedulingPolicy.max_reservations = 7\n"
        "c.SchedulingPolicy.user_quotas = {'3': {'guaranteed': 0, 'limit': 1}}\n"
        "c.SimulateCommand.checkpoint_classes = ['preemptible']\n"
        "c.SimulateCommand.schedulers = 'broker'\n"
        "c.Enrichment.time_limit_factor = 2.0\n"
        "c.Enrichment.class_by_size = {1: 'batch', 8: 'preemptible'}\n"
    )
    run(
        [
            f"--trace={PHILLY}",
            "--format=philly",
            "--cluster=4x8",
            f"--policy={policy}",
            "--time-limit-factor=3",  # the command line wins over the file
            "--until=30d",
            f"--out={tmp_path / 'out'}",
            "--quiet",
            "--no-plots",
        ]
    )
    data = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert list(data["runs"]) == ["broker"]
    settings = data["settings"]
    assert settings["checkpoint_classes"] == ["preemptible"]
    assert settings["scheduling_policy"]["max_reservations"] == 7
    assert settings["enrichment"]["time_limit_factor"] == 3.0
    assert settings["until_s"] == 30 * 86400
    assert data["runs"]["broker"]["allocation"]["window_s"][1] <= 30 * 86400
    assert not (tmp_path / "out" / "allocation.png").exists()
    assert any("by size" in note for note in data["notes"])


def test_bad_inputs_exit_with_a_message(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        run(["--trace=missing.csv", "--format=philly", f"--out={tmp_path}", "--quiet"])
    SimulateCommand.clear_instance()
    with pytest.raises(SystemExit):
        run([f"--trace={PHILLY}", "--format=philly", "--cluster=8x", f"--out={tmp_path}"])


def test_durations_and_table() -> None:
    assert parse_duration("90") == 90
    assert parse_duration("90m") == 5400
    assert parse_duration("1.5d") == 1.5 * 86400
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration("soon")
    table = summary_table(
        {
            "trace": {"source": "t.csv", "format": "native", "jobs": 1, "problems": 0},
            "cluster": {"gpus": 4, "nodes": 1},
            "runs": {
                "fifo": {
                    "queueing_delay_s": {"mean": 7200.0, "median": None, "p95": 90000.0},
                    "jct_s": {"mean": 10.0, "median": 10.0, "p95": 10.0},
                    "allocation": {"ratio": 0.5},
                    "preemptions": {"evictions": 0},
                    "fairness": {"jain_index": None},
                    "simulation": {"jobs_per_s": 1000.0},
                    "fractional": {"capacity_allocated": 0.25, "fragmentation_rate": 0.5},
                }
            },
            "ratios_to_fifo": {},
        }
    )
    assert "7,200 s (2.0 h)" in table and "90,000 s (1.0 d)" in table
    assert "fragmentation rate 0.500" in table


def test_openb_fractional_trace_reports_capacity_and_fragmentation(tmp_path: Path) -> None:
    trace = tmp_path / "openb.csv"
    trace.write_text(
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,"
        "creation_time,deletion_time,scheduled_time\n"
        "p0,1000,1024,1,250,,BE,Succeeded,0,100,0\n"
        "p1,1000,1024,1,500,,LS,Succeeded,0,100,0\n"
        "p2,1000,1024,2,1000,,LS,Succeeded,50,150,50\n"
        "p3,1000,1024,0,0,,LS,Running,60,100,60\n"
    )
    run(
        [
            f"--trace={trace}",
            "--format=openb",
            "--cluster=1x4",
            "--schedulers=broker,fifo",
            f"--out={tmp_path / 'out'}",
            "--quiet",
            "--no-plots",
        ]
    )
    data = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert data["trace"]["fractional"] and data["trace"]["jobs"] == 3
    assert data["problems"][0]["line"] == 5 and "CPU-only" in data["problems"][0]["reason"]
    assert any("whole device" in n for n in data["notes"])
    fractional = data["runs"]["fifo"]["fractional"]
    # 0.75 GPUs asked for on 2 devices for 0-100 s, 2 GPUs on 2 devices for 50-150 s
    assert fractional["requested_gpu_seconds"] == pytest.approx(75 + 200)
    assert fractional["fragmentation_rate"] == pytest.approx(1 - 275 / 400)
    assert fractional["capacity_allocated"] == pytest.approx(275 / (4 * 150))


def test_packing_experiment_prints_and_writes_its_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run(
        [
            f"--trace={DATA / 'openb_default_first400.csv'}",
            "--format=openb",
            f"--cluster={DATA / 'openb_nodes_sample.csv'}",
            "--packing=1.0,1.3",
            "--seeds=2",
            "--strategies=packing,best-fit",
            f"--out={tmp_path}",
        ]
    )
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("strategy | placed @1 | placed @1.3 | vs best-fit")
    data = json.loads((tmp_path / "packing.json").read_text())
    assert data["host_modelled"] and data["gpus"] == 201 and data["pods"] > 300
    assert set(data["strategies"]) == {"packing", "best-fit"}
    assert data["strategies"]["packing"]["seeds"] == [0, 1]
    assert all("CPU-only" in reason for reason in data["left_out"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--packing=0"], "must be > 0"),
        (["--packing=nan"], "at most 10"),
        (["--packing=1e7"], "at most 10"),
        (["--packing=1.3", "--cluster=missing.csv"], "missing.csv: no such file"),
        (["--packing=1.3", "--strategies=tetris"], "strategies tetris"),
        (["--packing=1.3", "--format=native"], "needs an openb pod list"),
        (["--packing=1.3", "--seeds=0"], "seeds 0"),
    ],
)
def test_packing_experiment_refuses_bad_arguments(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    base = [f"--trace={DATA / 'openb_default_first400.csv'}", f"--out={tmp_path}"]
    if not any(a.startswith("--cluster") for a in argv):
        base.append(f"--cluster={DATA / 'openb_nodes_sample.csv'}")
    if not any(a.startswith("--format") for a in argv):
        base.append("--format=openb")
    with pytest.raises(SystemExit) as exit_:
        run([*base, *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_jobs_per_second_counts_only_the_jobs_replayed(tmp_path: Path) -> None:
    run(
        [
            f"--trace={PHILLY}",
            "--format=philly",
            "--cluster=2x8xA100-80GB",
            "--schedulers=fifo",
            "--until=6h",
            f"--out={tmp_path}",
            "--quiet",
            "--no-plots",
        ]
    )
    data = json.loads((tmp_path / "metrics.json").read_text())
    sim = data["runs"]["fifo"]["simulation"]
    submitted = data["runs"]["fifo"]["jobs"]["submitted"]
    assert 0 < sim["jobs_replayed"] < 300
    assert sim["jobs_per_s"] == pytest.approx(sim["jobs_replayed"] / sim["wall_s"])
    assert submitted >= sim["jobs_replayed"]


GPUBROKER = Path(sys.executable).with_name("gpubroker")


def _cli(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``gpubroker simulate ARGV`` as a user runs it (the console script)."""
    return subprocess.run(
        [str(GPUBROKER), "simulate", *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--cluster=bad.txt"], "--cluster: cluster file bad.txt is not UTF-8 text"),
        (["--out=taken"], "--out taken: exists and is not a directory"),
        (["--out=taken/sub"], "--out taken/sub: taken is not a directory"),
        (["--out=held"], "--out held: held/metrics.json is a directory"),
        (["--policy=syntax.py"], "--policy syntax.py: SyntaxError: '(' was never closed"),
        (["--policy=quota.py"], "--policy quota.py: user_quotas['3']: need 0 <= guaranteed"),
        (["--policy=shape.py"], "--policy shape.py: user_quotas['3']: must be {"),
        (["--policy=raises.py"], "--policy raises.py: RuntimeError: boom"),
        (["--policy=absent.py"], "--policy absent.py: no such file"),
        (
            ["--packing=1.0", "--format=openb", f"--trace={DATA / 'openb_default_first400.csv'}"],
            "--cluster: cluster file bad.txt is not UTF-8 text",
        ),
        (
            ["--packing=1.0", "--format=openb", f"--trace={DATA / 'openb_default_first400.csv'}"],
            "--out taken: exists and is not a directory",
        ),
        (
            [
                "--packing=1.0",
                "--format=openb",
                f"--trace={DATA / 'openb_default_first400.csv'}",
                "--policy=quota.py",
            ],
            "--policy quota.py: user_quotas['3']: need 0 <= guaranteed",
        ),
    ],
)
def test_bad_options_are_one_line_errors_before_any_work(
    tmp_path: Path, argv: list[str], message: str
) -> None:
    """A non-UTF-8 cluster file, an --out that cannot take the outputs, and
    a policy file that does not run or sets a bad quota each stop the real
    command with status 2 and one line naming the option, before the
    replay (they were tracebacks; a bad --out only after the whole run)."""
    (tmp_path / "bad.txt").write_bytes(b"n\xff 8\n")
    (tmp_path / "taken").write_text("")
    (tmp_path / "held" / "metrics.json").mkdir(parents=True)
    (tmp_path / "syntax.py").write_text("c.SchedulingPolicy.max_reservations = (\n")
    (tmp_path / "quota.py").write_text(
        "c.SchedulingPolicy.user_quotas = {'3': {'guaranteed': 5, 'limit': 1}}\n"
    )
    (tmp_path / "shape.py").write_text("c.SchedulingPolicy.user_quotas = {'3': 'lots'}\n")
    (tmp_path / "raises.py").write_text("raise RuntimeError('boom')\n")
    base = {
        "--trace": f"--trace={PHILLY}",
        "--format": "--format=philly",
        "--cluster": "--cluster=4x8",
        "--out": "--out=out",
    }
    if "bad.txt" in message:
        base["--cluster"] = "--cluster=bad.txt"
    if "taken:" in message and "--packing=1.0" in argv:
        base["--out"] = "--out=taken"
    for arg in argv:
        base[arg.split("=", 1)[0]] = arg
    done = _cli([*base.values(), "--quiet", "--no-plots", "--schedulers=fifo"], tmp_path)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert message in done.stderr
    critical = [line for line in done.stderr.splitlines() if "CRITICAL" in line]
    assert len(critical) == 1, done.stderr
    assert "Replaying" not in done.stderr and not done.stdout  # no work was done
    assert not (tmp_path / "out").exists()


def test_packing_warns_of_pods_with_an_empty_host_request(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pods = tmp_path / "pods.csv"
    pods.write_text(
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\n"
        "a,,1024,1,500,\nb,2000,,1,500,\nc,2000,1024,1,1000,\n"
    )
    run(
        [
            f"--trace={pods}",
            "--format=openb",
            "--packing=1.0",
            "--seeds=1",
            "--strategies=best-fit",
            f"--cluster={DATA / 'openb_nodes_sample.csv'}",
            f"--out={tmp_path / 'out'}",
        ]
    )
    assert (
        "packed as asking none of it: 1 without cpu_milli, 1 without memory_mib"
        in capsys.readouterr().err
    )
    data = json.loads((tmp_path / "out" / "packing.json").read_text())
    assert data["defaulted"] == {"cpu_milli": 1, "memory_mib": 1}
