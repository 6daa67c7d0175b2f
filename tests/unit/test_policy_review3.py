"""Defects a third review of the scheduling policy found, one test each."""

from __future__ import annotations

import datetime as dt
from dataclasses import replace

from gpubroker.scheduler import (
    INTERACTIVE_POOLS,
    Policy,
    Quota,
    SchedulerState,
    Slot,
    WaitReason,
    schedule,
)

from .policy_helpers import HOUR, NOW, node, req, running

# 1: PoolDrained for a request of one pool looks at that pool's nodes


def test_request_larger_than_every_node_of_its_pool_waits_pool_drained() -> None:
    slots = node("a", 8) + node("b", 2, pool="small")
    pending = (req(1, "ann", 4, pool="small"),)
    decisions = schedule(SchedulerState(slots, (), pending, Policy()), NOW)
    assert decisions.grants == ()
    (wait,) = decisions.waits
    assert wait.reason is WaitReason.pool_drained
    assert wait.message.startswith("waiting: no node of pool small has 4 GPUs in service")
    assert "(largest: 2)" in wait.message


def test_request_of_a_pool_drained_to_the_last_device_waits_pool_drained() -> None:
    slots = node("a", 4) + node("b", 2, pool="old", drained=True)
    decisions = schedule(SchedulerState(slots, (), (req(1, "ann", pool="old"),), Policy()), NOW)
    (wait,) = decisions.waits
    assert wait.reason is WaitReason.pool_drained and "(largest: 0)" in wait.message


def test_interactive_request_larger_than_every_interactive_node_waits_pool_drained() -> None:
    slots = tuple(replace(s, pool="jobs", batch=True) for s in node("a", 8)) + node("b", 2)
    pending = (req(1, "ann", 4, pool=INTERACTIVE_POOLS),)
    (wait,) = schedule(SchedulerState(slots, (), pending, Policy()), NOW).waits
    assert wait.reason is WaitReason.pool_drained
    assert "outside batch pools" in wait.message and "(largest: 2)" in wait.message
    # a pool-drained request takes no reservation from those behind it
    pending = (*pending, req(2, "bob", 2, minute=1, pool=INTERACTIVE_POOLS, time_limit=60))
    decisions = schedule(SchedulerState(slots, (), pending, Policy(max_reservations=1)), NOW)
    assert [g.lease_id for g in decisions.grants] == [2]


# 2: preemption never takes free devices reserved for a request ahead


def test_preemption_leaves_free_devices_reserved_for_a_request_ahead() -> None:
    slots = node("a", 2) + node("b", 2)
    run = (
        running(1, "bob", ("a1",), priority_class="batch", ends=NOW + HOUR),
        running(2, "dan", ("b0", "b1"), priority_class="batch"),
    )
    pending = (
        req(10, "ann", 2),  # interactive: first, reserves a0 (free) and a1
        req(11, "cat", 2, minute=1, priority_class="batch-urgent"),
    )
    decisions = schedule(SchedulerState(slots, run, pending, Policy()), NOW)
    waits = {w.lease_id: w for w in decisions.waits}
    assert waits[10].eta == NOW + HOUR  # its reservation still holds
    assert [p.lease_id for p in decisions.preemptions] == [2]
    assert waits[11].earmarked == ("b0", "b1")
    assert "a0" not in waits[11].earmarked


def test_preemption_without_unreserved_room_waits() -> None:
    run = (running(1, "bob", ("a1",), priority_class="batch", ends=NOW + HOUR),)
    pending = (req(10, "ann", 2), req(11, "cat", 2, minute=1, priority_class="batch-urgent"))
    decisions = schedule(SchedulerState(node("a", 2), run, pending, Policy()), NOW)
    assert decisions.preemptions == ()
    assert all(w.earmarked == () for w in decisions.waits)


# 3: a preemption whose requester left is withdrawn, even when others use its spares


