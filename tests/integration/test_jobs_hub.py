"""Batch jobs through the broker behind a real JupyterHub: a real papermill
run in a real kernel on a leased (fake) GPU, owner-scoped like leases."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import nbformat

from ..hubutil import RunningHub
from ..nbutil import write_notebook
from .test_spawn import wait_until


def test_a_notebook_job_runs_to_completion_and_only_its_owner_sees_it(
    clean_hub: RunningHub,
) -> None:
    hub = clean_hub
    token = hub.create_user("jobber")
    other = hub.create_user("snoop")
    home = hub.workdir / "home" / "jobber"
    home.mkdir(parents=True, exist_ok=True)
    write_notebook(
        home / "train.ipynb",
        ["epochs = 1", "import os\nprint(os.environ['CUDA_VISIBLE_DEVICES'], epochs)"],
    )
    r = hub.broker_api(
        "POST",
        "/jobs",
        json={"notebook": "train.ipynb", "gpus": 1, "time": "10m", "params": ["epochs=2"]},
        token=token,
    )
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["user"] == "jobber" and job["state"] == "queued"
    done = wait_until(
        lambda: (
            (j := hub.broker_api("GET", f"/jobs/{job['id']}", token=token).json())["state"]
            in ("succeeded", "failed")
            and j
        ),
        timeout=120,
    )
    assert done["state"] == "succeeded", done
    out = nbformat.read(home / f"train.{job['id']}.ipynb", as_version=4)
    printed = "".join(o.get("text", "") for o in out.cells[-1].outputs)
    assert printed.startswith("GPU-") and printed.strip().endswith(" 2")
    logs = hub.broker_api("GET", f"/jobs/{job['id']}/logs", token=token).json()
    assert logs["state"] == "succeeded" and "Executing" in logs["text"]
    # another user sees nothing of it, not even that it exists (404, as for
    # an id nobody has); an admin sees everything
    for method, path in (("GET", ""), ("DELETE", ""), ("GET", "/logs")):
        r = hub.broker_api(method, f"/jobs/{job['id']}{path}", token=other)
        assert r.status_code == 404 and r.json()["message"] == f"job {job['id']}: no such job"
    assert hub.broker_api("GET", "/jobs", token=other).json()["jobs"] == []
    assert job["id"] in [j["id"] for j in hub.broker_api("GET", "/jobs").json()["jobs"]]
    # the owner was told, and the shell sees the same (gpubroker jobs, her token)
    notices = hub.broker_api("GET", "/notices", token=token).json()["notices"]
    assert notices[0]["kind"] == "job-ended" and "succeeded" in notices[0]["message"]
    env = {**os.environ, "GPUBROKER_URL": f"{hub.url}/services/gpubroker"}
    env["GPUBROKER_API_TOKEN"] = token
    cli = [sys.executable, "-m", "gpubroker", "jobs"]
    listed = subprocess.run([*cli, "list"], env=env, capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    assert f"{job['id']:>6}  jobber" in listed.stdout and "succeeded" in listed.stdout
    shown = subprocess.run(
        [*cli, "show", str(job["id"]), "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert json.loads(shown.stdout)["state"] == "succeeded", shown.stderr
    logs = subprocess.run([*cli, "logs", str(job["id"])], env=env, capture_output=True, text=True)
    assert "Executing" in logs.stdout
    env["GPUBROKER_API_TOKEN"] = other
    refused = subprocess.run(
        [*cli, "show", str(job["id"])], env=env, capture_output=True, text=True
    )
    assert refused.returncode == 2 and f"job {job['id']}: no such job" in refused.stderr
    # its lease was a job's, in the batch class, and is released
    lease = hub.broker_api("GET", f"/leases/{done['lease_id']}").json()
    assert lease["holder_kind"] == "job" and lease["priority_class"] == "batch"
    assert lease["state"] == "released"
    json.dumps(done)


def test_bad_job_requests_are_a_400_naming_the_field(hub: RunningHub) -> None:
    token = hub.create_user("badjob")
    home = hub.workdir / "home" / "badjob"
    home.mkdir(parents=True, exist_ok=True)
    nb = nbformat.v4.new_notebook()
    nbformat.write(nb, home / "bare.ipynb")  # no kernelspec: papermill could not run it
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "P", "language": "python"}
    nbformat.write(nb, home / "x.ipynb")
    for body, field in [
        ({"notebook": "x.ipynb", "gpus": 99}, "gpus"),
        ({"notebook": "x.ipynb", "gpus": 1, "time": "banana"}, "time"),
        ({"notebook": "x.ipynb", "gpus": 1, "params": ["epochs"]}, "param"),
        ({"notebook": "../x.ipynb", "gpus": 1}, "notebook"),
        ({"notebook": "bare.ipynb", "gpus": 1}, "notebook"),
        ({"notebook": "x.ipynb", "gpus": 1, "kernel": "no-such-kernel"}, "kernel"),
        ({"command": "true", "gpus": 1, "bogus": 1}, "bogus"),
    ]:
        r = hub.broker_api("POST", "/jobs", json=body, token=token)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["message"].startswith(f"{field}: "), r.text
    assert hub.broker_api("GET", "/jobs", token=token).json()["jobs"] == []
