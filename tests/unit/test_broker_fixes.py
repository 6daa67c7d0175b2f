"""Broker-side fixes of the security and correctness issue (#10): restarts,
MIG-mode devices outside MIG pools, queue positions per pool, every holder
of a shared device, the MIG count hint, the writer lock and a private store.
Real SQLite store; only the GPUs are simulated."""

from __future__ import annotations

import datetime as dt
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from gpubroker.api import validation
from gpubroker.core import Broker
from gpubroker.culler import Signals, Track, judge, kernel_list, parse_time
from gpubroker.devices import mig
from gpubroker.devices.fake import FakeDeviceBackend
from gpubroker.enforce.mps import MPSControl
from gpubroker.errors import BadRequest
from gpubroker.store.db import make_engine, make_session_factory, upgrade
from gpubroker.store.lock import DatabaseLocked, WriterLock, describe_self

from ..conftest import make_broker
from .test_sharing_core import sharing_broker


def mig_on(backend: FakeDeviceBackend, uuid: str) -> bool:
    return next(d for d in backend.devices() if d.uuid == uuid).mig_enabled


def uuids(lease: dict) -> list[str]:
    return [d["uuid"] for d in lease["devices"]]


# -- restarts ---------------------------------------------------------------------------


def test_a_restart_counts_and_gets_its_devices_back(broker: Broker) -> None:
    first = broker.request_lease("ann", "", gpus=1)
    second = broker.request_lease("bob", "", gpus=1)
    broker.request_lease("cat", "", gpus=1)
    broker.release_lease(second["id"], "server exited (status -9)")
    broker.release_lease(first["id"], "server stopped")
    # best fit alone would give bob ann's lower-numbered device
    again = broker.request_lease("bob", "", gpus=1, restart_of=second["id"])
    assert again["state"] == "granted"
    assert uuids(again) == uuids(second)
    assert (again["restarts"], again["restart_of"]) == (1, second["id"])
    twice = broker.request_lease("bob", "x", gpus=1)
    assert twice["restarts"] == 0


def test_a_restart_replaces_a_lease_whose_release_was_lost(broker: Broker) -> None:
    first = broker.request_lease("ann", "", gpus=2)
    with pytest.raises(Exception, match="already has active lease"):
        broker.request_lease("ann", "", gpus=2)
    dry = broker.request_lease("ann", "", gpus=2, restart_of=first["id"], dry_run=True)
    assert dry["admitted"] is True
    assert broker.get_lease(first["id"])["state"] == "granted"  # a dry run changes nothing
    again = broker.request_lease("ann", "", gpus=2, restart_of=first["id"])
    old = broker.get_lease(first["id"])
    assert (old["state"], old["release_reason"]) == ("released", "server restarted")
    assert uuids(again) == uuids(first) and again["restarts"] == 1
    third = broker.request_lease("ann", "", gpus=2, restart_of=again["id"])
    assert third["restarts"] == 2


def test_restart_of_must_name_a_lease_of_the_same_server(broker: Broker) -> None:
    theirs = broker.request_lease("ann", "", gpus=1)
    for user, server in (("bob", ""), ("ann", "other")):
        with pytest.raises(BadRequest, match="restart_of: lease"):
            broker.request_lease(user, server, gpus=1, restart_of=theirs["id"])
    with pytest.raises(BadRequest, match="restart_of: lease 999"):
        broker.request_lease("ann", "", gpus=1, restart_of=999)
    assert broker.get_lease(theirs["id"])["state"] == "granted"


def test_a_restart_takes_other_devices_when_its_own_are_taken(broker: Broker) -> None:
    first = broker.request_lease("ann", "", gpus=1)
    broker.release_lease(first["id"], "server exited (status 1)")
    taken = broker.request_lease("bob", "", gpus=1)
    assert uuids(taken) == uuids(first)
    again = broker.request_lease("ann", "", gpus=1, restart_of=first["id"])
    assert again["state"] == "granted" and uuids(again) != uuids(first)


