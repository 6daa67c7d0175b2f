"""One real JupyterHub (demo config: proxy, broker service, fake GPUs) shared
by the integration tests; each test leaves it with no servers and no leases."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest

from ..hubutil import REPO, RunningHub

pytestmark = pytest.mark.hub


def _require_proxy() -> None:
    proxy = REPO / "node_modules" / ".bin" / "configurable-http-proxy"
    if not proxy.exists():
        pytest.fail(f"{proxy} is missing: run `make setup` (npm ci) first")


@pytest.fixture(scope="session")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningHub]:
    """The shared hub: reconciliation every 2 s, hub polls servers every 2 s."""
    _require_proxy()
    workdir: Path = tmp_path_factory.mktemp("hub")
    running = RunningHub(
        workdir,
        GPUBROKER_DEMO_RECONCILE_INTERVAL="2",
        GPUBROKER_DEMO_POLL_INTERVAL="2",
    ).start()
    yield running
    running.stop()


def _stop_everything(hub: RunningHub) -> None:
    users = hub.api("GET", "/users", params={"state": "active"}).json()
    for user in users:
        for name in user["servers"]:
            path = (
                f"/users/{user['name']}/servers/{name}"
                if name
                else (f"/users/{user['name']}/server")
            )
            hub.api("DELETE", path)
    for user in users:
        for name in user["servers"]:
            hub.wait_for_no_server(user["name"], name)
    for lease in hub.leases():
        hub.broker_api("DELETE", f"/leases/{lease['id']}", json={"reason": "test cleanup"})
    # stored quotas too (a fuzzer may have made some): the next test starts with none
    quotas = hub.broker_api("GET", "/quotas").json()
    for kind, key in (("user", "users"), ("group", "groups")):
        for name in quotas.get(key) or {}:
            hub.broker_api("DELETE", f"/quotas/{kind}/{quote(name, safe='')}")


@pytest.fixture
def clean_hub(hub: RunningHub) -> Iterator[RunningHub]:
    """The shared hub, emptied of servers and leases after the test."""
    assert hub.leases() == [], "a previous test left leases behind"
    yield hub
    _stop_everything(hub)
    deadline = time.monotonic() + 30
    while hub.leases() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert hub.leases() == []
