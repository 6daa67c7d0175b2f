"""Adversarial review of the broker core (gpubroker.broker): a command that
fails half-way leaves memory, side effects and subscribers exactly as the
store's committed truth says, and random command sequences keep memory equal
to what a restart loads, with every lease's log replaying to its state."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import itertools
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy.exc import OperationalError

from gpubroker.broker.passloop import PassLoop
from gpubroker.broker.world import World
from gpubroker.core import Broker
from gpubroker.devices.fake import FakeDeviceBackend
from gpubroker.errors import BrokerError
from gpubroker.model.lifecycle import Event, replay
from gpubroker.store.db import make_engine, make_session_factory, upgrade
from gpubroker.store.models import Intent
from gpubroker.transitions import as_events

from .test_sharing_core import sharing_broker


def _fail_commits(monkeypatch: pytest.MonkeyPatch, after: int = 0) -> None:
    """Every commit of the broker's memory fails (``after``: the first
    ``after`` commits succeed), as a locked or lost database makes it."""
    real = World._insert_events
    calls = itertools.count()

    def boom(self: World) -> None:
        if next(calls) >= after:
            raise OperationalError("COMMIT", {}, Exception("database is locked"))
        real(self)

    monkeypatch.setattr(World, "_insert_events", boom)


def _broker(url: str, inventory: list[str]) -> Broker:
    backend = FakeDeviceBackend(inventory=inventory, node_name="node-a")
    broker = Broker(session_factory=make_session_factory(make_engine(url)), backend=backend)
    broker.sync_inventory()
    broker.adopt()
    return broker


# -- side effects of a command that rolls back ------------------------------------------


def test_a_rolled_back_release_leaves_the_mig_instance_of_the_granted_lease(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broker = sharing_broker(db_url, tmp_path)
    lease = broker.request_lease("ann", "", mig_profile="3g.40gb", pool="mig")
    slot = lease["slots"][0]
    with monkeypatch.context() as patch:
        _fail_commits(patch)
        with pytest.raises(OperationalError):
            broker.release_lease(lease["id"], "done")
    # the store says granted: its holder still runs on the instance
    assert broker.get_lease(lease["id"])["state"] == "granted"
    assert slot["uuid"] in [m.uuid for m in broker.backend.mig_devices(slot["device"])]
    broker.release_lease(lease["id"], "done")  # committed: now it goes
    assert slot["uuid"] not in [m.uuid for m in broker.backend.mig_devices(slot["device"])]


def test_a_rolled_back_preemption_asks_the_hub_to_stop_nothing(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    broker = _broker(db_url, ["1 x H100"])
    stopped: list[dict[str, Any]] = []
    broker.on_evict = stopped.append
    lease = broker.request_lease("ann", "nb", gpus=1)
    with monkeypatch.context() as patch:
        _fail_commits(patch)
        with pytest.raises(OperationalError):
            broker.preempt_lease(lease["id"], "maintenance", actor="root")
    assert stopped == []  # no stop is stored: the hub must not be asked
    broker.preempt_lease(lease["id"], "maintenance", actor="root")
    assert [x["id"] for x in stopped] == [lease["id"]]


# -- events: subscribers see what committed, and only that ---------------------------------


def test_events_a_command_committed_reach_subscribers_when_a_later_part_fails(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    broker = _broker(db_url, ["2 x H100"])
    seen: list[Event] = []
    broker.bus.subscribe(seen.append)
    broker.inventory_unknown("the engine is down")  # no grants until read again
    lease = broker.request_lease("ann", "", gpus=1)
    assert lease["state"] == "pending"
    # device 1 went into MIG mode behind the broker's back: the inventory
    # read grants the request (its first transaction commits), then turns
    # MIG mode off again and runs a pass in a second transaction, which fails
    broker.backend.set_mig_mode(broker.backend.devices()[1].uuid, True)
    with monkeypatch.context() as patch:
        _fail_commits(patch, after=2)
        with pytest.raises(OperationalError):
            broker.sync_inventory()
    stored = broker.lease_events(lease["id"])
    assert [e["kind"] for e in stored][-1] == "granted"  # committed
    # subscribers (the usage ledger, the notifier) saw exactly what committed
    assert [(e.lease_id, e.kind) for e in seen] == [(lease["id"], e["kind"]) for e in stored]


def test_a_rolled_back_command_publishes_nothing(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    broker = _broker(db_url, ["1 x H100"])
    seen: list[Event] = []
    broker.bus.subscribe(seen.append)
    holder = broker.request_lease("ann", "", gpus=1)
    broker.request_lease("bob", "", gpus=1)
    seen.clear()
    with monkeypatch.context() as patch:
        _fail_commits(patch)
        with pytest.raises(OperationalError):
            broker.release_lease(holder["id"], "done")
    assert seen == []
    broker.release_lease(holder["id"], "done")
    assert [e.kind for e in seen] == ["released", "granted"]


# -- random command sequences: memory, store, log and subscribers agree -------------------

_USERS = ("ann", "bob", "cy")
_OPS = st.one_of(
    st.tuples(
        st.just("request"),
        st.sampled_from(_USERS),
        st.sampled_from(("", "nb")),
        st.integers(1, 2),
        st.sampled_from(("interactive", "batch", "preemptible")),
    ),
    st.tuples(st.just("release"), st.integers(0, 9)),
    st.tuples(st.just("cull"), st.integers(0, 9)),
    st.tuples(st.just("preempt"), st.integers(0, 9)),
    st.tuples(st.just("priority"), st.integers(0, 9), st.sampled_from(("interactive", "batch"))),
    st.tuples(st.just("reconcile"), st.sets(st.sampled_from(_USERS))),
    st.tuples(st.just("quota"), st.sampled_from(_USERS), st.integers(0, 2)),
    st.tuples(st.just("drain"), st.integers(0, 2)),
    st.tuples(st.just("tick")),
    st.tuples(st.just("pass")),
)


class _Clock:
    def __init__(self) -> None:
        self.now = dt.datetime(2030, 1, 1, tzinfo=dt.timezone.utc)

    def __call__(self) -> dt.datetime:
        return self.now

    def tick(self, seconds: float) -> None:
        self.now += dt.timedelta(seconds=seconds)


def _run(broker: Broker, op: tuple[Any, ...], ids: list[int], clock: _Clock) -> None:
    """Run one drawn command (a refusal, 4xx, is an answer too)."""
    name, *args = op

    def pick(k: int) -> int:
        return ids[k % len(ids)] if ids else 1

    if name == "request":
        user, server, gpus, cls = args
        ids.append(broker.request_lease(user, server, gpus=gpus, priority_class=cls)["id"])
    elif name == "release":
        broker.release_lease(pick(args[0]), "done")
    elif name == "cull":
        broker.stop_lease(pick(args[0]), "idle", cause="cull")
    elif name == "preempt":
        broker.preempt_lease(pick(args[0]), "maintenance", actor="root")
    elif name == "priority":
        broker.set_priority_class(pick(args[0]), args[1], actor="root")
    elif name == "reconcile":
        servers = [(u, s) for u in args[0] for s in ("", "nb")]
        broker.reconcile(servers, clock())
    elif name == "quota":
        broker.set_quota("user", args[0], 0, args[1], actor="root")
    elif name == "drain":
        uuid = sorted(broker._world.devices)[args[0]]
        broker.set_drained(uuid, not broker._world.devices[uuid].drained, actor="root")
    elif name == "tick":
        clock.tick(40)
    else:
        broker.schedule_now()


def _picture(world: World) -> dict[str, Any]:
    """What a world holds that a restart must load the same."""
    leases = {}
    for lease_id, x in world.leases.items():
        slots = sorted((a.device_uuid, a.instance_uuid or "") for a in x.allocations if a.active)
        stored = (x.state, slots, x.priority_class, x.preempted_for, x.reclaimable)
        leases[lease_id] = stored + ((x.version,) if x.state == "granted" else ())
    return {
        "leases": leases,
        "stops": {i: (s.reason, s.cause, s.state) for i, s in world.stops.items()},
        "quotas": {k: (q.guaranteed, q.limit) for k, q in world.quotas.items()},
        "devices": {u: (d.present, d.drained, d.mig_target) for u, d in world.devices.items()},
    }


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A migrated SQLite store, copied for each example."""
    path = tmp_path_factory.mktemp("template") / "broker.sqlite"
    upgrade(f"sqlite:///{path}")
    return path


