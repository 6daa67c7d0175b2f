"""The broker policy, case by case (pure: no clock, no database)."""

from __future__ import annotations

import datetime as dt

from gpubroker.devices.topology import dgx_like
from gpubroker.scheduler import (
    Policy,
    Quota,
    SchedulerState,
    Slot,
    UsageRecord,
    WaitReason,
    schedule,
)

from .policy_helpers import HOUR, NOW, node, req, running


def test_limit_holds_a_request_back_with_a_reason() -> None:
    policy = Policy(user_quotas={"ann": Quota(limit=1)})
    state = SchedulerState(node(), (running(1, "ann", ("a0",)),), (req(2, "ann"),), policy)
    (wait,) = schedule(state, NOW).waits
    assert wait.reason is WaitReason.quota_user
    assert "you hold 1 of your 1 GPU limit" in wait.message


def test_group_limit_message_names_the_group() -> None:
    policy = Policy(group_quotas={"vision": Quota(limit=2)})
    held = (running(1, "a", ("a0", "a1"), group="vision"),)
    state = SchedulerState(node(), held, (req(3, "b", group="vision"),), policy)
    (wait,) = schedule(state, NOW).waits
    assert wait.reason is WaitReason.quota_group
    assert wait.message.startswith("waiting: group vision holds 2 of its 2 GPUs limit")


def test_guaranteed_group_reclaims_a_borrowed_lease_after_grace() -> None:
    policy = Policy(group_quotas={"A": Quota(guaranteed=4), "B": Quota(guaranteed=4)})
    slots = node()
    b_leases = tuple(
        running(
            10 + i,
            f"b{i}",
            (f"a{i}",),
            group="B",
            priority_class="batch",
            started=NOW - dt.timedelta(hours=8 - i),
        )
        for i in range(8)
    )
    state = SchedulerState(slots, b_leases, (req(99, "alice", group="A"),), policy)
    decisions = schedule(state, NOW)
    assert decisions.grants == ()
    # the four oldest of B are within B's guarantee; the newest borrowed one goes
    assert decisions.reclaimable == frozenset({14, 15, 16, 17})
    (pre,) = decisions.preemptions
    assert pre.lease_id == 17 and pre.for_lease == 99 and pre.devices == ("a7",)
    assert pre.deadline == NOW + dt.timedelta(seconds=60)  # batch grace
    (wait,) = decisions.waits
    assert wait.reason is WaitReason.preempting and wait.earmarked == ("a7",)

    # during the grace period nothing changes hands; others cannot take a7
    told = tuple(
        r
        if r.lease_id != 17
        else running(
            17,
            "b7",
            ("a7",),
            group="B",
            priority_class="batch",
            started=r.started,
            preempt_deadline=pre.deadline,
        )
        for r in b_leases
    )
    waiting = req(99, "alice", group="A", earmarked=("a7",))
    other = req(100, "zed", group="A", minute=-5)
    mid = schedule(
        SchedulerState(slots, told, (waiting, other), policy), NOW + dt.timedelta(seconds=30)
    )
    assert mid.grants == () and mid.evictions == ()
    # after the grace period the victim is evicted; a7 is alice's once it is gone
    after = schedule(SchedulerState(slots, told, (waiting,), policy), pre.deadline)
    assert [e.lease_id for e in after.evictions] == [17] and after.grants == ()
    rest = tuple(r for r in told if r.lease_id != 17)
    handed = schedule(SchedulerState(slots, rest, (waiting,), policy), pre.deadline)
    assert [(g.lease_id, g.devices) for g in handed.grants] == [(99, ("a7",))]


def test_in_guarantee_leases_are_never_reclaimed() -> None:
    policy = Policy(group_quotas={"A": Quota(guaranteed=8), "B": Quota(guaranteed=8)})
    b_leases = tuple(
        running(10 + i, "b", (f"a{i}",), group="B", priority_class="batch") for i in range(8)
    )
    decisions = schedule(
        SchedulerState(node(), b_leases, (req(99, "alice", group="A"),), policy), NOW
    )
    assert decisions.preemptions == () and decisions.reclaimable == frozenset()
    assert decisions.waits[0].reason is WaitReason.resources


