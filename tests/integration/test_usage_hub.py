"""Usage reports, the audit log and Prometheus metrics of the broker behind
a real JupyterHub, read with real hub tokens (the shared hub: its ledger
writes every 0.5 s)."""

from __future__ import annotations

import asyncio

import requests
from prometheus_client.parser import text_string_to_metric_families

from gpubroker.client import BrokerClient

from ..hubutil import RunningHub
from .test_spawn import wait_for_release, wait_until


def metrics_url(hub: RunningHub) -> str:
    return f"{hub.url}/services/gpubroker/metrics"


def test_metrics_parse_with_prometheus_client_and_need_the_scope(clean_hub: RunningHub) -> None:
    hub = clean_hub
    held = hub.broker_api(
        "POST", "/leases", json={"user": "m1", "gpus": 2, "holder_kind": "external"}
    )
    assert held.status_code == 201, held.text
    r = requests.get(metrics_url(hub), headers={"Authorization": f"token {hub.token}"}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["Content-Type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    devices = {s.labels["state"]: s.value for s in families["gpubroker_devices"].samples}
    assert devices["held"] == 2 and devices["free"] == 6
    assert any(s.value >= 1 for s in families["gpubroker_grants"].samples)
    assert "gpubroker_queue_wait_seconds" in families
    assert families["gpubroker_queue_wait_seconds"].type == "histogram"
    # no series carries a user name
    for family in families.values():
        for sample in family.samples:
            assert "m1" not in sample.labels.values() and "user" not in sample.labels

    # device telemetry with the DCGM exporter's label names, once sampled
    def telemetry() -> list:
        text = requests.get(
            metrics_url(hub), headers={"Authorization": f"token {hub.token}"}, timeout=30
        ).text
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        return fams["gpubroker_gpu_utilization_percent"].samples

    samples = wait_until(telemetry, timeout=30)
    assert {"gpu", "UUID", "modelName", "Hostname"} <= set(samples[0].labels)
    # a user's token lacks the scope; no token at all is 401
    user_token = hub.create_user("metrics-user")
    r = requests.get(metrics_url(hub), headers={"Authorization": f"token {user_token}"}, timeout=30)
    assert r.status_code == 403
    assert "custom:gpubroker:metrics" in r.json()["message"]
    assert requests.get(metrics_url(hub), timeout=30).status_code == 401
    hub.broker_api("DELETE", f"/leases/{held.json()['id']}")


def test_usage_report_users_see_their_own_rows_admins_all(clean_hub: RunningHub) -> None:
    hub = clean_hub
    tokens = {name: hub.create_user(name) for name in ("ursula", "victor")}
    leases = []
    for name in tokens:
        r = hub.broker_api(
            "POST", "/leases", json={"user": name, "gpus": 1, "holder_kind": "external"}
        )
        assert r.status_code == 201, r.text
        leases.append(r.json())
    for lease in leases:
        hub.broker_api("DELETE", f"/leases/{lease['id']}")
    everyone = hub.broker_api("GET", "/usage", params={"by": "user"}).json()
    assert {"ursula", "victor"} <= {row["key"] for row in everyone["rows"]}
    assert everyone["columns"][0] == "gpu_hours_allocated"
    mine = hub.broker_api("GET", "/usage", token=tokens["ursula"]).json()
    assert [row["key"] for row in mine["rows"]] == ["ursula"]
    assert mine["rows"][0]["leases"] == 1
    # the same through the client a notebook uses
    client = BrokerClient(f"{hub.url}/services/gpubroker", tokens["ursula"])
    assert asyncio.run(client.usage(by="day"))["rows"][-1]["leases"] == 1
    # a user cannot read another's rows
    r = hub.broker_api("GET", "/usage", params={"user": "victor"}, token=tokens["ursula"])
    assert r.status_code == 403
    csv = hub.broker_api("GET", "/usage", params={"format": "csv"}, token=tokens["victor"])
    assert csv.headers["Content-Type"].startswith("text/csv")
    assert csv.text.splitlines()[0].startswith("user,gpu_hours_allocated,gpu_hours_used")
    html = hub.broker_api("GET", "/usage", params={"format": "html", "by": "day"})
    assert html.status_code == 200 and html.text.count("<svg") == 3


def test_bad_report_parameters_are_a_400_naming_the_parameter(hub: RunningHub) -> None:
    for params, name in [
        ({"from": "2026-11-10", "to": "2026-11-01"}, "from"),
        ({"by": "team"}, "by"),
        ({"tz": "Mars/Olympus"}, "tz"),
        ({"format": "pdf"}, "format"),
    ]:
        r = hub.broker_api("GET", "/usage", params=params)
        assert r.status_code == 400, (params, r.text)
        assert r.json()["message"].startswith(f"{name}: ")


def test_a_group_quota_change_is_audited_with_the_admins_name(clean_hub: RunningHub) -> None:
    hub = clean_hub
    admin_token = hub.create_user("admin")  # the demo's hub admin is a broker admin
    r = hub.broker_api(
        "PUT", "/quotas/group/physics", json={"guaranteed": 2, "limit": 4}, token=admin_token
    )
    assert r.status_code == 200, r.text
    entries = hub.broker_api("GET", "/audit", params={"kind": "quota-set"}).json()["entries"]
    assert entries[0]["actor"] == "admin" and entries[0]["target"] == "group:physics"
    assert entries[0]["detail"] == {"guaranteed": 2.0, "limit": 4.0}
    hub.broker_api("DELETE", "/quotas/group/physics", token=admin_token)
    # a user's own request and release are not audited; an admin's release of it is
    user = hub.create_user("wanda")
    # for a server the hub lists (one without GPUs): the reconciliation (every
    # 2 s) would release a lease of a server it does not list before the admin
    assert hub.api("POST", "/users/wanda/servers/nb", json={"gpus": 0}).status_code in (201, 202)
    hub.wait_for_server("wanda", "nb")
    body = {"user": "wanda", "server_name": "nb", "gpus": 1}
    lease = hub.broker_api("POST", "/leases", json=body, token=user).json()
    assert lease["state"] == "granted", lease
    # her server runs: it is stopped first, then the lease released (by the admin)
    r = hub.broker_api("DELETE", f"/leases/{lease['id']}", token=admin_token)
    assert r.status_code == 200 and r.json()["state"] == "granted", r.text
    released = wait_for_release(hub, lease["id"], timeout=60)
    # (its server's spawner holds no lease: the reconciliation finds it gone)
    assert released["release_reason"].startswith("released by admin ("), released
    hub.wait_for_no_server("wanda", "nb")
    notices = hub.broker_api("GET", "/notices", token=user).json()["notices"]
    assert [(n["kind"], n["message"]) for n in notices][:1] == [
        ("admin-release", "released by admin")
    ], notices
    found = hub.broker_api("GET", "/audit", params={"user": "wanda"}).json()["entries"]
    actions = [(e["action"], e["actor"], e["cause"]) for e in found]
    assert ("released", "admin", "release") in actions
    assert ("granted", "scheduler", None) in actions
    assert not [a for a in actions if a[1] == "wanda"]
    # only admins read it, and bad filters are a 400
    assert hub.broker_api("GET", "/audit", token=user).status_code == 403
    r = hub.broker_api("GET", "/audit", params={"since": "soon"})
    assert r.status_code == 400 and r.json()["message"].startswith("since: ")
    r = hub.broker_api("GET", "/audit", params={"limit": "0"})
    assert r.status_code == 400 and r.json()["message"].startswith("limit: ")
