"""apply(): one pass's decisions applied to the pure state (broker and simulator)."""

from __future__ import annotations

import copy
import dataclasses
import datetime as dt

import pytest

from gpubroker.model.lifecycle import NOTES, TRANSITIONS, replay
from gpubroker.scheduler import (
    ApplyError,
    Decisions,
    Eviction,
    Grant,
    Part,
    PoolMode,
    Preemption,
    Request,
    Running,
    SchedulerState,
    Slot,
    UsageRecord,
    Wait,
    WaitReason,
    apply,
    release,
    schedule,
)

NOW = dt.datetime(2024, 5, 1, 12, tzinfo=dt.timezone.utc)
H100 = "NVIDIA H100 80GB HBM3"


def minutes(n: float) -> dt.timedelta:
    return dt.timedelta(minutes=n)


def cluster() -> tuple[Slot, ...]:
    whole = tuple(Slot(f"g{i}", "a", i) for i in range(4))
    mig = Slot("m0", "b", 0, pool="mig", mode=PoolMode.mig.value, model=H100, memory_mib=81559)
    share = tuple(
        Slot(
            f"s{i}",
            "c",
            i,
            pool="ts",
            mode=PoolMode.timeslice.value,
            model=H100,
            memory_mib=81559,
            reserve_mib=559,
        )
        for i in range(2)
    )
    return (*whole, mig, *share)


def base_state() -> SchedulerState:
    running = (
        Running(1, "ann", ("g0", "g1"), NOW - minutes(60), ends=NOW + minutes(60)),
        Running(2, "bob", ("g2",), NOW - minutes(30), priority_class="preemptible"),
        Running(3, "cy", ("g3",), NOW - minutes(10), preempt_deadline=NOW + minutes(1), group="ml"),
    )
    pending = (
        Request(10, "dan", 1, NOW - minutes(5), time_limit=600),
        Request(11, "eve", 1, NOW - minutes(4), kind="mig", mig_profile="1g.10gb"),
        Request(12, "fay", 2, NOW - minutes(3), kind="share", memory_mib=20000),
        Request(13, "gus", 2, NOW - minutes(2), earmarked=("g2", "g3")),
    )
    return SchedulerState(
        slots=cluster(),
        running=running,
        pending=pending,
        usage={"ann": UsageRecord(3600.0, NOW - minutes(60))},
    )


MIG_PART = Part("m0", "mig", 1 / 7, profile="1g.10gb", start=6, size=1, memory_mib=9856)
SHARES = (Part("s0", "share", 0.25, memory_mib=20000), Part("s1", "share", 0.25, memory_mib=20000))


def test_whole_mig_and_share_grants_become_running_leases() -> None:
    state = base_state()
    decisions = Decisions(
        grants=(
            Grant(10, ("g3",)),  # g3's holder is evicted first in the same pass
            Grant(11, (), (MIG_PART,)),
            Grant(12, (), SHARES),
        ),
        evictions=(Eviction(3, "preempted: grace period over"),),
    )
    out = apply(state, decisions, NOW)
    by_id = {lease.lease_id: lease for lease in out.state.running}
    whole, mig, share = by_id[10], by_id[11], by_id[12]
    assert whole.devices == ("g3",) and whole.parts == ()
    assert whole.started == NOW and whole.ends == NOW + dt.timedelta(seconds=600)
    assert mig.devices == () and mig.parts == (MIG_PART,) and mig.ends is None
    assert mig.gpus == pytest.approx(1 / 7)
    assert share.parts == SHARES and share.gpus == 0.5
    assert [r.lease_id for r in out.state.pending] == [13]
    assert [lease.lease_id for lease in out.granted] == [10, 11, 12]
    assert 3 not in by_id and [lease.lease_id for lease in out.evicted] == [3]
    grants = [e for e in out.events if e.kind == "granted"]
    assert [(e.lease_id, e.detail["slots"], e.detail["kind"]) for e in grants] == [
        (10, ["g3"], "gpus"),
        (11, ["m0"], "mig"),
        (12, ["s0", "s1"], "share"),
    ]
    assert grants[1].detail["weight"] == pytest.approx(1 / 7)
    assert grants[0].detail["ends"] == (NOW + dt.timedelta(seconds=600)).isoformat()
    assert all(e.at == NOW and e.from_state == "pending" for e in grants)


def test_realized_instance_uuid_is_the_slot_named() -> None:
    part = Part("m0", "mig", 1 / 7, profile="1g.10gb", start=6, size=1, instance="MIG-abc")
    out = apply(base_state(), Decisions(grants=(Grant(11, (), (part,)),)), NOW)
    (event,) = out.events
    assert event.detail["slots"] == ["MIG-abc"]