# -- MIG mode outside MIG pools ------------------------------------------------------


def test_a_device_in_mig_mode_is_never_granted_whole(db_url: str, tmp_path: Path) -> None:
    sharing = sharing_broker(db_url, tmp_path)  # GPUs 0-1 in MIG mode, in a MIG pool
    held = sharing.request_lease("ann", "", mig_profile="1g.10gb", pool="mig")
    assert held["state"] == "granted"
    gpu = held["devices"][0]["uuid"]
    # the admin goes back to whole GPUs, keeping the state (store and fake GPUs)
    backend = FakeDeviceBackend(
        inventory=["8 x H100"], node_name="node-a", state_file=str(tmp_path / "fake-gpus.json")
    )
    assert mig_on(backend, gpu)
    whole = Broker(session_factory=make_session_factory(make_engine(db_url)), backend=backend)
    whole.sync_inventory()
    whole.adopt()
    eight = whole.request_lease("bob", "", gpus=8)
    assert eight["state"] == "pending"  # not on devices in MIG mode
    six = whole.request_lease("cat", "", gpus=6)
    assert six["state"] == "granted"
    assert not {d["uuid"] for d in six["devices"]} & {gpu}
    # once the MIG lease ends, MIG mode goes off and the device serves whole
    whole.release_lease(held["id"], "done")
    whole.release_lease(six["id"], "done")
    whole.housekeep_mig()
    assert not mig_on(backend, gpu)
    assert whole.get_lease(eight["id"])["state"] == "granted"
    assert gpu in uuids(whole.get_lease(eight["id"]))


# -- queue positions and holders ---------------------------------------------------------


def test_queue_position_counts_only_competing_requests(db_url: str, tmp_path: Path) -> None:
    broker = sharing_broker(db_url, tmp_path)
    # fill the whole devices (2-7 are not MIG: 2-3 shared, 4-7 exclusive)
    assert broker.request_lease("h", "", gpus=4)["state"] == "granted"
    for i in range(14):
        broker.request_lease(f"m{i}", "", mig_profile="1g.10gb", pool="mig")
    waiting_mig = [broker.request_lease(f"w{i}", "", mig_profile="1g.10gb") for i in range(2)]
    assert [x["queue"]["position"] for x in waiting_mig] == [1, 2]
    whole = broker.request_lease("solo", "", gpus=1)
    assert whole["state"] == "pending"
    assert whole["queue"]["position"] == 1  # the MIG requests ahead do not compete
    assert "you are 1st in the queue" in whole["queue"]["message"]


def test_devices_list_every_holder_of_a_shared_device(db_url: str, tmp_path: Path) -> None:
    broker = sharing_broker(db_url, tmp_path)
    a = broker.request_lease("ann", "", mig_profile="1g.10gb", pool="mig")
    b = broker.request_lease("bob", "nb", mig_profile="1g.10gb", pool="mig")
    rows = dict(broker.device_rows())
    (device,) = [d for d in rows if d.uuid == a["devices"][0]["uuid"]]
    holders = rows[device]
    assert b["devices"][0]["uuid"] == device.uuid  # packed beside ann's instance
    assert [(h["user"], h["server_name"], h["kind"]) for h in holders] == [
        ("ann", "", "mig"),
        ("bob", "nb", "mig"),
    ]
    assert all(h["instance_uuid"].startswith("MIG-") for h in holders)
    assert holders[0]["profile"] == "1g.10gb" and holders[0]["memory_gib"] > 9


# -- the MIG count hint ---------------------------------------------------------------------


def test_asking_for_two_mig_instances_suggests_the_profile_that_fits() -> None:
    with pytest.raises(BadRequest) as err:
        validation.lease_request({"user": "ann", "mig_profile": "3g.40gb", "count": 2})
    assert "ask for mig_profile '7g.80gb'" in err.value.message
    with pytest.raises(BadRequest) as err:
        validation.lease_request({"user": "ann", "mig_profile": "1g.10gb", "count": 2})
    assert "2g.20gb on H100-80GB" in err.value.message
    assert mig.profile_for_many("4g.40gb", 2) == {}


