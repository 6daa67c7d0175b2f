"""Defects of GPU sharing found by a review (MIG instances, MPS and
time-sliced shares), each reproduced and then fixed:

1. shares being prepared (MPS daemon starting) count as taken: no device
   is ever over-committed, and a stale preparation is not granted;
2. a MIG mode change cannot be reversed while its switch runs (409);
3. a MIG instance made by hand is learned when a make fails on it;
4. the share watchdog attributes a process to a lease only when its uid
   is the holder's (where known);
5. MIG mode goes on only for a model of the MIG catalogue;
6. MIG mode of an absent device is a 4xx, never a KeyError;
7. the fake backend never reuses a MIG UUID across MIG mode changes.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from traitlets.config import Config

from gpubroker.broker.actuator import Actuator
from gpubroker.broker.sharing import MigModeRefused
from gpubroker.core import Broker
from gpubroker.devices.fake import FakeDeviceBackend
from gpubroker.devices.mig import Placement
from gpubroker.enforce.watchdog import (
    Overuse,
    ProcessSample,
    ShareCap,
    ShareWatchdog,
    lease_of_pid,
    process_uid,
)
from gpubroker.errors import BadRequest, BrokerError, Conflict
from gpubroker.scheduler import Part
from gpubroker.store.db import make_engine, make_session_factory

from .test_enforce_mps import StandIn
from .test_sharing_core import POOLS, sharing_broker

GIB = 1024


def _kinds(broker: Broker, lease_id: int) -> list[str]:
    return [e["kind"] for e in broker.lease_events(lease_id)]


def _shared_mib(broker: Broker) -> dict[str, int]:
    """MiB of shares granted on each device, from the leases' views."""
    held: dict[str, int] = {}
    for lease in broker.list_leases():
        if lease["state"] != "granted":
            continue
        for slot in lease["slots"]:
            if slot.get("kind") == "share":
                held[slot["device"]] = held.get(slot["device"], 0) + int(slot["memory_mib"])
    return held


@pytest.fixture
def broker(db_url: str, tmp_path: Path) -> Broker:
    broker = sharing_broker(db_url, tmp_path)
    broker.actuator = Actuator(broker.log, backoff=0.01)
    return broker


# -- 1. shares being prepared count as taken --------------------------------------------


async def test_shares_being_prepared_are_not_given_twice(broker: Broker, standin: StandIn) -> None:
    """Two time-sliced devices with 78 GiB of share room each: three 60 GiB
    shares whose MPS daemons start off the event loop. The third waits: the
    two being prepared hold their memory for the passes meanwhile."""
    broker.mps = standin.control()
    leases = [broker.request_lease(f"u{i}", "", memory_gib=60, pool="shared") for i in range(3)]
    reasons = [broker.get_lease(x["id"])["queue"]["reason"] for x in leases]
    assert reasons[:2] == ["Preparing", "Preparing"]
    assert reasons[2] == "Resources", broker.get_lease(leases[2]["id"])["queue"]
    assert broker.actuator is not None
    await broker.actuator.idle()
    views = [broker.get_lease(x["id"]) for x in leases]
    assert [v["state"] for v in views] == ["granted", "granted", "pending"]
    assert len({v["slots"][0]["device"] for v in views[:2]}) == 2
    assert all(mib <= 78 * GIB for mib in _shared_mib(broker).values())
    assert broker.validate_state([x["id"] for x in leases]) == []


def test_a_stale_share_preparation_is_not_granted_over_the_room(
    db_url: str, tmp_path: Path
) -> None:
    """The outcome of a share's preparation re-checks the device's room: a
    grant that no longer fits waits (``grant-failed``) instead."""
    broker = sharing_broker(db_url, tmp_path)
    first = broker.request_lease("ann", "", memory_gib=60, pool="shared")
    second = broker.request_lease("bob", "", memory_gib=60, pool="shared")
    waiting = broker.request_lease("cat", "", memory_gib=60, pool="shared")
    assert [first["state"], second["state"], waiting["state"]] == ["granted", "granted", "pending"]
    device = first["slots"][0]["device"]
    part = Part(device, "share", 60 / 80, memory_mib=60 * GIB)
    broker.sharing._prepared(waiting["id"], (part,), None)
    view = broker.get_lease(waiting["id"])
    assert view["state"] == "pending" and view["slots"] == []
    assert view["queue"]["reason"] == "Resources", view["queue"]  # the pass after tells why
    failed = [e for e in broker.lease_events(waiting["id"]) if e["kind"] == "grant-failed"]
    assert len(failed) == 1 and device in failed[0]["reason"], failed
    assert all(mib <= 78 * GIB for mib in _shared_mib(broker).values())