def test_minimum_runtime_protects_young_leases() -> None:
    policy = Policy(user_quotas={"alice": Quota(guaranteed=1)})
    young = (
        running(
            1, "bob", ("a0",), priority_class="interactive", started=NOW - dt.timedelta(minutes=2)
        ),
    )
    decisions = schedule(SchedulerState(node(n=1), young, (req(2, "alice"),), policy), NOW)
    assert decisions.preemptions == ()


def test_withdrawn_preemption_when_the_request_is_gone() -> None:
    told = (running(1, "bob", ("a0",), priority_class="batch", preempt_deadline=NOW + HOUR),)
    decisions = schedule(SchedulerState(node(n=1), told, ()), NOW)
    assert decisions.withdrawn == (1,) and decisions.evictions == ()


def test_reservation_blocks_later_small_requests_unless_they_end_before_it() -> None:
    # 8 GPUs: 6 busy without limit, 2 busy until +2h; 1 free right now on a
    # node where nothing else frees up; a 2-GPU high-priority request waits
    slots = node("a", 4) + node("b", 4)
    busy = (
        running(1, "x", ("a0", "a1", "a2")),
        running(2, "y", ("b0", "b1"), ends=NOW + 2 * HOUR),
        running(3, "z", ("b2",)),
    )
    big = req(10, "hi", gpus=2, priority_class="batch-urgent", time_limit=3600)
    short = req(11, "lo", gpus=1, minute=1, priority_class="batch", time_limit=1800)
    long = req(12, "lo2", gpus=1, minute=2, priority_class="batch", time_limit=4 * 3600)
    nolimit = req(13, "lo3", gpus=1, minute=3, priority_class="batch")
    decisions = schedule(SchedulerState(slots, busy, (big, short, long, nolimit)), NOW)
    waits = {w.lease_id: w for w in decisions.waits}
    assert waits[10].reason is WaitReason.resources and waits[10].eta == NOW + 2 * HOUR
    assert "estimated start 14:00 UTC" in waits[10].message
    # b3 is free now but reserved from 14:00 for the big request; a3 is free
    assert [(g.lease_id, g.devices) for g in decisions.grants] == [(11, ("a3",))]
    # the 4-hour request would end after 14:00: it may not use b3
    assert waits[12].reason is WaitReason.reserved
    assert waits[13].reason is WaitReason.reserved
    backfill = req(14, "lo4", gpus=1, minute=4, priority_class="batch", time_limit=3600)
    decisions = schedule(SchedulerState(slots, busy, (big, short, long, nolimit, backfill)), NOW)
    granted = {g.lease_id: g.devices for g in decisions.grants}
    assert granted == {11: ("a3",), 14: ("b3",)}  # 13:00 ends before the reservation


def test_small_request_without_time_limit_cannot_take_reserved_gpus() -> None:
    slots = node("a", 2)
    busy = (running(1, "x", ("a0",), ends=NOW + HOUR),)
    big = req(10, "hi", gpus=2)
    small = req(11, "lo", gpus=1, minute=1)
    decisions = schedule(SchedulerState(slots, busy, (big, small)), NOW)
    assert decisions.grants == ()
    assert [w.reason for w in decisions.waits] == [WaitReason.resources, WaitReason.reserved]
    assert decisions.waits[0].eta == NOW + HOUR


def test_fair_share_orders_users_and_decays() -> None:
    policy = Policy(half_life=12 * 3600.0)
    usage = {"heavy": UsageRecord(8 * 86400.0, NOW)}  # 8 GPU-days, just now
    pending = (req(1, "heavy", minute=0), req(2, "light", minute=1))
    busy = tuple(running(10 + i, "x", (f"a{i}",)) for i in range(8))
    state = SchedulerState(node(), busy, pending, policy, usage)
    assert [w.lease_id for w in schedule(state, NOW).waits] == [2, 1]
    week = NOW + dt.timedelta(days=7)
    later = SchedulerState(node(), busy, pending, policy, {"heavy": UsageRecord(8 * 86400.0, NOW)})
    # a week later the usage has decayed: even again, so age decides
    assert [w.lease_id for w in schedule(later, week).waits] == [1, 2]