# -- one writer, private store --------------------------------------------------------


def test_the_writer_lock_refuses_a_second_broker_and_frees_on_release(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'b.sqlite'}"
    first = WriterLock(make_engine(url), describe_self("http://127.0.0.1:1/"))
    first.acquire()
    second = WriterLock(make_engine(url))
    with pytest.raises(DatabaseLocked, match=rf"pid {os.getpid()} on .*serving http://127"):
        second.acquire()
    first.release()
    second.acquire()
    second.release()
    WriterLock(make_engine("sqlite://")).acquire()  # in memory: one process, no lock


def test_the_store_is_created_readable_by_its_owner_only(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        url = f"sqlite:///{tmp_path / 'fresh.sqlite'}"
        upgrade(url)
        make_broker(url)
    finally:
        os.umask(old)
    assert (tmp_path / "fresh.sqlite").exists()
    for name in ("fresh.sqlite", "fresh.sqlite-wal", "fresh.sqlite-shm"):
        path = tmp_path / name
        if path.exists():  # the WAL's files come and go with connections
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, name


# -- from trying to break the fixes ---------------------------------------------------------


def test_the_writer_lock_follows_the_file_not_the_path(tmp_path: Path) -> None:
    db = tmp_path / "b.sqlite"
    url = f"sqlite:///{db}"
    upgrade(url)
    first = WriterLock(make_engine(url), describe_self())
    first.acquire()
    (tmp_path / "link.sqlite").symlink_to(db)
    os.link(db, tmp_path / "hard.sqlite")
    others = [
        f"sqlite:///{tmp_path / 'link.sqlite'}",
        f"sqlite:///{tmp_path / 'hard.sqlite'}",
        f"sqlite:///file:{db}?uri=true",
    ]
    for other in others:
        with pytest.raises(DatabaseLocked) as refused:
            WriterLock(make_engine(other)).acquire()
        if "hard" not in other:  # a hard link has no path back to the holder's note
            assert f"pid {os.getpid()} on " in str(refused.value)
    first.release()


def test_upgrade_db_refuses_while_a_broker_holds_the_store(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'b.sqlite'}"
    upgrade(url)
    lock = WriterLock(make_engine(url), describe_self())
    lock.acquire()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "gpubroker", "upgrade-db", f"--db-url={url}"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        lock.release()
    assert done.returncode == 2, done.stderr
    assert "Not upgrading: another gpubroker is the active broker" in done.stderr


def test_the_mps_daemon_gets_no_broker_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", "secret-token")
    monkeypatch.setenv("GPUBROKER_API_TOKEN", "secret-too")
    env = MPSControl()._daemon_env("GPU-1")
    assert "JUPYTERHUB_API_TOKEN" not in env and "GPUBROKER_API_TOKEN" not in env
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-1"


def test_a_servers_kernels_answer_is_read_as_untrusted() -> None:
    assert kernel_list([{"execution_state": "busy", "last_activity": 5}, 7, "x"]) == [
        {"execution_state": "busy", "last_activity": None}
    ]
    with pytest.raises(ValueError, match="not a list"):
        kernel_list({"kernels": []})
    assert parse_time(5) is None and parse_time(["2026"]) is None


def test_activity_claimed_in_the_future_does_not_keep_a_lease() -> None:
    now = dt.datetime(2026, 12, 1, 12, tzinfo=dt.timezone.utc)
    granted = now - dt.timedelta(hours=3)

    def verdict(claimed: dt.datetime) -> object:
        signals = Signals(claimed, claimed, 1, False, 0, 0)
        return judge(signals, Track(gpu_active=granted), granted, now, 3600, 5, 4 * 3600, False)

    far = verdict(now + dt.timedelta(days=365))
    assert far.cull is True and far.idle == 3 * 3600  # no evidence of use
    skewed = verdict(now + dt.timedelta(seconds=30))  # a clock a little ahead: now
    assert skewed.cull is False and skewed.idle == 0