_examples = itertools.count()


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=st.lists(st.tuples(_OPS, st.booleans()), min_size=1, max_size=14))
def test_random_commands_keep_memory_store_log_and_subscribers_in_step(
    template: Path,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
    ops: list[tuple[tuple[Any, ...], bool]],
) -> None:
    path = tmp_path_factory.getbasetemp() / f"prop-{next(_examples)}.sqlite"
    shutil.copy(template, path)
    url = f"sqlite:///{path}"
    broker = _broker(url, ["3 x H100"])
    clock = _Clock()
    broker.runner.clock = clock
    broker.evict_timeout = 60.0
    asked: list[int] = []
    broker.on_evict = lambda view: asked.append(view["id"])
    seen: list[Event] = []
    broker.bus.subscribe(seen.append)
    ids: list[int] = []
    for op, fail in ops:
        with monkeypatch.context() as patch:
            if fail:
                _fail_commits(patch)
            with contextlib.suppress(BrokerError, OperationalError):  # refused, or rolled back
                _run(broker, op, ids, clock)
        assert broker.validate_state(ids) == []
        fresh = World(broker.session_factory)
        try:
            assert _picture(broker._world) == _picture(fresh), op
        finally:
            fresh.close()
    # every lease's log replays to its stored state; subscribers saw exactly the log
    logged: list[tuple[int, str, str]] = []
    for lease_id in sorted(set(ids)):
        events = broker.lease_events(lease_id)
        assert replay(as_events_of(broker, lease_id)) == broker.get_lease(lease_id)["state"]
        assert all(e["actor"] and e["stimulus"] for e in events)
        logged += [(lease_id, e["kind"], e["stimulus"]) for e in events]
    published = sorted((e.lease_id, e.kind, e.stimulus) for e in seen if e.lease_id in ids)
    assert published == sorted(logged)
    # the hub was asked to stop only servers whose stop was stored
    with broker._world.read() as repo:
        stored_stops = {x.lease_id for x in repo.session.query(Intent)}
    assert set(asked) <= stored_stops
    broker._world.close()


