"""DockerGPUSpawner's pure parts: the device requests and binds a lease's
environment asks for, and the environment its containers get (the whole
spawner runs against a real engine in tests/integration/test_docker_spawner_hub.py)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
import requests
from docker.errors import APIError, NotFound
from jupyterhub.objects import Hub

from gpubroker.enforce.caps import STARTUP_DIR
from gpubroker_spawner.docker import (
    DockerGPUSpawner,
    _merged,
    device_ids,
    exit_reason,
    gpu_host_config,
    is_stale,
)

from .test_spawner_faults import Broker


@pytest.fixture
async def broker() -> AsyncIterator[Broker]:
    """The stand-in broker of the spawner's fault tests (a real Tornado server)."""
    stub = Broker()
    yield stub
    await stub.stop()


def make_spawner(**kwargs) -> DockerGPUSpawner:
    user = SimpleNamespace(name="ann", url="/user/ann/", escaped_name="ann", id=1)
    hub = Hub(ip="127.0.0.1", port=8081, base_url="/hub/")
    kwargs.setdefault("broker_url", "http://broker:10101/services/gpubroker/")
    return DockerGPUSpawner(user=user, hub=hub, **kwargs)


def test_the_device_request_names_exactly_the_leased_uuids() -> None:
    env = {"NVIDIA_VISIBLE_DEVICES": "GPU-a,MIG-b", "CUDA_VISIBLE_DEVICES": "GPU-a,MIG-b"}
    assert gpu_host_config(env) == {
        "device_requests": [
            {"driver": "nvidia", "device_ids": ["GPU-a", "MIG-b"], "capabilities": [["gpu"]]}
        ]
    }


def test_no_gpu_means_no_device_request() -> None:
    for visible in ("void", "", "none"):
        assert device_ids({"NVIDIA_VISIBLE_DEVICES": visible}) == []
        assert gpu_host_config({"NVIDIA_VISIBLE_DEVICES": visible}) == {"device_requests": []}
    assert gpu_host_config({}) == {"device_requests": []}


def test_configured_host_config_is_kept_but_device_requests_are_the_leases() -> None:
    gpu = gpu_host_config({"NVIDIA_VISIBLE_DEVICES": "GPU-a"})
    merged = _merged({"shm_size": "1g", "binds": {"/data": {"bind": "/data", "mode": "ro"}}}, gpu)
    assert merged["shm_size"] == "1g" and merged["binds"] == {
        "/data": {"bind": "/data", "mode": "ro"}
    }
    # a configured device request cannot widen the lease's, nor give a server without one GPUs
    wide = [{"driver": "nvidia", "count": -1, "capabilities": [["gpu"]]}]
    assert _merged({"device_requests": wide}, gpu)["device_requests"] == gpu["device_requests"]
    assert _merged({"device_requests": wide}, gpu_host_config({}))["device_requests"] == []


def test_mps_is_not_passed_into_containers() -> None:
    spawner = make_spawner()
    spawner._gpu_env = {
        "NVIDIA_VISIBLE_DEVICES": "GPU-a",
        "CUDA_VISIBLE_DEVICES": "GPU-a",
        "CUDA_MPS_PIPE_DIRECTORY": "/run/gpubroker/mps/GPU-a/pipe",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=10240M",
    }
    env = spawner.get_env()
    assert not [name for name in env if name.startswith("CUDA_MPS_")]
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-a"


def container(devices: list[str], env: dict[str, str]) -> dict:
    requests = [{"DeviceIDs": devices}] if devices else None
    return {
        "HostConfig": {"DeviceRequests": requests},
        "Config": {"Env": [f"{k}={v}" for k, v in env.items()] + ["PATH=/usr/bin"]},
    }


def test_a_container_made_for_another_lease_is_stale() -> None:
    lease = {"NVIDIA_VISIBLE_DEVICES": "GPU-a", "CUDA_VISIBLE_DEVICES": "GPU-a"}
    same = container(["GPU-a"], lease | {"GPUBROKER_LEASE_ID": "7"})
    assert not is_stale(same, lease | {"GPUBROKER_LEASE_ID": "7"})
    assert is_stale(same, lease | {"GPUBROKER_LEASE_ID": "8"})  # same device, new lease
    assert is_stale(container(["GPU-b"], lease), lease)
    no_gpu = {"NVIDIA_VISIBLE_DEVICES": "void", "CUDA_VISIBLE_DEVICES": ""}
    assert is_stale(same, no_gpu) and not is_stale(container([], no_gpu), no_gpu)


def test_the_share_hook_path_is_the_images() -> None:
    spawner = make_spawner(environment={"PYTHONPATH": "/home/jovyan/lib"})
    spawner._gpu_env = {
        "NVIDIA_VISIBLE_DEVICES": "GPU-a",
        "CUDA_VISIBLE_DEVICES": "GPU-a",
        "GPUBROKER_MEMORY_LIMIT_MIB": "10240",
        "PYTHONPATH": STARTUP_DIR,
    }
    env = spawner.get_env()
    assert env["PYTHONPATH"] == "/opt/gpubroker/startup:/home/jovyan/lib"
    assert env["GPUBROKER_MEMORY_LIMIT_MIB"] == "10240"
    assert env["NVIDIA_VISIBLE_DEVICES"] == "GPU-a"


