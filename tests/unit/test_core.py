"""The broker core on a real SQLite store and fake devices."""

from __future__ import annotations

import asyncio
import datetime as dt
import time

import pytest
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from gpubroker.core import Broker, utcnow
from gpubroker.errors import BadRequest, Conflict, Forbidden, NotFound
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
        "message": "waiting: not enough free GPUs on one node; you are 1st in the queue; "
        "estimated start unknown (GPUs are held without a time limit)",
        "eta": None,
        "earmarked": [],
    }
    # the 2 free GPUs are held back for the 4-GPU request ahead of it
    assert small["queue"]["position"] == 2 and small["queue"]["reason"] == "Reserved"
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


def test_reconcile_releases_a_lease_whose_server_was_started_again_without_it(
    broker: Broker,
) -> None:
    """ann's server died while the broker was down (its release failed), and
    she started it again without GPUs: the hub lists ``ann/`` as running, so
    the old lease kept its GPU for as long as the new server ran. The hub's
    ``started`` (set before the spawner requests its lease) tells the two
    servers apart."""
    old = broker.request_lease("ann", "", 1)
    mine = broker.request_lease("bob", "", 1)
    created = dt.datetime.fromisoformat(old["created"].replace("Z", "+00:00"))
    later = utcnow() + dt.timedelta(minutes=10)
    started = {
        ("ann", ""): created + dt.timedelta(minutes=5),  # a newer server
        ("bob", ""): created - dt.timedelta(seconds=2),  # its own: started, then leased
    }
    servers = {("ann", ""), ("bob", "")}
    assert broker.reconcile(servers, later, started=started) == [old["id"]]
    reason = broker.get_lease(old["id"])["release_reason"]
    assert reason.startswith("reconcile: server ann/ was started again at ")
    assert broker.get_lease(mine["id"])["state"] == "granted"
    # within the clocks' slack, or with no start time, the server is the lease's
    again = broker.request_lease("ann", "", 1)
    near = dt.datetime.fromisoformat(again["created"].replace("Z", "+00:00"))
    started = {("ann", ""): near + dt.timedelta(seconds=30), ("bob", ""): None}
    assert broker.reconcile(servers, later, started=started) == []


def test_reconcile_spares_leases_newer_than_the_hub_listing(broker: Broker) -> None:
    before = utcnow() - dt.timedelta(seconds=5)
    fresh = broker.request_lease("ann", "", 1)
    assert broker.reconcile(set(), before) == []
    assert broker.get_lease(fresh["id"])["state"] == "granted"


def test_reconcile_leaves_leases_an_engine_follows_to_it(broker: Broker) -> None:
    followed = broker.request_lease("ann", "", 1)
    gone = broker.request_lease("bob", "", 1)
    later = utcnow() + dt.timedelta(seconds=1)
    assert broker.reconcile(set(), later, followed=[followed["id"]]) == [gone["id"]]
    assert broker.get_lease(followed["id"])["state"] == "granted"


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


# -- policy through the core -------------------------------------------------------


def quota_broker(db_url: str, **policy) -> Broker:
    broker = make_broker(db_url)
    for key, value in policy.items():
        setattr(broker.policy, key, value)
    broker.schedule_now()
    return broker


def test_limit_refuses_at_once_with_403_naming_the_quota(db_url: str) -> None:
    broker = quota_broker(db_url, user_quotas={"ann": {"limit": 1}})
    first = broker.request_lease("ann", "", 1)
    with pytest.raises(Forbidden, match="user ann holds or waits for 1 GPU; 1 more would exceed"):
        broker.request_lease("ann", "second", 1)
    assert broker.get_lease(first["id"])["state"] == "granted"
    assert [x["id"] for x in broker.list_leases(user="ann")] == [first["id"]]


def test_quota_refusals_never_write_units_in_exponent_notation() -> None:
    """``{:.3g}`` wrote a limit of 1,000 GPUs as ``1e+03`` and 1,500 as ``1.5e+03``."""
    from gpubroker.broker.admission import _units

    assert [_units(x) for x in (1000.0, 1500.0, 12.345, 3 / 7, 2.0, 0.0)] == [
        "1000",
        "1500",
        "12.345",
        "0.429",
        "2",
        "0",
    ]