def as_events_of(broker: Broker, lease_id: int) -> list[Event]:
    with broker._world.read() as repo:
        return as_events(repo.events_of(lease_id))


# -- the pass loop: a pass that rolls back is run again -----------------------------------


class _Monotonic:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_a_loop_pass_that_rolls_back_is_run_again(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    broker = _broker(db_url, ["1 x H100"])
    clock = _Monotonic()
    broker.passes = PassLoop(0.01, clock)
    holder = broker.request_lease("ann", "", gpus=1)
    waiter = broker.request_lease("bob", "", gpus=1)
    broker.passes.last_took = 0.005  # keep a gap: the release only marks the state
    broker.release_lease(holder["id"], "done")
    assert broker.get_lease(waiter["id"])["state"] == "pending"
    tries: list[int] = []

    def run_pass() -> None:
        tries.append(1)
        with monkeypatch.context() as patch:
            if len(tries) == 1:  # the first try rolls back (a locked database)
                _fail_commits(patch)
            broker.schedule_now()

    clock.now += 1.0
    loop = asyncio.ensure_future(broker.passes.run(run_pass, broker.log))
    try:
        for _ in range(100):
            await asyncio.sleep(0.01)
            clock.now += 0.01
            if len(tries) >= 2:
                break
        assert len(tries) == 2
        assert broker.get_lease(waiter["id"])["state"] == "granted"
    finally:
        loop.cancel()


# -- what memory alone holds survives a rollback ----------------------------------------


def test_a_rolled_back_release_keeps_what_the_ledger_held_a_lease_for(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpubroker import core

    from .test_usage_ledger import HOUR, T0, Clock, ledger_of, restart

    clock = Clock(T0)
    monkeypatch.setattr(core, "utcnow", clock)
    broker = _broker(db_url, ["8 x H100"])
    ledger = ledger_of(broker, clock)
    lease = broker.request_lease("eve", "", 2, holder_kind="external")
    clock.advance(HOUR)
    ledger.flush()
    clock.advance(HOUR)  # down for an hour, then started again
    again = restart(db_url, clock, clock.epoch())
    held = again._world.inputs.held.get(lease["id"])
    assert held is not None  # fair share charges it as the ledger counts it
    with monkeypatch.context() as patch:
        _fail_commits(patch)
        with pytest.raises(OperationalError):
            again.release_lease(lease["id"], "done")
    assert again.get_lease(lease["id"])["state"] == "granted"
    assert again._world.inputs.held.get(lease["id"]) == held


# -- stored stops are asked for once per start --------------------------------------------


def test_a_stop_decided_at_adoption_is_asked_for_once(db_url: str, tmp_path: Path) -> None:
    broker = sharing_broker(db_url, tmp_path)
    lease = broker.request_lease("ann", "nb", mig_profile="1g.10gb")
    state_file = tmp_path / "fake-gpus.json"
    state = json.loads(state_file.read_text())
    state["_mig"][lease["slots"][0]["device"]]["instances"] = []  # a GPU reset
    state_file.write_text(json.dumps(state))
    backend = FakeDeviceBackend(
        inventory=["8 x H100"], node_name="node-a", mig_enabled=[0, 1], state_file=str(state_file)
    )
    again = Broker(
        session_factory=make_session_factory(make_engine(db_url)),
        backend=backend,
        config=broker.config,
    )
    asked: list[int] = []
    again.on_evict = lambda view: asked.append(view["id"])
    again.sync_inventory()
    again.adopt()
    assert asked == [lease["id"]]  # the hub is asked once, not again as a resumed stop
    assert again._world.stops[lease["id"]].attempts == 1