# -- 2. a MIG mode change under way is not reversed --------------------------------------


async def test_a_mig_mode_change_under_way_cannot_be_reversed(broker: Broker) -> None:
    gpu0 = broker.backend.devices()[0].uuid
    view = broker.request_mig_mode(gpu0, False)
    assert view["mig_target"] is False
    assert broker.actuator is not None and broker.actuator.busy(f"MIG mode of {gpu0}")
    with pytest.raises(Conflict) as refused:
        broker.request_mig_mode(gpu0, True)
    assert refused.value.status == 409
    assert gpu0 in refused.value.message and "mig_mode" in refused.value.message
    # the same change asked again is no reversal: answered as it stands
    assert broker.request_mig_mode(gpu0, False)["mig_target"] is False
    done = await broker.after_mig_mode(view)
    assert done == {"uuid": gpu0, "mig_enabled": False, "mig_target": None}
    # once done, turning it on again is accepted
    on = await broker.after_mig_mode(broker.request_mig_mode(gpu0, True))
    assert on == {"uuid": gpu0, "mig_enabled": True, "mig_target": None}


# -- 3. a MIG instance made by hand ------------------------------------------------------


async def test_an_instance_made_by_hand_is_learned_and_the_request_goes_elsewhere(
    broker: Broker,
) -> None:
    gpu0, gpu1 = (d.uuid for d in broker.backend.devices()[:2])
    by_hand = broker.backend.create_mig_device(gpu0, "1g.10gb", Placement(0, 1))
    assert all(by_hand.uuid != i.uuid for i in broker.sharing.mig_inventory.get(gpu0, []))
    lease = broker.request_lease("ann", "", mig_profile="7g.80gb", pool="mig")
    assert broker.actuator is not None
    await broker.actuator.idle()
    failed = broker.get_lease(lease["id"])
    # the first try went to gpu0 (both looked empty) and met the instance
    assert failed["state"] == "pending", failed
    assert _kinds(broker, lease["id"])[-1] == "grant-failed"
    # the failure re-read the device: the inventory knows the instance now
    assert by_hand.uuid in {i.uuid for i in broker.sharing.mig_inventory[gpu0]}
    broker.sharing.retry_after.clear()  # the backoff is over
    broker.schedule_now()
    await broker.actuator.idle()
    done = broker.get_lease(lease["id"])
    assert done["state"] == "granted" and done["slots"][0]["device"] == gpu1
    assert broker.validate_state([lease["id"]]) == []


def test_an_instance_made_by_hand_is_learned_without_an_actuator(
    db_url: str, tmp_path: Path
) -> None:
    broker = sharing_broker(db_url, tmp_path)
    gpu0, gpu1 = (d.uuid for d in broker.backend.devices()[:2])
    by_hand = broker.backend.create_mig_device(gpu0, "1g.10gb", Placement(0, 1))
    lease = broker.request_lease("ann", "", mig_profile="7g.80gb", pool="mig")
    assert lease["state"] == "pending"  # tried on gpu0 (both looked empty): refused there
    assert by_hand.uuid in {i.uuid for i in broker.sharing.mig_inventory[gpu0]}
    broker.schedule_now()
    done = broker.get_lease(lease["id"])
    assert done["state"] == "granted" and done["slots"][0]["device"] == gpu1


# -- 4. the watchdog checks the process's uid --------------------------------------------

