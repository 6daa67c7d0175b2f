"""The notebook magics in a real kernel of a server spawned through a real
hub: %gpu_submit promotes a notebook to a batch job that outlives the
server; %gpu_jobs, %gpu and usage errors."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import nbformat
from websocket import WebSocketConnectionClosedException

from ..hubutil import RunningHub
from ..kernelutil import connect, execute, start_kernel
from ..nbutil import write_notebook
from .test_spawn import spawn, wait_until


def _read_json(path: Path) -> object:
    return json.loads(path.read_text()) if path.exists() else None


def _notebook_job(hub: RunningHub, token: str) -> dict | None:
    """The user's notebook job, as the broker's API lists it (None: none yet)."""
    jobs = hub.broker_api("GET", "/jobs", token=token).json()["jobs"]
    return next((j for j in jobs if j["kind"] == "notebook"), None)


def test_gpu_submit_runs_the_notebook_as_a_job_that_outlives_the_server(
    clean_hub: RunningHub,
) -> None:
    hub = clean_hub
    user = "magician"
    token = hub.create_user(user)
    home = hub.workdir / "home" / user
    home.mkdir(parents=True, exist_ok=True)
    write_notebook(
        home / "train.ipynb",
        [
            "epochs = 1",
            "import os, time\ntime.sleep(3)\nprint(os.environ['CUDA_VISIBLE_DEVICES'], epochs)",
        ],
    )
    assert spawn(hub, user, {"gpus": 1}).status_code in (201, 202)
    hub.wait_for_server(user)
    ws = connect(hub, user, token, start_kernel(hub, user, token))
    try:
        assert not execute(
            ws,
            "%load_ext gpubroker\n"
            "import json\n"
            "lease = %gpu\n"
            "job = %gpu_submit train.ipynb --gpus 1 --time 10m --param epochs=2\n"
            "open('submitted.json', 'w').write(json.dumps({'job': job, 'lease': lease}))\n"
            "errors = []\n"
            "bad = ['train.ipynb --time 10m', 'train.ipynb --gpus 99',\n"
            "       'train.ipynb --gpus 1 --time banana']\n"
            "for line in bad:\n"
            "    try:\n"
            "        get_ipython().run_line_magic('gpu_submit', line)\n"
            "    except Exception as err:\n"
            "        errors.append(f'{type(err).__name__}: {err}')\n"
            "open('errors.json', 'w').write(json.dumps(errors))\n",
        )
        submitted = wait_until(lambda: _read_json(home / "submitted.json"), timeout=30)
        job = submitted["job"]
        assert job["state"] in ("queued", "running") and job["spec"]["params"] == {"epochs": 2}
        assert submitted["lease"]["state"] == "granted"  # %gpu: the server's own lease
        errors = _read_json(home / "errors.json")
        assert errors[0].startswith("UsageError: %gpu_submit: give exactly one of --gpus")
        assert errors[1].startswith("UsageError: gpubroker: gpus: must be between 1 and")
        assert errors[2].startswith("UsageError: gpubroker: time: not a duration")
        # the server stops while the job runs: the job is not touched
        wait_until(
            lambda: (
                hub.broker_api("GET", f"/jobs/{job['id']}", token=token).json()["state"]
                == "running"
            ),
            timeout=60,
        )
    finally:
        ws.close()
    hub.api("DELETE", f"/users/{user}/server")
    hub.wait_for_no_server(user)
    done = hub.wait_for_job(job["id"], token, timeout=120)
    assert done["state"] == "succeeded", done
    out = nbformat.read(home / f"train.{job['id']}.ipynb", as_version=4)
    printed = "".join(o.get("text", "") for o in out.cells[-1].outputs)
    assert printed.startswith("GPU-") and printed.split()[-1] == "2"
    # %gpu_jobs in a new server's kernel shows it succeeded
    assert spawn(hub, user, {}).status_code in (201, 202)
    hub.wait_for_server(user)
    ws = connect(hub, user, token, start_kernel(hub, user, token))
    try:
        execute(
            ws,
            "%load_ext gpubroker\nimport json\n"
            "jobs = %gpu_jobs\n"
            "open('jobs.json', 'w').write(json.dumps(jobs))\n",
        )
        jobs = wait_until(lambda: _read_json(home / "jobs.json"), timeout=30)
    finally:
        ws.close()
    assert [(j["id"], j["state"]) for j in jobs] == [(job["id"], "succeeded")]
    hub.api("DELETE", f"/users/{user}/server")
    hub.wait_for_no_server(user)


def test_a_cell_job_and_submit_release_free_the_servers_gpu_for_a_waiting_user(
    clean_hub: RunningHub,
) -> None:
    """%%gpu_job runs a cell as a script job on a GPU of its own; then, with
    every other GPU held, %gpu_submit --release --yes: the job is accepted,
    the hub stops the server, and the user waiting first gets its GPU."""
    hub = clean_hub
    user = "promoter"
    token = hub.create_user(user)
    home = hub.workdir / "home" / user
    home.mkdir(parents=True, exist_ok=True)
    write_notebook(home / "train.ipynb", ["print('trained')"])
    assert spawn(hub, user, {"gpus": 1}).status_code in (201, 202)
    hub.wait_for_server(user)
    ws = connect(hub, user, token, start_kernel(hub, user, token))
    try:
        assert not execute(
            ws,
            "%load_ext gpubroker\n"
            "import json\n"
            "cell = get_ipython().run_cell_magic('gpu_job', '--gpus 1 --time 5m',\n"
            "    \"import os\\nopen('cell.txt', 'w').write(os.environ['CUDA_VISIBLE_DEVICES'])\")\n"
            "open('cell.json', 'w').write(json.dumps(cell))\n",
        )
        cell = wait_until(lambda: _read_json(home / "cell.json"), timeout=30)
        assert cell["kind"] == "command"
        ended = hub.wait_for_job(cell["id"], token, timeout=120)
        assert ended["state"] == "succeeded", ended
        assert (home / "cell.txt").read_text().startswith("GPU-")
        fillers = [
            hub.broker_api(
                "POST", "/leases", json={"user": "filler", "gpus": 1, "holder_kind": "external"}
            ).json()
            for _ in range(7)
        ]
        assert all(f["state"] == "granted" for f in fillers)
        waiter = hub.broker_api(
            "POST", "/leases", json={"user": "waiter", "gpus": 1, "holder_kind": "external"}
        ).json()
        assert waiter["state"] == "pending"
        # The server stops once the lease is released: the kernel's reply may
        # or may not reach us first, so the job is looked up through the API.
        with contextlib.suppress(WebSocketConnectionClosedException):
            assert not execute(ws, "%gpu_submit train.ipynb --gpus 1 --release --yes\n")
        job = wait_until(lambda: _notebook_job(hub, token), timeout=30)
    finally:
        ws.close()
    hub.wait_for_no_server(user)
    granted = wait_until(
        lambda: hub.broker_api("GET", f"/leases/{waiter['id']}").json()["state"] == "granted",
        timeout=60,
    )
    assert granted
    assert hub.broker_api("GET", f"/jobs/{job['id']}", token=token).json()["state"] == "queued"
    for lease in [*fillers, waiter]:
        hub.broker_api("DELETE", f"/leases/{lease['id']}")
    done = hub.wait_for_job(job["id"], token, timeout=120)
    assert done["state"] == "succeeded", done
