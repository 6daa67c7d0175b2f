"""A broker killed with SIGKILL loses nothing: the hub restarts the managed
service, which re-adopts every lease and queue entry from the store. Each
test runs on a SQLite store and on a PostgreSQL one (``either_hub``)."""

from __future__ import annotations

import datetime as dt
import itertools
import os
import signal
import threading
import time
from typing import Any

import requests
from sqlalchemy import select
from sqlalchemy.orm import Session

from gpubroker import state_check
from gpubroker.store.db import make_engine
from gpubroker.store.models import Lease, LeaseEvent
from gpubroker.store.repository import Repository

from ..hubutil import RunningHub
from .test_spawn import process_env, spawn, wait_until


def test_sigkilled_broker_restarts_with_every_lease_and_queue_entry(either_hub: RunningHub) -> None:
    hub = either_hub
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


def _client(hub: RunningHub, user: str, stop: threading.Event, seen: dict, errors: list) -> None:
    """Request and release one GPU in a loop as ``user``, riding out a broker
    restart: an operation that gets no answer is tried again until it does;
    after a request whose answer was lost, the user's own stray leases are
    released (so a retried request never leaves one behind)."""
    session = requests.Session()
    session.headers["Authorization"] = f"token {hub.token}"
    base = f"http://127.0.0.1:{hub.broker_port}/services/gpubroker/api/v1"

    def call(method: str, url: str, **kw: Any) -> requests.Response:
        deadline = time.monotonic() + 120
        while True:
            try:
                r = session.request(method, url, timeout=15, **kw)
                if r.status_code < 500:
                    return r
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{user}: no answer to {method} {url} in 120 s")
            time.sleep(0.2)

    body = {"user": user, "gpus": 1, "holder_kind": "external"}
    try:
        while not stop.is_set():
            try:
                r = session.post(f"{base}/leases", json=body, timeout=15)
            except requests.RequestException:
                r = None
            if r is None or r.status_code >= 500:  # lost: find what it made
                mine = call("GET", f"{base}/leases", params={"user": user}).json()["leases"]
                for lease in mine:
                    seen[lease["id"]] = "answered"
                    call("DELETE", f"{base}/leases/{lease['id']}").raise_for_status()
                    seen[lease["id"]] = "released"
                continue
            r.raise_for_status()
            lease = r.json()
            seen[lease["id"]] = "answered"
            call("DELETE", f"{base}/leases/{lease['id']}").raise_for_status()
            seen[lease["id"]] = "released"
    except BaseException as err:  # reported by the test
        errors.append(err)


def test_sigkill_under_64_clients_loses_nothing_and_grants_nothing_twice(
    either_hub: RunningHub,
) -> None:
    hub = either_hub
    stop = threading.Event()
    seen: dict[int, str] = {}
    errors: list[BaseException] = []
    threads = [
        threading.Thread(target=_client, args=(hub, f"loop{i}", stop, seen, errors))
        for i in range(64)
    ]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: len(seen) >= 100, timeout=60)
        old_pid = hub.broker_pid()
        assert old_pid
        os.kill(old_pid, signal.SIGKILL)
        wait_until(lambda: (pid := hub.broker_pid()) and pid != old_pid and pid, timeout=60)
        wait_until(lambda: hub.broker_api("GET", "/health").status_code == 200, timeout=30)
        answered_before = len(seen)
        wait_until(lambda: len(seen) >= answered_before + 100, timeout=60)
    finally:
        stop.set()
        for t in threads:
            t.join(150)
    assert errors == [] and not any(t.is_alive() for t in threads)  # every client answered
    # no lease lost: each one a client was told about is there, and released
    views = {i: hub.broker_api("GET", f"/leases/{i}").json() for i in seen}
    assert {v["state"] for v in views.values()} == {"released"}
    assert [x for x in hub.leases() if x["user"].startswith("loop")] == []
    # the transition log has no gap: each lease's log replays to its stored
    # state; and no device was ever held by two leases at once
    engine = make_engine(hub.db_url)
    with Session(engine) as session:
        ids = list(session.scalars(select(Lease.id).where(Lease.user.like("loop%"))))
        assert set(seen) <= set(ids)
        assert state_check.problems(Repository(lambda: session), ids) == []
        held: dict[str, list[tuple[dt.datetime, dt.datetime]]] = {}
        for lease_id in ids:
            rows = session.scalars(
                select(LeaseEvent).where(LeaseEvent.lease_id == lease_id).order_by(LeaseEvent.id)
            ).all()
            granted = [r for r in rows if r.kind == "granted"]
            if granted:
                released = next(r for r in rows if r.kind == "released")
                for slot in granted[0].detail["slots"]:
                    held.setdefault(slot, []).append((granted[0].at, released.at))
    engine.dispose()
    for slot, spans in held.items():
        spans.sort()
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert start >= end, f"{slot} held twice at {start}"
    assert sum(len(s) for s in held.values()) > 0


