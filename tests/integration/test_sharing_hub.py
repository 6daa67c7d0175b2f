"""GPU sharing through a real JupyterHub, real servers and kernels: spawn-form
profiles, MIG instances made by the (fake) backend, and the share memory
watchdog ending a real kernel process over its cap.

Pools: devices 0-1 are a MIG pool (MIG mode on), 2-3 time-sliced with a
2 GiB reserve, 4-7 the default exclusive pool.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from gpubroker.devices import mig
from gpubroker.devices.fake import FakeDeviceBackend

from ..hubutil import RunningHub
from ..kernelutil import connect, execute, start_kernel
from .test_spawn import lease_of, spawn, wait_for_release, wait_until

BROKER = """
c.Pools.pools = [
    {"name": "mig", "mode": "mig", "devices": ["*:0-1"]},
    {"name": "shared", "mode": "timeslice", "devices": ["*:2-3"], "reserve_gib": 2},
]
c.FakeDeviceBackend.mig_enabled = [0, 1]
c.ShareGuard.interval = 1
c.ShareWatchdog.grace = 3
c.ShareWatchdog.term_timeout = 2
"""

HUB = """
c.SimpleLocalGPUSpawner.gpu_profiles = [
    {"display_name": "Full H100", "request": {"gpus": 1}},
    {"display_name": "MIG 1g.10gb", "slug": "mig-1g", "request": {"mig_profile": "1g.10gb"}},
    {"display_name": "Shared GPU, 10 GiB", "slug": "shared-10",
     "request": {"memory_gib": 10}},
    {"display_name": "No GPU", "slug": "no-gpu", "request": {}, "default": True},
]
"""


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningHub]:
    workdir: Path = tmp_path_factory.mktemp("sharing-hub")
    (workdir / "broker_config.py").write_text(BROKER)
    (workdir / "hub_config.py").write_text(HUB)
    running = RunningHub(
        workdir,
        GPUBROKER_DEMO_BROKER_CONFIG=str(workdir / "broker_config.py"),
        GPUBROKER_DEMO_EXTRA_CONFIG=str(workdir / "hub_config.py"),
    ).start()
    yield running
    running.stop()


def kernel_facts(hub: RunningHub, user: str, token: str) -> dict:
    """Start a kernel in ``user``'s server; return its pid and environment."""
    kernel = start_kernel(hub, user, token)
    out = hub.workdir / f"kernel-{user}.json"
    ws = connect(hub, user, token, kernel)
    facts = "json.dumps({'pid': os.getpid(), 'env': dict(os.environ)})"
    code = f"import os, json; open({str(out)!r}, 'w').write({facts})"
    execute(ws, code)
    ws.close()
    return json.loads(wait_until(lambda: out.exists() and out.read_text(), timeout=30))


def start(hub: RunningHub, user: str, options: dict) -> str:
    token = hub.create_user(user)
    r = spawn(hub, user, options)
    assert r.status_code in (201, 202), r.text
    hub.wait_for_server(user)
    return token


def stop(hub: RunningHub, user: str) -> None:
    hub.api("DELETE", f"/users/{user}/server")
    hub.wait_for_no_server(user)


