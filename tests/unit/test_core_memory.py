"""The broker's in-memory state, coalesced passes and per-lease waiters
(gpubroker.broker): memory always equals what a restart would load, a pass
writes nothing for requests that only wait, and waiters wake only for their
own lease."""

from __future__ import annotations

import asyncio
import re

import pytest
from sqlalchemy import event
from sqlalchemy.exc import OperationalError

from gpubroker.broker.passloop import PassLoop
from gpubroker.broker.waiters import Waiters
from gpubroker.broker.world import World
from gpubroker.core import Broker
from gpubroker.errors import Conflict
from gpubroker.store.models import Lease

from ..conftest import make_broker


def _statements(broker: Broker) -> list[str]:
    """Every SQL statement the broker's engine runs from now on."""
    seen: list[str] = []
    engine = broker._world.repo.session.get_bind()
    event.listen(engine, "before_cursor_execute", lambda *a: seen.append(a[2]))
    return seen


def test_memory_equals_the_store_after_a_failed_command(db_url: str) -> None:
    broker = make_broker(db_url, ["2 x H100"])
    first = broker.request_lease("ann", "nb", gpus=1)
    # the second request is refused half-way (after it checked and released
    # nothing): the transaction rolls back and memory is reloaded from the store
    with pytest.raises(Conflict):
        broker.request_lease("ann", "nb", gpus=1)
    assert broker.validate_state() == []
    assert [x["id"] for x in broker.list_leases()] == [first["id"]]
    assert broker.get_lease(first["id"])["state"] == "granted"


def test_a_read_block_that_a_write_joined_commits_nothing_when_it_fails(db_url: str) -> None:
    """A command that writes inside a read block (``housekeep_mig`` runs a
    pass inside one) and then fails changes nothing, in the store or in
    memory (before: the read block committed what the write had done)."""
    broker = make_broker(db_url, ["2 x H100"])
    lease = broker.request_lease("ann", "", gpus=1)
    world = broker._world
    with pytest.raises(RuntimeError), world.read():
        with world.write():
            world.leases[lease["id"]].container_id = "c0ffee"
        raise RuntimeError("a bug after the write")
    assert broker.get_lease(lease["id"])["container_id"] is None
    assert make_broker(db_url, ["2 x H100"]).get_lease(lease["id"])["container_id"] is None
    assert broker.validate_state() == []
    # a change flushed inside a read block rolls back too
    with pytest.raises(RuntimeError), world.read() as repo:
        world.leases[lease["id"]].container_id = "c0ffee"
        repo.flush()
        raise RuntimeError("a bug after the flush")
    assert make_broker(db_url, ["2 x H100"]).get_lease(lease["id"])["container_id"] is None
    # a read block that only read ends its transaction, keeping the memory
    kept = world.leases[lease["id"]]
    with pytest.raises(KeyError), world.read():
        raise KeyError("not found")
    assert world.leases[lease["id"]] is kept


def test_a_restart_loads_exactly_what_memory_held(db_url: str) -> None:
    broker = make_broker(db_url, ["2 x H100"])
    leases = [broker.request_lease(f"u{i}", "", gpus=1) for i in range(4)]
    broker.release_lease(leases[0]["id"], "done")
    before = {x["id"]: (x["state"], x["slots"]) for x in broker.list_leases()}
    again = make_broker(db_url, ["2 x H100"])
    after = {x["id"]: (x["state"], x["slots"]) for x in again.list_leases()}
    assert after == before
    assert sorted(s for s, _ in after.values()) == ["granted", "granted", "pending"]


