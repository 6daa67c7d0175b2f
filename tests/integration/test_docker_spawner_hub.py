"""The Docker deployment end to end: a real JupyterHub with DockerGPUSpawner,
the broker run from the broker image (docker/broker/Dockerfile) as an
external hub service on a real PostgreSQL server, and servers run from the
notebook image (docker/notebook/Dockerfile), all in a real Docker engine
started by the tests (tests/dockerutil.py: the allowed flags only; images
built here FROM a base of this machine's Python, tests/dockerimages.py).

The NVIDIA container runtime is the one part simulated, as the GPUs are: a
hook accepts the device requests, and the tests assert on the requests each
container got.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker as sdk
import pytest
import requests

from .. import dockerutil
from ..hubutil import RunningHub, free_port
from ..pgutil import RunningPostgres

#: where the broker container sees the Docker engine's socket
SOCKET_IN_BROKER = "/var/run/docker.sock"

EXTRA_CONFIG = """
c.JupyterHub.spawner_class = "gpubroker-docker"
c.DockerGPUSpawner.image = {image!r}
c.DockerGPUSpawner.pull_policy = "never"
c.DockerGPUSpawner.client_kwargs = {{"base_url": {docker_url!r}}}
c.DockerGPUSpawner.network_name = "host"
c.DockerGPUSpawner.remove = True
c.DockerGPUSpawner.cmd = ["jupyterhub-singleuser"]
c.DockerGPUSpawner.args = []
c.DockerGPUSpawner.default_url = ""
"""


@dataclass
class Stack:
    hub: RunningHub
    client: Any
    broker_image: str
    broker_args: list[str]
    broker_env: dict[str, str]
    socket: str
    brokers: list[Any] = field(default_factory=list)

    def start_broker(self, *extra: str, port: int | None = None) -> Any:
        """Run a broker container (host network) on the stack's database."""
        container = self.client.containers.run(
            self.broker_image,
            command=[
                "gpubroker",
                "serve",
                "--ip=127.0.0.1",
                f"--port={port or self.hub.broker_port}",
                *self.broker_args,
                *extra,
            ],
            environment=self.broker_env,
            network_mode="host",
            volumes={self.socket: {"bind": SOCKET_IN_BROKER, "mode": "rw"}},
            detach=True,
        )
        self.brokers.append(container)
        return container

    def spawn(self, user: str, profile: str) -> None:
        self.hub.create_user(user)
        r = self.hub.api("POST", f"/users/{user}/server", json={"profile": profile})
        assert r.status_code in (201, 202), r.text

    def container_of(self, user: str) -> Any:
        """The container of ``user``'s default server (from its spawner state)."""
        state = self.hub.server(user)["state"]  # type: ignore[index]
        return self.client.containers.get(state["object_id"])

    def stop(self, user: str) -> None:
        r = self.hub.api("DELETE", f"/users/{user}/server")
        assert r.status_code in (202, 204), r.text
        self.hub.wait_for_no_server(user)


def env_of(container: Any) -> dict[str, str]:
    return dict(item.split("=", 1) for item in container.attrs["Config"]["Env"])


def wait_until(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.25)
    raise TimeoutError(what)


