"""Reading Slurm's answers (gpubroker.engines.slurm_json), on the shapes
Slurm 22.05 prints (seen on the test cluster and in Slurm's documentation)."""

from __future__ import annotations

import pytest

from gpubroker.engines import slurm_json as sj


def test_index_lists() -> None:
    assert sj.index_set("0-2,5") == {0, 1, 2, 5}
    assert sj.index_set("3") == {3}
    assert sj.index_set("N/A") == set()
    assert sj.index_set("") == set()
    with pytest.raises(ValueError, match="not a Slurm index list"):
        sj.index_set("0-x")


def test_host_lists() -> None:
    assert sj.expand_hostlist("n[1-3],gpu07") == ["n1", "n2", "n3", "gpu07"]
    assert sj.expand_hostlist("g[01-02,10]") == ["g01", "g02", "g10"]
    assert sj.expand_hostlist("n2") == ["n2"]
    assert sj.expand_hostlist("") == []
    assert sj.expand_hostlist("(null)") == []


def test_gres_strings() -> None:
    assert sj.gpu_gres("gpu:h100:4") == [sj.GpuGres("h100", 4)]
    assert sj.gpu_gres("gpu:4") == [sj.GpuGres("", 4)]
    assert sj.gpu_gres("gpu:h100:2(IDX:0-1)") == [sj.GpuGres("h100", 2, frozenset({0, 1}))]
    assert sj.gpu_gres("gpu:h100:0(IDX:N/A)") == [sj.GpuGres("h100", 0)]
    # indices that are not one range: Slurm lists them after the comma
    assert sj.gpu_gres("gpu:h100:2(IDX:1,3)") == [sj.GpuGres("h100", 2, frozenset({1, 3}))]
    both = sj.gpu_gres("gpu:a100:2(S:0,1),gpu:v100:1(IDX:3),shard:8")
    assert both == [sj.GpuGres("a100", 2), sj.GpuGres("v100", 1, frozenset({3}))]
    assert sj.gpu_gres("") == []
    assert sj.gpu_gres("(null)") == []


def test_node_states() -> None:
    assert sj.node_state("idle", []) == "up"
    assert sj.node_state("mixed", []) == "up"
    assert sj.node_state("allocated", []) == "up"
    assert sj.node_state("mixed", ["DRAIN"]) == "drained"
    assert sj.node_state("idle", ["MAINTENANCE"]) == "drained"
    assert sj.node_state("down", []) == "down"
    assert sj.node_state("idle", ["NOT_RESPONDING"]) == "down"
    assert sj.node_state("down", ["DRAIN"]) == "down"


def test_device_uuids_are_stable_and_distinct() -> None:
    a = sj.device_uuid("c", "n1", 0)
    assert a == sj.device_uuid("c", "n1", 0)
    assert a.startswith("GPU-") and len(a) == 40
    assert len({a, sj.device_uuid("c", "n1", 1), sj.device_uuid("c", "n2", 0)}) == 3
    assert sj.device_uuid("other", "n1", 0) != a


def test_a_jobs_gpus_per_node() -> None:
    job = {"nodes": "n[1-2]", "gres_detail": ["gpu:h100:2(IDX:0-1)", "gpu:h100:1(IDX:3)"]}
    assert sj.job_gpus(job) == {"n1": frozenset({0, 1}), "n2": frozenset({3})}
    assert sj.job_gpus({"nodes": "n1", "gres_detail": []}) == {}
    assert sj.job_gpus({"nodes": "", "gres_detail": None}) == {}


def test_wait_statuses() -> None:
    assert sj.wait_status(0) == (0, None)
    assert sj.wait_status(768) == (3, None)
    assert sj.wait_status(9) == (None, 9)
    assert sj.wait_status(15) == (None, 15)


