"""End to end through a real JupyterHub: spawn form options, leases, queue,
named servers, cancel, validation. Servers are real jupyterhub-singleuser
processes; their environment is read from /proc."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from ..hubutil import RunningHub


def process_env(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        items = f.read().split(b"\0")
    return dict(item.decode().split("=", 1) for item in items if b"=" in item)


def spawn(hub: RunningHub, user: str, options: dict, server: str = "") -> requests.Response:
    path = f"/users/{user}/servers/{server}" if server else f"/users/{user}/server"
    return hub.api("POST", path, json=options)


def lease_of(hub: RunningHub, user: str, server: str = "") -> dict:
    (lease,) = [x for x in hub.leases(user=user) if x["server_name"] == server]
    return lease


def fill_with_external_leases(hub: RunningHub, n: int = 8) -> list[dict]:
    leases = []
    for i in range(n):
        r = hub.broker_api(
            "POST", "/leases", json={"user": f"holder{i}", "gpus": 1, "holder_kind": "external"}
        )
        assert r.status_code == 201, r.text
        assert r.json()["state"] == "granted"
        leases.append(r.json())
    return leases


def wait_until(predicate, timeout: float = 30, interval: float = 0.3):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"condition not met in {timeout} s")


def wait_for_release(hub: RunningHub, lease_id: int, timeout: float = 30) -> dict:
    def released() -> dict | None:
        lease = hub.broker_api("GET", f"/leases/{lease_id}").json()
        return lease if lease["state"] == "released" else None

    return wait_until(released, timeout)


def test_eight_users_get_eight_gpus_and_a_ninth_waits_in_the_queue(clean_hub: RunningHub) -> None:
    hub = clean_hub
    users = [f"user{i}" for i in range(9)]
    for user in users:
        hub.create_user(user)
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda u: spawn(hub, u, {"gpus": 1}), users[:8]))
    assert all(r.status_code in (201, 202) for r in answers), [r.text for r in answers]
    envs = {}
    for user in users[:8]:
        pid = hub.wait_for_server(user)["state"]["pid"]
        envs[user] = process_env(pid)
    visible = {user: env["CUDA_VISIBLE_DEVICES"] for user, env in envs.items()}
    devices = hub.broker_api("GET", "/devices").json()
    fake_uuids = {d["uuid"] for d in devices["devices"]}
    assert set(visible.values()) == fake_uuids  # eight different UUIDs, all of the fake node
    for user, env in envs.items():
        lease = lease_of(hub, user)
        assert env["NVIDIA_VISIBLE_DEVICES"] == visible[user] == lease["devices"][0]["uuid"]
        assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        assert env["GPUBROKER_LEASE_ID"] == str(lease["id"])
        assert env["GPUBROKER_URL"].endswith("/services/gpubroker/")

    assert spawn(hub, "user8", {"gpus": 1}).status_code == 202
    waiting = wait_until(lambda: [x for x in hub.leases(user="user8") if x["state"] == "pending"])
    assert waiting[0]["queue"]["position"] == 1
    events = hub.progress("user8", timeout=4)
    messages = [e.get("message", "") for e in events]
    assert any("position 1" in m for m in messages), messages
    assert hub.server("user8")["pending"] == "spawn"

    freed = visible["user3"]
    hub.api("DELETE", "/users/user3/server")
    model = hub.wait_for_server("user8")
    assert process_env(model["state"]["pid"])["CUDA_VISIBLE_DEVICES"] == freed


def test_bad_gpu_counts_through_the_hub_api_are_refused_and_nothing_is_allocated(
    clean_hub: RunningHub,
) -> None:
    hub = clean_hub
    token = hub.create_user("eve")
    as_eve = {"Authorization": f"token {token}"}
    for options, message in [
        ({"gpus": 99}, "gpus: must be between 0 and 8 (the most this server may have), got 99"),
        ({"gpus": "two"}, 'gpus: must be an integer between 0 and 8, got "two"'),
        ({"gpus": -1}, "gpus: must be between 0 and 8"),
        ({"gpus": 1, "colour": "red"}, "colour: unknown option"),
    ]:
        r = requests.post(
            f"{hub.url}/hub/api/users/eve/server", json=options, headers=as_eve, timeout=30
        )
        assert r.status_code == 400, r.text
        assert message in r.json()["message"]
    assert hub.leases(user="eve", state="all") == []
    assert hub.server("eve") is None


def test_zero_gpus_hides_every_device(clean_hub: RunningHub) -> None:
    hub = clean_hub
    hub.create_user("zed")
    assert spawn(hub, "zed", {"gpus": 0}).status_code in (201, 202)
    env = process_env(hub.wait_for_server("zed")["state"]["pid"])
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    assert env["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert "GPUBROKER_LEASE_ID" not in env
    assert hub.leases(user="zed") == []


def test_named_second_server_gets_its_own_lease(clean_hub: RunningHub) -> None:
    hub = clean_hub
    hub.create_user("nora")
    assert spawn(hub, "nora", {"gpus": 1}).status_code in (201, 202)
    assert spawn(hub, "nora", {"gpus": 1}, server="second").status_code in (201, 202)
    first = process_env(hub.wait_for_server("nora")["state"]["pid"])
    second = process_env(hub.wait_for_server("nora", "second")["state"]["pid"])
    assert first["CUDA_VISIBLE_DEVICES"] != second["CUDA_VISIBLE_DEVICES"]
    default_lease, named_lease = lease_of(hub, "nora"), lease_of(hub, "nora", "second")
    assert default_lease["id"] != named_lease["id"]

    hub.api("DELETE", "/users/nora/servers/second")
    released = wait_for_release(hub, named_lease["id"])
    assert released["release_reason"] == "server stopped"
    assert hub.broker_api("GET", f"/leases/{default_lease['id']}").json()["state"] == "granted"


def test_cancelled_pending_spawn_leaves_the_queue(clean_hub: RunningHub) -> None:
    hub = clean_hub
    fill_with_external_leases(hub)
    for user in ("qa", "qb", "qc"):
        hub.create_user(user)
        assert spawn(hub, user, {"gpus": 1}).status_code == 202
        wait_until(lambda u=user: [x for x in hub.leases(user=u) if x["state"] == "pending"])
    positions = {u: lease_of(hub, u)["queue"]["position"] for u in ("qa", "qb", "qc")}
    assert positions == {"qa": 1, "qb": 2, "qc": 3}
    cancelled = lease_of(hub, "qa")

    hub.api("DELETE", "/users/qa/server")
    wait_for_release(hub, cancelled["id"])
    wait_until(lambda: lease_of(hub, "qb")["queue"]["position"] == 1)
    assert lease_of(hub, "qc")["queue"]["position"] == 2


def test_server_killed_outside_the_hub_loses_its_lease(clean_hub: RunningHub) -> None:
    import os
    import signal

    hub = clean_hub
    hub.create_user("kim")
    assert spawn(hub, "kim", {"gpus": 2}).status_code in (201, 202)
    pid = hub.wait_for_server("kim")["state"]["pid"]
    lease = lease_of(hub, "kim")
    os.kill(pid, signal.SIGKILL)
    # the hub polls servers every 2 s and the broker reconciles every 2 s
    released = wait_for_release(hub, lease["id"], timeout=15)
    reason = released["release_reason"]
    assert reason.startswith(("server exited", "reconcile:")), reason


def test_lease_whose_server_is_gone_is_reconciled_with_a_reason(clean_hub: RunningHub) -> None:
    hub = clean_hub
    r = hub.broker_api("POST", "/leases", json={"user": "ghost", "server_name": "nb", "gpus": 1})
    assert r.status_code == 201 and r.json()["state"] == "granted"
    lease_id = r.json()["id"]
    released = wait_for_release(hub, lease_id, timeout=10)
    assert released["release_reason"] == "reconcile: server ghost/nb is gone from the hub"


def children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def test_a_kernel_of_the_server_sees_the_leased_gpu(clean_hub: RunningHub) -> None:
    hub = clean_hub
    token = hub.create_user("kate")
    assert spawn(hub, "kate", {"gpus": 1}).status_code in (201, 202)
    server_pid = hub.wait_for_server("kate")["state"]["pid"]
    as_kate = {"Authorization": f"token {token}"}
    r = requests.post(f"{hub.url}/user/kate/api/kernels", headers=as_kate, json={}, timeout=60)
    assert r.status_code == 201, r.text
    kernel_pid = wait_until(lambda: children(server_pid), timeout=30)[0]
    env = process_env(kernel_pid)
    lease = lease_of(hub, "kate")
    assert env["CUDA_VISIBLE_DEVICES"] == lease["devices"][0]["uuid"]
    assert env["CUDA_VISIBLE_DEVICES"].startswith("GPU-")