def test_priority_class_goes_first() -> None:
    busy = tuple(running(10 + i, "x", (f"a{i}",)) for i in range(8))
    pending = (req(1, "u", priority_class="batch"), req(2, "v", minute=5))
    assert [w.lease_id for w in schedule(SchedulerState(node(), busy, pending), NOW).waits] == [
        2,
        1,
    ]


def test_four_gpus_land_on_an_nvlink_island_when_one_is_free() -> None:
    slots = node()
    topology = {"a": dgx_like(8)}
    busy = (running(1, "x", ("a1",)), running(2, "y", ("a6",)))  # breaks both islands
    state = SchedulerState(slots, busy, (req(3, "u", gpus=4),), topology=topology)
    (split,) = schedule(state, NOW).grants
    assert len(split.devices) == 4  # no island is whole: still granted, across islands
    free_island = (running(1, "x", ("a1",)), running(2, "y", ("a2",)))  # 4-7 stay whole
    state = SchedulerState(slots, free_island, (req(3, "u", gpus=4),), topology=topology)
    (grant,) = schedule(state, NOW).grants
    assert grant.devices == ("a4", "a5", "a6", "a7")


def test_not_preemptible_class_runs_only_within_guarantee() -> None:
    from gpubroker.scheduler import DEFAULT_CLASSES, PriorityClass

    classes = {c.name: c for c in DEFAULT_CLASSES}
    classes["reserved"] = PriorityClass("reserved", 90, preemptible=False)
    policy = Policy(classes=classes, user_quotas={"ann": Quota(guaranteed=1)})
    pending = (
        req(1, "ann", gpus=2, priority_class="reserved"),
        req(2, "ann", gpus=1, server="x") if False else req(2, "bob", priority_class="reserved"),
    )
    decisions = schedule(SchedulerState(node(), (), pending, policy), NOW)
    assert {w.lease_id: w.reason for w in decisions.waits} == {
        1: WaitReason.over_guarantee,
        2: WaitReason.over_guarantee,
    }


def test_pool_drained_when_no_node_is_big_enough() -> None:
    slots = (*node("a", 2), Slot("b0", "b", 0, drained=True))
    (wait,) = schedule(SchedulerState(slots, (), (req(1, "u", gpus=3),)), NOW).waits
    assert wait.reason is WaitReason.pool_drained and "largest: 2" in wait.message


def test_users_waiting_behind_a_partial_queue_still_count_in_fair_share() -> None:
    """A pass over the head of the queue (the simulator's prefix passes) names
    the users left out in ``also_waiting``: their shares normalise the
    factors, so the head is ordered as in the whole queue."""
    from dataclasses import replace

    from gpubroker.scheduler import queue_order

    usage = {
        "ann": UsageRecord(3 * 3600.0, NOW),
        "bob": UsageRecord(3600.0, NOW),
        "cat": UsageRecord(4e6, NOW),  # far behind
    }
    pending = (req(1, "ann", minute=-30), req(2, "bob", minute=-10), req(3, "cat", minute=-5))
    policy = Policy(shares={"ann": 1.0, "bob": 1.0, "cat": 8.0})
    state = SchedulerState(node("a", 4), (), pending, policy, usage)
    whole = [r.lease_id for r in queue_order(state, NOW)]
    assert whole == [2, 1, 3]  # bob used less: first
    head = replace(state, pending=pending[:2])
    # without cat, ann and bob round to one fair-share step: age decides
    assert [r.lease_id for r in queue_order(head, NOW)] == [1, 2]
    told = replace(head, also_waiting=frozenset({"ann", "bob", "cat"}))
    assert [r.lease_id for r in queue_order(told, NOW)] == whole[:2]
    assert [w.lease_id for w in schedule(replace(told, slots=()), NOW).waits] == [2, 1]