def test_pending_requests_count_against_the_limit(db_url: str) -> None:
    broker = quota_broker(db_url, user_quotas={"ann": {"limit": 2}})
    broker.request_lease("bob", "", 8)
    broker.request_lease("ann", "a", 1)
    broker.request_lease("ann", "b", 1)
    with pytest.raises(Forbidden, match="user limit of 2 GPUs"):
        broker.request_lease("ann", "c", 1)


def test_group_limit_and_charged_group(db_url: str) -> None:
    broker = quota_broker(db_url, group_quotas={"vision": {"limit": 2}})
    lease = broker.request_lease("ann", "", 2, groups=["nlp", "vision"])
    assert lease["group"] == "vision"  # the user's first group with a quota
    with pytest.raises(Forbidden, match="group vision holds or waits for 2 GPUs"):
        broker.request_lease("bob", "", 1, groups=["vision"])
    assert broker.request_lease("cat", "", 1, groups=["nlp"])["group"] is None
    with pytest.raises(Forbidden, match="not a member of group 'vision'"):
        broker.request_lease("dan", "", 1, group="vision", groups=["nlp"])


def test_dry_run_checks_everything_and_creates_nothing(db_url: str) -> None:
    broker = quota_broker(db_url, user_quotas={"ann": {"limit": 1}})
    answer = broker.request_lease("ann", "", 1, dry_run=True)
    assert answer == {
        "admitted": True,
        "user": "ann",
        "gpus": 1,
        "kind": "gpus",
        "weight": 1.0,
        "priority_class": "interactive",
        "group": None,
    }
    assert broker.list_leases(active=False) == []
    with pytest.raises(Forbidden):
        broker.request_lease("ann", "", 2, dry_run=True)


def test_unknown_priority_class_is_a_bad_request(broker: Broker) -> None:
    with pytest.raises(BadRequest, match="priority_class: must be one of"):
        broker.request_lease("ann", "", 1, priority_class="vip")


def test_stored_quota_overrides_config_and_lowering_keeps_running_leases(db_url: str) -> None:
    broker = quota_broker(db_url, user_quotas={"ann": {"limit": 4}})
    running = broker.request_lease("ann", "a", 3)
    broker.set_quota("user", "ann", 0, 1)
    assert broker.quotas()["users"]["ann"] == {"guaranteed": 0.0, "limit": 1.0}
    assert broker.get_lease(running["id"])["state"] == "granted"
    with pytest.raises(Forbidden):
        broker.request_lease("ann", "b", 1)
    broker.delete_quota("user", "ann")
    assert broker.quotas()["users"]["ann"]["limit"] == 4.0
    with pytest.raises(NotFound, match=r"SchedulingPolicy.user_quotas\) and is changed there"):
        broker.delete_quota("user", "ann")
    with pytest.raises(NotFound, match=r"no stored quota for user 'bob'$"):
        broker.delete_quota("user", "bob")


