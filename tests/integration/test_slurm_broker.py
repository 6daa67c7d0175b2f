"""The broker on the Slurm engine, against the real two-node cluster
(tests/slurmutil.py): its inventory is Slurm's, GPUs that jobs from outside
hold and drained nodes take no grants, and jobs run as Slurm jobs whose
bound GPUs the lease records."""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from traitlets.config import Config

from gpubroker.core import Broker
from gpubroker.devices.fake import FakeDeviceBackend
from gpubroker.jobs.service import JobService
from gpubroker.model import jobs as model
from gpubroker.store.db import make_engine, make_session_factory
from gpubroker.views import device_listing

from ..slurmutil import SlurmCluster

pytestmark = pytest.mark.slurm


@pytest.fixture
def broker(db_url: str, slurm_cluster: SlurmCluster) -> Iterator[Broker]:
    config = Config()
    config.Broker.engine_kind = "slurm"
    config.Broker.check_state = "raise"
    config.SlurmEngine.slurm_conf = str(slurm_cluster.conf)
    config.SlurmEngine.partition = "batch"
    made = Broker(
        session_factory=make_session_factory(make_engine(db_url)),
        backend=FakeDeviceBackend(inventory=[]),
        config=config,
    )
    made.sync_inventory()
    made.adopt()
    yield made
    slurm_cluster.run("scancel", "--full", "--user=root", check=False)
    slurm_cluster.run("scontrol", "update", "nodename=n1,n2", "state=resume", check=False)
    deadline = time.monotonic() + 30
    while slurm_cluster.run("squeue", "-h").stdout.strip() and time.monotonic() < deadline:
        time.sleep(0.3)


def _nodes_of(broker: Broker, lease: dict[str, Any]) -> set[str]:
    devices = {d["uuid"]: d for d in device_listing(broker, True, "admin", logging)["devices"]}
    return {devices[s["device"]]["node"] for s in lease["slots"]}


def _ask(broker: Broker, user: str, gpus: int) -> dict[str, Any]:
    return broker.request_lease(user, "", gpus=gpus, holder_kind="external")


def _jobs(broker: Broker, home: Path, **more: Any) -> JobService:
    made = JobService(
        broker, broker.engine, run_as_self=True, poll_interval=0.2, runner="slurm", **more
    )
    made.root_dir_template = str(home / "{username}")
    (home / "ann").mkdir(parents=True, exist_ok=True)
    return made


def _ticks(jobs: JobService, job_id: int, until: Any, timeout: float = 80) -> dict[str, Any]:
    """Tick the jobs service until ``until(view)`` holds; the job's view."""

    async def run() -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            await jobs.tick()
            view = jobs.get(job_id)
            if until(view):
                return view
            await asyncio.sleep(0.2)
        raise AssertionError(f"job not there after {timeout}s: {jobs.get(job_id)}")

    return asyncio.run(run())


def _final(view: dict[str, Any]) -> bool:
    return view["state"] in model.FINAL


def test_the_inventory_is_slurms_nodes_and_gpus(broker: Broker) -> None:
    listing = device_listing(broker, True, "admin", logging)
    devices = listing["devices"]
    assert sorted({d["node"] for d in devices}) == ["n1", "n2"]
    assert len(devices) == 8
    assert all(d["state"] == "free" and d["outside"] is None for d in devices)
    assert all(d["usage"] is None for d in devices)  # Slurm reports no GPU use


