"""The broker core on a real SQLite store and fake devices."""

from __future__ import annotations

import asyncio
import datetime as dt

import pytest
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from gpubroker.core import Broker, utcnow
from gpubroker.errors import BadRequest, Conflict, NotFound
from gpubroker.store.models import Allocation, Lease

from ..conftest import make_broker


def uuids(lease: dict) -> list[str]:
    return [d["uuid"] for d in lease["devices"]]


def test_grant_when_free_then_queue_in_fifo_order(broker: Broker) -> None:
    first = broker.request_lease("ann", "", 6)
    assert first["state"] == "granted" and len(uuids(first)) == 6
    assert first["env"]["CUDA_VISIBLE_DEVICES"] == ",".join(uuids(first))
    assert first["env"]["NVIDIA_VISIBLE_DEVICES"] == ",".join(uuids(first))
    assert first["env"]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert first["env"]["GPUBROKER_LEASE_ID"] == str(first["id"])
    big = broker.request_lease("bob", "", 4)
    small = broker.request_lease("cat", "", 1)
    assert big["state"] == small["state"] == "pending"
    assert big["queue"] == {
        "position": 1,
        "reason": "Resources",
        "message": "waiting: not enough free GPUs for 4; you are 1st in the queue",
    }
    assert small["queue"]["position"] == 2 and small["queue"]["reason"] == "Priority"
    assert big["env"] == {} and big["devices"] == []


def test_release_is_idempotent_and_serves_the_queue(broker: Broker) -> None:
    held = broker.request_lease("ann", "", 8)
    waiting = broker.request_lease("bob", "", 2)
    released = broker.release_lease(held["id"], "done")
    assert released["state"] == "released" and released["release_reason"] == "done"
    assert broker.release_lease(held["id"], "again") == released
    granted = broker.get_lease(waiting["id"])
    assert granted["state"] == "granted"
    assert set(uuids(granted)) <= set(uuids(held))


def test_one_active_lease_per_server_but_named_servers_are_separate(broker: Broker) -> None:
    broker.request_lease("ann", "", 1)
    with pytest.raises(Conflict, match="already has active lease"):
        broker.request_lease("ann", "", 1)
    named = broker.request_lease("ann", "gpu2", 1)
    assert named["state"] == "granted"
    ext1 = broker.request_lease("ann", "", 1, holder_kind="external")
    ext2 = broker.request_lease("ann", "", 1, holder_kind="external")
    assert ext1["id"] != ext2["id"]


@pytest.mark.parametrize("gpus", [0, -1, 9])
def test_gpus_out_of_range_is_refused_and_nothing_is_stored(broker: Broker, gpus: int) -> None:
    with pytest.raises(BadRequest, match=r"gpus: must be between 1 and 8"):
        broker.request_lease("ann", "", gpus)
    assert broker.list_leases(active=False) == []


def test_max_gpus_per_request_caps_the_limit(db_url: str) -> None:
    broker = make_broker(db_url)
    broker.max_gpus_per_request = 2
    assert broker.request_limit() == 2
    with pytest.raises(BadRequest, match="between 1 and 2"):
        broker.request_lease("ann", "", 3)


def test_unknown_lease_is_not_found(broker: Broker) -> None:
    with pytest.raises(NotFound, match="lease 42"):
        broker.get_lease(42)
    with pytest.raises(NotFound):
        broker.release_lease(42, "x")


def test_restart_readopts_leases_and_queue(db_url: str) -> None:
    first = make_broker(db_url)
    held = first.request_lease("ann", "", 8)
    waiting = first.request_lease("bob", "", 1)
    second = make_broker(db_url)  # a new process over the same store
    assert second.get_lease(held["id"]) == held
    assert second.get_lease(waiting["id"])["queue"]["position"] == 1
    second.release_lease(held["id"], "done")
    assert second.get_lease(waiting["id"])["state"] == "granted"


def test_database_refuses_a_second_active_allocation_of_a_device(broker: Broker) -> None:
    held = broker.request_lease("ann", "", 1)
    other = broker.request_lease("bob", "", 1, holder_kind="external")
    session = broker.session_factory()
    with pytest.raises(IntegrityError), session.begin():
        session.add(Allocation(lease_id=other["id"], device_uuid=uuids(held)[0], active=True))
    session.close()