def test_victim_keeps_running_when_its_requester_left() -> None:
    slots = node("a", 2)
    run = (running(1, "bob", ("a0", "a1"), priority_class="batch"),)
    ann = req(10, "ann", 1, priority_class="batch-urgent")
    # cat is within her guarantee, but bob too: she may not take his lease
    cat = req(11, "cat", 1, minute=1, priority_class="batch")
    policy = Policy(user_quotas={"cat": Quota(guaranteed=1), "bob": Quota(guaranteed=2)})
    first = schedule(SchedulerState(slots, run, (ann, cat), policy), NOW)
    (told,) = first.preemptions
    assert told.lease_id == 1 and told.for_lease == 10
    ear = {w.lease_id: w.earmarked for w in first.waits}
    assert ear[10] and ear[11]  # cat uses the victim's other device
    victim = replace(run[0], preempt_deadline=told.deadline, preempted_for=10)
    # ann cancels; the grace period is over
    later = told.deadline + dt.timedelta(seconds=1)
    second = schedule(
        SchedulerState(slots, (victim,), (replace(cat, earmarked=ear[11]),), policy), later
    )
    assert second.evictions == ()
    assert second.withdrawn == (1,)
    assert second.grants == ()
    assert second.preemptions == ()  # cat may not preempt bob herself
    (wait,) = second.waits
    assert wait.earmarked == () and wait.reason is not WaitReason.preempting


def test_victim_taken_by_another_entitled_request_gets_a_new_grace_period() -> None:
    slots = node("a", 2)
    run = (running(1, "bob", ("a0", "a1"), priority_class="batch"),)
    ann = req(10, "ann", 1, priority_class="batch-urgent")
    cat = req(11, "cat", 1, minute=1, priority_class="batch-urgent")
    first = schedule(SchedulerState(slots, run, (ann, cat), Policy()), NOW)
    (told,) = first.preemptions
    ear = {w.lease_id: w.earmarked for w in first.waits}
    victim = replace(run[0], preempt_deadline=told.deadline, preempted_for=10)
    later = told.deadline + dt.timedelta(seconds=1)
    second = schedule(
        SchedulerState(slots, (victim,), (replace(cat, earmarked=ear[11]),), Policy()), later
    )
    assert second.evictions == () and second.withdrawn == (1,)
    (again,) = second.preemptions
    assert (again.lease_id, again.for_lease) == (1, 11)
    assert again.deadline == later + dt.timedelta(seconds=60)  # bob's class (batch): grace anew
    assert again.reason == "preempted by a batch-urgent request"  # who asked is not said
    assert "cat" not in again.reason and again.for_lease == 11  # admins trace it by id


def test_victim_of_a_requester_still_waiting_is_evicted_after_grace() -> None:
    run = (running(1, "bob", ("a0",), priority_class="batch"),)
    ann = req(10, "ann", 1, priority_class="batch-urgent")
    first = schedule(SchedulerState(node("a", 1), run, (ann,), Policy()), NOW)
    (told,) = first.preemptions
    victim = replace(run[0], preempt_deadline=told.deadline, preempted_for=10)
    waiting = replace(ann, earmarked=first.waits[0].earmarked)
    later = told.deadline + dt.timedelta(seconds=1)
    second = schedule(SchedulerState(node("a", 1), (victim,), (waiting,), Policy()), later)
    assert [e.lease_id for e in second.evictions] == [1] and second.withdrawn == ()


def test_preemptions_for_a_request_that_lost_its_earmark_are_withdrawn_too() -> None:
    # cat needs 2 GPUs: bob's spare a1 (bob preempted for ann) and dan's a2
    # (dan preempted for cat); ann left, so bob stays, cat loses a1 and
    # needs dan's GPU no more
    deadline = NOW - dt.timedelta(minutes=1)
    run = (
        running(1, "bob", ("a0", "a1"), preempt_deadline=deadline, preempted_for=10),
        running(2, "dan", ("a2",), preempt_deadline=deadline, preempted_for=11),
    )
    cat = req(11, "cat", 2, priority_class="batch", earmarked=("a1", "a2"))
    quotas = {"cat": Quota(guaranteed=2), "bob": Quota(guaranteed=2), "dan": Quota(guaranteed=1)}
    decisions = schedule(SchedulerState(node("a", 3), run, (cat,), Policy(user_quotas=quotas)), NOW)
    assert decisions.evictions == () and decisions.withdrawn == (1, 2)
    assert decisions.preemptions == ()
    assert decisions.waits[0].earmarked == ()