def test_eviction_removes_the_lease_charges_usage_and_words_its_reason() -> None:
    state = base_state()
    decisions = Decisions(
        evictions=(Eviction(1, "time limit reached"), Eviction(3, "preempted: grace period over"))
    )
    out = apply(state, decisions, NOW)
    assert [lease.lease_id for lease in out.state.running] == [2]
    released = [e for e in out.events if e.kind == "released"]
    assert [(e.lease_id, e.detail["cause"]) for e in released] == [
        (1, "time-limit"),
        (3, "preempted"),
    ]
    assert released[0].reason == "time limit of 7200 s reached"
    assert released[0].detail["slots"] == ["g0", "g1"]
    assert all((e.from_state, e.to_state) == ("granted", "released") for e in released)
    # ann held 2 GPUs for an hour: her old 3600 GPU-s plus 7200, both decayed (7-day half-life)
    assert out.usage["ann"].as_of == NOW
    assert 10760 < out.usage["ann"].gpu_seconds < 10790
    assert out.usage["cy"].gpu_seconds == pytest.approx(600, rel=1e-3)
    assert "bob" not in out.usage


def test_preemption_marks_the_victim_and_withdrawn_clears_it() -> None:
    state = base_state()
    deadline = NOW + minutes(2)
    decisions = Decisions(
        preemptions=(Preemption(2, 13, ("g2",), "preempted by a batch-urgent request", deadline),),
        withdrawn=(3,),
        waits=(
            Wait(13, 1, WaitReason.preempting, "being reclaimed", deadline, ("g2",)),
            Wait(10, 2, WaitReason.priority, "second"),
        ),
    )
    out = apply(state, decisions, NOW)
    by_id = {lease.lease_id: lease for lease in out.state.running}
    assert by_id[2].preempt_deadline == deadline
    assert by_id[2].preempted_for == 13  # the next pass withdraws it if 13 leaves
    assert by_id[3].preempt_deadline is None and by_id[3].preempted_for is None
    assert by_id[1].preempt_deadline is None
    assert {lease.lease_id for lease in out.marked} == {2, 3}
    pending = {r.lease_id: r for r in out.state.pending}
    assert pending[13].earmarked == ("g2",) and pending[10].earmarked == ()
    assert [r.lease_id for r in out.earmarked] == [13]
    kinds = [(e.lease_id, e.kind) for e in out.events]
    assert kinds == [(3, "preemption-withdrawn"), (2, "preempting")]
    note = out.events[1]
    assert note.detail == {"for_lease": 13, "deadline": deadline.isoformat(), "devices": ["g2"]}
    assert note.reason == "preempted by a batch-urgent request"
    assert all(e.kind in NOTES and not e.is_transition for e in out.events)
    assert out.waits == decisions.waits


def test_waiting_notes_only_when_the_reason_changed() -> None:
    waits = (
        Wait(10, 1, WaitReason.resources, "first"),
        Wait(11, 1, WaitReason.fragmented, "in the way"),
    )
    decisions = Decisions(waits=waits)
    assert apply(base_state(), decisions, NOW).events == ()  # no previous reasons: no notes
    out = apply(base_state(), decisions, NOW, {10: WaitReason.resources, 11: None})
    (note,) = out.events
    assert (note.lease_id, note.kind, note.reason) == (11, "waiting", "in the way")
    assert note.detail == {"reason": "Fragmented", "position": 1}


def test_reclaimable_only_flags_whole_device_leases() -> None:
    decisions = Decisions(grants=(Grant(11, (), (MIG_PART,)),), reclaimable=frozenset({1, 2, 11}))
    assert apply(base_state(), decisions, NOW).reclaimable == frozenset({1, 2})


def test_input_state_is_not_changed() -> None:
    state = base_state()
    before = copy.deepcopy(state)
    decisions = Decisions(
        grants=(Grant(10, ("g3",)), Grant(12, (), SHARES)),
        evictions=(Eviction(3, "preempted: grace period over"), Eviction(1, "time limit")),
        preemptions=(Preemption(2, 13, ("g2",), "why", NOW + minutes(1)),),
        waits=(Wait(13, 1, WaitReason.preempting, "m", None, ("g2",)),),
    )
    out = apply(state, decisions, NOW)
    assert out.state != state
    assert state == before
    assert dict(state.usage) == dict(before.usage)
    assert out.before is state


@pytest.mark.parametrize(
    ("decisions", "match"),
    [
        (Decisions(grants=(Grant(99, ("g3",)),)), "not pending"),
        (Decisions(grants=(Grant(10, ("g0",)),)), "busy"),
        (Decisions(grants=(Grant(13, ("g3", "g3")),)), "busy"),
        (Decisions(grants=(Grant(13, ("g3",)),)), "not what it asked"),
        (Decisions(grants=(Grant(11, ("g3",)),)), "not what it asked"),
        (Decisions(evictions=(Eviction(99, "x"),)), "not running"),
        (Decisions(preemptions=(Preemption(99, 13, (), "x", NOW),)), "not running"),
        (
            Decisions(grants=(Grant(11, (), (MIG_PART,)), Grant(13, (), ()))),
            "not what it asked",
        ),
    ],
)
def test_impossible_decisions_raise(decisions: Decisions, match: str) -> None:
    with pytest.raises(ApplyError, match=match):
        apply(base_state(), decisions, NOW)


