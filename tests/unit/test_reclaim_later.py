"""A request within guarantee whose reclaim must wait for the borrowers'
``min_runtime`` is told so, with the time the reclaim can start and its
ETA (before, it read "not enough free GPUs" with no estimate, although
the reclaim was minutes away)."""

from __future__ import annotations

import datetime as dt

from gpubroker.scheduler import Policy, PriorityClass, Quota, SchedulerState, WaitReason, schedule

from .policy_helpers import HOUR, NOW, node, req, running

MINUTE = dt.timedelta(minutes=1)
#: ann may have one GPU whatever others borrow
POLICY = Policy(user_quotas={"ann": Quota(guaranteed=1)})


def _wait(held_since: dt.timedelta, **kw: object) -> tuple[object, ...]:
    """Ann's request on one device bob borrows (interactive: min_runtime
    600 s, grace 300 s), granted ``held_since`` before the pass."""
    bob = (
        running(1, "bob", ("a0",), priority_class="interactive", started=NOW - held_since, **kw),
    )
    decisions = schedule(SchedulerState(node(n=1), bob, (req(2, "ann"),), POLICY), NOW)
    return decisions.preemptions, decisions.waits[0]


def test_a_reclaim_inside_the_borrowers_min_runtime_says_when_it_can_start() -> None:
    preemptions, wait = _wait(2 * MINUTE)
    assert preemptions == ()
    # bob's lease may be reclaimed from 11:58 + 10 min; free 5 min (grace) later
    assert wait.eta == NOW + 8 * MINUTE + 5 * MINUTE
    assert wait.message == (
        "waiting: GPUs lent from your guarantee can be reclaimed for you from 12:08 UTC, "
        "once the leases holding them have run their minimum runtime; you are 1st in the "
        "queue; estimated start 12:13 UTC"
    )
    assert wait.reason is WaitReason.resources


def test_past_the_min_runtime_the_reclaim_happens_at_once() -> None:
    preemptions, wait = _wait(HOUR)
    assert [p.lease_id for p in preemptions] == [1]
    assert wait.reason is WaitReason.preempting


def test_a_borrower_that_ends_sooner_gives_the_earlier_estimate() -> None:
    _, wait = _wait(2 * MINUTE, ends=NOW + 3 * MINUTE)
    assert wait.eta == NOW + 3 * MINUTE
    assert "minimum runtime" not in wait.message


def test_a_request_above_its_guarantee_is_not_promised_a_reclaim() -> None:
    bob = (running(1, "bob", ("a0",), priority_class="interactive", started=NOW - 2 * MINUTE),)
    held = (running(3, "ann", ("b0",), started=NOW - HOUR),)  # her guarantee is used
    state = SchedulerState(node(n=1) + node("b", n=1), bob + held, (req(2, "ann"),), POLICY)
    wait = schedule(state, NOW).waits[0]
    assert "minimum runtime" not in wait.message and wait.eta is None


# --- a review: the first borrower to unlock, and only lent GPUs --------------------


def _two_borrowers(same_node: bool) -> SchedulerState:
    """Bob borrows two devices: one lease past its min_runtime at 12:01,
    the other (started later: first in victim order) at 12:08 or 12:09."""
    if same_node:
        slots, devices = node(n=2), ("a0", "a1")
        starts = (NOW - 9 * MINUTE, NOW - 2 * MINUTE)
    else:
        slots, devices = node("a", n=1) + node("b", n=1), ("b0", "a0")
        starts = (NOW - 9 * MINUTE, NOW - 1 * MINUTE)
    bob = tuple(
        running(i + 1, "bob", (d,), priority_class="interactive", started=s)
        for i, (d, s) in enumerate(zip(devices, starts, strict=True))
    )
    return SchedulerState(slots, bob, (req(3, "ann"),), POLICY)


def test_the_reclaim_is_told_for_the_first_borrower_to_unlock() -> None:
    """It named the borrower that unlocks last (12:08), although the reclaim
    happens at 12:01 with the other one."""
    for same_node in (True, False):
        state = _two_borrowers(same_node)
        wait = schedule(state, NOW).waits[0]
        assert "reclaimed for you from 12:01 UTC" in wait.message
        assert wait.eta == NOW + 6 * MINUTE
        # a minute later it happens, with that ETA
        later = schedule(state, NOW + MINUTE)
        assert len(later.preemptions) == 1 and later.waits[0].eta == wait.eta


def test_a_class_preemption_is_not_told_as_a_reclaim_of_lent_gpus() -> None:
    """Carol holds within her own guarantee: nothing is lent, although a
    preempting class could take her lease after its min_runtime."""
    low = PriorityClass("low", 20, min_runtime=600, grace=30)
    policy = Policy(
        user_quotas={"ann": Quota(guaranteed=1), "carol": Quota(guaranteed=1)},
        classes={**Policy().classes, "low": low},
    )
    carol = (running(1, "carol", ("a0",), priority_class="low", started=NOW - 2 * MINUTE),)
    urgent = (req(3, "ann", priority_class="batch-urgent"),)
    wait = schedule(SchedulerState(node(n=1), carol, urgent, policy), NOW).waits[0]
    assert "lent from your guarantee" not in wait.message