def test_a_pass_writes_nothing_for_requests_that_only_wait(db_url: str) -> None:
    broker = make_broker(db_url, ["2 x H100"])
    held = [broker.request_lease(f"holder{i}", "", gpus=1) for i in range(2)]
    waiting = [broker.request_lease(f"w{i}", "", gpus=1) for i in range(50)]
    seen = _statements(broker)
    # the third in the queue leaves: 47 requests move up one place ...
    broker.release_lease(waiting[2]["id"], "changed my mind")
    writes = [s for s in seen if re.match(r"\s*(UPDATE|INSERT)", s)]
    # ... yet only the released lease and its event are written
    assert len(writes) == 2, writes
    assert broker.get_lease(waiting[3]["id"])["queue"]["position"] == 3
    assert broker.get_lease(waiting[49]["id"])["queue"]["position"] == 49
    # and a grant writes the grant, not the queue
    seen.clear()
    broker.release_lease(held[0]["id"], "done")
    assert broker.get_lease(waiting[0]["id"])["state"] == "granted"
    assert broker.get_lease(waiting[1]["id"])["queue"]["position"] == 1
    tables = {
        re.search(r"(?:UPDATE|INSERT INTO) (\w+)", s).group(1) for s in seen if "SELECT" not in s
    }  # type: ignore[union-attr]
    assert tables <= {"leases", "allocations", "lease_events", "usage"}, tables


def test_positions_are_served_from_memory_and_recomputed_after_a_restart(db_url: str) -> None:
    broker = make_broker(db_url, ["1 x H100"])
    broker.request_lease("holder", "", gpus=1)
    first = broker.request_lease("a", "", gpus=1)
    second = broker.request_lease("b", "", gpus=1)
    broker.release_lease(first["id"], "gone")
    assert broker.get_lease(second["id"])["queue"]["position"] == 1
    again = make_broker(db_url, ["1 x H100"])
    view = again.get_lease(second["id"])
    assert view["queue"]["position"] == 1
    assert view["queue"]["reason"] == broker.get_lease(second["id"])["queue"]["reason"]


# -- coalesced passes --------------------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_pass_loop_keeps_a_gap_as_long_as_the_last_pass_took() -> None:
    clock = _Clock()
    loop = PassLoop(0.005, clock)
    assert loop.at_once()  # idle: at once
    clock.now += 0.004  # the pass took 4 ms
    loop.ran()
    assert loop.last_took == pytest.approx(0.004)
    clock.now += 0.001
    assert not loop.at_once() and not loop.at_once()  # two commands, one pass later
    clock.now += 0.004  # the gap is over
    assert loop.at_once()
    clock.now += 0.1  # a slow pass: the gap is capped by the interval
    loop.ran()
    clock.now += 0.006
    assert loop.at_once()
    assert (loop.asked, loop.passes) == (5, 2)


def test_lazy_changes_keep_a_longer_gap_cut_short_by_others() -> None:
    clock = _Clock()
    loop = PassLoop(0.05, clock, lazy_factor=3.0)
    assert loop.at_once(lazy=True)  # idle: at once, lazy or not
    clock.now += 0.004  # the pass took 4 ms
    loop.ran()
    assert loop.gap() == pytest.approx(0.004) and loop.gap(lazy=True) == pytest.approx(0.012)
    clock.now += 0.006  # past the plain gap, within the lazy one
    assert not loop.at_once(lazy=True)  # a request nothing is free for: marked only
    assert loop.at_once(lazy=False)  # a release: the plain gap is over, so at once
    clock.now += 0.004
    loop.ran()
    clock.now += 0.001
    assert not loop.at_once(lazy=True)
    assert not loop.at_once(lazy=False)  # within the plain gap too
    clock.now += 0.004  # the plain gap is over: a lazy ask runs at once now (one is due)
    assert loop.at_once(lazy=True)
    clock.now += 1.0  # a slow pass: both gaps are capped by the interval
    loop.ran()
    assert loop.gap(lazy=True) == pytest.approx(0.05)


