"""A race hunt in the broker core: a request's earmark survives a restart
as it stood, a cancel that rolls back keeps the request's wait and version,
and a GPU freed during a preemption's grace period is used (the victim then
keeps running)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.exc import OperationalError

import gpubroker.core as core
from gpubroker.broker.actuator import Actuator
from gpubroker.broker.world import World
from gpubroker.core import Broker

from .test_core import quota_broker
from .test_sharing_core import sharing_broker

POLICY: dict[str, Any] = {
    "group_quotas": {"A": {"guaranteed": 4}, "B": {"guaranteed": 4}},
    "priority_classes": [
        {"name": "interactive", "rank": 100},
        {"name": "batch", "rank": 50, "grace": 30},
    ],
}


class Clock:
    def __init__(self) -> None:
        self.now = dt.datetime(2030, 1, 1, tzinfo=dt.timezone.utc)

    def __call__(self) -> dt.datetime:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(core, "utcnow", c)
    return c


def reclaim(db_url: str) -> tuple[Broker, list[dict[str, Any]], dict[str, Any]]:
    """Group B holds all 8 GPUs above its guarantee; alice of group A asks
    for one within hers: a B lease is told, and alice waits Preempting."""
    broker = quota_broker(db_url, **POLICY)
    held = [
        broker.request_lease(f"b{i}", "", 1, priority_class="batch", groups=["B"]) for i in range(8)
    ]
    alice = broker.request_lease("alice", "", 1, groups=["A"])
    assert alice["queue"]["reason"] == "Preempting"
    return broker, held, alice


def told(broker: Broker) -> list[dict[str, Any]]:
    return [x for x in broker.list_leases() if x["preemption"]]


def test_a_restart_loads_the_earmark_the_request_has_now(db_url: str, clock: Clock) -> None:
    """The earmark was written only by the request's INSERT: after the
    reclaim moved to another lease, a restart loaded the first earmark and
    the request waited Preempting for ever, with no victim told."""
    broker, _, alice = reclaim(db_url)
    first = told(broker)[0]["devices"][0]["uuid"]
    broker.set_drained(first, True)  # the reclaim moves to another B lease's GPU
    broker.set_drained(first, False)
    assert broker.get_lease(alice["id"])["queue"]["earmarked"] != [first]
    broker._world.close()
    again = quota_broker(db_url, **POLICY)  # a restart on the same store
    for _ in range(3):
        clock.now += dt.timedelta(seconds=31)
        again.schedule_now()
    view = again.get_lease(alice["id"])
    assert view["state"] == "granted", (view["queue"], told(again))
    assert again.validate_state() == []


async def test_a_cancel_that_rolls_back_keeps_the_requests_wait_and_version(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rollback kept the memory-only values of the leases indexed as
    active, but the failed release had taken the lease out of the index:
    it came back at an older version, "Preparing" with nothing being made."""
    broker = sharing_broker(db_url, tmp_path)
    broker.actuator = Actuator(broker.log, backoff=0.01)
    broker.grant_retry_backoff = 60.0
    broker.backend.fail_mig_creates = 1
    lease = broker.request_lease("ann", "", mig_profile="1g.10gb", pool="mig")
    assert lease["queue"]["reason"] == "Preparing"
    await broker.actuator.idle()
    seen = broker.get_lease(lease["id"])
    assert seen["queue"]["reason"] == "Resources"

    def locked(self: World) -> None:
        raise OperationalError("COMMIT", {}, Exception("database is locked"))

    with monkeypatch.context() as patch:
        patch.setattr(World, "_insert_events", locked)
        with pytest.raises(OperationalError):
            broker.release_lease(lease["id"], "cancel")
    after = broker.get_lease(lease["id"])
    assert after["state"] == "pending"
    assert after["version"] > seen["version"]  # versions never go back
    # not "Preparing" (nothing is being made): its wait comes with the next pass
    assert after["queue"]["reason"] == "Queued", after["queue"]
    assert broker.validate_state([lease["id"]]) == []
    broker.schedule_now()  # it tries again (the failed cancel forgot its backoff)
    await broker.actuator.idle()
    assert broker.get_lease(lease["id"])["state"] == "granted"


def test_a_gpu_freed_during_a_grace_period_is_used_and_the_victim_kept(
    db_url: str, clock: Clock
) -> None:
    """A request waiting for a reclaimed GPU only waited for it: a GPU freed
    meanwhile stayed idle, and at the deadline the victim was evicted too."""
    broker, held, alice = reclaim(db_url)
    victim = told(broker)[0]
    other = next(x for x in held if x["id"] != victim["id"])
    broker.release_lease(other["id"], "done")  # a GPU is free now
    assert broker.get_lease(alice["id"])["state"] == "granted"
    clock.now += dt.timedelta(seconds=31)
    broker.schedule_now()
    kept = broker.get_lease(victim["id"])
    assert kept["state"] == "granted" and not kept["preemption"], kept["release_reason"]
    assert broker.validate_state() == []
