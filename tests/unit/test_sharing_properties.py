"""Property tests of fractional slots (MIG instances, time-sliced shares)
through the broker's scheduling pass.

Hypothesis draws a small mixed cluster -- MIG devices (H100 80GB, A100 40GB,
A30) in two ``mig`` pools, some with foreign instances or drained, a
``timeslice`` pool with a memory reserve, a few ``exclusive`` devices -- and
a stream of events: requests for MIG profiles some device offers, for
shares (1 MiB up to a device's memory, 1-3 per request), for whole GPUs;
releases of running leases; cancellations. After each event one pass of
:func:`~gpubroker.scheduler.schedule` runs and its grants become running
leases (with their parts), and :func:`check_pass` asserts:

a. every MIG device's instances (foreign + held) form a valid layout;
b. no time-sliced device hands out more than its memory less its reserve;
c. the shares of one lease sit on distinct devices of one node;
d. no device is both held whole and in parts, and whole grants are on
   exclusive devices; parts only on in-service devices of the right pool;
e. every waiting fractional request has a known reason and a message;
   ``Fragmented``, ``Resources`` and ``PoolDrained`` are true statements
   about the cluster (nothing fits anywhere after the pass);
f. weights: a lease counts the sum of its parts' weights; a MIG part
   compute slices / the device's, a share memory / the device's memory;
g. all of it under both strategies (``least-fragmentation``, ``first-fit``).

Static layouts: grants only ever take a free static instance, with its
UUID. One :meth:`~gpubroker.scheduler.sharing.SharingPool.place_mig` call
on a random layout: the strategy's own choice, and ``Fragmented`` exactly
when some device has the slices free but scattered.
"""

from __future__ import annotations

import datetime as dt
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import pytest
from hypothesis import event as note_outcome
from hypothesis import given, settings
from hypothesis import strategies as st

from gpubroker.devices import mig
from gpubroker.scheduler import (
    Decisions,
    Instance,
    Part,
    Policy,
    Quota,
    Request,
    Running,
    SchedulerState,
    Slot,
    Wait,
    WaitReason,
    queue_order,
    schedule,
)
from gpubroker.scheduler.sharing import STRATEGIES, SharingPool, share_weight

T0 = dt.datetime(2026, 3, 2, 9, 0, tzinfo=dt.timezone.utc)
STEP = dt.timedelta(seconds=60)
EPS = 1e-9
GIB = 1024

#: NVML name and memory (MiB) of the models drawn (gpubroker.devices.models)
MODELS = {
    "H100": ("NVIDIA H100 80GB HBM3", 81559),
    "A100": ("NVIDIA A100-SXM4-40GB", 40960),
    "A30": ("NVIDIA A30", 24576),
}
MIG_POOLS = ("mig", "mig-b")
USERS = ("ana", "ben", "chi")
#: reasons a fractional request may wait with in these worlds
FRACTIONAL_REASONS = frozenset(
    {
        WaitReason.resources,
        WaitReason.fragmented,
        WaitReason.pool_drained,
        WaitReason.quota_user,
        WaitReason.quota_group,
    }
)

PROPERTIES = settings(max_examples=200, deadline=None)


def spec_of(slot: Slot) -> mig.GpuMigSpec:
    spec = mig.spec_for(slot.model)
    assert spec is not None
    return spec


def placement(part: Part | Instance) -> mig.Placement:
    return mig.Placement(part.start, part.size)


# --- strategies ----------------------------------------------------------------------


@st.composite
def layouts(
    draw: st.DrawFn, spec: mig.GpuMigSpec, max_size: int = 3, min_size: int = 0
) -> list[tuple[str, mig.Placement]]:
    """A valid layout: ``min_size`` to ``max_size`` tries to add an instance
    of a random profile at one of its valid placements (the first always
    succeeds: an empty GPU takes every profile)."""
    layout: list[tuple[str, mig.Placement]] = []
    names = sorted(spec.profiles)
    small = sorted(p.name for p in spec.profiles.values() if p.compute_slices <= 2)
    for _ in range(draw(st.integers(min_size, max_size))):
        name = draw(st.sampled_from(names) | st.sampled_from(small))
        valid = mig.valid_placements(spec, layout, name)
        if valid:
            layout.append((name, draw(st.sampled_from(valid))))
    return layout