def test_gpus_a_job_from_outside_holds_are_never_granted(
    broker: Broker, slurm_cluster: SlurmCluster
) -> None:
    theirs = slurm_cluster.run(
        "sbatch", "--parsable", "-w", "n1", "--gres=gpu:3", "-o", "/dev/null", "--wrap", "sleep 120"
    ).stdout.strip()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        broker.sync_inventory()
        held = [
            d for d in device_listing(broker, True, "admin", logging)["devices"] if d["outside"]
        ]
        if len(held) == 3:
            break
        time.sleep(0.5)
    assert {d["state"] for d in held} == {"outside"}
    assert {d["outside"] for d in held} == {f"held by Slurm job {theirs} of root"}
    first, second = _ask(broker, "ann", 2), _ask(broker, "bob", 2)
    assert first["state"] == second["state"] == "granted"
    assert _nodes_of(broker, first) == _nodes_of(broker, second) == {"n2"}
    third = _ask(broker, "cy", 2)
    assert third["state"] == "pending"  # n1 has one GPU the broker may grant
    slurm_cluster.run("scancel", theirs)
    deadline = time.monotonic() + 30
    while broker.get_lease(third["id"])["state"] != "granted" and time.monotonic() < deadline:
        time.sleep(0.5)
        broker.sync_inventory()
    granted = broker.get_lease(third["id"])
    assert granted["state"] == "granted" and _nodes_of(broker, granted) == {"n1"}


def test_a_node_drained_in_slurm_takes_no_grants_and_keeps_its_leases(
    broker: Broker, slurm_cluster: SlurmCluster
) -> None:
    on_n2 = [_ask(broker, "ann", 4), _ask(broker, "bob", 4)]
    n2 = next(lease for lease in on_n2 if _nodes_of(broker, lease) == {"n2"})
    broker.release_lease(next(x for x in on_n2 if x is not n2)["id"], "done")
    slurm_cluster.run("scontrol", "update", "nodename=n1", "state=drain", "reason=firmware")
    broker.sync_inventory()
    devices = device_listing(broker, True, "admin", logging)["devices"]
    n1 = [d for d in devices if d["node"] == "n1"]
    assert {d["state"] for d in n1} == {"outside"}
    assert {d["outside"] for d in n1} == {"node n1 is drained: firmware"}
    waiting = _ask(broker, "cy", 1)
    assert waiting["state"] == "pending"
    assert broker.get_lease(n2["id"])["state"] == "granted"
    slurm_cluster.run("scontrol", "update", "nodename=n1", "state=resume")
    deadline = time.monotonic() + 30
    while broker.get_lease(waiting["id"])["state"] != "granted" and time.monotonic() < deadline:
        time.sleep(0.5)
        broker.sync_inventory()
    assert broker.get_lease(waiting["id"])["state"] == "granted"


def test_a_job_runs_as_a_slurm_job_and_its_lease_records_the_gpus_slurm_bound(
    broker: Broker, tmp_path: Path
) -> None:
    """A lease the broker granted outside Slurm holds a GPU in the broker's
    books only; a second fills the other node. Slurm binds the job to the
    first free GPU in its own books, the one the broker gave the first
    lease: the two leases swap, and the job's lease records what Slurm
    bound (what the job's CUDA_VISIBLE_DEVICES says)."""
    home = tmp_path / "home"
    jobs = JobService(broker, broker.engine, run_as_self=True, poll_interval=0.2, runner="slurm")
    jobs.root_dir_template = str(home / "{username}")
    (home / "ann").mkdir(parents=True)
    blocker = _ask(broker, "bob", 1)
    filler = _ask(broker, "bob", 4)
    node = _nodes_of(broker, blocker).pop()
    assert _nodes_of(broker, filler) != {node}
    devices = {d["uuid"]: d for d in device_listing(broker, True, "admin", logging)["devices"]}
    blocked = blocker["slots"][0]["device"]
    script = "echo $CUDA_VISIBLE_DEVICES $SLURMD_NODENAME > seen.txt; sleep 4"
    job = jobs.submit("ann", {"command": ["/bin/sh", "-c", script], "gpus": 1, "time": "5m"})
    first = jobs.broker.get_lease(job["lease_id"])
    assert first["state"] == "granted"
    given = first["slots"][0]["device"]

    async def run() -> dict[str, Any]:
        for _ in range(400):
            await jobs.tick()
            view = jobs.get(job["id"])
            if view["state"] in model.FINAL:
                return view
            await asyncio.sleep(0.2)
        raise AssertionError(f"job still {jobs.get(job['id'])}")

    done = asyncio.run(run())
    assert done["state"] == "succeeded", done
    index, ran_on = (home / "ann" / "seen.txt").read_text().split()
    assert ran_on == node
    assert int(index) == devices[blocked]["index"]  # Slurm: the first free in its books
    lease = broker.get_lease(done["lease_id"])
    assert [s["device"] for s in lease["slots"]] == [blocked]
    assert [s["device"] for s in broker.get_lease(blocker["id"])["slots"]] == [given]
    kinds = [e["kind"] for e in broker.lease_events(done["lease_id"])]
    assert "rebound" in kinds and "job-started" in kinds
    assert "rebound" in [e["kind"] for e in broker.lease_events(blocker["id"])]
    for other in (blocker, filler):
        broker.release_lease(other["id"], "done")