GPU = "GPU-11111111-2222-3333-4444-555555555555"
OTHER_GPU = "GPU-66666666-7777-8888-9999-000000000000"
T0 = dt.datetime(2001, 2, 3, 4, 5, 6, tzinfo=dt.timezone.utc)


def _dog(uids: dict[int, int], holders: dict[str, int]) -> ShareWatchdog:
    dog = ShareWatchdog(grace=60, tolerance_mib=0)
    dog.uid_of_pid = uids.get
    dog.holder_uid = holders.get
    return dog


def test_a_process_of_another_uid_is_not_the_leases() -> None:
    """Process 300 (uid 2000) names ann's lease in its environment; ann's
    uid is 1000: it is not attributed, so never warned nor ended."""
    dog = _dog({100: 1000, 300: 2000}, {"ann": 1000})
    caps = [ShareCap(1, "ann", GPU, 1000)]
    samples = [ProcessSample(GPU, 100, 500), ProcessSample(GPU, 300, 5000)]
    assert dog.judge(samples, caps, {100: 1, 300: 1}.get, T0) == []
    # ann's own process over the cap is still warned
    samples = [ProcessSample(GPU, 100, 2000), ProcessSample(GPU, 300, 5000)]
    actions = dog.judge(samples, caps, {100: 1, 300: 1}.get, T0)
    assert [(a.pid, a.lease_used_mib) for a in actions if isinstance(a, Overuse)] == [(100, 2000)]


def test_the_caps_own_uid_wins_and_unknown_uids_are_not_checked() -> None:
    dog = _dog({300: 2000}, {})
    samples = [ProcessSample(GPU, 300, 5000)]
    # the cap names the holder's uid: 300 is not theirs
    assert dog.judge(samples, [ShareCap(1, "ann", GPU, 1000, uid=1000)], {300: 1}.get, T0) == []
    # the holder's uid is not known: attribution by the environment alone
    actions = dog.judge(samples, [ShareCap(2, "bob", GPU, 1000)], {300: 2}.get, T0)
    assert [a.pid for a in actions] == [300]
    off = _dog({300: 2000}, {"ann": 1000})
    off.check_uid = False
    actions = off.judge(samples, [ShareCap(1, "ann", GPU, 1000)], {300: 1}.get, T0)
    assert [a.pid for a in actions] == [300]


CONTAINER = "a" * 64
OTHER = "b" * 64


def test_a_containers_lease_counts_only_processes_in_that_container() -> None:
    """A server in a Docker container runs as the image's account (uid 1000
    for every user), not as its user's account on the broker's host (ann
    is uid 1001 there): compared by uid, ann's own over-cap process was
    ignored and her cap never enforced. A lease whose server runs in a
    container now counts the processes in that container, whatever their
    uid, and none outside it."""
    dog = _dog({100: 1000, 200: 1000, 300: 1001}, {"ann": 1001})
    containers = {100: CONTAINER, 200: OTHER, 300: ""}
    dog.container_of_pid = containers.get
    cap = ShareCap(1, "ann", GPU, 1000, container=CONTAINER[:12])
    lease = {100: 1, 200: 1, 300: 1}.get
    actions = dog.judge([ProcessSample(GPU, 100, 2000)], [cap], lease, T0)
    assert [(a.pid, type(a)) for a in actions] == [(100, Overuse)]
    # another container's process, or a host process (even one of ann's
    # own uid), naming her lease is not hers
    dog = _dog({200: 1000, 300: 1001}, {"ann": 1001})
    dog.container_of_pid = containers.get
    samples = [ProcessSample(GPU, 200, 5000), ProcessSample(GPU, 300, 5000)]
    assert dog.judge(samples, [cap], lease, T0) == []
    # a process whose container cannot be read: the environment alone
    dog.container_of_pid = {}.get
    actions = dog.judge([ProcessSample(GPU, 200, 5000)], [cap], lease, T0)
    assert [a.pid for a in actions] == [200]


