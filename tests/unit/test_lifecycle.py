"""The lease lifecycle (#11): the transition table, typed events in a
durable log written with each change, subscribers, and validate_state."""

from __future__ import annotations

import datetime as dt
import time

import pytest
from sqlalchemy import update

from gpubroker.core import Broker
from gpubroker.errors import Forbidden
from gpubroker.model.lifecycle import Event, IllegalTransition, replay, transition_kind
from gpubroker.state_check import StateInvalid
from gpubroker.store.culler_repo import load_tracks, save_tracks
from gpubroker.store.models import Allocation, LeaseEvent

from ..conftest import make_broker

T0 = dt.datetime(2026, 12, 1, tzinfo=dt.timezone.utc)


def ev(kind: str, frm: str | None, to: str) -> Event:
    return Event(1, kind, frm, to, "", "x", "s", T0)


def test_the_table_allows_only_the_lifecycle() -> None:
    assert transition_kind(None, "pending") == "requested"
    assert transition_kind("pending", "granted") == "granted"
    assert transition_kind("granted", "released") == "released"
    for frm, to in (("released", "granted"), ("granted", "pending"), (None, "granted")):
        with pytest.raises(IllegalTransition):
            transition_kind(frm, to)


def test_replay_follows_the_log_and_finds_gaps() -> None:
    story = [
        ev("requested", None, "pending"),
        ev("waiting", "pending", "pending"),
        ev("granted", "pending", "granted"),
        ev("cull-warning", "granted", "granted"),
        ev("released", "granted", "released"),
    ]
    assert replay(story) == "released"
    assert replay([ev("adopted", None, "granted"), ev("released", "granted", "released")])
    with pytest.raises(IllegalTransition, match="but the log was at 'pending'"):
        replay([story[0], story[4]])  # a missing grant
    with pytest.raises(IllegalTransition):
        replay([story[0], ev("granted", "pending", "pending"), story[4]])


def test_a_lease_log_reads_like_a_story(db_url: str) -> None:
    broker = make_broker(db_url, ["2 x H100"])
    published: list[Event] = []
    broker.bus.subscribe(published.append)
    first = broker.request_lease("ann", "", gpus=2, actor="ann")
    waiting = broker.request_lease("bob", "", gpus=1, actor="gpubroker")
    broker.add_notice(broker.server_leases()[0], "cull-warning", "idle 60 min")
    broker.release_lease(first["id"], "server stopped", actor="ann")
    story = [(e["kind"], e["actor"]) for e in broker.lease_events(waiting["id"])]
    assert story == [("requested", "gpubroker"), ("waiting", "scheduler"), ("granted", "scheduler")]
    events = broker.lease_events(waiting["id"])
    assert events[1]["detail"] == {"reason": "Resources"}
    assert "1st in the queue" in events[1]["reason"]
    granted = broker.get_lease(waiting["id"])["devices"]
    assert events[2]["detail"]["slots"] == [d["uuid"] for d in granted]
    ann = broker.lease_events(first["id"])
    assert [(e["kind"], e["from"], e["to"]) for e in ann] == [
        ("requested", None, "pending"),
        ("granted", "pending", "granted"),
        ("cull-warning", "granted", "granted"),
        ("released", "granted", "released"),
    ]
    assert ann[-1]["reason"] == "server stopped"
    # one command, one stimulus: ann's release and the grant to bob it caused
    assert ann[-1]["stimulus"] == events[2]["stimulus"] != events[0]["stimulus"]
    assert [e.kind for e in published][-2:] == ["released", "granted"]


def test_a_refused_command_logs_and_publishes_nothing(db_url: str) -> None:
    broker = make_broker(db_url, ["2 x H100"])
    broker.policy.default_user_quota = {"limit": 1}
    published: list[Event] = []
    broker.bus.subscribe(published.append)
    with pytest.raises(Forbidden):
        broker.request_lease("ann", "", gpus=2)
    assert published == []
    with broker.session_factory() as session:
        assert session.query(LeaseEvent).count() == 0


def test_an_eviction_notes_the_server_stop_before_the_release(db_url: str) -> None:
    broker = make_broker(db_url)
    stopped: list[dict] = []
    broker.on_evict = stopped.append
    lease = broker.request_lease("ann", "", gpus=1)
    broker.stop_lease(lease["id"], "culled: idle 61 min")
    assert [e["kind"] for e in broker.lease_events(lease["id"])][-1] == "stopping"
    assert broker.lease_events(lease["id"])[-1]["actor"] == "culler"
    broker.release_lease(lease["id"], "server stopped")
    last = broker.lease_events(lease["id"])[-1]
    assert (last["kind"], last["reason"]) == ("released", "culled: idle 61 min (server stopped)")


