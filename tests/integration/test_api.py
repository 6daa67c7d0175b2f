"""The broker's REST API through the real hub proxy, with real hub tokens."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import requests

from gpubroker.api.app import ROUTES

from ..hubutil import RunningHub


def post_lease(hub: RunningHub, body: dict, token: str | None = None) -> requests.Response:
    return hub.broker_api("POST", "/leases", json=body, token=token)


def test_health_and_openapi_need_no_token(hub: RunningHub) -> None:
    health = requests.get(f"{hub.broker}/health", timeout=10).json()
    assert health == {
        "status": "ok",
        "version": health["version"],
        "backend": "fake",
        "simulated": True,
    }
    spec = requests.get(f"{hub.broker}/openapi.json", timeout=10).json()
    assert set(spec["paths"]) == {f"/api/v1{path}" for path, _ in ROUTES}


def test_devices_say_loudly_that_they_are_simulated(hub: RunningHub) -> None:
    data = hub.broker_api("GET", "/devices").json()
    assert data["backend"]["simulated"] is True
    assert "SIMULATED" in data["backend"]["message"]
    assert len(data["devices"]) == 8
    assert {d["name"] for d in data["devices"]} == {"NVIDIA H100 80GB HBM3"}
    assert data["summary"]["request_limit"] == 8


def test_missing_or_foreign_tokens_are_refused(hub: RunningHub) -> None:
    r = requests.get(f"{hub.broker}/leases", timeout=10)
    assert r.status_code in (401, 403)
    assert r.json()["status"] == r.status_code and r.json()["message"]
    r = requests.get(f"{hub.broker}/leases", headers={"Authorization": "token nope"}, timeout=10)
    assert r.status_code in (401, 403)


def test_fifty_concurrent_requests_on_eight_gpus(clean_hub: RunningHub) -> None:
    hub = clean_hub
    barrier = threading.Barrier(50)

    def request(i: int) -> dict:
        barrier.wait()
        r = post_lease(hub, {"user": f"load{i:02d}", "gpus": 1, "holder_kind": "external"})
        assert r.status_code == 201, r.text
        return dict(r.json())

    with ThreadPoolExecutor(50) as pool:
        leases = list(pool.map(request, range(50)))
    granted = [x for x in leases if x["state"] == "granted"]
    assert len(granted) == 8
    uuids = [x["devices"][0]["uuid"] for x in granted]
    assert len(set(uuids)) == 8
    # a read waits for the pass covering every request answered before it
    pending = sorted((x for x in hub.leases() if x["state"] == "pending"), key=lambda x: x["id"])
    assert len(pending) == 42
    assert [x["queue"]["position"] for x in pending] == list(range(1, 43))  # arrival order
    assert {x["queue"]["reason"] for x in pending} <= {"Resources", "Priority"}
    assert max(x["id"] for x in granted) < min(x["id"] for x in pending)


def test_users_see_and_release_only_their_own_leases(clean_hub: RunningHub) -> None:
    hub = clean_hub
    token_a, token_b = hub.create_user("alice"), hub.create_user("bob")
    own = post_lease(hub, {"user": "bob", "gpus": 1}, token=token_b)
    assert own.status_code == 201, own.text
    r = hub.broker_api("DELETE", f"/leases/{own.json()['id']}", token=token_b)
    assert r.status_code == 200 and r.json()["state"] == "released"
    # bob's own request is for a server the hub does not list, which this hub's
    # reconciliation (every 2 s) rightly releases at any moment; the lease
    # checked below is bob's too, made by an admin for an external holder
    external_b = {"user": "bob", "gpus": 1, "holder_kind": "external"}
    lease_b = post_lease(hub, external_b)
    assert lease_b.status_code == 201, lease_b.text
    lease_id = lease_b.json()["id"]

    # another user's lease is answered as one nobody has (ids can be walked)
    assert hub.broker_api("GET", f"/leases/{lease_id}", token=token_a).status_code == 404
    r = hub.broker_api("DELETE", f"/leases/{lease_id}", token=token_a)
    assert r.status_code == 404 and r.json()["message"] == f"lease {lease_id}: no such lease"
    assert (
        hub.broker_api("GET", "/leases", token=token_a, params={"user": "bob"}).status_code == 403
    )
    assert hub.broker_api("GET", "/leases", token=token_a).json() == {"leases": []}
    assert post_lease(hub, {"user": "bob", "gpus": 1}, token=token_a).status_code == 403
    external = {"user": "alice", "gpus": 1, "holder_kind": "external"}
    assert post_lease(hub, external, token=token_a).status_code == 403
    assert hub.broker_api("GET", f"/leases/{lease_id}").json()["state"] == "granted"

    mine = hub.broker_api("GET", "/leases", token=token_b).json()["leases"]
    assert [x["id"] for x in mine] == [lease_id]
    released = hub.broker_api("DELETE", f"/leases/{lease_id}", token=token_b).json()
    assert released["state"] == "released" and released["release_reason"] == "released by bob"
    again = hub.broker_api("DELETE", f"/leases/{lease_id}", token=token_b)
    assert again.status_code == 200 and again.json()["release_reason"] == "released by bob"


def test_bad_requests_get_400_naming_the_field_and_allocate_nothing(clean_hub: RunningHub) -> None:
    hub = clean_hub
    cases = [
        ({"user": "ann", "gpus": 99}, "gpus: must be between 1 and 8 (the request limit), got 99"),
        ({"user": "ann", "gpus": "two"}, 'gpus: must be an integer, got "two"'),
        ({"user": "ann"}, "gpus/mig_profile/memory_gib: give exactly one of them, got none"),
        ({"user": "ann", "mig_profile": "1g.10gb"}, "mig_profile: no mig pool has devices"),
        ({"user": "ann", "memory_gib": 8, "pool": "x"}, "pool: no pool 'x' has devices"),
        ({"user": "ann", "gpus": 1, "extra": 1}, "extra: unknown field"),
    ]
    for body, message in cases:
        r = post_lease(hub, body)
        assert r.status_code == 400, r.text
        assert r.json() == {"status": 400, "message": r.json()["message"]}
        assert message in r.json()["message"]
    r = hub.broker_api("POST", "/leases", data=b"{not json")
    assert r.status_code == 400 and "body: not valid JSON" in r.json()["message"]
    r = hub.broker_api("GET", "/leases/1", params={"wait": "999"})
    assert r.status_code in (400, 404)
    assert hub.broker_api("GET", "/leases/999999").status_code == 404
    assert hub.leases(state="all", user="ann") == []


def test_second_lease_for_one_server_is_a_conflict(clean_hub: RunningHub) -> None:
    hub = clean_hub
    body = {"user": "cara", "server_name": "x", "gpus": 1}
    assert post_lease(hub, body).status_code == 201
    r = post_lease(hub, body)
    assert r.status_code == 409 and "already has active lease" in r.json()["message"]


def test_long_poll_returns_when_the_lease_is_granted(clean_hub: RunningHub) -> None:
    hub = clean_hub
    blockers = [
        post_lease(hub, {"user": f"b{i}", "gpus": 1, "holder_kind": "external"}).json()
        for i in range(8)
    ]
    waiting = post_lease(hub, {"user": "w", "gpus": 1, "holder_kind": "external"}).json()
    assert waiting["state"] == "pending"

    def release_later() -> None:
        time.sleep(1)
        hub.broker_api("DELETE", f"/leases/{blockers[5]['id']}")

    threading.Thread(target=release_later).start()
    # answered on the change: a long-poll that waited out its 120 s would
    # fail the client's own 60 s timeout instead
    r = hub.broker_api(
        "GET",
        f"/leases/{waiting['id']}",
        params={"wait": "120", "version": str(waiting["version"])},
    )
    assert r.json()["state"] == "granted"
    assert r.json()["devices"][0]["uuid"] == blockers[5]["devices"][0]["uuid"]


def test_each_endpoint_names_the_scope_it_needs(clean_hub: RunningHub) -> None:
    """The declared scopes, checked with the hub's real tokens (see
    ``tests/unit/test_api_scopes.py`` for every route)."""
    hub = clean_hub
    token = hub.create_user("scoped-ann")
    r = hub.api(
        "POST",
        "/users/scoped-ann/tokens",
        json={"note": "test", "scopes": ["read:users:name!user=scoped-ann"]},
    )
    assert r.status_code == 201, r.text
    no_access = r.json()["token"]
    r = hub.broker_api("GET", "/queue", token=no_access)
    assert r.status_code == 403
    # HubAuth.access_scopes, from the hub: access:services, access:services!service=gpubroker
    assert r.json()["message"].startswith("token lacks scope access:services")
    assert "access:services!service=gpubroker" in r.json()["message"]
    assert hub.broker_api("GET", "/queue", token=token).status_code == 200
    admin_only = "this endpoint needs scope custom:gpubroker:admin"
    for method, path, body in [
        ("GET", "/quotas", None),
        ("PUT", "/quotas/user/scoped-ann", {"guaranteed": 8}),
        ("PATCH", "/devices/GPU-x", {"drained": True}),
    ]:
        r = hub.broker_api(method, path, token=token, json=body)
        assert (r.status_code, r.json()["message"]) == (403, admin_only), (method, path)
    lease = post_lease(hub, {"user": "scoped-ann", "gpus": 1}, token=token).json()
    r = hub.broker_api(
        "PATCH", f"/leases/{lease['id']}", token=token, json={"priority_class": "batch"}
    )
    assert r.status_code == 403
    assert r.json()["message"] == "changing a lease needs scope custom:gpubroker:admin"
    external = {"user": "scoped-ann", "gpus": 1, "holder_kind": "external"}
    r = post_lease(hub, external, token=token)
    assert r.status_code == 403
    assert r.json()["message"] == "holder_kind: 'external' needs custom:gpubroker:admin"
    events = hub.broker_api("GET", f"/leases/{lease['id']}/events", token=token)
    assert events.status_code == 200 and events.json()["events"][0]["kind"] == "requested"
    r = hub.broker_api("DELETE", f"/leases/{lease['id']}", token=token)
    assert r.status_code == 200 and r.json()["state"] == "released"


def test_a_servers_container_is_recorded_and_bad_ids_are_refused_by_field(
    clean_hub: RunningHub,
) -> None:
    hub = clean_hub
    # held by an external holder: this hub's reconciliation (every 2 s) rightly
    # releases a server lease whose server it does not list, which would race
    # the checks below; the record and its checks are the same for any lease
    body = {"user": "contained", "gpus": 1, "holder_kind": "external"}
    lease = post_lease(hub, body).json()
    path = f"/leases/{lease['id']}"
    url = "http://127.0.0.1:9/user/contained/"
    for body, field in [
        ({"server_url": url, "container_id": "NOT-HEX"}, "container_id"),
        ({"server_url": url, "container_id": "ab" * 40}, "container_id"),
        ({"server_url": url, "docker_engine": "E1"}, "docker_engine"),
        ({"server_url": url, "container_id": "ab" * 32, "docker_engine": "a b"}, "docker_engine"),
        ({"server_url": 7, "container_id": "ab" * 32}, "server_url"),
        ({"server_url": url, "slurm_job": "12a"}, "slurm_job"),
        ({"server_url": url, "slurm_job": 12}, "slurm_job"),
        ({"server_url": url, "slurm_job": "1" * 21}, "slurm_job"),
        ({"server_url": url, "slurm_job": "12", "container_id": "ab" * 32}, "slurm_job"),
    ]:
        r = hub.broker_api("PATCH", path, json=body)
        assert r.status_code == 400 and r.json()["message"].startswith(f"{field}: "), body
    good = {"server_url": url, "container_id": "ab" * 32, "docker_engine": "5c3a:1f0e-9d2b"}
    r = hub.broker_api("PATCH", path, json=good)
    assert r.status_code == 200 and r.json()["state"] == "granted"
    assert r.json()["slurm_job"] is None
    r = hub.broker_api("PATCH", path, json={"server_url": url, "slurm_job": "4711"})
    assert r.status_code == 200 and r.json()["slurm_job"] == "4711"
    # a refused change loses nothing of the record
    bad = {"server_url": url, "container_id": "NOT-HEX", "slurm_job": "1"}
    assert hub.broker_api("PATCH", path, json=bad).status_code == 400
    kept = hub.broker_api("GET", path).json()
    assert (kept["state"], kept["slurm_job"]) == ("granted", "4711"), kept