def test_a_process_in_a_leases_container_cannot_leave_it_by_its_environment() -> None:
    """Inside her share's container, ann ran a process with
    GPUBROKER_LEASE_ID=0 (or another lease's id): attributed by its
    environment first, it belonged to no share and her cap went unenforced.
    The recorded container now decides, whatever the environment says."""
    cap = ShareCap(1, "ann", GPU, 1000, container=CONTAINER[:12])
    other = ShareCap(2, "bob", GPU, 1000, container=OTHER[:12])
    for named in ({100: 0}.get, {100: 2}.get, {}.get):
        dog = _dog({100: 1000}, {"ann": 1001})
        dog.container_of_pid = {100: CONTAINER}.get
        caps = iter([cap, other])  # judge takes any iterable of caps, read once
        actions = dog.judge([ProcessSample(GPU, 100, 2000)], caps, named, T0)
        assert [(a.lease_id, a.pid, type(a)) for a in actions] == [(1, 100, Overuse)]


async def test_the_share_guard_names_the_container_of_a_servers_lease(
    db_url: str, tmp_path: Path
) -> None:
    from gpubroker.share_guard import ShareGuard

    broker = sharing_broker(db_url, tmp_path)
    lease = broker.request_lease("ann", "", memory_gib=10, pool="shared")
    other = broker.request_lease("bob", "", memory_gib=10, pool="shared")
    broker.set_server_url(lease["id"], "http://10.0.0.2:8888", CONTAINER)
    guard = ShareGuard(broker)
    seen: list[ShareCap] = []

    def judge(samples: object, caps: list[ShareCap], *args: object) -> list[object]:
        seen.extend(caps)
        return []

    guard.watchdog.judge = judge  # type: ignore[method-assign]
    await guard.check_once()
    containers = {cap.lease_id: cap.container for cap in seen}
    assert containers == {lease["id"]: CONTAINER, other["id"]: None}


def test_process_container_reads_proc_cgroup(tmp_path: Path) -> None:
    from gpubroker.enforce.watchdog import process_container

    assert isinstance(process_container(os.getpid()), str)  # "" on a host, else an ID
    assert process_container(2**22 + 7) is None  # no such process
    (tmp_path / "1234").mkdir()
    for line, found in (
        (f"12:memory:/docker/{CONTAINER}", CONTAINER),
        (f"0::/system.slice/docker-{CONTAINER}.scope", CONTAINER),
        ("0::/user.slice/user-1000.slice/session-3.scope", ""),
        (f"0::/docker/{CONTAINER[:12]}", ""),  # not a full ID
    ):
        (tmp_path / "1234" / "cgroup").write_text(f"1:name=systemd:/\n{line}\n")
        assert process_container(1234, proc=str(tmp_path)) == found, line


def test_process_uid_reads_proc() -> None:
    assert process_uid(os.getpid()) == os.getuid()
    assert process_uid(2**22 + 12345) is None


@pytest.mark.skipif(os.geteuid() != 0, reason="starts a process as another uid (needs root)")
def test_lease_of_pid_does_not_climb_to_a_parent_of_another_uid() -> None:
    """A process of uid 65534 whose parent (root) names a lease is not that
    lease's: the variable is looked for only among ancestors of its uid."""
    env = {**os.environ, "GPUBROKER_LEASE_ID": "42"}
    code = (
        "import subprocess, sys, os; "
        "env = {k: v for k, v in os.environ.items() if k != 'GPUBROKER_LEASE_ID'}; "
        "c = subprocess.Popen(['sleep', '30'], user=65534, env=env); "
        "print(c.pid, flush=True); c.wait()"
    )
    with subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE) as parent:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        try:
            assert process_uid(child) == 65534
            assert lease_of_pid(parent.pid) == 42
            assert lease_of_pid(child) is None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
            parent.wait()


# -- 5. MIG mode only for models of the MIG catalogue ------------------------------------


