"""A broker killed with SIGKILL loses nothing: the hub restarts the managed
service, which re-adopts every lease and queue entry from the store."""

from __future__ import annotations

import os
import signal
import time

from ..hubutil import RunningHub
from .test_spawn import process_env, spawn, wait_until


def test_sigkilled_broker_restarts_with_every_lease_and_queue_entry(clean_hub: RunningHub) -> None:
    hub = clean_hub
    held = []
    for i in range(7):
        r = hub.broker_api(
            "POST", "/leases", json={"user": f"h{i}", "gpus": 1, "holder_kind": "external"}
        )
        held.append(r.json())
    hub.create_user("rita")
    assert spawn(hub, "rita", {"gpus": 1}).status_code in (201, 202)
    rita_env = process_env(hub.wait_for_server("rita")["state"]["pid"])
    hub.create_user("sam")
    assert spawn(hub, "sam", {"gpus": 1}).status_code == 202  # waits: 8 of 8 held
    queued = []
    for i in range(2):
        r = hub.broker_api(
            "POST", "/leases", json={"user": f"q{i}", "gpus": 2, "holder_kind": "external"}
        )
        queued.append(r.json())
    wait_until(lambda: [x for x in hub.leases(user="sam") if x["state"] == "pending"])
    before = sorted(hub.leases(), key=lambda x: x["id"])
    assert [x["state"] for x in before].count("pending") == 3

    old_pid = hub.broker_pid()
    assert old_pid
    os.kill(old_pid, signal.SIGKILL)
    new_pid = wait_until(lambda: (pid := hub.broker_pid()) and pid != old_pid and pid, timeout=60)
    assert new_pid != old_pid
    wait_until(lambda: hub.broker_api("GET", "/health").status_code == 200, timeout=30)

    after = sorted(hub.leases(), key=lambda x: x["id"])
    assert after == before
    granted = [d["uuid"] for x in after for d in x["devices"]]
    assert len(granted) == len(set(granted)) == 8
    assert rita_env["CUDA_VISIBLE_DEVICES"] in granted

    # the waiting spawn rode out the restart: a freed device reaches it
    hub.broker_api("DELETE", f"/leases/{held[0]['id']}")
    sam = hub.wait_for_server("sam")
    assert process_env(sam["state"]["pid"])["CUDA_VISIBLE_DEVICES"] == held[0]["devices"][0]["uuid"]
    time.sleep(0.1)
