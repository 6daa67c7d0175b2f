"""A request within guarantee whose reclaim must wait for the borrowers'
``min_runtime`` is told so, with the time the reclaim can start and its
ETA (before, it read "not enough free GPUs" with no estimate, although
the reclaim was minutes away)."""

from __future__ import annotations

import datetime as dt

from gpubroker.scheduler import Policy, Quota, SchedulerState, WaitReason, schedule

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