def test_overlapping_mig_instances_and_overfull_shares_raise() -> None:
    state = base_state()
    first = apply(state, Decisions(grants=(Grant(11, (), (MIG_PART,)),)), NOW).state
    again = Request(20, "hal", 1, NOW, kind="mig", mig_profile="1g.10gb")
    state2 = SchedulerState(first.slots, first.running, (*first.pending, again))
    with pytest.raises(ApplyError, match="overlap"):
        apply(state2, Decisions(grants=(Grant(20, (), (MIG_PART,)),)), NOW)
    big = Request(21, "ivy", 2, NOW, kind="share", memory_mib=70000)
    parts = tuple(Part(f"s{i}", "share", 0.9, memory_mib=70000) for i in range(2))
    state3 = SchedulerState(first.slots, first.running, (*first.pending, big))
    grant = apply(state3, Decisions(grants=(Grant(12, (), SHARES),)), NOW).state
    with pytest.raises(ApplyError, match="more than its 81000"):
        apply(grant, Decisions(grants=(Grant(21, (), parts),)), NOW)


def test_release_and_a_real_pass_round_trip() -> None:
    """The policy's own pass, applied: MIG and share requests get their parts,
    and the next pass sees them held (no second grant of the same slices)."""
    state = SchedulerState(
        slots=cluster(),
        running=(),
        pending=(
            Request(1, "ann", 4, NOW - minutes(3), time_limit=3600),
            Request(2, "bob", 1, NOW - minutes(2), kind="mig", mig_profile="3g.40gb"),
            Request(3, "cy", 2, NOW - minutes(1), kind="share", memory_mib=50000),
            Request(4, "dan", 2, NOW, kind="share", memory_mib=50000),
        ),
    )
    out = apply(state, schedule(state, NOW), NOW)
    held = {lease.lease_id: lease for lease in out.state.running}
    assert sorted(held) == [1, 2, 3]  # 4: the shares' memory is taken
    assert len(held[1].devices) == 4 and held[1].ends == NOW + dt.timedelta(hours=1)
    assert [p.profile for p in held[2].parts] == ["3g.40gb"]
    assert {p.device for p in held[3].parts} == {"s0", "s1"}
    assert [r.lease_id for r in out.state.pending] == [4]
    later = NOW + minutes(1)
    again = schedule(out.state, later)
    assert again.grants == ()
    freed = release(out.state, 3, later)
    assert [lease.lease_id for lease in freed.running] == [1, 2]
    assert freed.usage["cy"].gpu_seconds > 0
    (grant,) = schedule(freed, later).grants
    assert grant.lease_id == 4 and {p.device for p in grant.parts} == {"s0", "s1"}
    with pytest.raises(ApplyError, match="not running"):
        release(freed, 3, later)


def test_events_follow_the_lifecycle_table() -> None:
    state = base_state()
    first = apply(
        state, Decisions(grants=(Grant(10, ("g3",)),), evictions=(Eviction(3, "preempted"),)), NOW
    )
    second = apply(first.state, Decisions(evictions=(Eviction(10, "time limit reached"),)), NOW)
    log = [e.event("pass-1") for e in (*first.events, *second.events) if e.lease_id == 10]
    assert [e.kind for e in log] == ["granted", "released"]
    assert all((e.from_state, e.to_state) in TRANSITIONS for e in log)
    assert log[0].actor == "scheduler" and log[0].stimulus == "pass-1"
    adopted = [
        dataclasses.replace(log[0], kind="adopted", from_state="pending", to_state="pending")
    ]
    assert replay([*adopted, *log]) == "released"


def test_one_grant_is_checked_against_its_own_earlier_slots() -> None:
    """Each slot of a grant counts what the grant's earlier slots took: two
    shares that each fit a device but together overfill it, and one free
    device named twice, are refused (they used to pass, each checked only
    against the holdings from before the grant)."""
    state = base_state()
    big = Request(21, "ivy", 2, NOW, kind="share", memory_mib=50000)
    twice = tuple(Part("s0", "share", 0.6, memory_mib=50000) for _ in range(2))
    state2 = dataclasses.replace(state, pending=(*state.pending, big))
    with pytest.raises(ApplyError, match="s0 would hold 100000 MiB, more than its 81000"):
        apply(state2, Decisions(grants=(Grant(21, (), twice),)), NOW)
    # two shares that fit together on one device still pass
    fits = tuple(Part("s0", "share", 0.4, memory_mib=40000) for _ in range(2))
    small = dataclasses.replace(big, memory_mib=40000)
    state3 = dataclasses.replace(state, pending=(*state.pending, small))
    out = apply(state3, Decisions(grants=(Grant(21, (), fits),)), NOW)
    assert out.granted[0].parts == fits
    # g2 is freed by the eviction in the same pass; granting it twice is a bug
    decisions = Decisions(
        grants=(Grant(13, ("g2", "g2")),), evictions=(Eviction(2, "preempted: grace over"),)
    )
    with pytest.raises(ApplyError, match="device g2 is unknown or busy"):
        apply(state, decisions, NOW)