@st.composite
def clusters(draw: st.DrawFn, static: bool = False) -> tuple[Slot, ...]:
    """2-4 MIG devices in pools ``mig``/``mig-b`` over nodes m0, m1 (some
    with foreign instances, or a static layout when ``static``; few
    drained), 2-3 time-sliced devices in pool ``ts`` over nodes t0, t1 with
    a common reserve, and two exclusive devices."""
    slots: list[Slot] = []
    index: Counter[str] = Counter()

    def add(node: str, **kw: object) -> None:
        slots.append(Slot(f"GPU-{node}-{index[node]}", node, index[node], **kw))  # type: ignore[arg-type]
        index[node] += 1

    for k in range(draw(st.integers(2, 4))):
        model, memory = MODELS[draw(st.sampled_from(("H100", "H100", "A100", "A30")))]
        spec = mig.spec_for(model)
        assert spec is not None
        instances = tuple(
            Instance(name, p.start, p.size, f"MIG-{k}-{p.start}", draw(st.sampled_from((0, 999))))
            for name, p in draw(layouts(spec, max_size=4 if static else 2, min_size=int(static)))
        )
        add(
            f"m{draw(st.integers(0, 1))}",
            drained=draw(st.integers(0, 9)) == 0,
            pool=draw(st.sampled_from(MIG_POOLS)),
            mode="mig",
            model=model,
            memory_mib=memory,
            static=instances if static else (),
            foreign=() if static else instances,
        )
    reserve = draw(st.sampled_from((0, 1024, 2048)))
    for _ in range(draw(st.integers(2, 3))):
        model, memory = MODELS[draw(st.sampled_from(("H100", "A100")))]
        add(
            f"t{draw(st.integers(0, 1))}",
            drained=draw(st.integers(0, 14)) == 0,
            pool="ts",
            mode="timeslice",
            model=model,
            memory_mib=memory,
            reserve_mib=reserve,
        )
    for _ in range(2):
        add("x0")
    return tuple(slots)


#: an event between two passes; the first item says which
Event = tuple[object, ...]


ALL_KINDS = ("mig", "share", "gpus", "release", "cancel")


