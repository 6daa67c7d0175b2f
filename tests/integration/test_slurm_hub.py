"""A real JupyterHub whose servers are Slurm jobs (SlurmGPUSpawner) and
whose broker takes its inventory from Slurm, on the real two-node cluster
of the tests (tests/slurmutil.py): the demo config with
``GPUBROKER_DEMO_SLURM_CONF``, as ``make demo-slurm`` runs it."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import nbformat
import pytest

from ..hubutil import RunningHub
from ..kernelutil import connect, execute, start_kernel
from ..nbutil import write_notebook
from ..slurmutil import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.hub]

EXTRA = """
c.SlurmGPUSpawner.time_limit = 3600
c.SlurmGPUSpawner.slurm_poll_interval = 0.5
c.SlurmGPUSpawner.stop_grace = 3
c.SlurmGPUSpawner.gpu_profiles = [
    {"display_name": "Two GPUs", "slug": "two", "request": {"gpus": 2}, "default": True},
    {"display_name": "One GPU", "slug": "one", "request": {"gpus": 1}},
    {
        "display_name": "Broken",
        "slug": "broken",
        "request": {"gpus": 1},
        "spawner_override": {"cmd": ["/nonexistent/jupyterhub-singleuser"]},
    },
]
"""


@pytest.fixture(scope="module")
def slurm_hub(
    slurm_cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningHub]:
    workdir = tmp_path_factory.mktemp("slurm-hub")
    extra = workdir / "extra_config.py"
    extra.write_text(EXTRA)
    running = RunningHub(
        workdir,
        GPUBROKER_DEMO_SLURM_CONF=str(slurm_cluster.conf),
        GPUBROKER_DEMO_RECONCILE_INTERVAL="2",
        GPUBROKER_DEMO_POLL_INTERVAL="2",
        GPUBROKER_DEMO_INVENTORY_INTERVAL="600",  # read again by POST /inventory
        GPUBROKER_DEMO_EXTRA_CONFIG=str(extra),
    ).start()
    yield running
    running.stop()


@pytest.fixture
def hub(slurm_hub: RunningHub, slurm_cluster: SlurmCluster) -> Iterator[RunningHub]:
    """The Slurm hub, left with no servers, leases or Slurm jobs."""
    yield slurm_hub
    users = slurm_hub.api("GET", "/users", params={"state": "active"}).json()
    for user in users:
        for name in user["servers"]:
            slurm_hub.api("DELETE", f"/users/{user['name']}/servers/{name}")
    for user in users:
        for name in user["servers"]:
            slurm_hub.wait_for_no_server(user["name"], name)
    for lease in slurm_hub.leases():
        slurm_hub.broker_api("DELETE", f"/leases/{lease['id']}", json={"reason": "test cleanup"})
    slurm_cluster.run("scancel", "--full", "--user=root", check=False)
    _wait(lambda: not slurm_cluster.run("squeue", "-h").stdout.strip(), 30, "Slurm jobs left")


def _wait(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.3)
    raise TimeoutError(f"{what} (after {timeout} s)")


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


def _spawn(hub: RunningHub, user: str, profile: str) -> None:
    hub.create_user(user)
    r = hub.api("POST", f"/users/{user}/server", json={"profile": profile})
    assert r.status_code in (201, 202), r.text


def _server_up(hub: RunningHub, user: str, profile: str) -> dict[str, Any]:
    """Spawn ``user``'s server; its lease once Slurm's binding is on it."""
    _spawn(hub, user, profile)
    hub.wait_for_server(user, timeout=120)
    return dict(_wait(lambda: _bound_as_lease_says(hub, user), 30, f"{user}'s lease"))


def _lease_of(hub: RunningHub, user: str) -> dict[str, Any] | None:
    leases = [x for x in hub.leases() if x["user"] == user]
    return leases[0] if leases else None


def _outside(hub: RunningHub) -> int:
    devices = hub.broker_api("GET", "/devices").json()["devices"]
    return sum(1 for d in devices if d.get("state") == "outside")


def _held_outside(cluster: SlurmCluster) -> int:
    """GPUs held by the running jobs not of the broker (this test's, 2 GPUs each)."""
    jobs = json.loads(cluster.run("squeue", "--json").stdout)["jobs"]
    return sum(
        2
        for j in jobs
        if j["job_state"] == "RUNNING" and not j["name"].startswith("gpubroker-lease-")
    )


def _server_devices(hub: RunningHub, user: str) -> list[int]:
    """The GPU indices Slurm gave the user's server (CUDA_VISIBLE_DEVICES,
    printed by the launcher into the job's output file)."""
    log = Path(hub.workdir) / "home" / user / "slurm.log"
    found = re.findall(r"CUDA_VISIBLE_DEVICES=([0-9,]*)", log.read_text())
    assert found, log.read_text()
    return [int(x) for x in found[-1].split(",") if x]


def _bound_as_lease_says(hub: RunningHub, user: str) -> dict[str, Any] | None:
    lease = _lease_of(hub, user)
    if lease is None or not lease.get("slurm_job"):
        return None
    indices = sorted(d["index"] for d in lease["devices"])
    return lease if indices == sorted(_server_devices(hub, user)) else None


def test_two_servers_run_as_slurm_jobs_where_the_broker_placed_them_and_a_third_waits(
    hub: RunningHub, slurm_cluster: SlurmCluster
) -> None:
    # jobs from outside the broker take two GPUs of each node: four remain
    for node in ("n1", "n2"):
        slurm_cluster.run(
            "sbatch", f"--nodelist={node}", "--gres=gpu:2", "--output=/dev/null", "--wrap=sleep 600"
        )
    _wait(lambda: _held_outside(slurm_cluster) == 4, 30, "the outside jobs do not run")
    assert _outside(hub) == 0  # not read yet: the hub's interval is long
    hub.broker_api("POST", "/inventory").raise_for_status()
    assert _outside(hub) == 4

    _spawn(hub, "alice", "two")
    with ThreadPoolExecutor(1) as pool:
        # the spawn's progress, read while it starts
        progress = pool.submit(hub.progress, "alice", "", 60)
        _spawn(hub, "bob", "two")
        events = [e.get("message", "") for e in progress.result()]
    assert any(re.search(r"Slurm job \d+ submitted on n\d", m) for m in events), events
    assert any("RUNNING on" in m and "server on port" in m for m in events), events
    leases = {}
    for user in ("alice", "bob"):
        hub.wait_for_server(user, timeout=120)
        lease = _wait(lambda u=user: _bound_as_lease_says(hub, u), 30, f"{user}'s lease")
        leases[user] = lease
        nodes = {d["node"] for d in lease["devices"]}
        assert len(nodes) == 1 and len(lease["devices"]) == 2
        # the server is a Slurm job of the lease, on the node the broker chose
        job = json.loads(slurm_cluster.run("squeue", "--json").stdout)
        mine = [j for j in job["jobs"] if str(j["job_id"]) == lease["slurm_job"]]
        assert mine and mine[0]["job_state"] == "RUNNING"
        assert mine[0]["nodes"] == nodes.pop()
        assert mine[0]["partition"] == "interactive"
    # two outside jobs hold two GPUs per node: one server per node
    assert {leases[u]["devices"][0]["node"] for u in leases} == {"n1", "n2"}
    # the broker counts the servers' jobs as its own, not as outside
    hub.broker_api("POST", "/inventory").raise_for_status()
    assert _outside(hub) == 4

    _spawn(hub, "carol", "one")
    carol = _wait(lambda: _lease_of(hub, "carol"), 30, "carol's request")
    assert carol["state"] == "pending"
    assert carol["queue"]["reason"] and carol["queue"]["message"]
    assert carol["queue"]["eta"], carol["queue"]

    # alice stops: her GPUs go to carol, whose server starts on that node
    r = hub.api("DELETE", "/users/alice/server")
    assert r.status_code in (202, 204), r.text
    hub.wait_for_server("carol", timeout=120)
    carol = _wait(lambda: _bound_as_lease_says(hub, "carol"), 30, "carol's lease")
    assert carol["devices"][0]["node"] == leases["alice"]["devices"][0]["node"]


def test_scancel_of_a_server_releases_its_lease_and_the_hub_sees_it_stopped(
    hub: RunningHub, slurm_cluster: SlurmCluster
) -> None:
    lease = _server_up(hub, "dave", "one")

    slurm_cluster.run("scancel", lease["slurm_job"])

    _wait(lambda: _lease_of(hub, "dave") is None, 20, "the lease was not released")
    ended = hub.broker_api("GET", f"/leases/{lease['id']}").json()
    assert ended["state"] == "released"
    hub.wait_for_no_server("dave", timeout=30)


def test_a_server_job_that_dies_before_its_server_answers_fails_the_spawn_at_once(
    hub: RunningHub,
) -> None:
    hub.create_user("erin")
    r = hub.api("POST", "/users/erin/server", json={"profile": "broken"})
    if r.status_code in (201, 202):  # the hub answered before the spawn failed
        _wait(lambda: hub.server("erin") is None, 60, "the failed spawn is still pending")
        message = hub.log_tail(20000)
    else:
        message = r.json()["message"]
    # the spawn failed on the job's end (the message says so), not on the hub's
    # start timeout (3720 s), which the waits above would not have reached
    assert re.search(r"Slurm job \d+ ended: FAILED \(exit status 127", message), message
    assert "cannot run /nonexistent/jupyterhub-singleuser: No such file" in message
    assert not hub.user_model("erin")["servers"]
    # released by the spawn's failure itself, not later by the reconciliation
    _wait(lambda: _lease_of(hub, "erin") is None, 1.5, "the lease of the failed spawn")


def test_a_server_job_slurm_will_never_start_fails_the_spawn_and_is_cancelled(
    hub: RunningHub, slurm_cluster: SlurmCluster
) -> None:
    """The partition's MaxTime below the spawner's time limit (1 h): Slurm
    keeps the job PENDING for ever, as EnforcePartLimits is off (22.05 gives
    the reason PartitionConfig, later releases PartitionTimeLimit); the spawn
    fails at once with the reason, and the job is gone."""
    slurm_cluster.run("scontrol", "update", "PartitionName=interactive", "MaxTime=30")
    try:
        hub.create_user("hope")
        r = hub.api("POST", "/users/hope/server", json={"profile": "one"})
        if r.status_code in (201, 202):
            _wait(lambda: hub.server("hope") is None, 60, "the hopeless spawn is still pending")
            message = hub.log_tail(20000)
        else:
            message = r.json()["message"]
        found = re.search(
            r"Slurm will not start the server's job (\d+): "
            r"PENDING \(Partition(?:TimeLimit|Config)\)",
            message,
        )
        assert found, message
        assert not hub.user_model("hope")["servers"]
        _wait(lambda: _lease_of(hub, "hope") is None, 10, "the lease of the hopeless spawn")
        job = found.group(1)
        state = slurm_cluster.run("squeue", "-h", "-j", job, "-o", "%T", check=False).stdout
        assert state.strip() in ("", "CANCELLED"), state
    finally:
        slurm_cluster.run("scontrol", "update", "PartitionName=interactive", "MaxTime=INFINITE")


def test_gpu_submit_from_a_slurm_server_runs_the_notebook_as_a_slurm_job_on_batch(
    hub: RunningHub, slurm_cluster: SlurmCluster
) -> None:
    user = "frank"
    token = hub.create_user(user)
    home = Path(hub.workdir) / "home" / user
    home.mkdir(parents=True, exist_ok=True)
    write_notebook(
        home / "train.ipynb",
        ["epochs = 1", "import os\nprint(os.environ['SLURM_JOB_PARTITION'], epochs)"],
    )
    _spawn(hub, user, "one")
    hub.wait_for_server(user, timeout=120)
    ws = connect(hub, user, token, start_kernel(hub, user, token))
    try:
        errors = execute(
            ws,
            "%load_ext gpubroker\nimport json\n"
            "job = %gpu_submit train.ipynb --gpus 1 --time 10m --param epochs=2\n"
            "open('submitted.json', 'w').write(json.dumps(job))\n",
        )
        assert not errors, errors
        submitted = _wait(lambda: _read_json(home / "submitted.json"), 60, "no job submitted")
    finally:
        ws.close()
    done = hub.wait_for_job(submitted["id"], token, timeout=120)
    assert (done["state"], done["exit_code"]) == ("succeeded", 0), done
    out = nbformat.read(home / f"train.{done['id']}.ipynb", as_version=4)
    assert "".join(o.get("text", "") for o in out.cells[-1].outputs).split() == ["batch", "2"]
    jobs = json.loads(slurm_cluster.run("squeue", "--json").stdout)["jobs"]
    (ran,) = [
        j
        for j in jobs  # other tests' brokers (stores) have leases of the same ids
        if j["name"] == f"gpubroker-lease-{done['lease_id']}"
        and j["current_working_directory"] == str(home)
    ]
    assert (ran["partition"], ran["job_state"]) == ("batch", "COMPLETED")


def test_a_stopped_slurmctld_ends_no_lease_and_orphans_no_server(
    hub: RunningHub, slurm_cluster: SlurmCluster
) -> None:
    lease = _server_up(hub, "gina", "one")
    ctld = slurm_cluster.procs["slurmctld"]
    ctld.send_signal(signal.SIGSTOP)  # every Slurm command now hangs, then fails
    try:
        time.sleep(12)  # six reconcile intervals, six hub polls
        assert hub.broker_api("GET", f"/leases/{lease['id']}").json()["state"] == "granted"
        assert (hub.server("gina") or {}).get("ready")
    finally:
        ctld.send_signal(signal.SIGCONT)
    # Slurm answers again: the job still runs, and its end is seen as before
    assert "Slurm job" in hub.log_tail(200000)
    slurm_cluster.run("scancel", lease["slurm_job"])
    _wait(lambda: _lease_of(hub, "gina") is None, 60, "the lease was not released")
    hub.wait_for_no_server("gina", timeout=60)


def test_a_stop_that_fails_while_slurmctld_is_down_keeps_the_lease_until_the_job_is_cancelled(
    hub: RunningHub, slurm_cluster: SlurmCluster
) -> None:
    lease = _server_up(hub, "ivan", "one")
    job = lease["slurm_job"]
    ctld = slurm_cluster.procs["slurmctld"]
    ctld.send_signal(signal.SIGSTOP)
    try:
        r = hub.api("DELETE", "/users/ivan/server")
        assert r.status_code in (202, 204), r.text
        # the stop fails (squeue, then scancel, each past command_timeout):
        # JupyterHub forgets the server, but its job still holds the GPU
        hub.wait_for_no_server("ivan", timeout=120)
        time.sleep(5)  # two hub reconciliations
        assert hub.broker_api("GET", f"/leases/{lease['id']}").json()["state"] == "granted"
    finally:
        ctld.send_signal(signal.SIGCONT)
    # Slurm answers again: the broker cancels the orphaned job, then releases
    _wait(lambda: _lease_of(hub, "ivan") is None, 90, "the lease was not released")
    view = hub.broker_api("GET", f"/leases/{lease['id']}").json()
    assert view["release_reason"] == (
        f"reconcile: the Slurm job {job} of server ivan/ was cancelled: "
        "its server is gone from the hub"
    )
    assert job not in slurm_cluster.run("squeue", "-h", "-o", "%i").stdout.split()


def test_a_restarted_broker_adopts_the_servers_slurm_jobs(
    hub: RunningHub, slurm_cluster: SlurmCluster
) -> None:
    lease = _server_up(hub, "hana", "two")
    old = hub.broker_pid()
    assert old is not None
    os.kill(old, signal.SIGKILL)
    _wait(lambda: (pid := hub.broker_pid()) and pid != old, 60, "the broker did not restart")
    _wait(lambda: _lease_of(hub, "hana") is not None, 60, "the broker does not answer")
    # the job's GPUs are still the lease's, not held from outside
    assert _lease_of(hub, "hana") == lease | {"version": _lease_of(hub, "hana")["version"]}
    assert _outside(hub) == 0
    slurm_cluster.run("scancel", lease["slurm_job"])
    _wait(lambda: _lease_of(hub, "hana") is None, 30, "the adopted job's end was not seen")


def test_an_admin_reads_the_inventory_again_at_once(
    hub: RunningHub, slurm_cluster: SlurmCluster
) -> None:
    # the hub's inventory interval is 600 s: what changes is POST's doing
    slurm_cluster.run("scontrol", "update", "nodename=n2", "state=drain", "reason=fans")
    try:
        listing = hub.broker_api("POST", "/inventory").json()
        drained = [d for d in listing["devices"] if d["node"] == "n2"]
        assert len(drained) == 4 and {d["state"] for d in drained} == {"outside"}
        assert all("fans" in d["outside"] for d in drained), drained
        token = hub.create_user("ivan")
        r = hub.broker_api("POST", "/inventory", token=token)
        assert r.status_code == 403, r.text
    finally:
        slurm_cluster.run("scontrol", "update", "nodename=n2", "state=resume")

    def none_outside() -> bool:
        listing = hub.broker_api("POST", "/inventory").json()
        return not [d for d in listing["devices"] if d["state"] == "outside"]

    _wait(none_outside, 10, "n2 still drained after its resume")