async def test_the_loop_keeps_a_lazy_gap_until_another_change_comes() -> None:
    clock = _Clock()  # frozen: the loop's waits are the gaps themselves
    loop = PassLoop(10.0, clock, lazy_factor=100.0)
    ran: list[int] = []

    def run_pass() -> None:
        ran.append(len(ran))
        loop.ran()

    loop.ran()
    loop.last_took = 0.05  # plain gap 0.05 s, lazy gap 5 s
    runner = asyncio.ensure_future(loop.run(run_pass, None))
    try:
        assert not loop.at_once(lazy=True)  # a request nothing is free for
        await asyncio.sleep(0.3)
        assert ran == []  # far past the plain gap: the lazy one holds
        assert not loop.at_once(lazy=False)  # a release, within the plain gap
        clock.now += 0.05  # the plain gap is over, the lazy one (5 s) is not
        for _ in range(100):  # the loop is woken and keeps the plain gap
            if ran:
                break
            await asyncio.sleep(0.02)
        assert ran == [0]
        loop.last_took = 0.05
        assert not loop.at_once(lazy=True)
        await asyncio.sleep(0.3)
        assert ran == [0]
        loop.mark_dirty()  # a rolled-back pass: not lazy
        clock.now += 0.05
        for _ in range(100):
            if len(ran) == 2:
                break
            await asyncio.sleep(0.02)
        assert ran == [0, 1]
    finally:
        runner.cancel()


def test_requests_nothing_is_free_for_and_withdrawals_are_lazy(db_url: str) -> None:
    broker = make_broker(db_url, ["1 x H100"])
    clock = _Clock()
    broker.passes = PassLoop(10.0, clock, lazy_factor=3.0)
    holder = broker.request_lease("holder", "", gpus=1)  # idle: at once
    assert holder["state"] == "granted"
    broker.passes.last_took = 0.5  # plain gap 0.5 s, lazy gap 1.5 s
    clock.now += 1.0
    waiting = broker.request_lease("w", "", gpus=1)  # nothing is free: lazy, marked only
    assert waiting["queue"]["reason"] == "Queued" and broker.passes.passes == 1
    late = broker.request_lease("late", "", gpus=1)
    broker.release_lease(late["id"], "changed my mind")  # a withdrawal: lazy too
    assert broker.passes.passes == 1
    broker.release_lease(holder["id"], "done")  # frees the GPU: the plain gap holds, over
    assert broker.passes.passes == 2
    assert broker.get_lease(waiting["id"])["state"] == "granted"
    assert broker.validate_state() == []


def test_withdrawals_and_restarts_that_may_free_devices_are_not_lazy(db_url: str) -> None:
    broker = make_broker(db_url, ["2 x H100"])
    clock = _Clock()
    broker.passes = PassLoop(10.0, clock, lazy_factor=3.0)
    ann = broker.request_lease("ann", "", gpus=1)  # at once: granted
    broker.passes.last_took = 0.5  # plain gap 0.5 s, lazy gap 1.5 s
    clock.now += 1.0
    big = broker.request_lease("big", "", gpus=2)  # a GPU is free: not lazy, at once
    assert broker.passes.passes == 2
    assert broker.get_lease(big["id"])["queue"]["reason"] == "Resources"  # keeps the free GPU
    broker.passes.last_took = 0.5
    clock.now += 1.0
    bob = broker.request_lease("bob", "", gpus=1)  # the free GPU is reserved for big
    assert broker.passes.passes == 3 and broker.get_lease(bob["id"])["state"] == "pending"
    broker.passes.last_took = 0.5
    clock.now += 1.0
    broker.release_lease(big["id"], "gave up")  # its reservation kept a free GPU back
    assert broker.passes.passes == 4 and broker.get_lease(bob["id"])["state"] == "granted"
    broker.passes.last_took = 0.5
    clock.now += 1.0
    cat = broker.request_lease("cat", "", gpus=1)  # nothing is free: lazy
    assert broker.passes.passes == 4
    # ann's server restarts asking for one GPU: her old lease is released, so not lazy
    again = broker.request_lease("ann", "", gpus=1, restart_of=ann["id"])
    assert broker.passes.passes == 5
    assert broker.get_lease(cat["id"])["state"] == "granted"  # older: first in the queue
    assert broker.get_lease(again["id"])["state"] == "pending"
    assert broker.validate_state() == []