def events(slots: tuple[Slot, ...], kinds: tuple[str, ...] = ALL_KINDS) -> st.SearchStrategy[Event]:
    """Events of ``kinds`` (repeat a kind to make it likelier): requests for
    MIG profiles some device of the cluster offers, for shares (of up to the
    largest time-sliced device's memory, 1-3 of them), for whole GPUs;
    releases and cancellations (``which`` picks one modulo their count)."""
    profiles = sorted({p for s in slots if s.mode == "mig" for p in spec_of(s).profiles})
    biggest = max(s.memory_mib for s in slots if s.mode == "timeslice")
    user = st.sampled_from(USERS)
    cls = st.sampled_from(("interactive", "batch"))
    limit = st.none() | st.integers(1, 10).map(lambda n: 60.0 * n)
    memory = (
        st.sampled_from((5, 10, 20, 40)).map(lambda g: g * GIB)
        | st.integers(1, biggest // GIB).map(lambda g: g * GIB)
        | st.integers(1, biggest)
    )
    which = st.integers(0, 99)
    each: dict[str, st.SearchStrategy[Event]] = {
        "mig": st.tuples(
            st.just("mig"), st.sampled_from(profiles), st.sampled_from((None, *MIG_POOLS)),
            user, cls, limit,
        ),
        "share": st.tuples(
            st.just("share"), memory, st.integers(1, 3), st.sampled_from((None, "ts")),
            user, cls, limit,
        ),
        "gpus": st.tuples(st.just("gpus"), st.integers(1, 2), user, cls, limit),
        "release": st.tuples(st.just("release"), which),
        "cancel": st.tuples(st.just("cancel"), which),
    }  # fmt: skip
    return st.sampled_from(kinds).flatmap(lambda kind: each[kind])


def policies() -> st.SearchStrategy[Policy]:
    """No quotas, or limits of 0.5-2 GPUs for some users."""
    limits = st.sampled_from((0.5, 1.0, 2.0)).map(lambda x: Quota(0.0, x))
    return st.builds(Policy, user_quotas=st.dictionaries(st.sampled_from(USERS), limits))


# --- requests as the broker makes them ---------------------------------------------------


def estimate(
    slots: Iterable[Slot], kind: str, what: str | int, count: int, pool: str | None
) -> float:
    """The weight admission charges a waiting request (gpubroker.admission):
    a profile's compute fraction on the first device offering it; shares:
    ``count`` x memory / the largest device's memory."""
    able = [s for s in slots if s.mode == kind and pool in (None, s.pool)]
    if kind == "mig":
        for slot in able:
            spec = spec_of(slot)
            if what in spec.profiles:
                return spec.profile(str(what)).compute_slices / spec.compute_slices
        return 1.0
    largest = max((s.memory_mib for s in able), default=0)
    return count * share_weight(int(what), largest)


def make_request(slots: tuple[Slot, ...], lease_id: int, event: Event, now: dt.datetime) -> Request:
    kind = event[0]
    if kind == "mig":
        _, profile, pool, user, cls, limit = event
        assert isinstance(profile, str)
        return Request(
            lease_id, str(user), 1, now, priority_class=str(cls), time_limit=limit,  # type: ignore[arg-type]
            kind="mig", mig_profile=profile, pool=pool,  # type: ignore[arg-type]
            weight=estimate(slots, "mig", profile, 1, pool),  # type: ignore[arg-type]
        )  # fmt: skip
    if kind == "share":
        _, memory, count, pool, user, cls, limit = event
        assert isinstance(memory, int) and isinstance(count, int)
        return Request(
            lease_id, str(user), count, now, priority_class=str(cls), time_limit=limit,  # type: ignore[arg-type]
            kind="share", memory_mib=memory, pool=pool,  # type: ignore[arg-type]
            weight=estimate(slots, "timeslice", memory, count, pool),  # type: ignore[arg-type]
        )  # fmt: skip
    _, gpus, user, cls, limit = event
    assert isinstance(gpus, int)
    return Request(lease_id, str(user), gpus, now, priority_class=str(cls), time_limit=limit)  # type: ignore[arg-type]


# --- what the cluster holds ------------------------------------------------------------


@dataclass
class Held:
    """Who holds what after a pass: whole devices, MIG instances, shares."""

    whole: Counter[str]
    instances: dict[str, list[tuple[str, mig.Placement, int | None, str]]]
    shares: dict[str, int]

    @classmethod
    def of(cls, slots: Iterable[Slot], leases: Iterable[Running]) -> Held:
        held = cls(Counter(), defaultdict(list), defaultdict(int))
        for slot in slots:
            for inst in slot.foreign:
                held.instances[slot.uuid].append((inst.profile, placement(inst), None, inst.uuid))
        for lease in leases:
            held.whole.update(lease.devices)
            for part in lease.parts:
                if part.kind == "mig":
                    held.instances[part.device].append(
                        (part.profile, placement(part), lease.lease_id, part.instance)
                    )
                else:
                    held.shares[part.device] += part.memory_mib
        return held

    def layout(self, uuid: str) -> list[tuple[str, mig.Placement]]:
        return [(name, where) for name, where, _owner, _uuid in self.instances.get(uuid, ())]


def able(slots: Iterable[Slot], held: Held, request: Request, mode: str) -> list[Slot]:
    """In-service devices of ``mode`` (of the request's pool), not held whole."""
    return [
        s
        for s in slots
        if s.mode == mode
        and not s.drained
        and s.uuid not in held.whole
        and request.pool in (None, s.pool)
    ]


def mig_fits(slot: Slot, held: Held, profile: str) -> bool:
    """Whether one ``profile`` instance could still be had on ``slot``."""
    spec = spec_of(slot)
    if profile not in spec.profiles:
        return False
    if slot.static:
        taken = {uuid for *_rest, uuid in held.instances.get(slot.uuid, ())}
        return any(i.profile == profile and i.uuid not in taken for i in slot.static)
    return bool(mig.valid_placements(spec, held.layout(slot.uuid), profile))


def share_room(slot: Slot, held: Held) -> int:
    return slot.memory_mib - slot.reserve_mib - held.shares.get(slot.uuid, 0)


def shares_fit(devices: list[Slot], count: int, need: int, room: Callable[[Slot], int]) -> bool:
    """Whether ``count`` of ``devices`` on one node have ``room`` for ``need`` MiB."""
    per_node = Counter(s.node for s in devices if room(s) >= need)
    return any(n >= count for n in per_node.values())


def capacity(slot: Slot) -> int:
    """MiB a time-sliced device ever hands out as shares."""
    return slot.memory_mib - slot.reserve_mib


# --- invariants ------------------------------------------------------------------------


def check_held(slots: tuple[Slot, ...], held: Held, leases: Iterable[Running]) -> None:
    """(a)-(d) and (f) on what running leases (and foreign instances) hold."""
    by_uuid = {s.uuid: s for s in slots}
    parts_on = Counter(p.device for lease in leases for p in lease.parts)
    assert not [u for u, n in held.whole.items() if n > 1], f"device in two leases: {held.whole}"
    both = set(held.whole) & set(parts_on)
    assert not both, f"(d) devices held whole and in parts: {both}"
    for uuid in held.whole:
        assert by_uuid[uuid].mode == "exclusive", f"(d) {uuid} held whole in a sharing pool"
    for uuid, instances in held.instances.items():
        slot = by_uuid[uuid]
        assert slot.mode == "mig"
        layout = held.layout(uuid)
        assert mig.is_valid_layout(spec_of(slot), layout), f"(a) invalid layout on {uuid}: {layout}"
        if slot.static:
            statics = {(i.profile, placement(i), i.uuid) for i in slot.static}
            for name, where, _owner, inst in instances:
                assert (name, where, inst) in statics, f"not a static instance: {name} {where}"
            taken = Counter(inst for *_rest, inst in instances)
            assert not [u for u, n in taken.items() if n > 1], f"static instance twice: {taken}"
    for uuid, memory in held.shares.items():
        slot = by_uuid[uuid]
        assert slot.mode == "timeslice"
        assert memory <= slot.memory_mib - slot.reserve_mib, f"(b) {uuid} over-committed"
    for lease in leases:
        if not lease.parts:
            continue
        assert lease.devices == ()
        assert lease.gpus == pytest.approx(sum(p.weight for p in lease.parts))  # (f)
        for part in lease.parts:
            slot = by_uuid[part.device]
            if part.kind == "mig":
                spec = spec_of(slot)
                prof = spec.profile(part.profile)
                assert part.weight == pytest.approx(prof.compute_slices / spec.compute_slices)
                assert part.size == prof.memory_slices and placement(part) in prof.placements
                memory = prof.memory_mib or prof.memory_gib * GIB
                if slot.static:  # the memory the driver reports, where known
                    given = next(i for i in slot.static if i.uuid == part.instance)
                    memory = given.memory_mib or memory
                assert part.memory_mib == memory
                assert bool(part.instance) == bool(slot.static)
            else:
                assert part.kind == "share"
                assert part.weight == pytest.approx(share_weight(part.memory_mib, slot.memory_mib))
        shares = [p for p in lease.parts if p.kind == "share"]
        if shares:  # (c)
            assert len(shares) == len(lease.parts)
            assert len({p.device for p in shares}) == len(shares), f"(c) {lease}"
            assert len({by_uuid[p.device].node for p in shares}) == 1, f"(c) {lease}"
            assert len({p.memory_mib for p in shares}) == 1
        else:
            assert len(lease.parts) == 1


def check_pass(state: SchedulerState, now: dt.datetime, d: Decisions) -> None:
    """Invariants of one pass: grants fit their requests, waits are true."""
    slots = state.slots
    by_uuid = {s.uuid: s for s in slots}
    pending = {r.lease_id: r for r in state.pending}
    decided = [g.lease_id for g in d.grants] + [w.lease_id for w in d.waits]
    assert sorted(decided) == sorted(pending), "not exactly one grant or wait per request"
    for i, w in enumerate(d.waits):  # place among the earlier waits it competes with
        mine = pending[w.lease_id]
        ahead = [
            o
            for o in (pending[x.lease_id] for x in d.waits[:i])
            if o.kind == mine.kind and (None in (o.pool, mine.pool) or o.pool == mine.pool)
        ]
        assert w.position == len(ahead) + 1, (w, mine)
    before = Held.of(slots, state.running)
    for g in d.grants:
        request = pending[g.lease_id]
        if request.whole:
            assert g.parts == () and len(g.devices) == request.gpus
            continue
        assert g.devices == (), g
        for part in g.parts:
            slot = by_uuid[part.device]
            assert not slot.drained, f"(d) grant on drained {slot.uuid}"
            assert part.device not in before.whole
            assert request.pool in (None, slot.pool), f"pool filter broken: {g} for {request}"
        if request.kind == "mig":
            (part,) = g.parts
            assert part.kind == "mig" and part.profile == request.mig_profile
            assert by_uuid[part.device].mode == "mig"
        else:
            assert len(g.parts) == request.gpus
            assert all(p.kind == "share" and p.memory_mib == request.memory_mib for p in g.parts)
            assert all(by_uuid[p.device].mode == "timeslice" for p in g.parts)

    # what is held at the end of the pass (leases being evicted still hold)
    leases = list(state.running) + [
        Running(g.lease_id, pending[g.lease_id].user, g.devices, now, parts=g.parts)
        for g in d.grants
    ]
    after = Held.of(slots, leases)
    check_held(slots, after, leases)

    check_waits(state, now, d)


def check_waits(state: SchedulerState, now: dt.datetime, d: Decisions) -> None:
    """(e) Replay the pass in queue order: each wait of a fractional request
    is true of the cluster as the pass found it when it got there (grants
    before it taken), and each grant keeps its user within their limit, at
    its estimate (``Request.weight``) and at the weight of its parts."""
    slots = state.slots
    grants = {g.lease_id: g for g in d.grants}
    waits = {w.lease_id: w for w in d.waits}
    leases = list(state.running)
    held_by: dict[str, float] = defaultdict(float)
    for lease in leases:
        held_by[lease.user] += lease.gpus
    for request in queue_order(state, now):
        limit = state.policy.user_quota(request.user).limit
        g = grants.get(request.lease_id)
        if g is not None:
            lease = Running(g.lease_id, request.user, g.devices, now, parts=g.parts)
            charged = max(lease.gpus, request.amount)
            assert limit is None or held_by[request.user] + charged <= limit + EPS, (
                f"{request.user} holds {held_by[request.user]} + {charged} > {limit}"
            )
            leases.append(lease)
            held_by[request.user] += lease.gpus
            continue
        w = waits[request.lease_id]
        assert w.message.startswith("waiting: ") and len(w.message) > 20, w
        if w.reason is WaitReason.preempting:
            held_by[request.user] += request.amount
        if request.whole:
            continue
        assert w.reason in FRACTIONAL_REASONS, w
        assert w.eta is None and w.earmarked == ()
        held = Held.of(slots, leases)
        if w.reason in (WaitReason.quota_user, WaitReason.quota_group):
            # over the limit at its estimate, or at the weight of the slots found
            found = weight_found(state, leases, request)
            assert limit is not None
            assert held_by[request.user] + max(request.amount, found) > limit + EPS, w
            continue
        if limit is not None:
            assert held_by[request.user] + request.amount <= limit + EPS, f"not {w.reason}: {w}"
        if request.kind == "mig":
            check_mig_wait(slots, held, request, w)
        else:
            check_share_wait(slots, held, request, w)


def weight_found(state: SchedulerState, leases: list[Running], request: Request) -> float:
    """The weight of the slots the pass finds for ``request`` (0: none)."""
    pool = SharingPool.build(state.slots, leases, state.sharing_strategy)
    if request.kind == "mig":
        part, _miss = pool.place_mig(request)
        return 0.0 if part is None else part.weight
    parts, _miss = pool.place_shares(request)
    return sum(p.weight for p in parts or ())


def check_mig_wait(slots: tuple[Slot, ...], held: Held, request: Request, w: Wait) -> None:
    """``PoolDrained``: no device of the pool offers the profile;
    ``Fragmented``: it fits nowhere, yet some device has the slices free but
    scattered (the message names what is in the way); ``Resources``: it
    fits nowhere and no device is merely fragmented."""
    profile = request.mig_profile
    offered = [s for s in able(slots, held, request, "mig") if profile in spec_of(s).profiles]
    if w.reason is WaitReason.pool_drained:
        assert not offered, f"PoolDrained, yet {[s.uuid for s in offered]} offer {profile}"
        return
    assert offered, f"{w.reason.value} for a profile no device offers: {w}"
    fits = [s.uuid for s in offered if mig_fits(s, held, profile)]
    assert not fits, f"{w.reason.value}, yet {profile} fits on {fits}"
    scattered = [
        s.uuid
        for s in offered
        if not s.static and mig.is_fragmented(spec_of(s), held.layout(s.uuid), profile)
    ]
    if w.reason is WaitReason.fragmented:
        assert scattered, f"Fragmented, yet no device has the slices free: {w}"
        assert "in the way" in w.message
    else:
        assert w.reason is WaitReason.resources, w
        assert not scattered, f"Resources, yet {profile} is only fragmented on {scattered}"


def check_share_wait(slots: tuple[Slot, ...], held: Held, request: Request, w: Wait) -> None:
    """``PoolDrained``: no node has enough devices big enough, ever;
    ``Resources``: some node has, but not with the memory free now."""
    devices = able(slots, held, request, "timeslice")
    need, count = request.memory_mib, request.gpus
    possible = shares_fit(devices, count, need, capacity)
    if w.reason is WaitReason.pool_drained:
        assert not possible, f"PoolDrained, yet {request} could be placed some day"
        return
    assert w.reason is WaitReason.resources, w
    assert possible, f"Resources, yet {request} never fits"
    now_free = shares_fit(devices, count, need, lambda s: share_room(s, held))
    assert not now_free, f"Resources, yet {request} fits now"


def apply(state: SchedulerState, d: Decisions, now: dt.datetime) -> SchedulerState:
    """The broker's side: evicted leases end, victims are told, withdrawn
    ones keep running, grants start with their parts, waits keep earmarks."""
    evicted = {e.lease_id for e in d.evictions}
    withdrawn = set(d.withdrawn)
    told = {p.lease_id: p.deadline for p in d.preemptions}
    running = []
    for lease in state.running:
        if lease.lease_id in evicted:
            continue
        if lease.lease_id in withdrawn:
            lease = replace(lease, preempt_deadline=None)
        if lease.lease_id in told:
            lease = replace(lease, preempt_deadline=told[lease.lease_id])
        running.append(lease)
    pending = {r.lease_id: r for r in state.pending}
    for g in d.grants:
        r = pending[g.lease_id]
        ends = None if r.time_limit is None else now + dt.timedelta(seconds=r.time_limit)
        running.append(
            Running(
                r.lease_id, r.user, g.devices, now, r.group, r.priority_class, ends, parts=g.parts
            )
        )
    waiting = tuple(replace(pending[w.lease_id], earmarked=w.earmarked) for w in d.waits)
    return replace(state, running=tuple(running), pending=waiting)


def apply_event(
    state: SchedulerState, event: Event, lease_id: int, now: dt.datetime
) -> SchedulerState:
    kind = event[0]
    if kind == "release":
        if not state.running:
            return state
        lease = state.running[int(event[1]) % len(state.running)]  # type: ignore[call-overload]
        return replace(state, running=tuple(r for r in state.running if r is not lease))
    if kind == "cancel":
        if not state.pending:
            return state
        gone = state.pending[int(event[1]) % len(state.pending)]  # type: ignore[call-overload]
        return replace(state, pending=tuple(r for r in state.pending if r is not gone))
    request = make_request(state.slots, lease_id, event, now)
    return replace(state, pending=(*state.pending, request))


def simulate(state: SchedulerState, stream: list[Event]) -> Counter[str]:
    """Apply ``stream`` one event per pass, checking every pass; returns
    how often each wait reason of a fractional request was seen."""
    seen: Counter[str] = Counter()
    now = T0
    check_held(state.slots, Held.of(state.slots, state.running), state.running)
    for k, step in enumerate(stream):
        state = apply_event(state, step, 100 + k, now)
        d = schedule(state, now)
        check_pass(state, now, d)
        pending = {r.lease_id: r for r in state.pending}
        seen.update(w.reason.value for w in d.waits if not pending[w.lease_id].whole)
        seen.update("granted" for g in d.grants if g.parts)
        state = apply(state, d, now)
        now += STEP
    for what in seen:
        note_outcome(what)  # --hypothesis-show-statistics: how many cases saw each outcome
    return seen


# --- the properties ------------------------------------------------------------------------


@PROPERTIES
@given(st.data(), st.sampled_from(STRATEGIES))
def test_event_streams_keep_the_sharing_invariants(data: st.DataObject, strategy: str) -> None:
    slots = data.draw(clusters(), label="slots")
    stream = data.draw(st.lists(events(slots), min_size=5, max_size=40), label="events")
    state = SchedulerState(slots, (), (), data.draw(policies()), sharing_strategy=strategy)
    simulate(state, stream)


@PROPERTIES
@given(st.data(), st.sampled_from(STRATEGIES))
def test_mig_only_streams_fill_devices_and_keep_layouts_valid(
    data: st.DataObject, strategy: str
) -> None:
    # many MIG requests and few releases: devices fill up, Fragmented happens
    slots = data.draw(clusters(), label="slots")
    mig_or_release = events(slots, ("mig", "mig", "mig", "release"))
    stream = data.draw(st.lists(mig_or_release, min_size=10, max_size=40), label="events")
    simulate(SchedulerState(slots, (), (), sharing_strategy=strategy), stream)


@PROPERTIES
@given(st.data())
def test_share_streams_never_overcommit_a_device(data: st.DataObject) -> None:
    # many shares and few releases: devices fill up to their memory less the reserve
    slots = data.draw(clusters(), label="slots")
    share_or_release = events(slots, ("share", "share", "share", "release"))
    stream = data.draw(st.lists(share_or_release, min_size=10, max_size=40), label="events")
    simulate(SchedulerState(slots, (), ()), stream)


@PROPERTIES
@given(st.data(), st.sampled_from(STRATEGIES))
def test_static_layouts_only_hand_out_their_own_instances(
    data: st.DataObject, strategy: str
) -> None:
    slots = data.draw(clusters(static=True), label="slots")
    mig_or_release = events(slots, ("mig", "mig", "mig", "release", "cancel"))
    stream = data.draw(st.lists(mig_or_release, min_size=5, max_size=40), label="events")
    simulate(SchedulerState(slots, (), (), sharing_strategy=strategy), stream)


@st.composite
def mig_worlds(draw: st.DrawFn) -> tuple[tuple[Slot, ...], tuple[Running, ...], Request]:
    """1-4 on-demand MIG devices of pool ``mig`` with random instances held
    by leases (and foreign ones), and one request for a profile of them."""
    slots: list[Slot] = []
    running: list[Running] = []
    for k in range(draw(st.integers(1, 4))):
        model, memory = MODELS[draw(st.sampled_from(("H100", "H100", "A100", "A30")))]
        spec = mig.spec_for(model)
        assert spec is not None
        layout = draw(layouts(spec, max_size=5))
        foreign = tuple(
            Instance(name, p.start, p.size, f"MIG-{k}-{p.start}")
            for name, p in layout
            if draw(st.integers(0, 3)) == 0
        )
        uuid = f"GPU-{k}"
        slots.append(
            Slot(uuid, f"n{k // 2}", k % 2, draw(st.integers(0, 7)) == 0, "mig", "mig", model,
                 memory, foreign=foreign)
        )  # fmt: skip
        for name, p in layout:
            if (name, p.start) in {(i.profile, i.start) for i in foreign}:
                continue
            prof = spec.profile(name)
            part = Part(uuid, "mig", prof.compute_slices / spec.compute_slices, name, p.start,
                        p.size, prof.memory_mib or prof.memory_gib * GIB)  # fmt: skip
            running.append(Running(len(running) + 1, "zoe", (), T0, parts=(part,)))
    profiles = sorted({p.name for s in slots for p in spec_of(s).profiles.values()})
    large = sorted(
        {p.name for s in slots for p in spec_of(s).profiles.values() if p.compute_slices >= 3}
    )
    profile = draw(st.sampled_from(profiles) | st.sampled_from(large))
    request = Request(99, "ana", 1, T0, kind="mig", mig_profile=profile, pool="mig")
    return tuple(slots), tuple(running), request


@settings(max_examples=400, deadline=None)
@given(mig_worlds(), st.sampled_from(STRATEGIES))
def test_one_mig_placement_is_the_strategys_choice_or_a_true_miss(
    world: tuple[tuple[Slot, ...], tuple[Running, ...], Request], strategy: str
) -> None:
    slots, running, request = world
    held = Held.of(slots, running)
    profile = request.mig_profile
    offered = [s for s in able(slots, held, request, "mig") if profile in spec_of(s).profiles]
    fits = [s for s in offered if mig_fits(s, held, profile)]  # in (node, index) order
    part, miss = SharingPool.build(slots, running, strategy).place_mig(request)
    note_outcome("placed" if part is not None else f"miss: {miss and miss.reason.value}")
    if part is not None:
        assert miss is None and fits
        slot = next(s for s in slots if s.uuid == part.device)
        spec, layout = spec_of(slot), held.layout(slot.uuid)
        assert mig.can_place(spec, layout, profile, placement(part))
        if strategy == "first-fit":
            assert slot == fits[0]
            assert placement(part) == mig.valid_placements(spec, layout, profile)[0]
        else:
            # least stranding first, then the fullest device, then least fragmentation
            def key(s: Slot) -> tuple[int, int]:
                best = mig.least_stranding_placement(spec_of(s), held.layout(s.uuid), profile)
                assert best is not None
                free = mig.free_compute_slices(spec_of(s), held.layout(s.uuid))
                return (best[1], free)

            assert key(slot) == min(key(s) for s in fits), "not the least stranding, fullest"
            chosen = mig.least_stranding_placement(spec, layout, profile)
            assert chosen is not None and placement(part) == chosen[0]
        return
    assert miss is not None and not fits
    scattered = [s for s in offered if mig.is_fragmented(spec_of(s), held.layout(s.uuid), profile)]
    if not offered:
        assert miss.reason is WaitReason.pool_drained
    elif scattered:
        assert miss.reason is WaitReason.fragmented
        (device,) = {b[0] for b in miss.blockers}
        slot = next(s for s in scattered if s.uuid == device)
        owners = {(name, str(where)): owner for name, where, owner, _u in held.instances[device]}
        for _d, name, where, owner in miss.blockers:
            assert owners[(name, where)] == owner, "blocker names the wrong lease"
        # without the instances in the way the profile fits on that device
        gone = {(name, where) for _d, name, where, _o in miss.blockers}
        rest = [(n, p) for n, p in held.layout(device) if (n, str(p)) not in gone]
        assert mig.valid_placements(spec_of(slot), rest, profile)
    else:
        assert miss.reason is WaitReason.resources
        assert miss.blockers == ()