def test_a_failing_squeue_ends_nothing_and_the_job_is_followed_when_slurm_answers(
    broker: Broker, tmp_path: Path
) -> None:
    jobs = _jobs(broker, tmp_path / "home")
    script = "while [ ! -e go ]; do sleep 0.2; done; echo done > out.txt"
    job = jobs.submit("ann", {"command": ["/bin/sh", "-c", script], "gpus": 1, "time": "5m"})
    _ticks(jobs, job["id"], lambda v: v["state"] == "running")
    broken = tmp_path / "bin"
    broken.mkdir()
    (broken / "squeue").write_text(
        "#!/bin/sh\necho 'Unable to contact slurm controller' >&2\nexit 1\n"
    )
    (broken / "squeue").chmod(0o755)
    engine = broker.engine
    engine.bin_dir = str(broken)  # type: ignore[attr-defined]
    try:
        for _ in range(5):
            asyncio.run(jobs.tick())
            time.sleep(0.2)
        assert jobs.get(job["id"])["state"] == "running"
        assert broker.get_lease(job["lease_id"])["state"] == "granted"
    finally:
        engine.bin_dir = ""  # type: ignore[attr-defined]
    (tmp_path / "home" / "ann" / "go").touch()
    done = _ticks(jobs, job["id"], _final)
    assert done["state"] == "succeeded", done
    assert (tmp_path / "home" / "ann" / "out.txt").read_text() == "done\n"
    assert broker.get_lease(job["lease_id"])["state"] == "released"


def test_a_job_slurm_queued_although_sbatch_failed_runs_once_on_its_lease(
    broker: Broker, tmp_path: Path
) -> None:
    # sbatch exits 1 ("Socket timed out on send/recv operation": slurmctld's
    # answer was lost) with the job queued (nextflow-io/nextflow#970): the
    # job must not be failed with its lease released while it runs
    lossy = tmp_path / "bin"
    lossy.mkdir()
    real = shutil.which("sbatch")
    (lossy / "sbatch").write_text(
        f'#!/bin/sh\n"{real}" "$@" > /dev/null\n'
        "echo 'sbatch: error: Batch job submission failed: Socket timed out on send/recv "
        "operation' >&2\nexit 1\n"
    )
    (lossy / "sbatch").chmod(0o755)
    for name in ("squeue", "sacct", "scancel", "scontrol", "sinfo"):  # bin_dir serves them all
        (lossy / name).symlink_to(shutil.which(name) or name)
    jobs = _jobs(broker, tmp_path / "home")
    engine = broker.engine
    engine.bin_dir = str(lossy)  # type: ignore[attr-defined]
    try:
        job = jobs.submit("ann", {"command": ["sh", "-c", "echo ran >> runs.txt"], "gpus": 1})
        done = _ticks(jobs, job["id"], _final)
    finally:
        engine.bin_dir = ""  # type: ignore[attr-defined]
    assert done["state"] == "succeeded", done
    assert (tmp_path / "home" / "ann" / "runs.txt").read_text() == "ran\n"
    assert broker.get_lease(job["lease_id"])["state"] == "released"