async def test_coalesced_requests_are_granted_by_one_pass(db_url: str) -> None:
    broker = make_broker(db_url, ["8 x H100"])
    clock = _Clock()  # frozen: every command after the first comes "too soon"
    broker.passes = PassLoop(10.0, clock)
    runner = asyncio.ensure_future(broker.passes.run(broker.schedule_now, broker.log))
    try:
        views = [broker.request_lease("u0", "", gpus=1)]
        broker.passes.last_took = 0.5  # as if that pass took 0.5 s: keep a gap
        views += [broker.request_lease(f"u{i}", "", gpus=1) for i in range(1, 6)]
        # the first ran its pass at once; the five after it only marked the state
        assert views[0]["state"] == "granted"
        assert {v["state"] for v in views[1:]} == {"pending"}
        clock.now += 1.0  # the loop's pass is due
        answered = await asyncio.gather(*(broker.after_pass(v) for v in views))
        assert {v["state"] for v in answered} == {"granted"}
        assert broker.passes.passes == 2  # one at once, one for the other five
        assert broker.validate_state() == []
    finally:
        runner.cancel()


async def test_a_request_no_free_device_could_serve_is_answered_at_once(db_url: str) -> None:
    broker = make_broker(db_url, ["2 x H100"])
    clock = _Clock()
    broker.passes = PassLoop(10.0, clock)
    runner = asyncio.ensure_future(broker.passes.run(broker.schedule_now, broker.log))
    try:
        held = [broker.request_lease("h0", "", gpus=1)]  # its pass runs at once
        broker.passes.last_took = 0.5  # keep a gap: the next commands only mark the state
        held.append(broker.request_lease("h1", "", gpus=1))
        clock.now += 1.0
        await broker.after_pass(held[1])  # the loop's pass: both GPUs held
        broker.passes.last_took, clock.now = 0.5, clock.now + 0.1
        full = broker.request_lease("full", "", gpus=1)
        assert full["queue"]["reason"] == "Queued" and full["queue"]["position"] is None
        # nothing is free for it: answered as it stands, without waiting for a pass
        answered = await asyncio.wait_for(broker.after_pass(full), 0.2)
        assert answered["queue"]["reason"] == "Queued"
        broker.release_lease(held[0]["id"], "done")  # a GPU is free now (no pass yet)
        fits = broker.request_lease("fits", "", gpus=1)
        assert fits["queue"]["reason"] == "Queued"
        waiting = asyncio.ensure_future(broker.after_pass(fits))  # a pass could grant it
        await asyncio.sleep(0.05)
        assert not waiting.done()
        clock.now += 1.0  # the loop's pass is due
        # queue order: "full" came first and takes the free GPU; "fits" waits
        assert (await waiting)["queue"]["reason"] == "Resources"
        await broker.settled()  # what a GET does first
        after = broker.get_lease(full["id"])
        assert after["state"] == "granted" and after["version"] > full["version"]
        assert broker.validate_state() == []
    finally:
        runner.cancel()


# -- waiters ------------------------------------------------------------------------------


async def test_waiters_wake_only_for_a_lease_that_changed() -> None:
    waiters = Waiters()
    versions = {1: 5, 2: 7}
    one = asyncio.ensure_future(waiters.wait(1, 5, 5.0))
    two = asyncio.ensure_future(waiters.wait(2, 7, 0.2))
    await asyncio.sleep(0)
    assert waiters.wake(versions.get) == 0
    versions[1] = 6
    assert waiters.wake(versions.get) == 1
    assert await one is True
    assert await two is False  # timed out, never woken
    assert len(waiters) == 0


async def test_a_long_poll_sees_its_grant_and_nothing_else_wakes_it(db_url: str) -> None:
    broker = make_broker(db_url, ["1 x H100"])
    holder = broker.request_lease("holder", "", gpus=1)
    mine = broker.request_lease("me", "", gpus=1)
    other = broker.request_lease("other", "", gpus=1)
    poll = asyncio.ensure_future(broker.wait_for_change(other["id"], 5.0))
    await asyncio.sleep(0)
    # changes of other leases: the holder's grant goes to "me", "other" moves up
    broker.release_lease(holder["id"], "done")
    view = await poll
    assert view["queue"]["position"] == 1 and view["version"] > other["version"]
    assert broker.get_lease(mine["id"])["state"] == "granted"


