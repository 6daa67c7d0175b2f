"""GPU-aware culling against a real JupyterHub, real servers and kernels;
GPU signals come from the fake backend's usage file.

The culler here: timeout 4 s, grace 6 s, a check every second; user "vip" is
exempt. A second hub runs the culler in dry-run mode.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import websocket

from gpubroker.devices.fake import FakeDeviceBackend

from ..hubutil import RunningHub
from ..kernelutil import connect, execute, start_kernel
from ..nbutil import write_notebook
from .test_spawn import lease_of, spawn, wait_for_release, wait_until

CULLER = """
c.Culler.timeout = 4
c.Culler.grace = 6
c.Culler.cull_every = 1
c.Culler.exempt_users = ["vip"]
"""


# the hub reads the proxy's traffic every second: an open tab shows as activity
HUB = "c.JupyterHub.last_activity_interval = 1\n"


def culler_hub(tmp_path_factory: pytest.TempPathFactory, name: str, extra: str) -> RunningHub:
    workdir: Path = tmp_path_factory.mktemp(name)
    config = workdir / "broker_config.py"
    config.write_text(CULLER + extra)
    hub_config = workdir / "hub_config.py"
    hub_config.write_text(HUB)
    return RunningHub(
        workdir,
        GPUBROKER_DEMO_BROKER_CONFIG=str(config),
        GPUBROKER_DEMO_EXTRA_CONFIG=str(hub_config),
    ).start()


class OpenTab:
    """A browser tab left open: the kernel websocket pings every second."""

    def __init__(self, ws) -> None:
        self.ws = ws
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._ping, daemon=True)
        self.thread.start()

    def _ping(self) -> None:
        while not self.done.wait(1):
            try:
                self.ws.ping()
            except Exception:
                return

    def close(self) -> None:
        self.done.set()
        self.thread.join(5)
        self.ws.close()


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningHub]:
    running = culler_hub(tmp_path_factory, "culler-hub", "")
    yield running
    running.stop()


def gpus(hub: RunningHub) -> FakeDeviceBackend:
    """The fake backend of the hub's broker, to set simulated GPU use."""
    return FakeDeviceBackend(
        inventory=["8 x NVIDIA H100 80GB HBM3"],
        node_name="demo-node",
        state_file=str(hub.workdir / "fake-gpu-usage.json"),
    )


def start(hub: RunningHub, user: str, util: int, memory_gib: int) -> tuple[str, dict, str]:
    """Spawn ``user`` with 1 GPU, then give that GPU the usage to test. Free
    GPUs look busy meanwhile, so no lease is judged before its test sets it
    up (a spawn can take longer than the 4 s timeout on a loaded machine)."""
    token = hub.create_user(user)
    backend = gpus(hub)
    for device in hub.broker_api("GET", "/devices").json()["devices"]:
        if device["state"] == "free":
            backend.set_usage(device["uuid"], utilization_gpu=100)
    assert spawn(hub, user, {"gpus": 1}).status_code in (201, 202)
    hub.wait_for_server(user)
    lease = lease_of(hub, user)
    kernel = start_kernel(hub, user, token)
    backend.set_usage(
        lease["devices"][0]["uuid"], utilization_gpu=util, memory_used_mib=memory_gib * 1024
    )
    return token, lease, kernel


def notices(hub: RunningHub, user: str, token: str) -> list[dict]:
    r = requests.get(
        f"{hub.broker}/notices", headers={"Authorization": f"token {token}"}, timeout=10
    )
    r.raise_for_status()
    return list(r.json()["notices"])


def kinds(hub: RunningHub, user: str, token: str) -> list[str]:
    return [n["kind"] for n in notices(hub, user, token)]


def culler_checks(hub: RunningHub) -> float:
    """The culler's completed checks so far (its metric)."""
    return hub.counter("gpubroker_culler_checks", outcome="ok")


def test_busy_kernel_on_a_busy_gpu_is_never_culled(hub: RunningHub) -> None:
    token, lease, kernel = start(hub, "trainer", util=80, memory_gib=40)
    ws = connect(hub, "trainer", token, kernel)
    execute(ws, "import time; time.sleep(40)", wait=False)
    ws.close()  # no browser attached
    checks = culler_checks(hub)
    time.sleep(14)  # > timeout + grace + checks
    assert culler_checks(hub) >= checks + 3  # it was judged, and kept
    assert hub.broker_api("GET", f"/leases/{lease['id']}").json()["state"] == "granted"
    assert kinds(hub, "trainer", token) == []
    hub.api("DELETE", "/users/trainer/server")
    wait_for_release(hub, lease["id"])


