"""A launch is found again by its tag on a real Docker engine (the
container's name) and a real Slurm cluster (the job's comment), so a broker
that crashed between launching a job and recording it adopts it instead of
running it twice."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpubroker.engines import EngineError, Handle, LaunchSpec
from gpubroker.engines.slurm import SlurmEngine
from gpubroker.jobs.service import JobService

from .. import dockerutil
from ..conftest import make_broker
from ..slurmutil import SlurmCluster
from ..unit.test_jobs import run_until_done
from ..unit.test_jobs_review import Crash, crash_after_launch


def docker_jobs(db_url: str, home: Path, url: str, image: str) -> JobService:
    broker = make_broker(db_url)
    service = JobService(
        broker, broker.engine, run_as_self=True, runner="docker", poll_interval=0.2
    )
    service.root_dir_template = str(home / "{username}")
    engine = service._engine("docker")
    engine.docker_url, engine.image = url, image
    return service


def test_a_container_launched_before_a_crash_is_adopted_not_run_twice(
    db_url: str,
    tmp_path: Path,
    private_docker: dockerutil.PrivateDocker,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    home = tmp_path / "home"
    (home / "ann").mkdir(parents=True)
    first = docker_jobs(db_url, home, private_docker.url, private_docker.image)
    job = first.submit("ann", {"command": "echo run >> runs.txt; sleep 2; exit 5", "gpus": 1})
    crash_after_launch(first, monkeypatch)
    with pytest.raises(Crash):
        asyncio.run(first.tick())
    second = docker_jobs(db_url, home, private_docker.url, private_docker.image)
    try:
        asyncio.run(second.tick())
        view = second.get(job["id"])
        assert view["state"] == "running", view["reason"]
        with second.sessions() as session:
            handle_id = second._get(session, job["id"]).handle_id
        client = second._engine("docker").client()
        assert client.containers.get(handle_id).name.startswith(f"gpubroker-job{job['id']}-")
        done = run_until_done(second, job["id"])
        assert done["state"] == "failed" and done["exit_code"] == 5, done["reason"]
        assert (home / "ann" / "runs.txt").read_text() == "run\n"
    finally:
        first._engine("docker").close()
        second._engine("docker").close()


@pytest.fixture
def slurm_engine(slurm_cluster: SlurmCluster) -> Iterator[SlurmEngine]:
    made = SlurmEngine(slurm_conf=str(slurm_cluster.conf), partition="batch")
    yield made
    slurm_cluster.run("scancel", "--full", "--user=root", check=False)


@pytest.mark.slurm
def test_a_slurm_job_is_found_by_its_launch_tag_from_a_new_engine(
    slurm_engine: SlurmEngine, tmp_path: Path
) -> None:
    spec = LaunchSpec(
        argv=("/bin/sh", "-c", "sleep 30"),
        env={"PATH": "/usr/bin:/bin"},
        cwd=str(tmp_path),
        user="root",
        lease_id=9,
        stdout=str(tmp_path / "out.log"),
        stderr=str(tmp_path / "out.log"),
        tag="job3-0-abcd",
    )
    handle = slurm_engine.launch(spec)
    again = SlurmEngine(slurm_conf=slurm_engine.slurm_conf, partition="batch")
    found = again.find("job3-0-abcd", "root")
    assert isinstance(found, Handle) and found.id == handle.id
    assert again.find("job3-0-other", "root") is None
    with pytest.raises(EngineError, match="not 'nobody'"):
        again.find("job3-0-abcd", "nobody")
    again.stop(found, 1.0)
    deadline = time.monotonic() + 30
    while again.poll(found).running and time.monotonic() < deadline:
        time.sleep(0.3)
    assert not again.poll(found).running
