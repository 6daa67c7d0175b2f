"""Slurm benchmarks (#16), on a real two-node cluster started here
(:mod:`gpubroker.engines.slurm_testbed`; needs root and ``slurm-wlm``):

- **spawn to running**: seconds from a spawn request to the hub (1 GPU,
  ``SlurmGPUSpawner``, the demo config on Slurm) until the server's Slurm
  job runs and has told its port, against a bare ``sbatch`` of the same
  batch script (the same launcher, then ``sleep``) until the same point;
  also to the hub's "ready", against the same bare figure. Median of
  ``ROUNDS`` alternating rounds.
- **lease throughput**: request/release pairs per second of a broker in
  this process whose inventory is the Slurm cluster's
  (``Broker.engine_kind = "slurm"``), against the same broker on the local
  engine with as many fake GPUs; ``PAIRS`` pairs each.

Without a cluster (not root, no Slurm) the figures are left out, saying why.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from gpubroker.engines import slurm_testbed
from gpubroker.engines.slurm_json import server_port

from . import fake_broker, figure

ROUNDS = 3
PAIRS = 500


def describe() -> str:
    return (
        "Slurm: spawn request to the server's job running, vs a bare sbatch of the same "
        f"script; lease pairs on the Slurm engine vs the local one ({PAIRS} pairs)"
    )


def _running_with_port(cluster: slurm_testbed.SlurmCluster, job: str) -> bool:
    jobs = json.loads(cluster.run("squeue", "--json").stdout).get("jobs") or []
    mine = [j for j in jobs if str(j["job_id"]) == job]
    if not mine or mine[0]["job_state"] != "RUNNING":
        return False
    return server_port(str(mine[0].get("comment") or "")) is not None


def _until(check: Any, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark step did not finish")
        time.sleep(0.02)


def _idle(cluster: slurm_testbed.SlurmCluster) -> None:
    """Wait until no job runs or completes (each round starts on an idle cluster)."""
    _until(lambda: not cluster.run("squeue", "-h", "-t", "R,CG,PD").stdout.strip())


def _bare(cluster: slurm_testbed.SlurmCluster, tmp: Path) -> float:
    """``sbatch`` of the server's script (launcher, then ``sleep``) until it
    runs and has told its port."""
    script = f"#!/bin/sh\nexec {sys.executable} -m gpubroker_spawner.slurm_server sleep 300\n"
    t0 = time.perf_counter()
    done = subprocess.run(
        ["sbatch", "--parsable", "--gres=gpu:1", "--nodelist=n1", f"--output={tmp}/bare.log"],
        input=script,
        env=cluster.env,
        capture_output=True,
        text=True,
        check=True,
    )
    job = done.stdout.strip().split(";")[0]
    _until(lambda: _running_with_port(cluster, job))
    elapsed = time.perf_counter() - t0
    cluster.run("scancel", job)
    _idle(cluster)
    return elapsed


def _spawned(hub: Any, cluster: slurm_testbed.SlurmCluster, user: str) -> tuple[float, float]:
    """(to the job running with its port, to the hub's ready) for one spawn."""
    hub.create_user(user)
    pool = ThreadPoolExecutor(1)  # the hub answers a spawn after slow_spawn_timeout (3 s)
    t0 = time.perf_counter()
    posted = pool.submit(hub.api, "POST", f"/users/{user}/server", json={"gpus": 1})
    job: list[str] = []

    def running() -> bool:
        if not job:
            leases = [x for x in hub.leases() if x["user"] == user]
            jobs = json.loads(cluster.run("squeue", "--json").stdout).get("jobs") or []
            names = {f"gpubroker-lease-{x['id']}" for x in leases}
            job.extend(str(j["job_id"]) for j in jobs if j["name"] in names)
        return bool(job) and _running_with_port(cluster, job[0])

    _until(running)
    to_running = time.perf_counter() - t0
    _until(lambda: (hub.server(user) or {}).get("ready"))
    to_ready = time.perf_counter() - t0
    posted.result().raise_for_status()
    pool.shutdown()
    hub.api("DELETE", f"/users/{user}/server")
    _until(lambda: hub.server(user) is None)
    _idle(cluster)
    return to_running, to_ready


def _pairs_per_second(broker: Any) -> float:
    started = time.perf_counter()
    for _ in range(PAIRS):
        lease = broker.request_lease("bench", "", gpus=1, holder_kind="external")
        broker.release_lease(lease["id"], "bench")
    return 2 * PAIRS / (time.perf_counter() - started)


def _slurm_broker(cluster: slurm_testbed.SlurmCluster, tmp: str) -> tuple[Any, Any]:
    from traitlets.config import Config

    from gpubroker.core import Broker
    from gpubroker.devices.fake import FakeDeviceBackend
    from gpubroker.store.db import make_engine, make_session_factory, upgrade

    url = f"sqlite:///{tmp}/slurm-broker.sqlite"
    upgrade(url)
    engine = make_engine(url)
    config = Config()
    config.Broker.engine_kind = "slurm"
    config.SlurmEngine.slurm_conf = str(cluster.conf)
    broker = Broker(
        session_factory=make_session_factory(engine),
        backend=FakeDeviceBackend(inventory=[]),
        config=config,
    )
    broker.check_state = "off"
    broker.sync_inventory()
    broker.adopt()
    return broker, engine


def _throughput(cluster: slurm_testbed.SlurmCluster) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        slurm, slurm_engine = _slurm_broker(cluster, tmp)
        local, local_engine = fake_broker(tmp)
        try:
            return _pairs_per_second(slurm), _pairs_per_second(local)
        finally:
            for broker, engine in ((slurm, slurm_engine), (local, local_engine)):
                broker._world.close()
                engine.dispose()


def run() -> dict[str, dict[str, Any]]:
    """The figures, or none (with the reason printed) without a cluster."""
    reason = slurm_testbed.why_not()
    if reason:
        print(f"  Slurm benchmarks left out: {reason}")
        return {}
    from tests.hubutil import RunningHub

    cluster = slurm_testbed.start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            hub = RunningHub(
                Path(tmp) / "hub",
                GPUBROKER_DEMO_SLURM_CONF=str(cluster.conf),
                GPUBROKER_DEMO_CHECK_STATE="off",
                GPUBROKER_DEMO_LEDGER_INTERVAL="10",
            ).start()
            try:
                bare, running, ready = [], [], []
                for i in range(ROUNDS):
                    bare.append(_bare(cluster, Path(tmp)))
                    to_running, to_ready = _spawned(hub, cluster, f"bench{i}")
                    running.append(to_running)
                    ready.append(to_ready)
            finally:
                hub.stop()
        slurm_rps, local_rps = _throughput(cluster)
    finally:
        cluster.stop()
    base = statistics.median(bare)
    name = "bare sbatch of the same script, to running with its port"
    return {
        "slurm.spawn_to_job_running": figure(statistics.median(running), "s", base, name),
        "slurm.spawn_to_server_ready": figure(statistics.median(ready), "s", base, name),
        "slurm.lease_pair_throughput": figure(
            slurm_rps, "requests/s", local_rps, "the same broker on the local engine"
        ),
    }


if __name__ == "__main__":
    for key, value in run().items():
        print(key, value)
