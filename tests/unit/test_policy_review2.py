"""Defects a second review of the scheduling policy found, one test each."""

from __future__ import annotations

import datetime as dt
from dataclasses import replace

from gpubroker.scheduler import Policy, Quota, SchedulerState, WaitReason, schedule
from gpubroker.scheduler.accounting import Accounting
from gpubroker.scheduler.types import DEFAULT_CLASSES, PriorityClass

from .policy_helpers import HOUR, NOW, node, req, running

# 1: a guarantee used by an earmarked request must not reclaim again in a later pass


def test_earmarked_request_uses_its_guarantee_before_the_walk() -> None:
    policy = Policy(user_quotas={"ann": Quota(guaranteed=1)})
    slots = node(n=2)
    run = (
        running(1, "bob", ("a0",), priority_class="batch"),
        running(2, "carol", ("a1",), priority_class="batch"),
    )
    first = schedule(
        SchedulerState(slots, run, (req(10, "ann", 1, priority_class="batch"),), policy), NOW
    )
    assert len(first.preemptions) == 1
    told = first.preemptions[0]
    run2 = tuple(
        replace(r, preempt_deadline=told.deadline) if r.lease_id == told.lease_id else r
        for r in run
    )
    pending = (
        req(10, "ann", 1, priority_class="batch", earmarked=first.waits[0].earmarked),
        req(11, "ann", 1, minute=1, priority_class="interactive"),
    )
    second = schedule(SchedulerState(slots, run2, pending, policy), NOW + dt.timedelta(seconds=5))
    assert second.preemptions == ()  # carol keeps her GPU
    waits = {w.lease_id: w for w in second.waits}
    assert waits[11].reason is not WaitReason.preempting
    assert waits[10].reason is WaitReason.preempting
    assert waits[10].earmarked == first.waits[0].earmarked
    # once free, the earmarked devices go to the request they were reclaimed for
    gone = tuple(r for r in run2 if r.lease_id != told.lease_id)
    third = schedule(SchedulerState(slots, gone, pending, policy), NOW + dt.timedelta(minutes=5))
    assert [(g.lease_id, g.devices) for g in third.grants] == [(10, told.devices)]


def test_earmarked_request_is_not_held_by_its_own_limit() -> None:
    policy = Policy(user_quotas={"ann": Quota(guaranteed=1, limit=1)})
    slots = node(n=1)
    run = (running(1, "bob", ("a0",), preempt_deadline=NOW + HOUR),)
    pending = (req(10, "ann", 1, earmarked=("a0",)),)
    decisions = schedule(SchedulerState(slots, run, pending, policy), NOW)
    assert decisions.waits[0].reason is WaitReason.preempting
    granted = schedule(SchedulerState(slots, (), pending, policy), NOW)
    assert [g.lease_id for g in granted.grants] == [10]
    assert granted.reclaimable == frozenset()  # within ann's guarantee


# 2: a user at or above her guarantee (borrowed leases included) may not reclaim


def test_no_reclaim_above_guarantee_with_a_partly_covered_lease() -> None:
    policy = Policy(user_quotas={"ann": Quota(guaranteed=1)})
    run = (running(1, "ann", ("a0", "a1")), running(2, "bob", ("a2",)))
    decisions = schedule(SchedulerState(node(n=3), run, (req(10, "ann", 1),), policy), NOW)
    assert decisions.preemptions == ()
    assert decisions.waits[0].reason is not WaitReason.preempting
    # ann's 2-GPU lease is borrowed as a whole (it does not fit her guarantee)
    assert 1 in decisions.reclaimable


def test_no_reclaim_above_guarantee_large() -> None:
    policy = Policy(user_quotas={"ann": Quota(guaranteed=7)})
    slots = node(n=8) + node("b", 8)
    others = tuple(running(10 + i, f"u{i}", (f"b{i}",)) for i in range(8))
    run = (running(1, "ann", tuple(f"a{i}" for i in range(8))), *others)
    decisions = schedule(SchedulerState(slots, run, (req(99, "ann", 7),), policy), NOW)
    assert decisions.preemptions == ()


def test_reclaim_still_allowed_for_the_unused_rest_of_a_guarantee() -> None:
    policy = Policy(user_quotas={"ann": Quota(guaranteed=3)})
    run = (running(1, "ann", ("a0", "a1")), running(2, "bob", ("a2",)))
    decisions = schedule(SchedulerState(node(n=3), run, (req(10, "ann", 1),), policy), NOW)
    assert [p.lease_id for p in decisions.preemptions] == [2]


def test_non_preemptible_class_counts_borrowed_leases_against_the_guarantee() -> None:
    course = PriorityClass("course", 90, preemptible=False)
    classes = {c.name: c for c in (*DEFAULT_CLASSES, course)}
    policy = Policy(user_quotas={"ann": Quota(guaranteed=1)}, classes=classes)
    run = (running(1, "ann", ("a0", "a1")),)
    pending = (req(10, "ann", 1, priority_class="course"),)
    decisions = schedule(SchedulerState(node(n=4), run, pending, policy), NOW)
    assert decisions.grants == ()
    assert decisions.waits[0].reason is WaitReason.over_guarantee


def test_accounting_guarantee_left_counts_borrowed_then_group() -> None:
    policy = Policy(
        user_quotas={"ann": Quota(guaranteed=1)}, group_quotas={"g": Quota(guaranteed=2)}
    )
    lease = running(1, "ann", ("a0", "a1", "a2", "a4"), group="g")  # 4 > 1 + 2: borrowed
    acct = Accounting.of(policy, (lease,))
    assert acct.borrowed == {1}
    assert not acct.within_guarantee("ann", "g", 1)
    assert acct.within_guarantee("ann", None, 0)