def test_no_gpu_profile_sees_no_gpu_at_all(hub: RunningHub) -> None:
    token = start(hub, "plain", {"profile": "no-gpu"})
    env = kernel_facts(hub, "plain", token)["env"]
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    assert env["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert "GPUBROKER_LEASE_ID" not in env
    assert [x for x in hub.leases(user="plain")] == []
    stop(hub, "plain")


def test_api_posted_options_are_checked_against_the_profiles(hub: RunningHub) -> None:
    hub.create_user("poster")
    r = spawn(hub, "poster", {"gpus": 1})
    assert r.status_code == 400 and "gpus: choose a profile" in r.text
    r = spawn(hub, "poster", {"profile": "huge"})
    assert r.status_code == 400 and "profile: unknown profile 'huge'" in r.text
    assert hub.server("poster") is None


def test_mig_profile_gets_a_mig_instance_and_it_goes_at_stop(hub: RunningHub) -> None:
    token = start(hub, "miggy", {"profile": "mig-1g"})
    lease = lease_of(hub, "miggy")
    assert lease["kind"] == "mig" and lease["summary"] == "1 x MIG 1g.10gb"
    (slot,) = lease["slots"]
    env = kernel_facts(hub, "miggy", token)["env"]
    assert env["CUDA_VISIBLE_DEVICES"] == slot["uuid"] and mig.is_mig_uuid(slot["uuid"])
    state = json.loads((hub.workdir / "fake-gpu-usage.json").read_text())
    instances = state["_mig"][slot["device"]]["instances"]
    assert [f"{i['start']}:{i['size']}" for i in instances] == [slot["placement"]]
    stop(hub, "miggy")
    wait_for_release(hub, lease["id"])
    state = json.loads((hub.workdir / "fake-gpu-usage.json").read_text())
    assert state["_mig"][slot["device"]]["instances"] == []


def notices(hub: RunningHub, token: str) -> list[dict]:
    r = requests.get(
        f"{hub.broker}/notices", headers={"Authorization": f"token {token}"}, timeout=10
    )
    r.raise_for_status()
    return list(r.json()["notices"])


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_share_over_its_cap_is_warned_then_its_process_ended(hub: RunningHub) -> None:
    hog_token = start(hub, "hog", {"profile": "shared-10"})
    calm_token = start(hub, "calm", {"profile": "shared-10"})
    hog, calm = lease_of(hub, "hog"), lease_of(hub, "calm")
    device = hog["slots"][0]["device"]
    assert calm["slots"][0]["device"] == device  # best fit: both shares on one device
    assert "memory cap of 10 GiB" in hog["guarantee"]
    hog_kernel = kernel_facts(hub, "hog", hog_token)
    calm_kernel = kernel_facts(hub, "calm", calm_token)
    assert hog_kernel["env"]["GPUBROKER_LEASE_ID"] == str(hog["id"])
    # the frameworks' allocators get the share less the CUDA context's 512 MiB
    assert hog_kernel["env"]["GPUBROKER_MEMORY_LIMIT_MIB"] == str(10 * 1024 - 512)
    backend = FakeDeviceBackend(
        inventory=["8 x NVIDIA H100 80GB HBM3"],
        node_name="demo-node",
        state_file=str(hub.workdir / "fake-gpu-usage.json"),
        mig_enabled=[0, 1],
    )
    backend.set_usage(
        device,
        utilization_gpu=90,
        processes=[
            {"pid": hog_kernel["pid"], "used_memory_mib": 30 * 1024},
            {"pid": calm_kernel["pid"], "used_memory_mib": 5 * 1024},
        ],
    )
    warning = wait_until(
        lambda: [n for n in notices(hub, hog_token) if n["kind"] == "share-overuse"], timeout=30
    )[0]
    assert "30.0 GiB of its 10.0 GiB cap" in warning["message"] and warning["deadline"]
    ended = wait_until(
        lambda: [n for n in notices(hub, hog_token) if n["kind"] == "share-process-ended"],
        timeout=30,
    )[0]
    assert str(hog_kernel["pid"]) in ended["message"]
    wait_until(lambda: not alive(hog_kernel["pid"]), timeout=15)
    time.sleep(2)
    assert alive(calm_kernel["pid"])  # the other share on the device is untouched
    assert notices(hub, calm_token) == []
    assert hub.broker_api("GET", f"/leases/{calm['id']}").json()["state"] == "granted"
    backend.set_usage(device, utilization_gpu=0, processes=[])
    stop(hub, "hog")
    stop(hub, "calm")


def external(hub: RunningHub, user: str, **request: object) -> dict:
    r = hub.broker_api("POST", "/leases", json={"user": user, "holder_kind": "external", **request})
    assert r.status_code == 201, r.text
    return dict(r.json())


def test_devices_show_every_holder_and_the_queue_counts_competitors_only(
    hub: RunningHub,
) -> None:
    ann = hub.create_user("ann")
    held = [
        external(hub, "ann", mig_profile="1g.10gb"),
        external(hub, "bob", mig_profile="1g.10gb"),
    ]
    devices = {d["uuid"]: d for d in hub.broker_api("GET", "/devices").json()["devices"]}
    shared = devices[held[0]["slots"][0]["device"]]
    assert shared["state"] == "shared" and shared["slots_held"] == 2
    assert [(h["user"], h["kind"]) for h in shared["holders"]] == [("ann", "mig"), ("bob", "mig")]
    assert all(h["instance_uuid"].startswith("MIG-") for h in shared["holders"])
    mine = hub.broker_api("GET", "/devices", token=ann).json()["devices"]
    seen = next(d for d in mine if d["uuid"] == shared["uuid"])
    assert [h["user"] for h in seen["holders"]] == ["ann"] and seen["slots_held"] == 2

    # every whole GPU (4-7) and every MIG slice held; two MIG requests wait
    held += [external(hub, "w", gpus=4)]
    held += [external(hub, f"m{i}", mig_profile="1g.10gb") for i in range(12)]
    waiting = [external(hub, f"q{i}", mig_profile="1g.10gb") for i in range(2)]
    assert [x["queue"]["position"] for x in waiting] == [1, 2]
    whole = external(hub, "solo", gpus=1)
    assert whole["state"] == "pending" and whole["queue"]["position"] == 1
    for lease in [*held, *waiting, whole]:
        hub.broker_api("DELETE", f"/leases/{lease['id']}")


def test_bad_requests_get_a_hint_not_a_bare_refusal(hub: RunningHub) -> None:
    token = hub.create_user("hinted")
    r = hub.broker_api(
        "POST",
        "/leases",
        token=token,
        json={"user": "hinted", "mig_profile": "1g.10gb", "count": 2},
    )
    assert r.status_code == 400 and "2g.20gb on H100-80GB" in r.json()["message"]
    r = hub.broker_api("POST", "/leases", token=token, json={"user": "hinted", "gpus": 0})
    assert r.status_code == 400
    assert r.json()["message"].startswith("gpus: must be at least 1, got 0 (a lease holds GPUs")


def test_switching_pools_off_leaves_mig_devices_out_until_mig_mode_is_off(
    hub: RunningHub,
) -> None:
    """Last in this module: it restarts the hub without pools (whole GPUs),
    keeping the store and the fake GPUs' MIG state."""
    mig_lease = external(hub, "keeper", mig_profile="3g.40gb")
    gpu = mig_lease["slots"][0]["device"]
    hub.stop()
    (hub.workdir / "broker_config.py").write_text("")
    hub.start()
    eight = external(hub, "big", gpus=8)
    assert eight["state"] == "pending"  # devices 0-1 are still in MIG mode
    six = external(hub, "six", gpus=6)
    assert six["state"] == "granted" and gpu not in [d["uuid"] for d in six["devices"]]
    hub.broker_api("DELETE", f"/leases/{six['id']}")
    hub.broker_api("DELETE", f"/leases/{mig_lease['id']}")
    granted = wait_until(
        lambda: (
            (x := hub.broker_api("GET", f"/leases/{eight['id']}").json())["state"] == "granted"
            and x
        ),
        timeout=30,
    )
    assert len({d["uuid"] for d in granted["devices"]}) == 8
    state = json.loads((hub.workdir / "fake-gpu-usage.json").read_text())
    assert all(not entry.get("enabled") for entry in state["_mig"].values()), state["_mig"]
    hub.broker_api("DELETE", f"/leases/{eight['id']}")