def test_reclaim_evicts_after_grace_and_hands_over_exactly_that_device(db_url: str) -> None:
    broker = quota_broker(
        db_url,
        group_quotas={"A": {"guaranteed": 4}, "B": {"guaranteed": 4}},
        priority_classes=[
            {"name": "interactive", "rank": 100},
            {"name": "batch", "rank": 50, "grace": 0.2},
        ],
    )
    evicted = []
    broker.on_evict = evicted.append
    b = [
        broker.request_lease(
            f"b{i}", "", 1, holder_kind="server", priority_class="batch", groups=["B"]
        )
        for i in range(8)
    ]
    waiting = broker.request_lease("alice", "", 1, groups=["A"])
    assert waiting["state"] == "pending" and waiting["queue"]["reason"] == "Preempting"
    victims = [x for x in broker.list_leases() if x["preemption"]]
    assert len(victims) == 1 and victims[0]["reclaimable"]
    assert victims[0]["id"] == b[-1]["id"]  # the newest borrowed lease
    assert victims[0]["preemption"]["for_lease"] == waiting["id"]
    untouched = b[:4]  # B's four oldest leases are within B's guarantee
    time.sleep(0.3)
    broker.schedule_now()  # grace over: the victim's server is asked to stop...
    assert [e["id"] for e in evicted] == [victims[0]["id"]]
    assert evicted[0]["release_reason"].startswith(
        "preempted: reclaimed for a request within its guarantee"
    )
    assert broker.get_lease(waiting["id"])["state"] == "pending"  # ...and still runs
    broker.release_lease(victims[0]["id"], "server stopped")  # as its spawner does
    granted = broker.get_lease(waiting["id"])
    assert granted["state"] == "granted"
    assert granted["devices"] == victims[0]["devices"]
    gone = broker.get_lease(victims[0]["id"])
    assert gone["release_reason"].startswith(
        "preempted: reclaimed for a request within its guarantee"
    )
    assert gone["release_reason"].endswith("(server stopped)")
    for lease in untouched:
        assert broker.get_lease(lease["id"])["state"] == "granted"


def test_drain_stops_new_grants_but_keeps_running_leases(broker: Broker) -> None:
    held = broker.request_lease("ann", "", 8)
    uuid = held["devices"][0]["uuid"]
    broker.set_drained(uuid, True)
    assert broker.get_lease(held["id"])["state"] == "granted"
    broker.release_lease(held["id"], "done")
    assert broker.request_limit() == 7
    lease = broker.request_lease("bob", "", 7)
    assert uuid not in [d["uuid"] for d in lease["devices"]]
    with pytest.raises(NotFound):
        broker.set_drained("GPU-nope", True)


def test_priority_class_of_a_pending_request_can_change(broker: Broker) -> None:
    broker.request_lease("ann", "", 8)
    low = broker.request_lease("bob", "", 1, priority_class="batch")
    high = broker.request_lease("cat", "", 1, priority_class="batch")
    assert [x["id"] for x in broker.queue()] == [low["id"], high["id"]]
    broker.set_priority_class(high["id"], "interactive")
    assert [x["id"] for x in broker.queue()] == [high["id"], low["id"]]
    with pytest.raises(Conflict):
        broker.set_priority_class(broker.list_leases(user="ann")[0]["id"], "batch")


def test_usage_is_recorded_for_fair_share_on_release(broker: Broker) -> None:
    from gpubroker.store.usage_repo import load_usage

    lease = broker.request_lease("ann", "", 2)
    broker.release_lease(lease["id"], "done")
    half_life = broker.policy.fairshare_half_life
    assert broker._world.usage["ann"].gpu_seconds > 0
    with broker.session_factory() as session:  # not written yet: loaded from the lease
        records, stored, behind = load_usage(session, half_life)
    assert records["ann"] == broker._world.usage["ann"]
    assert (stored, behind) == (set(), {"ann"})
    assert broker.write_usage() == 1
    again = broker.request_lease("ann", "", 1)
    broker.release_lease(again["id"], "done")
    with broker.session_factory() as session:  # the row, plus the release after it
        records, stored, behind = load_usage(session, half_life)
    assert records["ann"] == broker._world.usage["ann"]
    assert (stored, behind) == ({"ann"}, {"ann"})


def test_external_leases_past_their_time_limit_are_ended(db_url: str) -> None:
    broker = make_broker(db_url)
    lease = broker.request_lease("ann", "", 1, holder_kind="external", time_limit=0.1)
    assert lease["ends_at"] is not None
    time.sleep(0.2)
    broker.schedule_now()
    ended = broker.get_lease(lease["id"])
    assert ended["state"] == "released"
    assert ended["release_reason"] == "time limit of 0.1 s reached"


def test_evicted_server_is_released_after_the_timeout_if_the_hub_never_stops_it(
    db_url: str,
) -> None:
    broker = make_broker(db_url)
    broker.evict_timeout = 0.1
    asked = []
    broker.on_evict = asked.append
    lease = broker.request_lease("ann", "", 1, time_limit=0.1)
    time.sleep(0.15)
    broker.schedule_now()
    assert len(asked) == 1 and broker.get_lease(lease["id"])["state"] == "granted"
    time.sleep(0.15)
    broker.schedule_now()
    assert len(asked) == 1  # asked once
    assert broker.get_lease(lease["id"])["state"] == "released"