def test_idle_tab_holding_memory_is_warned_then_culled_and_told(hub: RunningHub) -> None:
    # the exempt user first: the idler's tab opens as soon as it is idle (a
    # start in between, slow on a loaded machine, outlasted timeout + grace)
    vip_token, vip_lease, _ = start(hub, "vip", util=0, memory_gib=20)
    token, lease, kernel = start(hub, "idler", util=0, memory_gib=20)
    tab = OpenTab(connect(hub, "idler", token, kernel))  # the tab stays open, nothing runs
    try:
        warning = wait_until(
            lambda: [n for n in notices(hub, "idler", token) if n["kind"] == "cull-warning"],
            timeout=30,
        )[0]
        assert "GPU 0%, 20.0 GiB held, no busy kernel" in warning["message"]
        assert warning["deadline"] is not None
        released = wait_for_release(hub, lease["id"], timeout=40)
    finally:
        tab.close()
    reason = released["release_reason"]
    assert reason.startswith("culled: idle ") and "GPU 0%, 20.0 GiB held, no busy kernel" in reason
    wait_until(lambda: hub.server("idler") is None, timeout=30)
    assert "culled" in kinds(hub, "idler", token)
    # the lease's transition log tells the story, to its owner (and admins) only
    r = requests.get(
        f"{hub.broker}/leases/{lease['id']}/events",
        headers={"Authorization": f"token {token}"},
        timeout=10,
    )
    assert r.status_code == 200, r.text
    story = [(e["kind"], e["actor"]) for e in r.json()["events"]]
    assert story[:2] == [("requested", "gpubroker"), ("granted", "scheduler")], story
    assert ("cull-warning", "culler") in story and ("stopping", "culler") in story
    assert story[-1][0] == "released" and r.json()["events"][-1]["reason"].startswith("culled: ")
    assert story.index(("cull-warning", "culler")) < story.index(("stopping", "culler"))
    # the cull is in the audit log with its reason, and in the usage report
    audit = hub.broker_api("GET", "/audit", params={"user": "idler", "kind": "culled"}).json()
    assert audit["entries"][0]["actor"] == "culler"
    assert audit["entries"][0]["reason"].startswith("culled: idle ")
    # the release that followed the server's stop is the culler's too, with its cause
    audit = hub.broker_api("GET", "/audit", params={"user": "idler", "kind": "cull"}).json()
    assert [(e["action"], e["actor"]) for e in audit["entries"]] == [("released", "culler")]
    (row,) = hub.broker_api("GET", "/usage", params={"user": "idler"}).json()["rows"]
    assert row["culls"] == 1 and row["idle_gpu_hours_culled"] > 0
    other = requests.get(
        f"{hub.broker}/leases/{lease['id']}/events",
        headers={"Authorization": f"token {vip_token}"},
        timeout=10,
    )
    assert other.status_code == 404  # another user's lease: as if there were none
    # the exempt user, idle just as long, keeps the GPU
    assert hub.broker_api("GET", f"/leases/{vip_lease['id']}").json()["state"] == "granted"
    assert kinds(hub, "vip", vip_token) == []
    hub.api("DELETE", "/users/vip/server")
    wait_for_release(hub, vip_lease["id"])


def test_a_culled_server_leaves_its_promoted_job_running(hub: RunningHub) -> None:
    """%gpu_submit from an idle server, which is then culled: the job holds a
    lease of its own and runs to the end."""
    token, lease, kernel = start(hub, "promoted", util=0, memory_gib=20)
    home = hub.workdir / "home" / "promoted"
    home.mkdir(parents=True, exist_ok=True)
    write_notebook(home / "train.ipynb", ["import time\ntime.sleep(40)\nprint('trained')"])
    ws = connect(hub, "promoted", token, kernel)
    try:
        errors = execute(
            ws,
            "%load_ext gpubroker\nimport json\n"
            "job = %gpu_submit train.ipynb --gpus 1 --time 10m\n"
            "open('job.json', 'w').write(json.dumps(job))\n",
        )
    finally:
        ws.close()
    assert not errors
    job = json.loads((home / "job.json").read_text())
    released = wait_for_release(hub, lease["id"], timeout=60)
    assert released["release_reason"].startswith("culled: ")
    wait_until(lambda: hub.server("promoted") is None, timeout=30)
    assert hub.broker_api("GET", f"/jobs/{job['id']}").json()["state"] in ("queued", "running")
    done = hub.wait_for_job(job["id"], None, timeout=120)
    assert done["state"] == "succeeded", done
    assert "culled" in kinds(hub, "promoted", token)


