"""Ways out of a spawn that must release the lease, and a hub restart that
must keep it. A hub of its own: the spawner's queue time-out is 4 s, servers
survive a hub restart, and user "broken" gets a command that does not exist."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ..hubutil import RunningHub
from .test_spawn import fill_with_external_leases, lease_of, spawn, wait_for_release, wait_until

EXTRA_CONFIG = """
c.SimpleLocalGPUSpawner.queue_timeout = 4
c.JupyterHub.cleanup_servers = False

def break_some(spawner):
    if spawner.user.name == "broken":
        spawner.cmd = ["/nonexistent/jupyterhub-singleuser"]

c.Spawner.pre_spawn_hook = break_some
"""


@pytest.fixture(scope="module")
def strict_hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningHub]:
    workdir: Path = tmp_path_factory.mktemp("strict-hub")
    extra = workdir / "extra_config.py"
    extra.write_text(EXTRA_CONFIG)
    hub = RunningHub(
        workdir, GPUBROKER_DEMO_EXTRA_CONFIG=str(extra), GPUBROKER_DEMO_RECONCILE_INTERVAL="1"
    ).start()
    yield hub
    hub.stop()
    hub.kill_kept_servers()


def test_start_failing_after_the_grant_releases_the_lease(strict_hub: RunningHub) -> None:
    hub = strict_hub
    hub.create_user("broken")
    spawn(hub, "broken", {"gpus": 1})
    (lease,) = wait_until(lambda: hub.leases(user="broken", state="all"))
    released = wait_for_release(hub, lease["id"])
    assert released["release_reason"] in ("server failed to start", "server stopped")
    assert hub.server("broken") is None


def test_spawn_waiting_longer_than_queue_timeout_withdraws_its_request(
    strict_hub: RunningHub,
) -> None:
    hub = strict_hub
    blockers = fill_with_external_leases(hub)
    hub.create_user("patient")
    assert spawn(hub, "patient", {"gpus": 1}).status_code == 202
    (lease,) = wait_until(lambda: hub.leases(user="patient"))
    assert lease["state"] == "pending"
    released = wait_for_release(hub, lease["id"], timeout=30)
    assert "spawn failed or was cancelled" in released["release_reason"]
    wait_until(lambda: hub.server("patient") is None, timeout=30)
    for blocker in blockers:
        hub.broker_api("DELETE", f"/leases/{blocker['id']}")


def test_hub_restart_keeps_the_running_server_and_its_lease(strict_hub: RunningHub) -> None:
    hub = strict_hub
    hub.create_user("stay")
    assert spawn(hub, "stay", {"gpus": 1}).status_code in (201, 202)
    pid = hub.wait_for_server("stay")["state"]["pid"]
    lease = lease_of(hub, "stay")

    hub.stop(keep_servers=True)
    hub.start()
    model = hub.wait_for_server("stay")
    assert model["state"]["pid"] == pid
    assert model["state"]["gpu_lease_id"] == lease["id"]
    hub.wait_for_reconciliations(3)  # the lease must survive the reconciliation
    assert hub.broker_api("GET", f"/leases/{lease['id']}").json()["state"] == "granted"

    hub.api("DELETE", "/users/stay/server")
    assert wait_for_release(hub, lease["id"])["release_reason"] == "server stopped"