def test_job_states() -> None:
    running = sj.job_status({"job_state": "RUNNING", "start_time": 1796281677})
    assert running.running and running.started is not None
    assert running.started.tzinfo is not None
    assert sj.job_status({"job_state": "PENDING", "start_time": 0}).running
    done = sj.job_status({"job_state": "COMPLETED", "exit_code": 0, "end_time": 1796281690})
    assert (done.state, done.exit_code, done.signal, done.timed_out) == ("exited", 0, None, False)
    failed = sj.job_status({"job_state": "FAILED", "exit_code": 768})
    assert (failed.exit_code, failed.signal) == (3, None)
    killed = sj.job_status({"job_state": "FAILED", "exit_code": 9})
    assert (killed.exit_code, killed.signal) == (None, 9)
    cancelled = sj.job_status({"job_state": "CANCELLED", "exit_code": 0})
    assert (cancelled.exit_code, cancelled.signal) == (None, 15)
    late = sj.job_status({"job_state": "TIMEOUT", "exit_code": 15})
    assert late.timed_out and late.signal == 15


def test_sacct_lines() -> None:
    done = sj.sacct_status("COMPLETED|0:0|2026-12-03T07:07:24|2026-12-03T07:08:00\n")
    assert done is not None
    assert (done.state, done.exit_code, done.signal) == ("exited", 0, None)
    assert done.ended is not None and done.ended.hour == 7 and done.ended.tzinfo is not None
    failed = sj.sacct_status("FAILED|2:0|2026-12-03T07:07:24|2026-12-03T07:08:00")
    assert failed is not None and failed.exit_code == 2
    killed = sj.sacct_status("CANCELLED by 0|0:9|2026-12-03T07:07:24|Unknown")
    assert killed is not None and (killed.exit_code, killed.signal) == (None, 9)
    assert killed.ended is None
    cancelled = sj.sacct_status("CANCELLED by 1000|0:0|x|y")
    assert cancelled is not None and cancelled.signal == 15
    timeout = sj.sacct_status("TIMEOUT|0:15|x|y")
    assert timeout is not None and timeout.timed_out
    assert sj.sacct_status("RUNNING|0:0|x|Unknown") == sj.Status("running")
    assert sj.sacct_status("") is None


def test_a_server_jobs_comment_gives_its_port() -> None:
    assert sj.server_port(sj.server_comment(40123)) == 40123
    assert sj.server_port("gpubroker server port=40123\n") == 40123
    assert sj.server_port("gpubroker lease 7") is None
    assert sj.server_port("gpubroker server port=0") is None
    assert sj.server_port("gpubroker server port=70000") is None
    assert sj.server_port("gpubroker server port=1; rm -rf") is None


def test_job_view_of_a_pending_and_a_running_server_job() -> None:
    pending = {"job_id": 12, "job_state": "PENDING", "state_reason": "Resources", "nodes": ""}
    view = sj.job_view(pending, "c")
    assert (view.job_id, view.state, view.reason, view.node, view.port) == (
        "12",
        "PENDING",
        "Resources",
        "",
        None,
    )
    assert view.status.running and view.status.devices == ()
    running = {
        "job_id": 12,
        "job_state": "RUNNING",
        "state_reason": "None",
        "nodes": "n2",
        "batch_host": "n2",
        "comment": "gpubroker server port=41000",
        "gres_detail": ["gpu:h100:2(IDX:1,3)"],
        "start_time": 1764748800,
    }
    view = sj.job_view(running, "c")
    assert (view.reason, view.node, view.port) == ("", "n2", 41000)
    assert view.status.devices == (sj.device_uuid("c", "n2", 1), sj.device_uuid("c", "n2", 3))
    failed = {"job_id": 12, "job_state": "FAILED", "exit_code": 127 << 8, "nodes": "n2"}
    view = sj.job_view(failed, "c")
    assert not view.status.running and view.status.exit_code == 127


def test_an_answer_with_errors_is_no_answer() -> None:
    # what squeue --json (22.05) prints, exit status 0, while slurmctld is stopped
    answer = {
        "errors": [
            {
                "description": "Failed while looking for jobs",
                "error_number": -1,
                "error": "Unspecified error",
                "source": "slurm_load_jobs",
            }
        ],
        "jobs": [],
    }
    assert sj.errors(answer) == "Failed while looking for jobs (slurm_load_jobs)"
    assert sj.errors({"errors": [], "jobs": []}) == ""
    assert sj.errors({"jobs": []}) == ""
