"""Defects a review of the scheduling policy found, one test each."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from traitlets import TraitError
from traitlets.config import Config

from gpubroker.core import Broker
from gpubroker.devices.fake import FakeDeviceBackend
from gpubroker.policy_config import SchedulingPolicy
from gpubroker.scheduler import Policy, Quota, SchedulerState, WaitReason, schedule
from gpubroker.store.db import make_engine, make_session_factory

from .policy_helpers import HOUR, NOW, node, req, running

# A: a class removed from the config


def test_lease_of_a_removed_class_is_never_preempted() -> None:
    legacy = (running(1, "bob", ("a0",), priority_class="legacy"),)
    state = SchedulerState(
        node(n=1), legacy, (req(2, "ann", priority_class="batch-urgent"),), Policy()
    )
    decisions = schedule(state, NOW)
    assert decisions.preemptions == () and decisions.grants == ()
    assert decisions.waits[0].reason is WaitReason.resources


def test_lease_of_a_removed_class_is_never_reclaimed() -> None:
    policy = Policy(user_quotas={"ann": Quota(guaranteed=1)})
    legacy = (running(1, "bob", ("a0",), priority_class="legacy"),)
    decisions = schedule(SchedulerState(node(n=1), legacy, (req(2, "ann"),), policy), NOW)
    assert decisions.preemptions == () and decisions.grants == ()


def test_removed_class_still_ranks_lowest_and_runs_only_within_guarantees() -> None:
    policy = Policy(user_quotas={"ann": Quota(guaranteed=1)})
    pending = (
        req(1, "ann", priority_class="legacy"),
        req(2, "bob", priority_class="legacy", minute=1),
        req(3, "cat", priority_class="preemptible", minute=2),
    )
    decisions = schedule(SchedulerState(node(n=1), (), pending, policy), NOW)
    # the known class goes first, although it came last
    assert [g.lease_id for g in decisions.grants] == [3]
    decisions = schedule(SchedulerState(node(n=2), (), pending[1:2], policy), NOW)
    assert decisions.grants == ()
    assert decisions.waits[0].reason is WaitReason.over_guarantee
    decisions = schedule(SchedulerState(node(n=2), (), pending[:1], policy), NOW)
    assert [g.lease_id for g in decisions.grants] == [1]  # within ann's guarantee


# B: bad priority classes are refused at load


@pytest.mark.parametrize(
    ("item", "words"),
    [
        ({"name": "batch", "rank": "100"}, "class 'batch': rank must be an integer"),
        ({"name": "batch", "rank": True}, "class 'batch': rank must be an integer"),
        ({"name": "batch", "rank": 50.5}, "class 'batch': rank must be an integer"),
        ({"name": "", "rank": 50}, "name must be a non-empty string"),
        ({"name": 7, "rank": 50}, "name must be a non-empty string"),
        ({"name": "batch", "rank": 50, "grace": -1}, "class 'batch': grace must be seconds >= 0"),
        ({"name": "batch", "rank": 50, "grace": "60"}, "class 'batch': grace must be seconds"),
        (
            {"name": "batch", "rank": 50, "min_runtime": -5},
            "class 'batch': min_runtime must be seconds >= 0",
        ),
        (
            {"name": "batch", "rank": 50, "preemptible": "no"},
            "class 'batch': preemptible must be True or False",
        ),
    ],
)
def test_bad_class_field_is_refused_at_load(item: dict[str, Any], words: str) -> None:
    classes = [{"name": "interactive", "rank": 100}, item]
    with pytest.raises(TraitError, match="priority_classes: ") as err:
        SchedulingPolicy(priority_classes=classes)
    assert words in str(err.value)


def test_duplicate_class_name_is_refused_at_load() -> None:
    classes = [{"name": "batch", "rank": 50}, {"name": "batch", "rank": 60}]
    with pytest.raises(TraitError, match="class 'batch' is defined twice"):
        SchedulingPolicy(priority_classes=classes, default_priority_class="batch")


def test_a_class_list_without_the_default_class_is_refused_by_the_broker(db_url: str) -> None:
    """traitlets checks ``default_priority_class`` only when it is set: a
    ``priority_classes`` list that left out ``interactive`` loaded, and every
    request naming no class (every spawn) was then a 400. The broker now
    refuses it when it is built (``gpubroker serve``: status 2); the
    simulator, whose jobs' default class is its own, still runs it."""
    classes = [{"name": "course", "rank": 90}]
    policy = SchedulingPolicy(priority_classes=classes)
    assert policy.build().classes.keys() == {"course"}  # the simulator's use
    with pytest.raises(TraitError, match=r"must be one of \['course'\], got 'interactive'"):
        policy.check_default_class()
    config = Config({"SchedulingPolicy": {"priority_classes": classes}})
    with pytest.raises(TraitError, match="default_priority_class"):
        Broker(
            session_factory=make_session_factory(make_engine(db_url)),
            backend=FakeDeviceBackend(inventory=["1 x H100"], node_name="n"),
            config=config,
        )
    config.SchedulingPolicy.default_priority_class = "course"
    SchedulingPolicy(config=config).check_default_class()


