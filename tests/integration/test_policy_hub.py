"""Quotas, limits and reclaim through a real JupyterHub (issue: scheduling policy).

A hub of its own whose broker has quotas: user "solo" may hold 1 GPU, user
"pair" 2; groups A and B are each guaranteed 4 GPUs; the batch class has a
6 s grace period and the scheduler ticks every second.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from ..hubutil import RunningHub
from .test_spawn import lease_of, process_env, spawn, wait_for_release, wait_until

BROKER_CONFIG = """
c.GPUBrokerApp.schedule_interval = 1
c.SchedulingPolicy.user_quotas = {"solo": {"limit": 1}, "pair": {"limit": 2}}
c.SchedulingPolicy.group_quotas = {"A": {"guaranteed": 4}, "B": {"guaranteed": 4}}
c.SchedulingPolicy.priority_classes = [
    {"name": "interactive", "rank": 100, "min_runtime": 0, "grace": 2},
    {"name": "batch", "rank": 50, "grace": 6},
]
"""


HUB_CONFIG = """
c.SimpleLocalGPUSpawner.priority_class = "batch"
"""


@pytest.fixture(scope="module")
def policy_hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningHub]:
    workdir: Path = tmp_path_factory.mktemp("policy-hub")
    config = workdir / "broker_config.py"
    config.write_text(BROKER_CONFIG)
    hub_config = workdir / "hub_config.py"
    hub_config.write_text(HUB_CONFIG)
    hub = RunningHub(
        workdir,
        GPUBROKER_DEMO_BROKER_CONFIG=str(config),
        GPUBROKER_DEMO_EXTRA_CONFIG=str(hub_config),
    ).start()
    yield hub
    hub.stop()


def test_named_server_over_the_user_limit_is_refused_with_403(policy_hub: RunningHub) -> None:
    hub = policy_hub
    token = hub.create_user("solo")
    as_solo = {"Authorization": f"token {token}"}
    r = requests.post(f"{hub.url}/hub/api/users/solo/server", json={"gpus": 1}, headers=as_solo)
    assert r.status_code in (201, 202), r.text
    hub.wait_for_server("solo")
    first = lease_of(hub, "solo")
    r = requests.post(
        f"{hub.url}/hub/api/users/solo/servers/second", json={"gpus": 1}, headers=as_solo
    )
    assert r.status_code == 403, r.text
    assert "user limit of 1 GPU" in r.json()["message"]
    assert hub.server("solo", "second") is None
    assert [x["id"] for x in hub.leases(user="solo")] == [first["id"]]
    assert hub.broker_api("GET", f"/leases/{first['id']}").json()["state"] == "granted"
    hub.api("DELETE", "/users/solo/server")
    wait_for_release(hub, first["id"])


def test_five_simultaneous_requests_under_a_limit_of_two(policy_hub: RunningHub) -> None:
    hub = policy_hub
    token = hub.create_user("pair")
    barrier = threading.Barrier(5)

    def ask(i: int) -> requests.Response:
        barrier.wait()
        body = {"user": "pair", "server_name": f"s{i}", "gpus": 1}
        return hub.broker_api("POST", "/leases", json=body, token=token)

    with ThreadPoolExecutor(5) as pool:
        answers = list(pool.map(ask, range(5)))
    assert sorted(r.status_code for r in answers) == [201, 201, 403, 403, 403]
    for r in answers:
        if r.status_code == 403:
            assert "limit of 2 GPUs" in r.json()["message"]
        else:
            hub.broker_api("DELETE", f"/leases/{r.json()['id']}")


def test_guaranteed_group_reclaims_a_borrowed_device(policy_hub: RunningHub) -> None:
    hub = policy_hub
    b_users = [f"bee{i}" for i in range(8)]
    for user in [*b_users, "ada"]:
        hub.create_user(user)
    assert hub.api("POST", "/groups/B", json={"users": b_users}).status_code == 201
    assert hub.api("POST", "/groups/A", json={"users": ["ada"]}).status_code == 201
    b_leases = []
    for user in b_users[:7]:  # B borrows everything: 4 within its guarantee, 4 above it
        body = {"user": user, "gpus": 1, "priority_class": "batch", "holder_kind": "external"}
        r = hub.broker_api("POST", "/leases", json=body)
        assert r.status_code == 201 and r.json()["state"] == "granted", r.text
        assert r.json()["group"] == "B"
        b_leases.append(r.json())
    # the newest borrowed lease is a real notebook server (batch class in this hub)
    assert spawn(hub, "bee7", {"gpus": 1}).status_code in (201, 202)
    bee_pid = hub.wait_for_server("bee7")["state"]["pid"]
    b_leases.append(lease_of(hub, "bee7"))
    leases = {x["id"]: x for x in hub.leases()}
    assert [leases[x["id"]]["reclaimable"] for x in b_leases] == [False] * 4 + [True] * 4

    spawning = threading.Thread(target=spawn, args=(hub, "ada", {"gpus": 1}))
    spawning.start()
    waiting = wait_until(
        lambda: [
            x for x in hub.leases(user="ada") if (x["queue"] or {}).get("reason") == "Preempting"
        ]
    )[0]
    victims = [x for x in hub.leases() if x["preemption"]]
    assert len(victims) == 1 and victims[0]["preemption"]["for_lease"] == waiting["id"]
    victim = victims[0]
    assert victim["id"] in [x["id"] for x in b_leases[4:]]  # a borrowed one
    assert waiting["queue"]["earmarked"] == [victim["devices"][0]["uuid"]]

    spawning.join()
    env = process_env(hub.wait_for_server("ada", timeout=60)["state"]["pid"])
    assert env["CUDA_VISIBLE_DEVICES"] == victim["devices"][0]["uuid"]
    gone = hub.broker_api("GET", f"/leases/{victim['id']}").json()
    assert gone["state"] == "released" and gone["release_reason"].startswith("preempted: reclaimed")
    assert gone["release_reason"].endswith("(server stopped)")  # stopped before handed on
    assert victim["user"] == "bee7" and hub.server("bee7") is None
    assert not Path(f"/proc/{bee_pid}").exists()
    for lease in b_leases[:4]:  # in-guarantee leases of B are never touched
        assert hub.broker_api("GET", f"/leases/{lease['id']}").json()["state"] == "granted"
    queue = hub.broker_api("GET", "/queue").json()["queue"]
    assert queue == []