@pytest.fixture(scope="module")
def stack(
    private_docker: dockerutil.PrivateDocker,
    docker_images: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    pg = RunningPostgres().start()
    workdir: Path = tmp_path_factory.mktemp("docker-hub")
    token = secrets.token_hex(32)
    secret = workdir / "gpubroker-service-token"
    secret.write_text(token)
    secret.chmod(0o600)
    extra = workdir / "docker_hub_config.py"
    extra.write_text(
        EXTRA_CONFIG.format(image=docker_images["notebook"], docker_url=private_docker.url)
    )
    hub = RunningHub(
        workdir,
        GPUBROKER_DEMO_EXTRA_CONFIG=str(extra),
        GPUBROKER_DEMO_SHARING="1",
        # the broker runs from its image, started by the test
        GPUBROKER_DEMO_EXTERNAL_BROKER="1",
        # the hub does not poll servers in these tests: what the broker finds
        # out about containers, it finds out from the Docker engine
        GPUBROKER_DEMO_POLL_INTERVAL="3600",
    )
    hub_api = f"http://127.0.0.1:{hub.env['GPUBROKER_DEMO_HUB_PORT']}/hub/api"
    broker_args = [
        f"--db-url={pg.url}",
        "--device-backend=fake",
        "--FakeDeviceBackend.inventory=8 x NVIDIA H100 80GB HBM3",
        "--FakeDeviceBackend.node_name=demo-node",
        '--Pools.pools=[{"name": "mig", "mode": "mig", "devices": ["*:4-5"]},'
        ' {"name": "shared", "mode": "timeslice", "devices": ["*:6-7"], "reserve_gib": 2}]',
        "--FakeDeviceBackend.mig_enabled=[4, 5]",
        "--GPUBrokerApp.reconcile_interval=2",
        "--Broker.check_state=raise",
        f"--DockerEngine.docker_url=unix://{SOCKET_IN_BROKER}",
    ]
    broker_env = {
        "JUPYTERHUB_API_TOKEN": token,
        "JUPYTERHUB_API_URL": hub_api,
        "JUPYTERHUB_SERVICE_PREFIX": "/services/gpubroker/",
        "JUPYTERHUB_SERVICE_URL": f"http://127.0.0.1:{hub.broker_port}",
    }
    client = sdk.DockerClient(base_url=private_docker.url)
    socket = private_docker.url.removeprefix("unix://")
    running = Stack(hub, client, docker_images["broker"], broker_args, broker_env, socket)
    try:
        running.start_broker()
        hub.start()
        yield running
    finally:
        try:
            for user in hub.api("GET", "/users", params={"state": "active"}).json():
                if "" in user["servers"]:
                    hub.api("DELETE", f"/users/{user['name']}/server")
                    hub.wait_for_no_server(user["name"])
        finally:
            for container in running.brokers:
                with contextlib.suppress(sdk.errors.NotFound):
                    container.remove(force=True)
            hub.stop()
            client.close()
            pg.stop()


@pytest.fixture
def docker_hub(stack: Stack) -> Iterator[Stack]:
    """The stack, with no servers and no leases left after the test."""
    yield stack
    for user in stack.hub.api("GET", "/users", params={"state": "active"}).json():
        if "" in user["servers"]:
            stack.stop(user["name"])
    wait_until(lambda: stack.hub.leases() == [], 30, "leases left behind")


def slot_uuids(lease: dict[str, Any]) -> list[str]:
    return [slot["uuid"] for slot in lease["slots"]]


def test_a_server_container_gets_exactly_its_leased_gpu_and_stopping_releases_it(
    docker_hub: Stack,
) -> None:
    hub = docker_hub.hub
    token = hub.create_user("ann")
    docker_hub.spawn("ann", "full-h100")
    hub.wait_for_server("ann")
    (lease,) = hub.leases(user="ann")
    (uuid,) = slot_uuids(lease)
    container = docker_hub.container_of("ann")
    (request,) = container.attrs["HostConfig"]["DeviceRequests"]
    assert request["Driver"] == "nvidia"
    assert request["DeviceIDs"] == [uuid] and uuid.startswith("GPU-")
    assert request["Capabilities"] == [["gpu"]]
    env = env_of(container)
    assert env["CUDA_VISIBLE_DEVICES"] == uuid and env["NVIDIA_VISIBLE_DEVICES"] == uuid
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["GPUBROKER_LEASE_ID"] == str(lease["id"])
    assert env["GPUBROKER_URL"].endswith("/services/gpubroker/")
    # the broker's own token never reaches the user's container
    assert docker_hub.broker_env["JUPYTERHUB_API_TOKEN"] not in env.values()
    assert "GPUBROKER_API_TOKEN" not in env
    # the user's volume (new, on a base without the directory) is writable
    # by the user; the sources the image was built from are gone
    check = (
        "import os; open('/home/jovyan/work/x', 'w').close(); "
        "print(os.stat('/home/jovyan/work/x').st_uid, os.path.exists('/tmp/gpubroker-src'))"
    )
    made = container.exec_run(["python3", "-c", check], user="1000")
    assert made.output.split() == [b"1000", b"False"], made.output
    # the server in the container answers through the hub's proxy
    r = requests.get(
        f"{hub.url}/user/ann/api/status", headers={"Authorization": f"token {token}"}, timeout=10
    )
    assert r.status_code == 200, r.text
    docker_hub.stop("ann")
    assert hub.leases(user="ann") == []
    ended = hub.broker_api("GET", f"/leases/{lease['id']}").json()
    # the spawner's release, or (when the 2 s reconciliation runs between the
    # container's exit and that release) the broker's, from what Docker said
    assert ended["state"] == "released"
    reconciled = f"reconcile: the container {container.id[:12]} of server ann/ "
    reason = ended["release_reason"]
    assert reason == "server stopped" or reason.startswith(reconciled), ended
    with pytest.raises(sdk.errors.NotFound):
        docker_hub.client.containers.get(container.id)


def test_users_spawning_at_once_get_containers_naming_their_own_devices(
    docker_hub: Stack,
) -> None:
    hub = docker_hub.hub
    chosen = {
        "bob": "full-h100",
        "cy": "mig-1g-10gb",
        "dan": "shared-gpu-10-gib",
        "eve": "no-gpu",
    }
    threads = [
        threading.Thread(target=docker_hub.spawn, args=(user, profile))
        for user, profile in chosen.items()
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for user in chosen:
        hub.wait_for_server(user)
    seen: dict[str, list[str]] = {}
    for user in ("bob", "cy", "dan"):
        (lease,) = hub.leases(user=user)
        container = docker_hub.container_of(user)
        (request,) = container.attrs["HostConfig"]["DeviceRequests"]
        assert request["DeviceIDs"] == slot_uuids(lease), user
        assert env_of(container)["CUDA_VISIBLE_DEVICES"] == ",".join(slot_uuids(lease))
        seen[user] = request["DeviceIDs"]
    assert seen["cy"][0].startswith("MIG-") and seen["bob"][0].startswith("GPU-")
    assert len({uuid for ids in seen.values() for uuid in ids}) == 3
    # the share's memory caps reach the container, the start-up hook from the image
    shared = docker_hub.container_of("dan")
    env = env_of(shared)
    assert env["GPUBROKER_MEMORY_LIMIT_MIB"] == str(10240 - 512)  # less the CUDA context
    assert env["PYTHONPATH"].split(":")[0] == "/opt/gpubroker/startup"
    found = shared.exec_run(
        ["python3", "-c", "import sitecustomize; print(sitecustomize.__file__)"]
    )
    assert found.output.decode().strip() == "/opt/gpubroker/startup/sitecustomize.py"
    # no GPU: no device request, nothing visible to the NVIDIA runtime
    plain = docker_hub.container_of("eve")
    assert not plain.attrs["HostConfig"]["DeviceRequests"]
    assert env_of(plain)["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert hub.leases(user="eve") == []


def test_a_container_killed_from_outside_is_released_by_the_next_reconciliation(
    docker_hub: Stack,
) -> None:
    hub = docker_hub.hub
    docker_hub.spawn("fay", "full-h100")
    hub.wait_for_server("fay")
    (lease,) = hub.leases(user="fay")
    docker_hub.container_of("fay").kill()
    # reconcile_interval is 2 s; the hub itself polls servers only hourly here
    wait_until(lambda: hub.leases(user="fay") == [], 20, "the lease of a killed container")
    ended = hub.broker_api("GET", f"/leases/{lease['id']}").json()
    assert ended["state"] == "released"
    assert ended["release_reason"].startswith("reconcile: the container ")
    assert "of server fay/" in ended["release_reason"]
    assert hub.server("fay") is not None  # the hub had not noticed: Docker told the broker


def test_a_second_broker_refuses_and_a_standby_takes_over_after_sigkill(
    docker_hub: Stack,
) -> None:
    hub = docker_hub.hub
    docker_hub.spawn("gil", "full-h100")
    hub.wait_for_server("gil")
    (lease,) = hub.leases(user="gil")
    active = docker_hub.brokers[-1]
    # a second broker on the same database refuses at once and names the holder
    second = docker_hub.start_broker(port=free_port())
    assert second.wait(timeout=60)["StatusCode"] != 0
    said = second.logs().decode()
    assert "another gpubroker is the active broker" in said and "pid=" in said, said[-2000:]
    # a standby on the active broker's own address waits for the lock ...
    standby = docker_hub.start_broker("--GPUBrokerApp.standby=True")
    wait_until(
        lambda: "Waiting for the database lock" in standby.logs().decode(), 30, "standby waits"
    )
    # ... and takes over when the active broker is SIGKILLed
    active.kill()
    killed = time.monotonic()
    wait_until(
        lambda: _answers(f"{hub.broker}/health"),
        60,
        f"standby did not take over:\n{standby.logs().decode()[-3000:]}",
    )
    print(f"standby took over {time.monotonic() - killed:.1f} s after the SIGKILL")
    again = hub.broker_api("GET", f"/leases/{lease['id']}").json()
    assert again["state"] == "granted" and slot_uuids(again) == slot_uuids(lease)
    assert [x["id"] for x in hub.leases()] == [lease["id"]]
    docker_hub.stop("gil")
    assert hub.broker_api("GET", f"/leases/{lease['id']}").json()["state"] == "released"


def _answers(url: str) -> bool:
    try:
        return requests.get(url, timeout=2).status_code == 200
    except requests.RequestException:
        return False