def test_good_classes_still_load_and_schedule() -> None:
    classes = [
        {"name": "interactive", "rank": 100, "min_runtime": 0, "grace": 2.5},
        {"name": "batch", "rank": -1, "preemptible": False, "preempting": True, "grace": 0},
    ]
    policy = SchedulingPolicy(priority_classes=classes).build()
    assert policy.classes["interactive"].grace == 2.5
    decisions = schedule(SchedulerState(node(n=1), (), (req(1, "ann"),), policy), NOW)
    assert [g.lease_id for g in decisions.grants] == [1]


# C: no more victims than needed


def test_preemption_spares_a_victim_not_needed() -> None:
    held = (
        running(1, "bob", ("a0",), priority_class="batch", started=NOW - dt.timedelta(minutes=10)),
        running(2, "bob", ("a1", "a2"), priority_class="batch", started=NOW - 5 * HOUR),
    )
    urgent = (req(9, "ann", 2, priority_class="batch-urgent"),)
    decisions = schedule(SchedulerState(node(n=3), held, urgent, Policy()), NOW)
    assert [(p.lease_id, p.devices) for p in decisions.preemptions] == [(2, ("a1", "a2"))]
    assert decisions.waits[0].earmarked == ("a1", "a2")


def test_preemption_drops_the_last_taken_first_and_keeps_what_is_needed() -> None:
    # victim order: 1 (1 GPU), 2 (1 GPU), 3 (2 GPUs); 3 GPUs needed.
    # greedy takes 1, 2, 3 (4 GPUs); dropping 3 leaves 2 < 3, so 3 stays;
    # dropping 2 leaves 3: enough, so 2 is spared; 1 is needed.
    held = (
        running(1, "bob", ("a0",), priority_class="batch", started=NOW - dt.timedelta(minutes=10)),
        running(2, "bob", ("a1",), priority_class="batch", started=NOW - dt.timedelta(minutes=20)),
        running(3, "bob", ("a2", "a3"), priority_class="batch", started=NOW - 5 * HOUR),
    )
    urgent = (req(9, "ann", 3, priority_class="batch-urgent"),)
    decisions = schedule(SchedulerState(node(n=4), held, urgent, Policy()), NOW)
    assert sorted(p.lease_id for p in decisions.preemptions) == [1, 3]
    assert sorted(decisions.waits[0].earmarked) == ["a0", "a2", "a3"]


@pytest.mark.parametrize(
    ("setting", "value", "words"),
    [
        ("fairshare_half_life", float("inf"), "fairshare_half_life: must be a positive, finite"),
        ("fairshare_half_life", float("nan"), "fairshare_half_life: must be a positive, finite"),
        ("fairshare_half_life", 0.0, "fairshare_half_life: must be a positive, finite"),
        ("fairshare_half_life", -3600.0, "fairshare_half_life: must be a positive, finite"),
        ("fairshare_resolution", -0.01, "fairshare_resolution: must be more than 0"),
        ("fairshare_resolution", 0.0, "fairshare_resolution: must be more than 0"),
        ("fairshare_resolution", 2.0, "fairshare_resolution: must be more than 0"),
        ("fairshare_shares", {"ann": -1}, "fairshare_shares['ann']: must be a positive, finite"),
        ("fairshare_shares", {"ann": 0}, "fairshare_shares['ann']: must be a positive, finite"),
        ("fairshare_shares", {"ann": "2"}, "fairshare_shares['ann']: must be a positive, finite"),
        ("fairshare_shares", {"ann": float("inf")}, "fairshare_shares['ann']: must be"),
    ],
)
def test_a_fair_share_setting_out_of_range_is_refused_at_load(
    setting: str, value: Any, words: str
) -> None:
    """A review found each accepted: an infinite half-life made every pass
    of a user holding a lease crash (NaN usage), 0 ranked every user who
    had used a GPU alike, a negative step put the heaviest users first."""
    with pytest.raises(TraitError, match=words.replace("[", r"\[").replace("]", r"\]")):
        SchedulingPolicy(config=Config({"SchedulingPolicy": {setting: value}}))


def test_fair_share_settings_in_range_load() -> None:
    config = {"fairshare_half_life": 3600.0, "fairshare_resolution": 1.0}
    policy = SchedulingPolicy(config=Config({"SchedulingPolicy": config}))
    shares = SchedulingPolicy(config=Config({"SchedulingPolicy": {"fairshare_shares": {"a": 2}}}))
    assert (policy.fairshare_half_life, shares.fairshare_shares) == (3600.0, {"a": 2.0})
