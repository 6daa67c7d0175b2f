"""The docker job runner against a real Docker engine started by the test
(tests/dockerutil.py: the allowed flags only, an image built here): a
container per job whose device request names exactly the leased UUIDs;
results, time limits, warnings and cancel recorded as with the local runner."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import docker as sdk
import pytest

from gpubroker.jobs.service import JobService

from .. import dockerutil
from ..conftest import make_broker
from ..unit.test_jobs import run_until_done


@pytest.fixture
def jobs(
    db_url: str, tmp_path: Path, private_docker: dockerutil.PrivateDocker
) -> Iterator[JobService]:
    broker = make_broker(db_url)
    service = JobService(
        broker, broker.engine, run_as_self=True, runner="docker", poll_interval=0.2
    )
    service.root_dir_template = str(tmp_path / "home" / "{username}")
    engine = service._engine("docker")
    engine.docker_url, engine.image = private_docker.url, private_docker.image
    yield service
    engine.close()


def container_of(jobs: JobService, job_id: int, url: str) -> dict:
    with jobs.sessions() as session:
        handle_id = jobs._get(session, job_id).handle_id
    client = sdk.DockerClient(base_url=url)
    try:
        return dict(client.containers.get(handle_id).attrs)
    finally:
        client.close()


def test_a_container_job_gets_exactly_its_leased_gpus_and_its_result_is_recorded(
    jobs: JobService, tmp_path: Path, private_docker: dockerutil.PrivateDocker
) -> None:
    home = tmp_path / "home" / "ann"
    home.mkdir(parents=True)
    script = (
        'echo "$NVIDIA_VISIBLE_DEVICES" > seen.txt; echo "$CUDA_VISIBLE_DEVICES" >> seen.txt; '
        "sleep 2"
    )
    # a HOME of the user's choosing changes nothing the broker mounts
    job = jobs.submit("ann", {"command": script, "gpus": 2, "env": {"HOME": "/etc"}})
    asyncio.run(jobs.tick())
    assert jobs.get(job["id"])["state"] == "running"
    attrs = container_of(jobs, job["id"], private_docker.url)
    leased = [s["uuid"] for s in jobs.broker.get_lease(job["lease_id"])["slots"]]
    (request,) = attrs["HostConfig"]["DeviceRequests"]
    assert request["Driver"] == "nvidia" and request["DeviceIDs"] == leased
    assert request["Capabilities"] == [["gpu"]]
    assert attrs["HostConfig"]["NetworkMode"] == "none"
    assert attrs["HostConfig"]["CapDrop"] == ["ALL"]
    assert attrs["HostConfig"]["SecurityOpt"] == ["no-new-privileges"]
    assert [m["Source"] for m in attrs["Mounts"] if m["Destination"] == str(home)] == [str(home)]
    assert not [m for m in attrs["Mounts"] if m["Source"] == "/etc"]
    assert attrs["Config"]["Labels"]["gpubroker.lease"] == str(job["lease_id"])
    done = run_until_done(jobs, job["id"])
    assert done["state"] == "succeeded" and done["exit_code"] == 0, done
    with pytest.raises(sdk.errors.NotFound):  # removed once its end was read
        container_of(jobs, job["id"], private_docker.url)
    seen = (home / "seen.txt").read_text().split()
    assert seen == [",".join(leased)] * 2
    assert jobs.broker.get_lease(done["lease_id"])["state"] == "released"
    failed = run_until_done(jobs, jobs.submit("ann", {"command": "exit 3", "gpus": 1})["id"])
    assert (failed["state"], failed["exit_code"]) == ("failed", 3)


def test_a_container_job_is_warned_then_timed_out_and_cancel_stops_one(
    jobs: JobService, tmp_path: Path
) -> None:
    home = tmp_path / "home" / "bob"
    home.mkdir(parents=True)
    jobs.warn_before = 2.5
    script = "trap 'echo warned > warned.txt' USR1; while true; do sleep 0.1; done"
    job = jobs.submit("bob", {"command": script, "gpus": 1, "time": "4s"})
    done = run_until_done(jobs, job["id"])
    assert done["state"] == "timed-out", done
    assert (home / "warned.txt").read_text() == "warned\n"
    # a cancel's SIGTERM reaches the program, which may use its grace period
    jobs.stop_grace = 10
    script = "trap 'sleep 1; echo term > term.txt; exit 0' TERM; while true; do sleep 0.1; done"
    long = jobs.submit("bob", {"command": script, "gpus": 1})
    asyncio.run(jobs.tick())
    assert jobs.get(long["id"])["state"] == "running"
    cancelled = asyncio.run(jobs.cancel(long["id"], "cancelled by bob", "bob"))
    assert cancelled["state"] == "cancelled"
    assert (home / "term.txt").read_text() == "term\n"
    assert jobs.broker.get_lease(long["lease_id"])["state"] == "released"


def test_the_reconciliation_reads_containers_of_its_own_engine_only(
    private_docker: dockerutil.PrivateDocker,
) -> None:
    from gpubroker.engines.docker import DockerEngine

    engine = DockerEngine(docker_url=private_docker.url)
    client = sdk.DockerClient(base_url=private_docker.url)
    try:
        ended = client.containers.run(
            private_docker.image, ["/bin/sh", "-c", "exit 3"], network_mode="none", detach=True
        )
        ended.wait(timeout=30)
        running = client.containers.run(
            private_docker.image, ["/bin/sleep", "60"], network_mode="none", detach=True
        )
        here = engine.engine_id()
        gone = "0" * 64
        watched = {
            1: (ended.id, here),
            2: (running.id, here),
            3: (gone, None),  # told by a spawner that could not read the engine's ID
            4: (gone, "ANOTHER:ENGINE"),
        }
        found, elsewhere = engine.ended_containers(watched)
        assert found == {1: (ended.id, "exited with status 3")}
        assert elsewhere == [3, 4]
        found, _ = engine.ended_containers({5: (gone, here)})
        assert found == {5: (gone, "is gone from the Docker engine")}
        running.kill()
        running.wait(timeout=30)
        found, _ = engine.ended_containers({2: (running.id, here)})
        assert found == {2: (running.id, "was ended by signal SIGKILL")}
        # read only: nothing was removed
        assert client.containers.get(ended.id).status == "exited"
        ended.remove()
        running.remove()
    finally:
        client.close()
        engine.close()


def test_a_share_job_in_a_container_keeps_its_framework_caps(
    db_url: str, tmp_path: Path, private_docker: dockerutil.PrivateDocker
) -> None:
    """The caps' start-up hook is a host path: the container gets it mounted
    read-only at /opt/gpubroker/startup, and PYTHONPATH names that."""
    from gpubroker.engines.docker import STARTUP_PATH

    from ..unit.test_sharing_core import sharing_broker

    broker = sharing_broker(db_url, tmp_path)
    service = JobService(broker, broker.engine, run_as_self=True, runner="docker")
    service.root_dir_template = str(tmp_path / "home" / "{username}")
    engine = service._engine("docker")
    engine.docker_url, engine.image = private_docker.url, private_docker.image
    home = tmp_path / "home" / "ann"
    home.mkdir(parents=True)
    try:
        script = (
            'echo "$PYTHONPATH" > pp.txt; echo "$GPUBROKER_MEMORY_LIMIT_MIB" >> pp.txt; '
            f"cat {STARTUP_PATH}/sitecustomize.py > hook.py"
        )
        job = service.submit("ann", {"command": script, "memory_gib": 10, "pool": "shared"})
        done = run_until_done(service, job["id"])
        assert done["state"] == "succeeded", done
        lease = broker.get_lease(done["lease_id"])
        assert lease["kind"] == "share"
        path, limit = (home / "pp.txt").read_text().split()
        assert path == STARTUP_PATH and int(limit) == 10 * 1024 - 512
        from gpubroker.enforce.caps import STARTUP_DIR

        hook = Path(STARTUP_DIR) / "sitecustomize.py"
        assert (home / "hook.py").read_text() == hook.read_text()
    finally:
        engine.close()