def test_users_may_not_pick_a_higher_or_preempting_class(broker: Broker) -> None:
    broker.class_for_caller("batch", admin=False)
    broker.class_for_caller(None, admin=False)
    with pytest.raises(Forbidden, match="batch-urgent"):
        broker.class_for_caller("batch-urgent", admin=False)
    broker.class_for_caller("batch-urgent", admin=True)


def test_charging_a_group_without_quota_to_dodge_a_limit_is_refused(db_url: str) -> None:
    broker = quota_broker(db_url, group_quotas={"vision": {"limit": 1}})
    with pytest.raises(Forbidden, match="charge one of your groups with a quota"):
        broker.request_lease("ann", "", 1, group="nlp", groups=["nlp", "vision"])
    with pytest.raises(Forbidden, match="cannot check"):
        broker.request_lease("ann", "", 1, group="vision", groups=None)


def test_non_preemptible_request_beyond_every_guarantee_is_refused(db_url: str) -> None:
    broker = quota_broker(
        db_url,
        user_quotas={"ann": {"guaranteed": 1}},
        priority_classes=[
            {"name": "interactive", "rank": 100},
            {"name": "pinned", "rank": 90, "preemptible": False},
        ],
    )
    assert broker.request_lease("ann", "", 1, priority_class="pinned")["state"] == "granted"
    with pytest.raises(Forbidden, match="not preemptible and runs only within guarantees"):
        broker.request_lease("ann", "b", 2, priority_class="pinned")


def test_policy_config_is_checked_when_set() -> None:
    from traitlets import TraitError

    from gpubroker.policy_config import SchedulingPolicy

    with pytest.raises(TraitError, match="default_priority_class"):
        SchedulingPolicy(default_priority_class="vip")
    with pytest.raises(TraitError, match="default_user_quota"):
        SchedulingPolicy(default_user_quota={"guaranteed": 2, "limit": 1})
    with pytest.raises(TraitError, match="group_quotas"):
        SchedulingPolicy(group_quotas={"g": {"limit": -1}})


def test_a_decision_that_does_not_fit_is_refused_before_any_row_changes(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broker applies decisions with the pure scheduler.apply first: a
    grant of a device another lease holds raises ApplyError, and the
    transaction rolls back (nothing is granted twice)."""
    from gpubroker import core, scheduler
    from gpubroker.scheduler.apply import ApplyError

    holder = broker.request_lease("ann", "", 8)
    waiting = broker.request_lease("bob", "", 1)
    assert (holder["state"], waiting["state"]) == ("granted", "pending")
    busy = uuids(holder)[0]

    def bad(state: scheduler.SchedulerState, now: dt.datetime) -> scheduler.Decisions:
        return scheduler.Decisions(grants=(scheduler.Grant(waiting["id"], (busy,)),))

    monkeypatch.setattr(core.scheduler, "schedule", bad)
    with pytest.raises(ApplyError, match=f"device {busy}"):
        broker.schedule_now()
    monkeypatch.undo()
    assert broker.get_lease(waiting["id"])["state"] == "pending"
    with broker._read() as repo:
        rows = repo.session.scalars(select(Allocation).where(Allocation.device_uuid == busy)).all()
    assert [(a.lease_id, a.active) for a in rows] == [(holder["id"], True)]


def test_share_mix_sizes_are_checked(broker: Broker) -> None:
    from traitlets import TraitError

    for bad in (0.0, 1e-4, float("inf"), float("nan"), 2048.0):
        with pytest.raises(
            TraitError, match=r"share_mix_gib: each size must be 1/1024\.\.1024 GiB"
        ):
            broker.share_mix_gib = [10.0, bad]
    broker.share_mix_gib = [10.0, 0.5]
    assert broker.share_mix_gib == [10.0, 0.5]
