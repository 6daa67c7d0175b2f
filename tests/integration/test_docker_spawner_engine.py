"""DockerGPUSpawner against a real Docker engine started by the tests
(tests/dockerutil.py), with the stand-in broker of the spawner's fault
tests (a real Tornado server): how a server's container ended reaches the
lease's release reason, and a start that fails after ``docker start``
leaves no container running on devices whose lease was released.
(The whole hub stack runs in test_docker_spawner_hub.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import docker as sdk
import pytest
from jupyterhub.objects import Hub

from gpubroker_spawner.docker import DockerGPUSpawner

from .. import dockerutil
from ..unit.test_spawner_faults import Broker

#: a server that runs until stopped (the spawner's own arguments are ignored)
SLEEPER = ["/bin/sh", "-c", "exec /bin/sleep 600"]


@pytest.fixture
def client(private_docker: dockerutil.PrivateDocker) -> Iterator[Any]:
    client = sdk.DockerClient(base_url=private_docker.url)
    yield client
    for container in client.containers.list(all=True, filters={"name": "jupyter-ann"}):
        container.remove(force=True)
    client.close()


@pytest.fixture
async def broker() -> Any:
    stub = Broker()
    yield stub
    await stub.stop()


def make_spawner(
    broker: Broker, docker: dockerutil.PrivateDocker, **kwargs: Any
) -> DockerGPUSpawner:
    user = SimpleNamespace(name="ann", url="/user/ann/", escaped_name="ann", id=1)
    hub = Hub(ip="127.0.0.1", port=8081, base_url="/hub/")
    kwargs.setdefault("cmd", SLEEPER)
    kwargs.setdefault("network_name", "none")
    return DockerGPUSpawner(
        user=user,
        hub=hub,
        broker_url=broker.url,
        image=docker.image,
        pull_policy="never",
        client_kwargs={"base_url": docker.url},
        broker_retry_interval=0.1,
        user_options={"gpus": 1},
        **kwargs,
    )


async def test_a_killed_container_is_released_with_its_real_exit_status_then_removed(
    broker: Broker, client: Any, private_docker: dockerutil.PrivateDocker
) -> None:
    spawner = make_spawner(broker, private_docker)
    await spawner.start()
    container = client.containers.get(spawner.object_id)
    assert container.attrs["HostConfig"]["AutoRemove"] is False
    container.kill()
    container.wait(timeout=30)
    assert await spawner.poll() == 137
    # with auto_remove, Docker deleted the container first: "status 0"
    assert broker.released == {12: "server exited (status 137)"}
    with pytest.raises(sdk.errors.NotFound):  # removed by the spawner once read
        client.containers.get(container.id)
    await spawner.stop()  # the hub stops a server its poll found dead
    assert broker.released == {12: "server exited (status 137)"}


async def test_a_start_failing_after_docker_start_removes_the_container_before_the_release(
    broker: Broker, client: Any, private_docker: dockerutil.PrivateDocker
) -> None:
    # the container runs on network "none"; get_ip_and_port() then looks
    # for network_name among its networks and fails
    spawner = make_spawner(
        broker,
        private_docker,
        network_name="gpubroker-missing",
        extra_host_config={"network_mode": "none"},
    )
    seen_at_release: list[list[Any]] = []
    release = spawner._release_call

    async def watched_release(lease_id: int, reason: str, note_end: bool = True) -> None:
        seen_at_release.append(client.containers.list(filters={"name": "jupyter-ann"}))
        await release(lease_id, reason, note_end)

    spawner._release_call = watched_release  # type: ignore[method-assign]
    with pytest.raises(Exception, match="Unknown docker network"):
        await spawner.start()
    assert broker.released == {12: "server failed to start"}
    assert seen_at_release == [[]]  # nothing ran on the devices when they were released
    assert client.containers.list(all=True, filters={"name": "jupyter-ann"}) == []
    await spawner.stop()  # as the hub cleans up a server that failed to start
    assert broker.released == {12: "server failed to start"}


async def test_a_failed_start_whose_container_cannot_be_stopped_keeps_the_lease(
    broker: Broker, client: Any, private_docker: dockerutil.PrivateDocker
) -> None:
    spawner = make_spawner(
        broker,
        private_docker,
        network_name="gpubroker-missing",
        extra_host_config={"network_mode": "none"},
    )
    stop_object = spawner.stop_object

    async def refused() -> None:
        raise sdk.errors.APIError("500 Server Error: engine unhealthy")

    spawner.stop_object = refused  # type: ignore[method-assign]
    with pytest.raises(Exception, match="Unknown docker network"):
        await spawner.start()
    assert broker.released == {}
    assert spawner.gpu_lease_id == 12
    (running,) = client.containers.list(filters={"name": "jupyter-ann"})
    # the hub stops a server that failed to start: then the lease goes
    spawner.stop_object = stop_object  # type: ignore[method-assign]
    await spawner.stop()
    assert broker.released == {12: "server stopped"}
    with pytest.raises(sdk.errors.NotFound):
        client.containers.get(running.id)