async def test_the_container_and_its_engine_are_what_the_broker_is_told() -> None:
    spawner = make_spawner()
    assert await spawner.gpu_server_record() == {}
    spawner.object_id = "0123456789abcdef" * 4

    async def info(method: str) -> dict:
        assert method == "info"
        return {"ID": "5c3a1f0e-9d2b-4c7e-8f61-2a9b0c4d7e13"}

    spawner.docker = info
    assert await spawner.gpu_server_record() == {
        "container_id": "0123456789abcdef" * 4,
        "docker_engine": "5c3a1f0e-9d2b-4c7e-8f61-2a9b0c4d7e13",
    }

    async def unreachable(method: str) -> dict:
        raise OSError("connection refused")

    spawner.docker = unreachable
    assert await spawner.gpu_server_record() == {"container_id": "0123456789abcdef" * 4}


def test_on_the_host_network_nothing_is_published() -> None:
    assert make_spawner(network_name="host").use_internal_ip is True
    assert make_spawner(network_name="bridge").use_internal_ip is False
    assert make_spawner(network_name="gpubroker").use_internal_ip is True


# -- poll(): only Docker's own answer ends a lease ------------------------------------


def api_error(status: int) -> APIError:
    response = requests.Response()
    response.status_code = status
    return (NotFound if status == 404 else APIError)(f"{status} error", response=response)


async def test_a_docker_500_on_poll_keeps_the_server_and_its_lease(broker: Broker) -> None:
    """dockerspawner takes a 500 on inspect for "gone" and forgets the
    container; the container may still run on the lease's devices."""
    spawner = make_spawner(broker_url=broker.url)
    spawner.object_id = "ab" * 32
    spawner.gpu_lease_id = 7
    asked: list[tuple] = []

    async def docker(method: str, *args: Any, **kwargs: Any) -> Any:
        asked.append((method, *args))
        raise api_error(500)

    spawner.docker = docker
    assert await spawner.poll() is None
    assert broker.released == {}
    assert spawner.gpu_lease_id == 7 and spawner.object_id == "ab" * 32
    assert asked == [("inspect_container", "ab" * 32)]  # the remembered id, not the name

    async def unreachable(method: str, *args: Any, **kwargs: Any) -> Any:
        raise requests.ConnectionError("connection refused")

    spawner.docker = unreachable
    assert await spawner.poll() is None
    assert broker.released == {} and spawner.gpu_lease_id == 7

    async def gone(method: str, *args: Any, **kwargs: Any) -> Any:
        raise api_error(404)

    spawner.docker = gone
    assert await spawner.poll() == 0
    assert broker.released == {
        7: f"server's container {'ab' * 6} is gone from the Docker engine (exit status unknown)"
    }


async def test_an_oom_kill_is_the_release_reason(broker: Broker) -> None:
    spawner = make_spawner(broker_url=broker.url, remove=False)
    spawner.object_id = "cd" * 32
    spawner.gpu_lease_id = 8
    state = {"Running": False, "ExitCode": 137, "OOMKilled": True, "Error": ""}

    async def docker(method: str, *args: Any, **kwargs: Any) -> Any:
        assert method == "inspect_container"
        return {"Id": "cd" * 32, "State": state}

    spawner.docker = docker
    assert await spawner.poll() == 137
    assert broker.released == {
        8: "server exited (status 137: killed for running out of memory (OOMKilled))"
    }
    assert exit_reason({"ExitCode": 0, "Error": ""}) == "server exited (status 0)"


def test_docker_never_removes_a_container_before_its_end_is_read() -> None:
    assert _merged({"auto_remove": True}, gpu_host_config({}))["auto_remove"] is False


async def test_a_container_removed_after_its_end_was_read_is_not_gone(
    broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    """The Docker trial: after ``docker kill`` the hub logged the container's
    end, then twice that it was "gone from the Docker engine", for a
    container the spawner had just removed itself."""
    spawner = make_spawner(broker_url=broker.url, remove=True)
    spawner.object_id = "ef" * 32
    spawner.gpu_lease_id = 9
    removed: list[str] = []

    async def docker(method: str, *args: Any, **kwargs: Any) -> Any:
        if method == "remove_container":
            removed.append(args[0])
            return None
        if removed:
            raise api_error(404)
        return {"Id": "ef" * 32, "State": {"Running": False, "ExitCode": 137, "Error": ""}}

    spawner.docker = docker
    assert await spawner.poll() == 137
    with caplog.at_level(logging.WARNING):
        assert await spawner.gpu_poll_server() == 0
    assert removed == ["ef" * 32] and "gone from the Docker engine" not in caplog.text