def test_a_job_slurm_will_never_start_fails_at_once_saying_why(
    broker: Broker, slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    # the partition's MaxTime is 1 minute and the job asks 5: Slurm 22.05
    # (EnforcePartLimits=NO) queues it PENDING (PartitionTimeLimit) for ever
    slurm_cluster.run("scontrol", "update", "PartitionName=batch", "MaxTime=1")
    try:
        jobs = _jobs(broker, tmp_path / "home")
        job = jobs.submit("ann", {"command": ["sleep", "1"], "gpus": 1, "time": "5m"})
        done = _ticks(jobs, job["id"], _final, timeout=30)
    finally:
        slurm_cluster.run("scontrol", "update", "PartitionName=batch", "MaxTime=INFINITE")
    assert done["state"] == "failed", done
    # Slurm says PartitionConfig first, PartitionTimeLimit later: both hopeless
    assert done["reason"].startswith("its engine will never start it: PENDING (Partition")
    assert done["reason"].endswith("(partition, account, QOS, time limit)")
    assert broker.get_lease(job["lease_id"])["state"] == "released"
    assert slurm_cluster.run("squeue", "-h").stdout.strip() == ""


def test_scancel_from_outside_ends_the_job_and_releases_its_lease(
    broker: Broker, slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    jobs = _jobs(broker, tmp_path / "home")
    job = jobs.submit("ann", {"command": ["sleep", "120"], "gpus": 2, "time": "5m"})
    _ticks(jobs, job["id"], lambda v: v["state"] == "running")
    listed = slurm_cluster.run("squeue", "-h", "-o", "%j %i").stdout.split()
    slurm_id = listed[listed.index(f"gpubroker-lease-{job['lease_id']}") + 1]
    slurm_cluster.run("scancel", slurm_id)
    done = _ticks(jobs, job["id"], _final, timeout=30)
    assert done["state"] == "failed" and done["signal"] == 15, done
    assert broker.get_lease(job["lease_id"])["state"] == "released"


def test_a_job_near_its_time_limit_gets_the_warning_signal_first(
    broker: Broker, tmp_path: Path
) -> None:
    jobs = _jobs(broker, tmp_path / "home", warn_before=60.0)
    script = "trap 'echo warned > warned.txt; exit 0' USR1; while :; do sleep 0.2; done"
    job = jobs.submit("ann", {"command": ["/bin/sh", "-c", script], "gpus": 1, "time": "62s"})
    done = _ticks(jobs, job["id"], _final, timeout=60)
    assert done["state"] == "succeeded", done
    assert (tmp_path / "home" / "ann" / "warned.txt").read_text() == "warned\n"
    kinds = [e["kind"] for e in broker.lease_events(done["lease_id"])]
    assert "job-warned" in kinds


def test_a_broker_restarted_while_a_slurm_job_runs_adopts_it_and_runs_it_once(
    broker: Broker, db_url: str, slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    jobs = _jobs(broker, home)
    script = "echo run >> runs.txt; while [ ! -e go ]; do sleep 0.2; done"
    job = jobs.submit("ann", {"command": ["/bin/sh", "-c", script], "gpus": 1, "time": "5m"})
    _ticks(jobs, job["id"], lambda v: v["state"] == "running")
    config = Config()
    config.Broker.engine_kind = "slurm"
    config.SlurmEngine.slurm_conf = str(slurm_cluster.conf)
    again = Broker(
        session_factory=make_session_factory(make_engine(db_url)),
        backend=FakeDeviceBackend(inventory=[]),
        config=config,
    )
    again.sync_inventory()
    again.adopt()
    later = _jobs(again, home)
    assert later.get(job["id"])["state"] == "running"
    (home / "ann" / "go").touch()
    done = _ticks(later, job["id"], _final)
    assert done["state"] == "succeeded", done
    assert (home / "ann" / "runs.txt").read_text() == "run\n"
    assert again.get_lease(job["lease_id"])["state"] == "released"
