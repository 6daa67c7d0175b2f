"""The broker in a hub with JupyterHub's internal TLS (``internal_ssl``).

The demo hub with ``GPUBROKER_DEMO_INTERNAL_SSL=1``: the hub's API, the
proxy's API and the single-user servers answer HTTPS only, to clients with a
certificate the hub's authorities signed. The broker calls the hub with the
certificate the hub gave it (``gpubroker.hub_tls``); the spawner, the proxy
and the servers' kernels reach the broker on its plain-HTTP loopback URL.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import requests

from ..hubutil import RunningHub
from ..kernelutil import connect, execute, start_kernel
from .test_spawn import lease_of, spawn, wait_for_release


@pytest.fixture(scope="module")
def tls_hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningHub]:
    hub = RunningHub(tmp_path_factory.mktemp("tls-hub"), GPUBROKER_DEMO_INTERNAL_SSL="1")
    hub.start(timeout=120)
    try:
        yield hub
    finally:
        hub.stop()


def _hub_api_port(hub: RunningHub) -> int:
    return int(hub.env["GPUBROKER_DEMO_HUB_PORT"])


def test_the_hub_really_asks_for_client_certificates(tls_hub: RunningHub) -> None:
    """The setting the other tests rely on: the hub's own API port answers
    only TLS, and only to a client with a certificate of the hub's CAs."""
    url = f"https://127.0.0.1:{_hub_api_port(tls_hub)}/hub/api/"
    certs = tls_hub.workdir / "internal-ssl"
    with pytest.raises(requests.exceptions.SSLError):
        requests.get(url, verify=str(certs / "hub-ca_trust.crt"), timeout=10)
    with pytest.raises(requests.exceptions.ConnectionError):
        requests.get(url.replace("https:", "http:"), timeout=10)


def test_a_server_in_a_hub_group_gets_its_gpu_and_its_kernel_reaches_the_broker(
    tls_hub: RunningHub,
) -> None:
    """Spawn → the spawner asks the broker → the broker reads the user's hub
    groups over the hub's TLS API (the lease carries the group) → the server
    starts with its GPU; its kernel calls the broker (``%gpu``); the stop
    releases the lease."""
    hub = tls_hub
    token = hub.create_user("tess")
    assert hub.api("POST", "/groups/optics", json={"users": ["tess"]}).status_code == 201
    # a lease is charged to the user's hub group that has a quota
    quota = {"guaranteed": 1, "limit": 4}
    assert hub.broker_api("PUT", "/quotas/group/optics", json=quota).status_code == 200
    assert spawn(hub, "tess", {"gpus": 1}).status_code in (201, 202)
    model = hub.wait_for_server("tess", timeout=120)
    assert model["ready"]
    lease = lease_of(hub, "tess")
    assert lease["state"] == "granted" and len(lease["devices"]) == 1
    assert lease["group"] == "optics"  # read from the hub's API, over TLS with its cert

    home = hub.workdir / "home" / "tess"
    ws = connect(hub, "tess", token, start_kernel(hub, "tess", token))
    try:
        assert not execute(
            ws,
            "%load_ext gpubroker\n"
            "import json, os\n"
            "lease = %gpu\n"
            "open('lease.json', 'w').write(json.dumps(\n"
            "    {'lease': lease, 'url': os.environ['GPUBROKER_URL']}))\n",
        )
    finally:
        ws.close()
    seen = json.loads((home / "lease.json").read_text())
    assert seen["lease"]["id"] == lease["id"] and seen["lease"]["state"] == "granted"
    assert seen["url"].startswith(f"http://127.0.0.1:{hub.broker_port}/")

    assert hub.api("DELETE", "/users/tess/server").status_code in (202, 204)
    hub.wait_for_no_server("tess")
    assert wait_for_release(hub, lease["id"])["release_reason"]


def test_the_brokers_log_says_it_calls_the_hub_with_its_certificate(tls_hub: RunningHub) -> None:
    # the broker logs at INFO by default (its start-up lines are in the hub's log)
    log = (tls_hub.workdir / "hub.log").read_text(errors="replace")
    assert "GPUBrokerApp] JupyterHub internal TLS: calling the hub with" in log
    assert "serving plain HTTP (the service URL is not https)" in log
