"""The spawner through the shared real hub when things go wrong: a server
killed from outside gets its GPUs back on an immediate restart; spawns and
stops while the broker restarts neither blame the user nor lose a release;
saved options the spawner no longer accepts fall back to the default."""

from __future__ import annotations

import os
import signal
import threading

from ..hubutil import RunningHub
from .test_spawn import lease_of, process_env, spawn, wait_for_release, wait_until

RETRY_MESSAGE = "GPU broker restarting, retrying\u2026"


def test_a_killed_server_releases_at_once_and_restarts_on_the_same_gpu(
    clean_hub: RunningHub,
) -> None:
    hub = clean_hub
    hub.create_user("phoenix")
    assert spawn(hub, "phoenix", {"gpus": 1}).status_code in (201, 202)
    pid = hub.wait_for_server("phoenix")["state"]["pid"]
    first = lease_of(hub, "phoenix")
    os.kill(pid, signal.SIGKILL)

    # the hub polls every 2 s; the spawner's poll() releases, not reconciliation
    released = wait_for_release(hub, first["id"], timeout=10)
    assert released["release_reason"] == "server exited (status -9)"
    wait_until(lambda: hub.server("phoenix") is None, timeout=10)

    assert spawn(hub, "phoenix", {"gpus": 1}).status_code in (201, 202)
    model = hub.wait_for_server("phoenix")
    second = lease_of(hub, "phoenix")
    assert second["id"] != first["id"]
    assert second["devices"][0]["uuid"] == first["devices"][0]["uuid"]
    assert (
        process_env(model["state"]["pid"])["CUDA_VISIBLE_DEVICES"] == (first["devices"][0]["uuid"])
    )
    assert second["restarts"] == 1
    assert "gpu_restart_of" not in model["state"]


def test_spawn_and_stop_while_the_broker_restarts(clean_hub: RunningHub) -> None:
    hub = clean_hub
    hub.create_user("leaver")
    hub.create_user("arriver")
    assert spawn(hub, "leaver", {"gpus": 1}).status_code in (201, 202)
    hub.wait_for_server("leaver")
    held = lease_of(hub, "leaver")

    old_pid = hub.broker_pid()
    assert old_pid
    os.kill(old_pid, signal.SIGKILL)
    wait_until(lambda: hub.broker_pid() is None, timeout=10)

    # the broker is down: a stop and a GPU spawn through the hub
    stop = hub.api("DELETE", "/users/leaver/server")
    assert stop.status_code in (202, 204), stop.text
    answer = spawn(hub, "arriver", {"gpus": 1})
    assert answer.status_code == 202, answer.text  # not 400 "Invalid user options"
    # The 202 comes after the spawn has run for slow_spawn_timeout (3 s), so
    # its first call to the broker was made before it. When the broker is
    # still down now, that call found it down, and the user must be told.
    # (The hub polls its services every ~30 s: now and then it restarts the
    # broker within the second between the kill and the spawn, and the
    # spawn never sees the outage.)
    down_through_the_first_call = hub.broker_pid() is None
    events: list[dict] = []
    reader = threading.Thread(target=lambda: events.extend(hub.progress("arriver", timeout=90)))
    reader.start()

    # the hub restarts the broker (it polls its services every ~30 s)
    model = hub.wait_for_server("arriver", timeout=90)
    reader.join(30)
    messages = [e.get("message", "") for e in events]
    if down_through_the_first_call:
        assert RETRY_MESSAGE in messages, messages
    assert any(m.startswith("GPUs granted") for m in messages), messages
    lease = lease_of(hub, "arriver")
    assert lease["state"] == "granted"
    assert process_env(model["state"]["pid"])["CUDA_VISIBLE_DEVICES"] == lease["devices"][0]["uuid"]

    # the release made while the broker was down reached it once it was back ...
    wait_until(lambda: f"leaver: lease {held['id']} released after" in hub.log_tail(200_000))
    released = wait_for_release(hub, held["id"], timeout=30)
    # ... unless the broker's reconciliation at start-up, which sees the server
    # gone from the hub, released it a moment before: either way it is released
    assert released["release_reason"] in (
        "server stopped",
        "reconcile: server leaver/ is gone from the hub",
    )


def test_saved_options_no_longer_accepted_fall_back_to_the_default(clean_hub: RunningHub) -> None:
    hub = clean_hub
    hub.create_user("stuck")
    refused = spawn(hub, "stuck", {"gpus": 99})
    assert refused.status_code == 400  # JupyterHub saved these options anyway
    assert hub.user_model("stuck")["servers"] == {} or hub.server("stuck") is None

    answer = hub.api("POST", "/users/stuck/server", json={})  # {}: the saved options
    assert answer.status_code in (201, 202), answer.text
    model = hub.wait_for_server("stuck")
    assert process_env(model["state"]["pid"])["CUDA_VISIBLE_DEVICES"] == ""
    assert hub.leases(user="stuck") == []
    log = hub.log_tail(200_000)
    assert 'stuck: saved user_options {"gpus": 99} refused' in log
    assert model["user_options"] == {}
