"""Pools whose purpose is ``batch`` take only jobs (#12): servers and
external leases never land there, jobs may land anywhere; on a real broker
(SQLite, fake GPUs) and in the pure scheduler."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from traitlets.config import Config

from gpubroker import scheduler
from gpubroker.core import Broker
from gpubroker.devices.fake import FakeDeviceBackend
from gpubroker.errors import BadRequest
from gpubroker.scheduler.types import INTERACTIVE_POOLS, in_pool
from gpubroker.store.db import make_engine, make_session_factory

POOLS = [
    {"name": "notebooks", "devices": ["*:0-3"]},
    {"name": "train", "purpose": "batch", "devices": ["*:4-7"]},
]


def batch_broker(db_url: str) -> Broker:
    config = Config()
    config.Pools.pools = POOLS
    config.Pools.default_pool = "notebooks"
    backend = FakeDeviceBackend(inventory=["8 x H100"], node_name="node-a")
    broker = Broker(
        session_factory=make_session_factory(make_engine(db_url)), backend=backend, config=config
    )
    broker.sync_inventory()
    broker.adopt()
    return broker


def indices(broker: Broker, lease: dict) -> list[int]:
    return sorted(d["index"] for d in broker.get_lease(lease["id"])["devices"])


def test_servers_never_land_on_a_batch_pool(db_url: str) -> None:
    broker = batch_broker(db_url)
    first = broker.request_lease("ann", "", 4)
    assert first["state"] == "granted"
    assert indices(broker, first) == [0, 1, 2, 3]
    second = broker.request_lease("bob", "", 1)  # 4 batch devices are free: it waits
    assert second["state"] == "pending"
    assert second["queue"]["reason"] == "Resources"
    external = broker.request_lease("cy", "", 1, holder_kind="external")
    assert external["state"] == "pending"
    job = broker.request_lease("dan", "job-1", 2, holder_kind="job")
    assert job["state"] == "granted"
    assert indices(broker, job) == [4, 5]
    broker.release_lease(first["id"], "done")
    assert broker.get_lease(second["id"])["state"] == "granted"
    assert all(i < 4 for i in indices(broker, second))


def test_a_job_may_use_either_pool_and_keeps_to_one_it_names(db_url: str) -> None:
    broker = batch_broker(db_url)
    anywhere = broker.request_lease("ann", "job-1", 8, holder_kind="job")
    assert anywhere["state"] == "granted"
    assert indices(broker, anywhere) == list(range(8))
    broker.release_lease(anywhere["id"], "done")
    named = broker.request_lease("ann", "job-2", 4, holder_kind="job", pool="train")
    assert indices(broker, named) == [4, 5, 6, 7]
    more = broker.request_lease("ann", "job-3", 1, holder_kind="job", pool="train")
    assert more["state"] == "pending"  # the notebooks pool is free, but not named


def test_naming_a_batch_pool_for_a_server_is_refused_and_nothing_is_queued(
    db_url: str,
) -> None:
    broker = batch_broker(db_url)
    for kind in ("server", "external"):
        with pytest.raises(BadRequest, match=r"pool: 'train' is a batch pool"):
            broker.request_lease("ann", "", 1, pool="train", holder_kind=kind)
    assert broker.list_leases() == []


def test_an_urgent_lease_preempts_only_on_devices_it_may_use(db_url: str) -> None:
    """Victims are looked for only on the pools a request may use: an urgent
    external lease preempts the lease in the notebooks pool, not the job on
    the batch pool (both preemptible)."""
    broker = batch_broker(db_url)
    job = broker.request_lease(
        "ann", "job-1", 4, holder_kind="job", pool="train", priority_class="preemptible"
    )
    other = broker.request_lease("bob", "", 4, holder_kind="external", priority_class="preemptible")
    urgent = broker.request_lease(
        "cy", "", 2, holder_kind="external", priority_class="batch-urgent"
    )
    assert broker.get_lease(job["id"])["preemption"] is None
    assert broker.get_lease(other["id"])["preemption"]["for_lease"] == urgent["id"]
    queue = broker.get_lease(urgent["id"])["queue"]
    assert queue["reason"] == "Preempting"
    notebooks = {d["uuid"] for d in broker.get_lease(other["id"])["devices"]}
    assert set(queue["earmarked"]) <= notebooks


def slot(uuid: str, index: int, pool: str, batch: bool = False) -> scheduler.Slot:
    return scheduler.Slot(uuid, "n1", index, pool=pool, batch=batch)


def test_in_pool_reads_the_purpose_only_for_the_interactive_pools() -> None:
    train = slot("b", 1, "train", batch=True)
    notebooks = slot("a", 0, "notebooks")
    assert in_pool(train, None) and in_pool(notebooks, None)
    assert in_pool(train, "train") and not in_pool(notebooks, "train")
    assert in_pool(notebooks, INTERACTIVE_POOLS) and not in_pool(train, INTERACTIVE_POOLS)


def test_the_pure_scheduler_keeps_interactive_requests_off_batch_devices() -> None:
    now = dt.datetime(2026, 12, 1, tzinfo=dt.timezone.utc)
    slots = (slot("a0", 0, "notebooks"), slot("b1", 1, "train", True), slot("b2", 2, "train", True))
    pending = (
        scheduler.Request(1, "ann", 1, now, pool=INTERACTIVE_POOLS),
        scheduler.Request(2, "bob", 1, now, pool=INTERACTIVE_POOLS),
        scheduler.Request(3, "cy", 2, now),
    )
    state = scheduler.SchedulerState(slots=slots, running=(), pending=pending)
    decisions = scheduler.schedule(state, now)
    granted = {g.lease_id: g.devices for g in decisions.grants}
    assert granted[1] == ("a0",)
    assert 2 not in granted  # waits for the notebooks pool
    assert sorted(granted[3]) == ["b1", "b2"]


# -- found by a review ------------------------------------------------------------


def test_queue_positions_count_the_interactive_pools_and_a_named_one_together(
    db_url: str,
) -> None:
    """A request naming the notebooks pool and one naming no pool (the
    interactive pools) compete for the same devices: the second is 2nd."""
    broker = batch_broker(db_url)
    broker.request_lease("ann", "", 4)  # the notebooks pool is full
    named = broker.request_lease("bob", "", 1, pool="notebooks")
    anywhere = broker.request_lease("cy", "", 1)
    assert broker.get_lease(named["id"])["queue"]["position"] == 1
    assert broker.get_lease(anywhere["id"])["queue"]["position"] == 2
    later = broker.request_lease("dan", "", 1, pool="notebooks")
    assert broker.get_lease(later["id"])["queue"]["position"] == 3
    job = broker.request_lease("eve", "job-1", 8, holder_kind="job", pool="train")
    assert broker.get_lease(job["id"])["queue"]["position"] == 1  # other devices


def test_a_server_asking_for_mig_where_only_a_batch_pool_has_mig_is_refused(
    db_url: str, tmp_path: Path
) -> None:
    config = Config()
    config.Pools.pools = [
        {"name": "notebooks", "devices": ["node-a:2-7"]},
        {"name": "migtrain", "mode": "mig", "purpose": "batch", "devices": ["node-a:0-1"]},
    ]
    backend = FakeDeviceBackend(
        inventory=["8 x H100"],
        node_name="node-a",
        mig_enabled=[0, 1],
        state_file=str(tmp_path / "fake.json"),
    )
    broker = Broker(
        session_factory=make_session_factory(make_engine(db_url)), backend=backend, config=config
    )
    broker.sync_inventory()
    broker.adopt()
    with pytest.raises(BadRequest, match=r"^mig_profile: .*\(batch pools take only jobs\)$"):
        broker.request_lease("ann", "", mig_profile="1g.10gb")
    assert broker.list_leases() == []
    job = broker.request_lease("ann", "job-1", mig_profile="1g.10gb", holder_kind="job")
    assert job["state"] == "granted"


def test_waiting_interactive_shares_count_in_the_share_mix_of_interactive_pools() -> None:
    from gpubroker.scheduler.sharing import pool_mixes

    now = dt.datetime(2026, 12, 1, tzinfo=dt.timezone.utc)
    request = scheduler.Request(
        1, "a", 1, now, kind="share", memory_mib=10240, pool=INTERACTIVE_POOLS
    )
    mixes = pool_mixes(["shared", "batchshare"], {}, [], [request], batch=frozenset({"batchshare"}))
    assert mixes["shared"] and not mixes["batchshare"]


def test_an_earmark_on_a_device_an_interactive_request_may_not_use_is_not_granted() -> None:
    now = dt.datetime(2026, 12, 1, tzinfo=dt.timezone.utc)
    slots = (slot("a0", 0, "notebooks"), slot("b1", 1, "train", True))
    pending = (scheduler.Request(1, "ann", 1, now, pool=INTERACTIVE_POOLS, earmarked=("b1",)),)
    state = scheduler.SchedulerState(slots=slots, running=(), pending=pending)
    decisions = scheduler.schedule(state, now)
    assert [g.devices for g in decisions.grants] == [("a0",)]
