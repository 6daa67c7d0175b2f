"""DockerServers against a real Docker engine started by the test
(tests/dockerutil.py): a server lease whose container still runs keeps its
devices whatever the hub's listing says, until the broker has stopped the
container itself; a lease is never released while its container runs.

The hub's listing is an input here (``alive``): the hub tests
(test_docker_spawner_hub.py) run the whole stack."""

from __future__ import annotations

import asyncio
import datetime as dt
import gc
import logging
import time
import warnings
from collections.abc import Iterator
from typing import Any

import docker as sdk
import pytest

from gpubroker.broker.docker_servers import DockerServers
from gpubroker.core import Broker
from gpubroker.engines.docker import DockerEngine

from .. import dockerutil
from ..conftest import make_broker

LOG = logging.getLogger("test.docker_servers")


@pytest.fixture
def docker_client(private_docker: dockerutil.PrivateDocker) -> Iterator[Any]:
    client = sdk.DockerClient(base_url=private_docker.url)
    yield client
    client.close()


@pytest.fixture
def engine(private_docker: dockerutil.PrivateDocker) -> Iterator[DockerEngine]:
    engine = DockerEngine(docker_url=private_docker.url)
    yield engine
    engine.close()


def serve(
    broker: Broker,
    client: Any,
    image: str,
    engine: DockerEngine,
    user: str,
    env: dict[str, str] | None = None,
) -> tuple[dict, Any]:
    """A granted server lease of ``user`` whose container runs (as
    DockerGPUSpawner records one: its environment names the lease, unless
    ``env`` is given)."""
    lease = broker.request_lease(user, "", gpus=1)
    container = client.containers.run(
        image,
        ["/bin/sleep", "600"],
        network_mode="none",
        detach=True,
        environment={"GPUBROKER_LEASE_ID": str(lease["id"])} if env is None else env,
    )
    broker.set_server_url(
        lease["id"], f"http://127.0.0.1:9/user/{user}/", container.id, engine.engine_id()
    )
    return lease, container


def reconcile(broker: Broker, servers: DockerServers, alive: set[tuple[str, str]]) -> list[int]:
    """One round as ``GPUBrokerApp.reconcile_once`` runs it."""
    as_of = dt.datetime.now(dt.timezone.utc)
    released = broker.reconcile(alive, as_of, servers.followed())
    return released + asyncio.run(servers.reconcile(alive, as_of))


def test_a_running_container_keeps_its_lease_until_the_broker_stopped_it(
    db_url: str,
    docker_client: Any,
    engine: DockerEngine,
    private_docker: dockerutil.PrivateDocker,
) -> None:
    broker = make_broker(db_url)
    servers = DockerServers(broker, lambda: engine, LOG)
    lease, container = serve(broker, docker_client, private_docker.image, engine, "ann")
    kept, kept_container = serve(broker, docker_client, private_docker.image, engine, "bob")
    alive = {("bob", "")}  # the hub has lost ann's server (a stop that failed)
    assert reconcile(broker, servers, alive) == []  # one listing may race a stop
    assert broker.get_lease(lease["id"])["state"] == "granted"
    container.reload()
    assert container.status == "running"
    assert reconcile(broker, servers, alive) == [lease["id"]]
    view = broker.get_lease(lease["id"])
    assert view["release_reason"] == (
        f"reconcile: the container {container.id[:12]} of server ann/ was stopped by the "
        "broker: its server is gone from the hub"
    )
    with pytest.raises(sdk.errors.NotFound):  # stopped, then removed
        docker_client.containers.get(container.id)
    assert broker.get_lease(kept["id"])["state"] == "granted"
    kept_container.reload()
    assert kept_container.status == "running"
    kept_container.remove(force=True)
    assert reconcile(broker, servers, alive) == []  # the spawner's release may be on its way
    assert reconcile(broker, servers, alive) == [kept["id"]]
    assert broker.get_lease(kept["id"])["release_reason"].endswith("is gone from the Docker engine")


def test_an_overdue_stop_is_carried_out_by_the_broker_before_the_devices_move(
    db_url: str,
    docker_client: Any,
    engine: DockerEngine,
    private_docker: dockerutil.PrivateDocker,
) -> None:
    """The broker asked the hub to stop a server (here a preemption the hub
    never carries out); past ``evict_timeout`` the lease is not released
    while the container runs: the broker stops the container, then
    releases with the stop's reason and cause."""
    broker = make_broker(db_url, ["1 x H100"])
    broker.evict_timeout = 0.2
    asked: list[dict] = []
    broker.on_evict = asked.append  # a hub that never stops the server
    servers = DockerServers(broker, lambda: engine, LOG)
    broker.containers_followed = servers.followed
    lease, container = serve(broker, docker_client, private_docker.image, engine, "ann")
    waiting = broker.request_lease("bob", "", gpus=1)
    assert waiting["state"] == "pending"
    broker.stop_lease(lease["id"], "culled: idle for 3600 s", cause="cull")
    assert [x["id"] for x in asked] == [lease["id"]]
    time.sleep(0.4)
    broker.schedule_now()  # past evict_timeout: a followed lease is not released here
    assert broker.get_lease(lease["id"])["state"] == "granted"
    assert broker.get_lease(waiting["id"])["state"] == "pending"
    assert reconcile(broker, servers, {("ann", ""), ("bob", "")}) == [lease["id"]]
    view = broker.get_lease(lease["id"])
    assert view["release_reason"] == (
        f"culled: idle for 3600 s (reconcile: the container {container.id[:12]} of server "
        "ann/ was stopped by the broker: the hub did not stop its server in 0.2 s)"
    )
    released = [e for e in broker.lease_events(lease["id"]) if e["kind"] == "released"]
    assert released[-1]["detail"]["cause"] == "cull"
    with pytest.raises(sdk.errors.NotFound):
        docker_client.containers.get(container.id)
    broker.schedule_now()
    assert broker.get_lease(waiting["id"])["state"] == "granted"