def test_activity_during_the_grace_period_withdraws_the_warning(hub: RunningHub) -> None:
    token, lease, kernel = start(hub, "returner", util=0, memory_gib=8)
    ws = connect(hub, "returner", token, kernel)
    try:
        wait_until(lambda: "cull-warning" in kinds(hub, "returner", token), timeout=30)
        execute(ws, "x = 1 + 1")  # the user is back
        wait_until(lambda: "cull-withdrawn" in kinds(hub, "returner", token), timeout=10)
        assert hub.broker_api("GET", f"/leases/{lease['id']}").json()["state"] == "granted"
        assert "culled" not in kinds(hub, "returner", token)
    finally:
        ws.close()
    hub.api("DELETE", "/users/returner/server")
    wait_for_release(hub, lease["id"])


def test_a_program_printing_in_a_terminal_keeps_its_server(hub: RunningHub) -> None:
    """Training started in a JupyterLab terminal, on a GPU whose use the
    culler cannot credit (idle here), with no kernel running: the terminal's
    output is activity. Once the terminal is gone, the server is culled."""
    token, lease, _kernel = start(hub, "terminal", util=0, memory_gib=8)
    auth = {"Authorization": f"token {token}"}
    api = f"{hub.url}/user/terminal/api/terminals"
    r = requests.post(api, headers=auth, timeout=30)
    r.raise_for_status()
    name = r.json()["name"]
    ws = websocket.create_connection(
        f"{hub.url.replace('http://', 'ws://')}/user/terminal/terminals/websocket/{name}",
        header=[f"Authorization: token {token}"],
        timeout=30,
    )
    ws.send(json.dumps(["stdin", "while true; do echo epoch; sleep 1; done\r"]))
    ws.close()  # the tab is closed; the program goes on printing
    checks = culler_checks(hub)
    time.sleep(14)  # > timeout + grace + checks
    assert culler_checks(hub) >= checks + 3  # it was judged, and kept
    assert hub.broker_api("GET", f"/leases/{lease['id']}").json()["state"] == "granted"
    assert kinds(hub, "terminal", token) == []
    requests.delete(f"{api}/{name}", headers=auth, timeout=30).raise_for_status()
    released = wait_for_release(hub, lease["id"], timeout=40)
    assert released["release_reason"].startswith("culled: idle ")


def test_dry_run_culls_nothing_but_reports(tmp_path_factory: pytest.TempPathFactory) -> None:
    dry = culler_hub(tmp_path_factory, "dry-hub", "c.Culler.dry_run = True\n")
    try:
        token, lease, _ = start(dry, "idle2", util=0, memory_gib=4)
        wait_until(lambda: "cull-dry-run" in kinds(dry, "idle2", token), timeout=40)
        report = next(n for n in notices(dry, "idle2", token) if n["kind"] == "cull-dry-run")
        assert report["message"].startswith("would be culled: idle ")
        assert dry.broker_api("GET", f"/leases/{lease['id']}").json()["state"] == "granted"
        assert dry.server("idle2") is not None
    finally:
        dry.stop()


#: jupyter_server config a user could put in her own home: before her server
#: answers an API call, try the token that came with it on everything that is
#: not hers (the attack of issue #10), and write down what each try got
SNOOPER = """
import json, os, urllib.error, urllib.request
from jupyter_server.base.handlers import APIHandler

HUB = {hub!r}
PROBES = {probes!r}
OUT = os.path.join(os.environ["HOME"], "captured.jsonl")
_prepare = APIHandler.prepare


def _try(method, url, token, body=None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("Authorization", token)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as err:
        return err.code, None


async def prepare(self):
    token = self.request.headers.get("Authorization")
    # the culler's read (it asks not to count as activity)
    if token and self.get_argument("no_track_activity", None):
        tried = {{k: _try(m, HUB + path, token, body)[0] for k, (m, path, body) in PROBES.items()}}
        whoami = _try("GET", HUB + "/hub/api/user", token)[1]
        with open(OUT, "a") as f:
            f.write(json.dumps({{"token": token, "tried": tried, "whoami": whoami}}) + "\\n")
    return await _prepare(self)


APIHandler.prepare = prepare
"""

