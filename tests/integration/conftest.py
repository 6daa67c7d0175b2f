"""One real JupyterHub (demo config: proxy, broker service, fake GPUs) shared
by the integration tests; each test leaves it with no servers and no leases."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest

from .. import dockerimages, dockerutil, slurmutil
from ..hubutil import REPO, RunningHub
from ..pgutil import RunningPostgres

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


def _cleaned(hub: RunningHub) -> Iterator[RunningHub]:
    assert hub.leases() == [], "a previous test left leases behind"
    yield hub
    _stop_everything(hub)
    deadline = time.monotonic() + 30
    while hub.leases() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert hub.leases() == []


@pytest.fixture
def clean_hub(hub: RunningHub) -> Iterator[RunningHub]:
    """The shared hub, emptied of servers and leases after the test."""
    yield from _cleaned(hub)


@pytest.fixture(scope="module")
def pg_hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningHub]:
    """A second hub like the shared one, whose broker's store is a real
    PostgreSQL server (tests/pgutil.py) instead of SQLite."""
    _require_proxy()
    server = RunningPostgres().start()
    try:
        running = RunningHub(
            tmp_path_factory.mktemp("pg-hub"),
            GPUBROKER_DEMO_DB_URL=server.url,
            GPUBROKER_DEMO_RECONCILE_INTERVAL="2",
            GPUBROKER_DEMO_POLL_INTERVAL="2",
        ).start()
        yield running
        running.stop()
    finally:
        server.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def either_hub(request: pytest.FixtureRequest) -> Iterator[RunningHub]:
    """The shared hub (SQLite store), then the PostgreSQL hub: a test using
    it runs on both stores; emptied of servers and leases after the test."""
    name = "hub" if request.param == "sqlite" else "pg_hub"
    yield from _cleaned(request.getfixturevalue(name))


@pytest.fixture(scope="session")
def private_docker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dockerutil.PrivateDocker]:
    """One private Docker engine for the Docker tests (tests/dockerutil.py)."""
    reason = dockerutil.why_not()
    if reason:
        pytest.skip(f"no Docker engine can start here: {reason}")
    running = dockerutil.start(tmp_path_factory.mktemp("docker"))
    yield running
    running.stop()


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[slurmutil.SlurmCluster]:
    """One real two-node Slurm cluster for the Slurm tests (tests/slurmutil.py)."""
    reason = slurmutil.why_not()
    if reason:
        pytest.skip(f"no Slurm cluster can start here: {reason}")
    cluster = slurmutil.start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def docker_images(
    private_docker: dockerutil.PrivateDocker, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, str]:
    """The notebook and broker images of docker/, built on the private
    engine FROM a base made of this machine's Python (tests/dockerimages.py):
    ``{"notebook": TAG, "broker": TAG}``."""
    import docker as sdk

    client = sdk.DockerClient(base_url=private_docker.url)
    try:
        base = dockerimages.python_base(client, tmp_path_factory.mktemp("images"))
        return {
            name: dockerimages.build(client, f"{name}/Dockerfile", f"gpubroker-test-{name}:1", base)
            for name in ("notebook", "broker")
        }
    finally:
        client.close()