def test_nothing_is_released_while_docker_cannot_be_read(
    db_url: str,
    docker_client: Any,
    engine: DockerEngine,
    private_docker: dockerutil.PrivateDocker,
    tmp_path: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """No lease is ended on an engine that does not answer, nor left to the
    hub (which lists no server here): the broker says so every round, and
    once as an error past ``unreachable_alarm``."""
    broker = make_broker(db_url)
    lease, container = serve(broker, docker_client, private_docker.image, engine, "ann")
    unreachable = DockerEngine(docker_url=f"unix://{tmp_path / 'no.sock'}")
    servers = DockerServers(broker, lambda: unreachable, LOG)
    servers.unreachable_alarm = 0.0
    # the Docker SDK leaves the socket of a failed version probe to the
    # garbage collector (docker 7.2, APIClient.__init__): not ours to close
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        try:
            for _ in range(3):
                assert reconcile(broker, servers, set()) == []
        finally:
            unreachable.close()
            gc.collect()
    assert broker.get_lease(lease["id"])["state"] == "granted"
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == LOG.name]
    warned = [m for level, m in said if level == logging.WARNING]
    assert len(warned) == 3 and all(f"leases [{lease['id']}] are kept" in m for m in warned)
    (alarm,) = [m for level, m in said if level == logging.ERROR]
    assert "has not answered for" in alarm and f"leases [{lease['id']}] keep" in alarm
    container.remove(force=True)


@pytest.mark.parametrize("env", [{}, {"GPUBROKER_LEASE_ID": "999"}])
def test_a_container_not_of_the_lease_is_never_stopped(
    db_url: str,
    docker_client: Any,
    engine: DockerEngine,
    private_docker: dockerutil.PrivateDocker,
    caplog: pytest.LogCaptureFixture,
    env: dict[str, str],
) -> None:
    """An admin recorded another container's id on a lease (``PATCH
    /leases/{id}``): the broker does not stop it, though the hub has lost
    the lease's server, and says why."""
    broker = make_broker(db_url)
    servers = DockerServers(broker, lambda: engine, LOG)
    lease, foreign = serve(broker, docker_client, private_docker.image, engine, "ann", env)
    with caplog.at_level(logging.DEBUG, logger=LOG.name):
        for _ in range(3):
            assert reconcile(broker, servers, set()) == []
    foreign.reload()
    assert foreign.status == "running"
    assert broker.get_lease(lease["id"])["state"] == "granted"
    refused = [r for r in caplog.records if r.getMessage().startswith("Not stopping container")]
    assert [r.levelno for r in refused] == [logging.ERROR, logging.DEBUG]  # said once loudly
    assert f"{foreign.id[:12]} recorded on lease {lease['id']}" in refused[0].getMessage()
    assert "GPUBROKER_LEASE_ID is " in refused[0].getMessage()
    foreign.remove(force=True)
    assert reconcile(broker, servers, set()) == []
    assert reconcile(broker, servers, set()) == [lease["id"]]  # gone: its lease ends


def test_a_server_stopped_by_the_hub_is_not_recorded_as_a_loss(
    db_url: str,
    docker_client: Any,
    engine: DockerEngine,
    private_docker: dockerutil.PrivateDocker,
) -> None:
    """The spawner stops the container, then releases the lease: a
    reconciliation in between finds the container ended, and must leave
    the release (and its reason) to the spawner; a container left ended
    is released at the next round, with how it ended."""
    broker = make_broker(db_url)
    servers = DockerServers(broker, lambda: engine, LOG)
    alive = {("ann", ""), ("bob", "")}
    stopped, container = serve(broker, docker_client, private_docker.image, engine, "ann")
    died, dead = serve(broker, docker_client, private_docker.image, engine, "bob")
    container.stop(timeout=0)  # the spawner's stop_object()
    dead.kill()
    assert reconcile(broker, servers, alive) == []
    broker.release_lease(stopped["id"], "server stopped")  # the spawner's release
    assert reconcile(broker, servers, alive) == [died["id"]]
    assert broker.get_lease(stopped["id"])["release_reason"] == "server stopped"
    assert broker.get_lease(died["id"])["release_reason"] == (
        f"reconcile: the container {dead.id[:12]} of server bob/ was ended by signal SIGKILL"
    )
    container.remove(force=True)
    dead.remove(force=True)