def test_database_refuses_two_active_leases_for_one_server(broker: Broker) -> None:
    broker.request_lease("ann", "", 1)
    session = broker.session_factory()
    with pytest.raises(IntegrityError), session.begin():
        session.add(Lease(user="ann", server_name="", gpus=1, state="pending", created=utcnow()))
    session.close()


def test_reconcile_releases_leases_of_servers_gone_and_spares_the_rest(broker: Broker) -> None:
    gone = broker.request_lease("ann", "", 1)
    alive = broker.request_lease("bob", "nb", 1)
    external = broker.request_lease("cat", "", 1, holder_kind="external")
    later = utcnow() + dt.timedelta(seconds=1)
    assert broker.reconcile({("bob", "nb")}, later) == [gone["id"]]
    reason = broker.get_lease(gone["id"])["release_reason"]
    assert reason == "reconcile: server ann/ is gone from the hub"
    assert broker.get_lease(alive["id"])["state"] == "granted"
    assert broker.get_lease(external["id"])["state"] == "granted"


def test_reconcile_spares_leases_newer_than_the_hub_listing(broker: Broker) -> None:
    before = utcnow() - dt.timedelta(seconds=5)
    fresh = broker.request_lease("ann", "", 1)
    assert broker.reconcile(set(), before) == []
    assert broker.get_lease(fresh["id"])["state"] == "granted"


def test_inventory_sync_marks_vanished_devices_absent(db_url: str) -> None:
    make_broker(db_url, ["8 x H100"])
    smaller = make_broker(db_url, ["4 x H100"])
    rows = smaller.device_rows()
    assert len(rows) == 8
    assert sum(1 for device, _ in rows if device.present) == 4
    assert smaller.request_limit() == 4


def test_no_device_is_ever_in_two_active_leases(broker: Broker) -> None:
    ids = [broker.request_lease(f"u{i}", "", 1 + i % 3)["id"] for i in range(20)]
    for lease_id in ids[::3]:
        broker.release_lease(lease_id, "test")
    session = broker.session_factory()
    active = session.scalars(select(Allocation.device_uuid).where(Allocation.active)).all()
    session.close()
    assert len(active) == len(set(active))


async def test_wait_for_change_wakes_on_grant(broker: Broker) -> None:
    held = broker.request_lease("ann", "", 8)
    waiting = broker.request_lease("bob", "", 1)
    waiter = asyncio.ensure_future(broker.wait_for_change(waiting["id"], 10))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    broker.release_lease(held["id"], "done")
    result = await asyncio.wait_for(waiter, 5)
    assert result["state"] == "granted"


async def test_wait_for_change_times_out_with_the_unchanged_lease(broker: Broker) -> None:
    broker.request_lease("ann", "", 8)
    waiting = broker.request_lease("bob", "", 1)
    result = await broker.wait_for_change(waiting["id"], 0.1)
    assert result == broker.get_lease(waiting["id"])


async def test_wait_for_change_answers_at_once_when_the_caller_is_behind(broker: Broker) -> None:
    held = broker.request_lease("ann", "", 8)
    waiting = broker.request_lease("bob", "", 1)
    broker.release_lease(held["id"], "done")  # granted before the caller polls again
    result = await asyncio.wait_for(
        broker.wait_for_change(waiting["id"], 30, known_version=waiting["version"]), 2
    )
    assert result["state"] == "granted" and result["version"] > waiting["version"]


def test_version_grows_only_on_visible_changes(broker: Broker) -> None:
    held = broker.request_lease("ann", "", 8)
    first = broker.request_lease("bob", "", 1)
    second = broker.request_lease("cat", "", 1)
    broker.schedule_now()
    assert broker.get_lease(second["id"])["version"] == second["version"]
    broker.release_lease(first["id"], "cancelled")
    moved = broker.get_lease(second["id"])
    assert moved["queue"]["position"] == 1 and moved["version"] == second["version"] + 1
    assert broker.get_lease(held["id"])["version"] == held["version"]