def test_a_sigkilled_broker_counts_a_lease_once_with_no_gap_beyond_the_heartbeat(
    either_hub: RunningHub,
) -> None:
    """The usage ledger across a crash: the interval open at the SIGKILL is
    closed at the last heartbeat (the ledger writes every 0.5 s here), the
    restarted broker counts on from its start, and the lease is one lease."""
    hub = either_hub
    lease = hub.broker_api(
        "POST", "/leases", json={"user": "ledgered", "gpus": 2, "holder_kind": "external"}
    ).json()
    granted = dt.datetime.fromisoformat(lease["granted_at"].replace("Z", "+00:00"))
    time.sleep(2.0)  # a few heartbeats
    old_pid = hub.broker_pid()
    assert old_pid
    killed = dt.datetime.now(dt.timezone.utc)
    os.kill(old_pid, signal.SIGKILL)
    wait_until(lambda: (pid := hub.broker_pid()) and pid != old_pid, timeout=60)
    wait_until(lambda: hub.broker_api("GET", "/health").status_code == 200, timeout=30)
    back = dt.datetime.now(dt.timezone.utc)
    time.sleep(1.0)
    released = hub.broker_api("DELETE", f"/leases/{lease['id']}").json()
    ended = dt.datetime.fromisoformat(released["released_at"].replace("Z", "+00:00"))
    (row,) = hub.broker_api("GET", "/usage", params={"user": "ledgered"}).json()["rows"]
    assert row["leases"] == 1
    held = row["gpu_hours_allocated"] * 3600 / 2  # seconds, per GPU
    before = (killed - granted).total_seconds()
    after = (ended - back).total_seconds()
    assert held <= (ended - granted).total_seconds() - 0.5  # the time it was down is not counted
    assert held >= before - 0.5 - 0.2 + after  # at most one heartbeat lost before the kill


def test_a_job_running_when_the_broker_is_sigkilled_is_adopted_and_runs_once(
    either_hub: RunningHub,
) -> None:
    """The job's process outlives the broker; the restarted broker adopts it
    (still running, its log goes on), learns its real outcome, and never
    starts it a second time."""
    hub = either_hub
    token = hub.create_user("survivor")
    home = hub.workdir / "home" / "survivor"
    home.mkdir(parents=True, exist_ok=True)
    script = "echo run >> runs.txt; echo before; sleep 6; echo after; exit 4"
    r = hub.broker_api("POST", "/jobs", json={"command": script, "gpus": 1}, token=token)
    assert r.status_code == 201, r.text
    job = r.json()
    wait_until(
        lambda: (
            hub.broker_api("GET", f"/jobs/{job['id']}", token=token).json()["state"] == "running"
        ),
        timeout=60,
    )
    old_pid = hub.broker_pid()
    assert old_pid
    os.kill(old_pid, signal.SIGKILL)
    wait_until(lambda: (pid := hub.broker_pid()) and pid != old_pid, timeout=60)
    wait_until(lambda: hub.broker_api("GET", "/health").status_code == 200, timeout=30)
    done = hub.wait_for_job(job["id"], token, timeout=90)
    assert (done["state"], done["exit_code"], done["restarts"]) == ("failed", 4, 0), done
    assert (home / "runs.txt").read_text() == "run\n"  # started once
    logs = hub.broker_api("GET", f"/jobs/{job['id']}/logs", token=token).json()["text"]
    assert "before" in logs and "after" in logs
    assert hub.broker_api("GET", f"/leases/{done['lease_id']}").json()["state"] == "released"