def test_validate_state_catches_a_lease_without_its_slots(db_url: str) -> None:
    broker: Broker = make_broker(db_url)
    lease = broker.request_lease("ann", "", gpus=2)
    assert broker.validate_state([lease["id"]]) == []
    with broker.session_factory() as session, session.begin():
        session.execute(
            update(Allocation).where(Allocation.lease_id == lease["id"]).values(active=False)
        )
    with pytest.raises(StateInvalid, match=f"granted lease {lease['id']} holds 0 slots, not 2"):
        broker.validate_state()
    broker.check_state = "log"
    # the store was changed behind the broker's back: memory disagrees too
    assert broker.validate_state() == [
        f"granted lease {lease['id']} holds 0 slots, not 2",
        f"lease {lease['id']}: memory and store disagree on its slots",
    ]


def test_validate_state_catches_a_log_that_does_not_replay(db_url: str) -> None:
    broker = make_broker(db_url)
    lease = broker.request_lease("ann", "", gpus=1)
    with broker.session_factory() as session, session.begin():
        session.execute(
            update(LeaseEvent).where(LeaseEvent.kind == "granted").values(to_state="released")
        )
    with pytest.raises(StateInvalid, match="its log ends 'released', the lease is 'granted'"):
        broker.validate_state([lease["id"]])


# -- intents and the culler's memory survive a restart ----------------------------------


def test_a_server_stop_asked_before_a_restart_is_asked_again(db_url: str) -> None:
    broker = make_broker(db_url)
    asked: list[dict] = []
    broker.on_evict = asked.append
    lease = broker.request_lease("ann", "", gpus=1)
    broker.stop_lease(lease["id"], "culled: idle 61 min")
    assert [x["id"] for x in asked] == [lease["id"]]
    # the broker restarts before the server stopped
    restarted = Broker(session_factory=broker.session_factory, backend=broker.backend)
    resumed: list[dict] = []
    restarted.on_evict = resumed.append
    restarted.sync_inventory()
    restarted.adopt()
    assert [(x["id"], x["release_reason"]) for x in resumed] == [
        (lease["id"], "culled: idle 61 min")
    ]
    assert restarted.get_lease(lease["id"])["state"] == "granted"  # not before it stopped
    released = restarted.release_lease(lease["id"], "server stopped")
    assert released["release_reason"] == "culled: idle 61 min (server stopped)"


def test_a_preempted_server_stopped_across_a_restart_hands_on_its_device_only_once_gone(
    db_url: str,
) -> None:
    classes = [
        {"name": "urgent", "rank": 100, "preempting": True, "preemptible": False, "grace": 0},
        {"name": "spare", "rank": 10, "preemptible": True, "grace": 0},
    ]
    broker = make_broker(db_url, ["1 x H100"])
    broker.policy.priority_classes = classes
    broker.policy.user_quotas = {"boss": {"guaranteed": 1}}
    asked: list[dict] = []
    broker.on_evict = asked.append
    victim = broker.request_lease("ann", "nb", gpus=1, priority_class="spare")
    urgent = broker.request_lease("boss", "", gpus=1, priority_class="urgent")
    broker.schedule_now()  # grace 0: the preemption notice is due now
    assert [x["id"] for x in asked] == [victim["id"]]  # the hub is asked to stop it
    # the broker restarts before the hub server stopped
    restarted = Broker(session_factory=broker.session_factory, backend=broker.backend)
    restarted.policy.priority_classes = classes
    restarted.policy.user_quotas = {"boss": {"guaranteed": 1}}
    resumed: list[dict] = []
    restarted.on_evict = resumed.append
    restarted.sync_inventory()
    restarted.adopt()
    assert [x["id"] for x in resumed] == [victim["id"]]  # the stop is carried out
    restarted.schedule_now()
    # the device stays with the server until it is gone
    assert restarted.get_lease(victim["id"])["state"] == "granted"
    assert restarted.get_lease(urgent["id"])["state"] == "pending"
    restarted.release_lease(victim["id"], "server stopped")  # the spawner, after the stop
    assert restarted.get_lease(urgent["id"])["state"] == "granted"
    reason = restarted.get_lease(victim["id"])["release_reason"]
    assert reason.startswith("preempted") and reason.endswith("(server stopped)")


def test_a_server_that_never_stops_is_released_after_evict_timeout(db_url: str) -> None:
    broker = make_broker(db_url)
    broker.on_evict = lambda lease: None
    broker.evict_timeout = 0.2
    lease = broker.request_lease("ann", "", gpus=1)
    broker.stop_lease(lease["id"], "preempted: reclaimed")
    assert broker.get_lease(lease["id"])["state"] == "granted"
    time.sleep(0.3)
    broker.schedule_now()
    done = broker.get_lease(lease["id"])
    assert (done["state"], done["release_reason"]) == ("released", "preempted: reclaimed")


def test_the_culler_tracks_are_stored(db_url: str) -> None:
    broker = make_broker(db_url)
    lease = broker.request_lease("ann", "", gpus=1)
    warned = T0 + dt.timedelta(minutes=10)
    fields = {
        "gpu_active": T0,
        "busy_since_gpu_idle": None,
        "warned_until": warned,
        "flagged": True,
        "culled": False,
        "kernels_seen": True,
    }
    save_tracks(broker.session_factory, {lease["id"]: fields})
    assert load_tracks(broker.session_factory) == {lease["id"]: fields}
    save_tracks(broker.session_factory, {})
    assert load_tracks(broker.session_factory) == {}