#: what the snooper tries: name -> (method, path under the hub's public URL, body)
PROBES = {
    "hub: list users": ("GET", "/hub/api/users", None),
    "hub: read victim": ("GET", "/hub/api/users/victim", None),
    "hub: new token for victim": ("POST", "/hub/api/users/victim/tokens", {}),
    "hub: stop victim": ("DELETE", "/hub/api/users/victim/server", None),
    "victim: files": ("GET", "/user/victim/api/contents", None),
    "victim: kernels": ("GET", "/user/victim/api/kernels", None),
    "victim: terminals": ("POST", "/user/victim/api/terminals", {}),
    "broker: quotas": ("GET", "/services/gpubroker/api/v1/quotas", None),
    "broker: raise quota": (
        "PUT",
        "/services/gpubroker/api/v1/quotas/user/snoop",
        {"guaranteed": 8, "limit": 8},
    ),
    "broker: all leases": ("GET", "/services/gpubroker/api/v1/leases?user=victim", None),
}


def test_what_reaches_a_server_carries_only_its_users_rights(hub: RunningHub) -> None:
    """The culler's read of a server's kernels sends a token of that server's
    user limited to that one server, revoked after use: a user who records
    it reaches nothing of anyone else's, nor the hub or broker admin API."""
    home = hub.workdir / "home" / "snoop"
    (home / ".jupyter").mkdir(parents=True, exist_ok=True)
    (home / ".jupyter" / "jupyter_server_config.py").write_text(
        SNOOPER.format(hub=hub.url, probes=PROBES)
    )
    _, victim_lease, _ = start(hub, "victim", util=80, memory_gib=4)
    _, lease, _ = start(hub, "snoop", util=80, memory_gib=4)
    captured = home / "captured.jsonl"
    wait_until(lambda: captured.exists() and captured.read_text().strip(), timeout=30)
    record = json.loads(captured.read_text().splitlines()[0])
    broker_token = (hub.workdir / "gpubroker-service-token").read_text().strip()
    assert broker_token not in record["token"]
    tried = record["tried"]
    # it is hers, and reaches her own server only
    assert record["whoami"]["name"] == "snoop"
    scopes = set(record["whoami"]["scopes"])
    # beyond the access to her one server: only the identity every token has
    assert scopes - {"access:servers!server=snoop/"} <= {
        "read:users:name!user=snoop",
        "read:users:groups!user=snoop",
    }, scopes
    assert "access:servers!server=snoop/" in scopes
    assert all(status in (401, 403, 404) for status in tried.values()), tried
    # and it is revoked once the read is done (the capture is written during
    # the read: the revocation follows its answer, a moment later)
    token = record["token"].split()[-1]

    def revoked() -> bool:
        gone = requests.get(
            f"{hub.url}/hub/api/user", headers={"Authorization": f"token {token}"}, timeout=10
        )
        return gone.status_code == 403

    wait_until(revoked, timeout=30)
    assert hub.server("victim") is not None
    assert hub.broker_api("GET", f"/leases/{victim_lease['id']}").json()["state"] == "granted"
    for user, held in (("snoop", lease), ("victim", victim_lease)):
        hub.api("DELETE", f"/users/{user}/server")
        wait_for_release(hub, held["id"])


def test_a_warning_deadline_holds_across_a_broker_restart(hub: RunningHub) -> None:
    """The culler's tracks are stored: a broker killed after its warning
    culls at the original deadline once it is back, with no second warning
    and no new idle timeout."""
    token, lease, _ = start(hub, "phoenix", util=0, memory_gib=2)
    wait_until(lambda: "cull-warning" in kinds(hub, "phoenix", token), timeout=30)
    old = hub.broker_pid()
    assert old
    os.kill(old, signal.SIGKILL)
    wait_until(lambda: (pid := hub.broker_pid()) and pid != old, timeout=90)
    wait_until(lambda: hub.broker_api("GET", "/health").status_code == 200, timeout=30)
    released = wait_for_release(hub, lease["id"], timeout=60)
    assert released["release_reason"].startswith("culled: idle ")
    seen = kinds(hub, "phoenix", token)
    assert seen.count("cull-warning") == 1, seen
    assert "culled" in seen
    wait_until(lambda: hub.server("phoenix") is None, timeout=30)