def test_mig_mode_is_refused_for_a_model_outside_the_catalogue(db_url: str, tmp_path: Path) -> None:
    broker = sharing_broker(db_url, tmp_path)
    gpu0 = broker.backend.devices()[0].uuid
    assert broker.request_mig_mode(gpu0, False)["mig_enabled"] is False
    with broker.runner.write() as repo:
        device = repo.device(gpu0)
        assert device is not None
        device.name = "NVIDIA Mystery GPU"
    with pytest.raises(BadRequest) as refused:
        broker.request_mig_mode(gpu0, True)
    assert refused.value.status == 400
    assert "mig_mode" in refused.value.message and "NVIDIA Mystery GPU" in refused.value.message
    assert broker.sharing.mig_mode_view(gpu0) == {
        "uuid": gpu0,
        "mig_enabled": False,
        "mig_target": None,
    }


# -- 6. MIG mode of an absent device ------------------------------------------------------


def _moved_broker(db_url: str, tmp_path: Path) -> Broker:
    """The sharing broker's store, reopened with the GPUs on another node:
    the old devices (0 and 1 in MIG mode) are absent."""
    config = Config()
    config.Pools.pools = POOLS
    backend = FakeDeviceBackend(
        inventory=["8 x H100"],
        node_name="node-b",
        state_file=str(tmp_path / "fake-gpus-b.json"),
    )
    engine = make_engine(db_url)
    broker = Broker(session_factory=make_session_factory(engine), backend=backend, config=config)
    broker.sync_inventory()
    broker.adopt()
    return broker


@pytest.mark.parametrize("enabled", [False, True])
def test_mig_mode_of_an_absent_device_is_a_4xx(db_url: str, tmp_path: Path, enabled: bool) -> None:
    old = sharing_broker(db_url, tmp_path)
    gpu0 = old.backend.devices()[0].uuid
    broker = _moved_broker(db_url, tmp_path)
    rows = {d.uuid: d for d, _ in broker.device_rows()}
    assert not rows[gpu0].present and rows[gpu0].mig_enabled
    with pytest.raises(BrokerError) as refused:
        broker.request_mig_mode(gpu0, enabled)
    assert refused.value.status in (404, 409)
    assert gpu0 in refused.value.message and "mig_mode" in refused.value.message


def test_a_device_the_backend_does_not_know_is_a_refused_switch(
    db_url: str, tmp_path: Path
) -> None:
    broker = sharing_broker(db_url, tmp_path)
    with pytest.raises(MigModeRefused) as refused:
        broker.sharing._switch_mig_mode("GPU-00000000-0000-0000-0000-000000000000", False, [])
    assert "GPU-00000000-0000-0000-0000-000000000000" in str(refused.value)


# -- 7. the fake backend never reuses a MIG UUID -----------------------------------------


def test_fake_mig_uuids_stay_unique_across_mig_mode_changes(tmp_path: Path) -> None:
    backend = FakeDeviceBackend(
        inventory=["1 x H100"],
        node_name="node-a",
        mig_enabled=[0],
        state_file=str(tmp_path / "fake-gpus.json"),
    )
    gpu = backend.devices()[0].uuid
    seen = set()
    for _ in range(3):
        made = backend.create_mig_device(gpu, "1g.10gb", Placement(0, 1))
        assert made.uuid not in seen
        seen.add(made.uuid)
        backend.destroy_mig_device(gpu, made.uuid)
        backend.set_mig_mode(gpu, False)
        backend.set_mig_mode(gpu, True)


def test_a_processs_container_is_read_once_per_judgement() -> None:
    """Attributing a process to a container's lease and checking it runs in
    that container both need its ``/proc/<pid>/cgroup``: read once."""
    cap = ShareCap(1, "ann", GPU, 1000, container=CONTAINER[:12])
    reads: list[int] = []

    def container_of_pid(pid: int) -> str:
        reads.append(pid)
        return CONTAINER

    dog = _dog({100: 1000}, {"ann": 1001})
    dog.container_of_pid = container_of_pid
    samples = [ProcessSample(GPU, 100, 2000), ProcessSample(OTHER_GPU, 100, 10)]
    caps = [cap, ShareCap(1, "ann", OTHER_GPU, 1000, container=CONTAINER[:12])]
    actions = dog.judge(samples, caps, {100: 1}.get, T0)
    assert [(a.pid, type(a)) for a in actions] == [(100, Overuse)]
    assert reads == [100]