# -- a failed commit: memory goes back to the store's, nothing else is lost ---------------


def _failing_commits(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(self: World) -> None:
        raise OperationalError("COMMIT", {}, Exception("database is locked"))

    monkeypatch.setattr(World, "_insert_events", boom)


def test_a_failed_commit_keeps_waits_and_versions_and_numbers_no_lease_twice(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    broker = make_broker(db_url, ["2 x H100"])
    holder = broker.request_lease("holder", "", gpus=2)
    first = broker.request_lease("w", "", gpus=1)
    seen = broker.get_lease(first["id"])
    with monkeypatch.context() as patch:
        _failing_commits(patch)
        with pytest.raises(OperationalError):
            broker.request_lease("ann", "nb", gpus=2)  # rolled back
    after = broker.get_lease(first["id"])
    assert after["queue"] == seen["queue"] and after["version"] > seen["version"]
    bob = broker.request_lease("bob", "nb", gpus=1)
    assert bob["id"] > first["id"] + 1  # the rolled-back request's id is not reused
    broker.release_lease(holder["id"], "done")
    assert [len(broker.get_lease(x["id"])["slots"]) for x in (first, bob)] == [1, 1]
    assert broker.validate_state() == []


def test_an_object_read_after_a_rollback_does_not_swallow_later_commits(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    broker = make_broker(db_url, ["2 x H100"])
    ann = broker.request_lease("ann", "nb", gpus=1)
    kept = broker.server_leases()  # the culler keeps these across its awaits
    broker.release_lease(ann["id"], "done")
    with monkeypatch.context() as patch:
        _failing_commits(patch)
        with pytest.raises(OperationalError):
            broker.request_lease("x", "", gpus=1)
    assert kept[0].user == "ann"  # a lazy read outside any block
    bob = broker.request_lease("bob", "nb", gpus=1)
    with broker.session_factory() as fresh:
        assert fresh.get(Lease, bob["id"]) is not None  # committed
    assert broker.validate_state() == []


def test_a_rolled_back_pass_is_asked_for_again(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    broker = make_broker(db_url, ["1 x H100"])
    clock = _Clock()
    broker.passes = PassLoop(10.0, clock)
    holder = broker.request_lease("holder", "", gpus=1)
    broker.request_lease("w", "", gpus=1)
    with monkeypatch.context() as patch:
        _failing_commits(patch)
        with pytest.raises(OperationalError):
            broker.release_lease(holder["id"], "done")  # its pass ran, then rolled back
    assert broker.passes._dirty.is_set()  # the loop will run it again


def test_scheduler_values_are_built_again_only_for_changed_leases(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpubroker.broker import inputs

    broker = make_broker(db_url, ["2 x H100"])
    for i in range(2):
        broker.request_lease(f"holder{i}", "", gpus=1)
    for i in range(30):
        broker.request_lease(f"w{i}", "", gpus=1)
    broker.check_state = "off"  # the check builds every value afresh
    built: list[int] = []
    real = inputs.request_of
    monkeypatch.setattr(inputs, "request_of", lambda x, *a: built.append(x.id) or real(x, *a))
    lease = broker.request_lease("late", "", gpus=1)
    broker.release_lease(lease["id"], "done")
    # the new request is built (its first pass); none of the 30 others
    assert set(built) == {lease["id"]}
    broker.check_state = "raise"
    assert broker.validate_state() == []


def test_a_scheduler_value_left_stale_is_a_broken_invariant(db_url: str) -> None:
    from sqlalchemy.orm.attributes import set_committed_value

    broker = make_broker(db_url, ["1 x H100"])
    broker.request_lease("holder", "", gpus=1)
    waiting = broker.request_lease("w", "", gpus=1)
    broker.check_state = "log"
    lease = broker._world.leases[waiting["id"]]
    # a change no one told the inputs of (as a forgotten mark would be)
    set_committed_value(lease, "priority_class", "preemptible")
    found = broker.validate_state()
    assert any(f"lease {waiting['id']}: scheduler value" in p for p in found)


def test_usage_lost_in_a_crash_between_writes_is_loaded_from_the_leases(db_url: str) -> None:
    broker = make_broker(db_url, ["2 x H100"])
    seen = _statements(broker)
    for user in ("ann", "bob", "ann"):
        lease = broker.request_lease(user, "", gpus=2)
        broker.release_lease(lease["id"], "done")
    written = [s for s in seen if s.startswith(("INSERT INTO usage", "UPDATE usage"))]
    assert written == []  # a release writes no usage row
    broker.write_usage()
    lease = broker.request_lease("ann", "", gpus=1)
    broker.release_lease(lease["id"], "done")  # after the write: in memory only
    before = dict(broker._world.usage)
    # the broker dies here (no write); the next one loads rows + later releases
    again = make_broker(db_url, ["2 x H100"])
    assert again._world.usage.keys() == before.keys() == {"ann", "bob"}
    for user, record in before.items():
        assert again._world.usage[user].as_of == record.as_of
        assert again._world.usage[user].gpu_seconds == pytest.approx(record.gpu_seconds, rel=1e-12)
    assert again._world.usage_behind == {"ann"}


def test_a_lease_granted_above_guarantees_is_reclaimable_in_its_grant(db_url: str) -> None:
    broker = make_broker(db_url)
    broker.policy.group_quotas = {"A": {"guaranteed": 4}, "B": {"guaranteed": 4}}
    views = [broker.request_lease(f"b{i}", "", 1, groups=["B"]) for i in range(6)]
    # the 5th and 6th borrow above group B's guarantee: flagged as they are granted
    assert [v["reclaimable"] for v in views] == [False] * 4 + [True] * 2
    assert [x["reclaimable"] for x in broker.list_leases()] == [False] * 4 + [True] * 2


def test_usage_is_not_counted_twice_when_the_clock_steps_back(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import datetime as dt

    import gpubroker.core as core

    broker = make_broker(db_url)
    # before the write, a load folds the two releases in stamp order, not in
    # the order they happened: equal only to ~1e-5 (the check wants 1e-9)
    broker.check_state = "off"
    real = core.utcnow
    lease = broker.request_lease("ann", "a", 1)
    broker.release_lease(lease["id"], "done")
    monkeypatch.setattr(core, "utcnow", lambda: real() - dt.timedelta(seconds=30))
    lease = broker.request_lease("ann", "c", 1)
    broker.release_lease(lease["id"], "done")  # stamped 30 s before the first release
    broker.write_usage()
    kept = broker._world.usage["ann"]
    monkeypatch.setattr(core, "utcnow", real)
    again = make_broker(db_url)
    assert again._world.usage["ann"] == kept
    assert kept.gpu_seconds < 1.0  # two short leases, not 30 s of phantom use


def test_usage_is_charged_with_the_half_life_in_force(db_url: str) -> None:
    broker = make_broker(db_url)
    broker.policy.fairshare_half_life = 3600.0
    assert broker._world.half_life == 3600.0


def test_kept_devices_follow_the_earmarks_of_pending_requests(db_url: str) -> None:
    from gpubroker.passes import set_wait

    broker = make_broker(db_url, ["1 x H100"])
    holder = broker.request_lease("holder", "", gpus=1)
    waiting = broker.request_lease("w", "", gpus=1)
    inputs = broker._world.refresh_inputs()
    assert inputs.earmarked_devices() == frozenset()
    uuid = holder["devices"][0]["uuid"]
    lease = broker._world.leases[waiting["id"]]
    set_wait(lease, "Preempting", "reclaimed", 1, None, [uuid], inputs)
    assert broker._world.refresh_inputs().earmarked_devices() == {uuid}
    set_wait(lease, "Resources", "waiting", 1, None, None, inputs)
    assert broker._world.refresh_inputs().earmarked_devices() == frozenset()