def test_withdrawn_victim_frees_its_devices_at_its_own_end() -> None:
    # the preemption is withdrawn (nobody waits for its devices): the lease
    # runs to its time limit, so that is when a request can plan on them
    run = (running(1, "bob", ("a0",), ends=NOW + 2 * HOUR, preempt_deadline=NOW - HOUR),)
    decisions = schedule(SchedulerState(node("a", 1), run, (req(10, "ann"),), Policy()), NOW)
    assert decisions.withdrawn == (1,)
    assert decisions.waits[0].eta == NOW + 2 * HOUR


# 4: wait sentences say what is so


def test_first_in_its_queue_is_not_told_of_higher_priority() -> None:
    slots = node("a", 2, pool="p") + node("b", 2, pool="q")
    run = (running(1, "bob", ("a0",)), running(2, "bob", ("b0",)))
    pending = (req(10, "ann", 2, pool="p"), req(11, "cat", 2, minute=1, pool="q"))
    decisions = schedule(SchedulerState(slots, run, pending, Policy()), NOW)
    assert sorted(w.lease_id for w in decisions.waits) == [10, 11]
    for wait in decisions.waits:
        assert wait.position == 1
        assert wait.reason is WaitReason.resources
        assert "higher priority" not in wait.message


def test_behind_a_request_held_at_its_limit_is_not_told_of_higher_priority() -> None:
    policy = Policy(user_quotas={"ann": Quota(limit=1)})
    run = (running(1, "ann", ("a0",)),)
    pending = (req(10, "ann", 1), req(11, "cat", 2, minute=1))
    waits = {
        w.lease_id: w
        for w in schedule(SchedulerState(node("a", 2), run, pending, policy), NOW).waits
    }
    assert waits[10].reason is WaitReason.quota_user
    assert waits[11].position == 2 and waits[11].reason is WaitReason.resources


def test_behind_a_blocked_request_is_told_of_priority() -> None:
    run = (running(1, "bob", ("a0",)),)
    pending = (req(10, "ann", 2), req(11, "cat", 2, minute=1))
    waits = schedule(SchedulerState(node("a", 2), run, pending, Policy()), NOW).waits
    assert [(w.position, w.reason) for w in waits] == [
        (1, WaitReason.resources),
        (2, WaitReason.priority),
    ]


def test_unknown_start_is_not_blamed_on_holders_with_time_limits() -> None:
    run = (running(1, "bob", ("a0", "a1"), ends=NOW + HOUR),)
    pending = (req(10, "ann", 2), req(11, "cat", 2, minute=1))
    policy = Policy(max_reservations=1)
    waits = schedule(SchedulerState(node("a", 2), run, pending, policy), NOW).waits
    assert waits[0].eta == NOW + HOUR
    assert waits[1].eta is None
    assert "without a time limit" not in waits[1].message
    assert waits[1].message.endswith(
        "estimated start unknown (only the first blocked request gets an estimate)"
    )


def test_unknown_start_of_holders_without_time_limits_says_so() -> None:
    run = (running(1, "bob", ("a0", "a1")),)
    (wait,) = schedule(SchedulerState(node("a", 2), run, (req(10, "ann", 2),), Policy()), NOW).waits
    assert wait.eta is None
    assert wait.message.endswith("estimated start unknown (GPUs are held without a time limit)")


def test_unknown_start_for_a_reservation_behind_one_without_time_limit() -> None:
    # the GPUs are held with a time limit, but a request ahead without one
    # is planned on them: no holder is without a time limit
    run = (running(1, "bob", ("a0", "a1"), ends=NOW + HOUR),)
    pending = (req(10, "ann", 2), req(11, "cat", 2, minute=1))
    waits = schedule(SchedulerState(node("a", 2), run, pending, Policy()), NOW).waits
    assert waits[1].eta is None
    assert "held without a time limit" not in waits[1].message


def test_slot_helper_keeps_the_pool() -> None:
    assert node("b", 1, pool="x") == (Slot("b0", "b", 0, pool="x"),)
