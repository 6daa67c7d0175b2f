"""Property tests of the broker's scheduling policy over random workloads.

Hypothesis draws small clusters (1-4 nodes of 1-8 devices, some drained, some
with a DGX-like topology), running leases on disjoint devices, pending
requests, quotas and past usage, and checks:

* one pass (:func:`check_pass`): no device in two leases, grants on one node
  with exactly the requested count of in-service devices, every request gets
  exactly one grant or wait, waits numbered 1..n, no grant over a limit,
  preemptions, evictions and withdrawals only of leases that may have them,
  and reclaimed devices earmarked for one request only;
* a simulation (:func:`run_pass`, :func:`expire`, :func:`apply_event`) that
  applies the decisions the way the broker does, advances the clock and lets
  requests arrive or be cancelled, leases be released and devices be drained:
  the same invariants at every step, liveness of finite workloads, and that a
  request within its guarantee gets its devices back from borrowers within
  grace + minimum runtime.
"""

from __future__ import annotations

import datetime as dt
import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpubroker.devices.topology import dgx_like
from gpubroker.scheduler import (
    DEFAULT_CLASSES,
    Decisions,
    Policy,
    PriorityClass,
    Quota,
    Request,
    Running,
    SchedulerState,
    Slot,
    Topology,
    UsageRecord,
    WaitReason,
    fifo_schedule,
    schedule,
)
from gpubroker.scheduler.accounting import Accounting
from gpubroker.scheduler.fairshare import decay, running_usage

T0 = dt.datetime(2026, 1, 5, 9, 0, tzinfo=dt.timezone.utc)
STEP = 60.0
STEPS = 40
EPS = 1e-9

USERS = ("ana", "ben", "chi", "dee", "eve")
GROUPS = ("physics", "biology")
BORROWERS = ("xia", "yan", "zoe")

DEFAULTS = {c.name: c for c in DEFAULT_CLASSES}
#: an extra class that is not preemptible, so OverGuarantee can happen
DEDICATED = PriorityClass("dedicated", 90, preempting=False, preemptible=False, grace=60)
WITH_DEDICATED = {**DEFAULTS, DEDICATED.name: DEDICATED}

MAX_GRACE = max(c.grace for c in DEFAULT_CLASSES)
MAX_MIN_RUNTIME = max(c.min_runtime for c in DEFAULT_CLASSES)

#: reasons that hold a request whatever happens to the devices
HOLD = frozenset(
    {
        WaitReason.quota_user,
        WaitReason.quota_group,
        WaitReason.pool_drained,
        WaitReason.over_guarantee,
    }
)

PROPERTIES = settings(max_examples=150, deadline=None)


def seconds(s: float) -> dt.timedelta:
    return dt.timedelta(seconds=s)


# --- strategies ----------------------------------------------------------------------


@st.composite
def inventories(draw: st.DrawFn) -> tuple[tuple[Slot, ...], dict[str, Topology]]:
    """1-4 nodes of 1-8 devices, a few drained, some with a DGX-like topology."""
    slots: list[Slot] = []
    topology: dict[str, Topology] = {}
    for n in range(draw(st.integers(1, 4))):
        node = f"n{n}"
        size = draw(st.integers(1, 8))
        drained = draw(st.frozensets(st.integers(0, size - 1), max_size=2))
        slots += [Slot(f"GPU-{node}-{i}", node, i, i in drained) for i in range(size)]
        if draw(st.booleans()):
            topology[node] = dgx_like(size)
    return tuple(slots), topology


def quotas() -> st.SearchStrategy[Quota]:
    """A guarantee of 0-8 GPUs and no limit or a limit at or above it."""
    return st.builds(
        lambda g, extra: Quota(float(g), None if extra is None else float(g + extra)),
        st.integers(0, 8),
        st.none() | st.integers(0, 8),
    )


@st.composite
def running_leases(
    draw: st.DrawFn,
    slots: tuple[Slot, ...],
    classes: Iterable[str],
    users: tuple[str, ...] = USERS,
    groups: tuple[str | None, ...] = (*GROUPS, None),
    finite: bool = False,
    full: bool | None = None,
    overdue: bool = False,
) -> tuple[Running, ...]:
    """Leases on disjoint devices, one node each, started in the past.

    ``finite``: every lease has an end (else some have none). ``full``: no
    free devices between leases (``None``: drawn). ``overdue``: some leases
    are past their end (not yet ended by the broker).
    """
    by_node: dict[str, list[str]] = defaultdict(list)
    for slot in slots:
        by_node[slot.node].append(slot.uuid)
    fields = st.tuples(
        st.sampled_from(users),
        st.sampled_from(groups),
        st.sampled_from(sorted(classes)),
        st.integers(0, 7200),  # age, seconds
        (st.integers(60, 3600) if finite else st.none() | st.integers(60, 7200))
        | (st.integers(-300, 0) if overdue else st.nothing()),  # remaining seconds
    )
    if full is None:
        full = draw(st.booleans())
    leases: list[Running] = []
    for uuids in by_node.values():
        order = draw(st.permutations(uuids))
        chunk = st.tuples(st.integers(1, 8), fields if full else st.none() | fields)
        at = 0
        for size, lease in draw(st.lists(chunk, max_size=5)):
            devices = tuple(order[at : at + size])
            at += size
            if not devices:
                break
            if lease is None:  # a gap: these devices stay free
                continue
            user, group, cls, age, remaining = lease
            leases.append(
                Running(
                    lease_id=1 + len(leases),
                    user=user,
                    devices=devices,
                    started=T0 - seconds(age),
                    group=group,
                    priority_class=cls,
                    ends=None if remaining is None else T0 + seconds(remaining),
                )
            )
    return tuple(leases)


def request_fields(
    classes: Iterable[str], max_gpus: int, finite: bool
) -> st.SearchStrategy[tuple[str, str | None, int, str, int | None, int]]:
    """(user, group, gpus, class, time limit, age); small requests are likelier."""
    top = max(max_gpus, 1)
    return st.tuples(
        st.sampled_from(USERS),
        st.sampled_from((*GROUPS, None)),
        st.integers(1, min(2, top)) | st.integers(1, top),
        st.sampled_from(sorted(classes)),
        st.integers(60, 1800) if finite else st.none() | st.integers(60, 7200),
        st.integers(0, 3600),
    )


def make_request(
    lease_id: int, fields: tuple[str, str | None, int, str, int | None, int]
) -> Request:
    user, group, gpus, cls, limit, age = fields
    return Request(
        lease_id=lease_id,
        user=user,
        gpus=gpus,
        created=T0 - seconds(age),
        group=group,
        priority_class=cls,
        time_limit=None if limit is None else float(limit),
    )


@st.composite
def policies(draw: st.DrawFn, classes: Mapping[str, PriorityClass]) -> Policy:
    return Policy(
        classes=classes,
        user_quotas=draw(st.dictionaries(st.sampled_from(USERS), quotas(), max_size=5)),
        group_quotas=draw(st.dictionaries(st.sampled_from(GROUPS), quotas(), max_size=2)),
        default_user_quota=draw(st.just(Quota()) | quotas()),
        shares=draw(
            st.dictionaries(st.sampled_from(USERS), st.sampled_from((0.5, 1.0, 4.0)), max_size=2)
        ),
        half_life=draw(st.sampled_from((3600.0, 86400.0, 7 * 86400.0))),
        max_reservations=draw(st.sampled_from((0, 1, 2, 100))),
    )


def usage_records() -> st.SearchStrategy[dict[str, UsageRecord]]:
    record = st.builds(
        lambda s, age: UsageRecord(float(s), T0 - seconds(age)),
        st.integers(0, 10**6),
        st.integers(0, 86400),
    )
    return st.dictionaries(st.sampled_from(USERS), record, max_size=len(USERS))


def in_service_by_node(slots: Iterable[Slot]) -> Counter[str]:
    return Counter(s.node for s in slots if not s.drained)


@st.composite
def worlds(draw: st.DrawFn, finite: bool = False, overdue: bool = False) -> SchedulerState:
    """A random state at ``T0``.

    ``finite``: every running lease ends, every request has a time limit and
    fits on some node's in-service devices (when any node has some). Half of
    the worlds are contended: every device is held, some by borrowers.
    ``overdue``: some leases are past their end.
    """
    slots, topology = draw(inventories())
    classes = draw(st.sampled_from((DEFAULTS, WITH_DEDICATED)))
    # contended: the cluster is full, partly with borrowers (no guarantee)
    contended = draw(st.booleans())
    users = (*USERS, *BORROWERS) if contended else USERS
    full = True if contended else None
    running = draw(
        running_leases(slots, classes, users=users, finite=finite, full=full, overdue=overdue)
    )
    largest = max(in_service_by_node(slots).values(), default=0)
    fields = request_fields(classes, largest if finite else 8, finite)
    pending = draw(st.lists(fields, max_size=8))
    return SchedulerState(
        slots=slots,
        running=running,
        pending=tuple(make_request(100 + k, f) for k, f in enumerate(pending)),
        policy=draw(policies(classes)),
        usage=draw(usage_records()),
        topology=topology,
    )


@st.composite
def reclaim_scenarios(draw: st.DrawFn, requesters: int = 1) -> SchedulerState:
    """Nodes full of (or partly free besides) borrowed leases of other users,
    and requests of ``requesters`` users within their guarantees.

    With one requester: 1-3 nodes and a request that fits a node. With more:
    one node, and the requests together fit on it.
    """
    n_nodes = draw(st.integers(1, 3)) if requesters == 1 else 1
    size = draw(st.integers(requesters, 8))
    slots = tuple(Slot(f"GPU-n{n}-{i}", f"n{n}", i) for n in range(n_nodes) for i in range(size))
    topology = {f"n{n}": dgx_like(size) for n in range(n_nodes)}
    running = draw(running_leases(slots, DEFAULTS, users=BORROWERS, groups=(None, "physics")))
    total = draw(st.integers(requesters, size))
    cuts: list[int] = []
    if requesters > 1:
        n = requesters - 1
        cuts = sorted(draw(st.sets(st.integers(1, total - 1), min_size=n, max_size=n)))
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]
    pending = []
    user_quotas = {}
    for k, gpus in enumerate(sizes):
        user = USERS[k]
        guaranteed = gpus + draw(st.integers(0, 4))
        limit = draw(st.none() | st.integers(guaranteed, 16))
        user_quotas[user] = Quota(float(guaranteed), None if limit is None else float(limit))
        pending.append(
            Request(
                lease_id=100 + k,
                user=user,
                gpus=gpus,
                created=T0 - seconds(draw(st.integers(0, 600))),
                group=draw(st.sampled_from((None, "physics"))),
                priority_class=draw(st.sampled_from(sorted(DEFAULTS))),
                time_limit=draw(st.none() | st.integers(600, 7200).map(float)),
            )
        )
    return SchedulerState(
        slots=slots,
        running=running,
        pending=tuple(pending),
        policy=Policy(user_quotas=user_quotas),
        usage=draw(usage_records()),
        topology=topology,
    )


#: what may happen between two passes: (step, kind, which)
Event = tuple[int, str, int]


@st.composite
def timelines(draw: st.DrawFn, state: SchedulerState) -> tuple[list[Event], dict[int, Request]]:
    """Events during a simulation: cancellations, releases, drains, arrivals.

    Returns:
        the events, and the requests that arrive, by id (``which`` of an
        ``arrive`` event); their ``created`` becomes the arrival time.
    """
    kinds = st.sampled_from(("cancel", "release", "drain", "undrain", "arrive"))
    events = draw(
        st.lists(st.tuples(st.integers(0, STEPS - 1), kinds, st.integers(0, 99)), max_size=12)
    )
    fields = request_fields(state.policy.classes, 8, finite=False)
    arrivals = {}
    for k, (step, kind, _) in enumerate(events):
        if kind == "arrive":
            arrivals[500 + k] = make_request(500 + k, draw(fields))
            events[k] = (step, kind, 500 + k)
    return sorted(events), arrivals


# --- invariants ----------------------------------------------------------------------


def holdings(leases: Iterable[Running]) -> tuple[dict[str, float], dict[str, float]]:
    """GPUs held per user and per group."""
    users: dict[str, float] = defaultdict(float)
    groups: dict[str, float] = defaultdict(float)
    for lease in leases:
        users[lease.user] += lease.gpus
        if lease.group is not None:
            groups[lease.group] += lease.gpus
    return users, groups


def over_limit(state: SchedulerState, running: Iterable[Running]) -> set[str]:
    """Users (``user:name``) and groups (``group:name``) above their limit."""
    users, groups = holdings(running)
    policy = state.policy
    over = set()
    for user, held in users.items():
        limit = policy.user_quota(user).limit
        if limit is not None and held > limit + EPS:
            over.add(f"user:{user}")
    for group, held in groups.items():
        quota = policy.group_quota(group)
        if quota is not None and quota.limit is not None and held > quota.limit + EPS:
            over.add(f"group:{group}")
    return over


def check_grants(state: SchedulerState, d: Decisions) -> None:
    """Grants: exactly ``gpus`` in-service devices of one node, held by no
    lease that keeps running, granted once; one grant or wait per request,
    waits numbered 1..n in order."""
    slots = {s.uuid: s for s in state.slots}
    in_service = {u for u, s in slots.items() if not s.drained}
    pending = {r.lease_id: r for r in state.pending}
    evicted = {e.lease_id for e in d.evictions}
    held = {u for r in state.running if r.lease_id not in evicted for u in r.devices}
    taken: set[str] = set()
    for g in d.grants:
        request = pending[g.lease_id]
        devices = set(g.devices)
        assert len(g.devices) == len(devices) == request.gpus, (g, request)
        assert devices <= in_service, f"grant {g} uses drained or unknown devices"
        assert len({slots[u].node for u in devices}) == 1, f"grant {g} spans nodes"
        assert not devices & held, f"grant {g} uses devices of running leases"
        assert not devices & taken, f"grant {g} uses devices granted in this pass"
        taken |= devices
    decided = [g.lease_id for g in d.grants] + [w.lease_id for w in d.waits]
    assert sorted(decided) == sorted(pending), "not exactly one grant or wait per request"
    assert [w.position for w in d.waits] == list(range(1, len(d.waits) + 1))


def check_pass(state: SchedulerState, now: dt.datetime, d: Decisions) -> None:
    """Invariants of one pass of the policy over ``state`` at ``now``."""
    check_grants(state, d)
    in_service = {s.uuid for s in state.slots if not s.drained}
    pending = {r.lease_id: r for r in state.pending}
    running = {r.lease_id: r for r in state.running}
    classes = state.policy.classes

    # evictions: only leases past their grace or time limit; withdrawals: only told leases
    evicted = {e.lease_id for e in d.evictions}
    assert len(evicted) == len(d.evictions), "a lease evicted twice"
    for lease_id in evicted:
        ends = [running[lease_id].preempt_deadline, running[lease_id].ends]
        assert any(t is not None and t <= now for t in ends), f"lease {lease_id} evicted early"
    assert len(set(d.withdrawn)) == len(d.withdrawn)
    for lease_id in d.withdrawn:
        assert running[lease_id].preempt_deadline is not None
        assert lease_id not in evicted

    # waits: earmarks only while Preempting, on in-service devices
    for w in d.waits:
        assert set(w.earmarked) <= in_service
        if w.reason is not WaitReason.preempting:
            assert w.earmarked == (), f"{w} carries earmarks but is not Preempting"

    # reclaimable: borrowed leases, when anyone has a guarantee
    after = [r for r in running.values() if r.lease_id not in evicted]
    borrowed = Accounting.of(state.policy, tuple(after)).borrowed
    borrowed |= Accounting.of(state.policy, state.running).borrowed  # evicted ones count or not
    assert d.reclaimable <= borrowed | {g.lease_id for g in d.grants}

    # limits: no one granted anything ends above a limit
    after += [as_running(pending[g.lease_id], g.devices, now) for g in d.grants]
    granted = {f"user:{pending[g.lease_id].user}" for g in d.grants}
    granted |= {f"group:{pending[g.lease_id].group}" for g in d.grants}  # "group:None": no-op
    assert not over_limit(state, after) & granted, "a grant exceeds a limit"

    # preemptions: of running, untold (or withdrawn), preemptible leases past their minimum
    # runtime, borrowed by someone else or of a lower class than a preempting
    # request, for a request now waiting on those devices
    waits = {w.lease_id: w for w in d.waits}
    for p in d.preemptions:
        victim, request = running[p.lease_id], pending[p.for_lease]
        vcls, rcls = classes[victim.priority_class], classes[request.priority_class]
        assert p.lease_id not in evicted
        # untold, or told for a request that left: withdrawn and told anew
        assert victim.preempt_deadline is None or p.lease_id in d.withdrawn
        assert vcls.preemptible, f"{p} of a non-preemptible class"
        assert (now - victim.started).total_seconds() >= vcls.min_runtime
        reclaim = victim.lease_id in borrowed and victim.user != request.user
        assert reclaim or (rcls.preempting and vcls.rank < rcls.rank), p
        assert p.deadline == now + seconds(vcls.grace)
        assert set(p.devices) <= set(victim.devices)
        wait = waits[p.for_lease]
        assert wait.reason is WaitReason.preempting
        assert set(p.devices) <= set(wait.earmarked)
    check_earmarks(d)


def check_earmarks(d: Decisions) -> None:
    """Reclaimed devices go to one request: no lease told twice, no device
    earmarked for two requests or for one request and granted to another."""
    told = Counter(p.lease_id for p in d.preemptions)
    assert not [k for k, n in told.items() if n > 1], f"lease preempted twice: {d.preemptions}"
    marked = Counter(u for w in d.waits for u in w.earmarked)
    twice = sorted(u for u, n in marked.items() if n > 1)
    assert not twice, f"devices earmarked for two requests: {twice}; {d.waits}"
    granted = {u for g in d.grants for u in g.devices}
    assert not granted & set(marked), "a device earmarked for one request granted to another"


def check_state(state: SchedulerState) -> None:
    """No device in two running leases."""
    devices = Counter(u for r in state.running for u in r.devices)
    assert not [u for u, n in devices.items() if n > 1], f"device in two leases: {devices}"


# --- the simulation driver -----------------------------------------------------------


def as_running(request: Request, devices: tuple[str, ...], now: dt.datetime) -> Running:
    """The lease a grant of ``devices`` to ``request`` at ``now`` starts."""
    return Running(
        lease_id=request.lease_id,
        user=request.user,
        devices=devices,
        started=now,
        group=request.group,
        priority_class=request.priority_class,
        ends=None if request.time_limit is None else now + seconds(request.time_limit),
    )


def _charge(
    usage: dict[str, UsageRecord], lease: Running, now: dt.datetime, half_life: float
) -> None:
    """Fold an ending lease's usage into its user's record (decayed to ``now``)."""
    old = usage.get(lease.user)
    past = 0.0
    if old is not None:
        past = decay(old.gpu_seconds, (now - old.as_of).total_seconds(), half_life)
    spent = running_usage(lease.gpus, lease.started, now, half_life)
    usage[lease.user] = UsageRecord(past + spent, now)


def _end(state: SchedulerState, ended: set[int], now: dt.datetime) -> SchedulerState:
    usage = dict(state.usage)
    running = []
    for lease in state.running:
        if lease.lease_id in ended:
            _charge(usage, lease, now, state.policy.half_life)
        else:
            running.append(lease)
    return replace(state, running=tuple(running), usage=usage)


def apply(state: SchedulerState, d: Decisions, now: dt.datetime) -> SchedulerState:
    """The broker's side of a pass: grants start, victims are told or evicted,
    withdrawn victims keep running, waiting requests keep their earmarks."""
    state = _end(state, {e.lease_id for e in d.evictions}, now)
    withdrawn = set(d.withdrawn)
    deadlines: dict[int, dt.datetime] = {}
    for p in d.preemptions:
        deadlines[p.lease_id] = min(p.deadline, deadlines.get(p.lease_id, p.deadline))
    running: list[Running] = []
    for lease in state.running:
        if lease.lease_id in withdrawn:
            lease = replace(lease, preempt_deadline=None)
        if lease.lease_id in deadlines:
            lease = replace(lease, preempt_deadline=deadlines[lease.lease_id])
        running.append(lease)
    pending = {r.lease_id: r for r in state.pending}
    running += [as_running(pending[g.lease_id], g.devices, now) for g in d.grants]
    waiting = tuple(replace(pending[w.lease_id], earmarked=w.earmarked) for w in d.waits)
    return replace(state, running=tuple(running), pending=waiting)


def expire(state: SchedulerState, now: dt.datetime) -> SchedulerState:
    """End the leases whose time limit has run out by ``now``."""
    ended = {r.lease_id for r in state.running if r.ends is not None and r.ends <= now}
    return _end(state, ended, now)


def apply_event(
    state: SchedulerState,
    now: dt.datetime,
    event: Event,
    arrivals: Mapping[int, Request],
) -> SchedulerState:
    """A user or admin acts between passes.

    ``cancel``: the ``which``-th pending request (modulo their count; for an
    even ``which``, of those with earmarks if any) goes away; ``release``:
    the ``which``-th running lease ends; ``undrain``: the ``which``-th device
    returns to service; ``drain``: the ``which``-th device that is not
    earmarked is drained (for earmarked ones see
    :func:`test_draining_earmarked_devices_keeps_the_invariants`); ``arrive``:
    request ``which`` of ``arrivals`` is made now.
    """
    _, kind, which = event
    marked = [r for r in state.pending if r.earmarked]
    if kind == "cancel" and state.pending:
        requests = marked if marked and which % 2 == 0 else state.pending
        gone = requests[which % len(requests)]
        return replace(state, pending=tuple(r for r in state.pending if r is not gone))
    if kind == "release" and state.running:
        return _end(state, {state.running[which % len(state.running)].lease_id}, now)
    if kind in ("drain", "undrain"):
        earmarked = {u for r in marked for u in r.earmarked} if kind == "drain" else set()
        slots = [s for s in state.slots if s.uuid not in earmarked]
        if not slots:
            return state
        slot = slots[which % len(slots)]
        changed = replace(slot, drained=kind == "drain")
        return replace(state, slots=tuple(changed if s is slot else s for s in state.slots))
    if kind == "arrive":
        request = replace(arrivals[which], created=now)
        return replace(state, pending=(*state.pending, request))
    return state


def run_pass(
    state: SchedulerState, now: dt.datetime
) -> tuple[Decisions, SchedulerState, dt.datetime]:
    """One simulated step: schedule, check, apply, advance the clock, expire."""
    d = schedule(state, now)
    check_pass(state, now, d)
    state = apply(state, d, now)
    check_state(state)
    now += seconds(STEP)
    return d, expire(state, now), now


def simulate(
    state: SchedulerState,
    events: list[Event],
    arrivals: Mapping[int, Request],
) -> None:
    """``STEPS`` steps with ``events``, checking invariants at each one."""
    within = {f"user:{u}" for u in USERS} | {f"group:{g}" for g in GROUPS}
    within -= over_limit(state, state.running)
    now = T0
    for step in range(STEPS):
        for event in (e for e in events if e[0] == step):
            state = apply_event(state, now, event, arrivals)
        _, state, now = run_pass(state, now)
        assert not over_limit(state, state.running) & within, "a limit was exceeded"


# --- a. one pass ---------------------------------------------------------------------


@PROPERTIES
@given(worlds())
def test_one_pass_keeps_the_invariants(state: SchedulerState) -> None:
    d = schedule(state, T0)
    check_pass(state, T0, d)
    assert schedule(state, T0) == d, "not deterministic"


@PROPERTIES
@given(worlds(overdue=True))
def test_one_pass_with_overdue_leases_keeps_the_invariants(state: SchedulerState) -> None:
    check_pass(state, T0, schedule(state, T0))


def test_a_lease_at_its_time_limit_is_not_also_preempted() -> None:
    # one GPU, held by a borrowed lease whose time limit ends now; ana asks
    # within her guarantee. The lease used to be both evicted and preempted.
    lease = Running(1, "xia", ("GPU-a-0",), T0 - seconds(3600), priority_class="batch", ends=T0)
    state = SchedulerState(
        (Slot("GPU-a-0", "a", 0),),
        (lease,),
        (Request(10, "ana", 1, T0),),
        Policy(user_quotas={"ana": Quota(1.0)}),
    )
    d = schedule(state, T0)
    assert [e.lease_id for e in d.evictions] == [1]
    assert d.preemptions == ()


@PROPERTIES
@given(worlds())
def test_one_fifo_pass_places_like_the_policy(state: SchedulerState) -> None:
    # the baseline knows no quotas or preemption; its grants obey the same rules
    d = fifo_schedule(state, T0)
    check_grants(state, d)
    assert d.preemptions == () and d.evictions == ()


# --- b. simulation -------------------------------------------------------------------


@PROPERTIES
@given(st.data())
def test_simulation_keeps_the_invariants_at_every_step(data: st.DataObject) -> None:
    state = data.draw(worlds())
    events, arrivals = data.draw(timelines(state))
    simulate(state, events, arrivals)


@PROPERTIES
@given(reclaim_scenarios(), st.data())
def test_draining_earmarked_devices_keeps_the_invariants(
    state: SchedulerState, data: st.DataObject
) -> None:
    # devices are being reclaimed for the request(s); an admin drains some of
    # them during the grace period, or once the victims are gone
    _, state, now = run_pass(state, T0)
    earmarked = sorted({u for r in state.pending for u in r.earmarked})
    if not earmarked:
        return
    drained = data.draw(st.sets(st.sampled_from(earmarked), min_size=1))
    for _ in range(data.draw(st.integers(0, 6))):
        _, state, now = run_pass(state, now)
    slots = tuple(replace(s, drained=s.uuid in drained) for s in state.slots)
    state = replace(state, slots=slots)
    for _ in range(STEPS):
        _, state, now = run_pass(state, now)


@pytest.mark.parametrize("victim_gone", [False, True], ids=["victim-in-grace", "victim-gone"])
def test_draining_an_earmarked_device_does_not_break_the_pass(victim_gone: bool) -> None:
    # GPU-a-0 was reclaimed for ana's request 10, then an admin drained it
    # (or it left the inventory); GPU-a-1 is free. This used to raise KeyError
    # in Pool._unfree: the drained device was taken for free and granted.
    slots = (Slot("GPU-a-0", "a", 0, drained=True), Slot("GPU-a-1", "a", 1))
    told = Running(
        1, "xia", ("GPU-a-0",), T0 - seconds(3600), priority_class="batch",
        preempt_deadline=T0 + seconds(30),
    )  # fmt: skip
    state = SchedulerState(
        slots,
        () if victim_gone else (told,),
        (Request(10, "ana", 1, T0, earmarked=("GPU-a-0",)),),
        Policy(user_quotas={"ana": Quota(1.0)}),
    )
    d = schedule(state, T0)
    check_pass(state, T0, d)
    assert d.grants == () or d.grants[0].devices == ("GPU-a-1",)


@PROPERTIES
@given(worlds(finite=True))
def test_finite_workload_is_granted_or_held_for_good(state: SchedulerState) -> None:
    # while anything runs, time moves towards its end; when nothing runs, the
    # first request that may be granted is: so the sum of lease lifetimes
    # (each rounded up to a step) bounds the time to drain the queue
    horizon = sum((r.ends - T0).total_seconds() for r in state.running if r.ends is not None)
    horizon += sum(r.time_limit or 0.0 for r in state.pending)
    steps = math.ceil(horizon / STEP) + len(state.running) + len(state.pending) + 3
    now = T0
    for _ in range(steps):
        if not state.pending:
            return
        before = state
        d, state, now = run_pass(state, now)
        idle = not before.running and not d.grants
        if idle and not any(r.earmarked for r in before.pending):
            break
    else:
        pytest.fail(f"still waiting after {steps} steps: {state.pending} {d.waits}")
    # the cluster is idle and nothing more is granted: each request is held for good
    largest = max(in_service_by_node(state.slots).values(), default=0)
    policy = state.policy
    requests = {r.lease_id: r for r in before.pending}
    for w in d.waits:
        request = requests[w.lease_id]
        assert w.reason in HOLD, f"{request} waits with {w.reason} on an idle cluster"
        user = policy.user_quota(request.user)
        group = policy.group_quota(request.group)
        if w.reason is WaitReason.quota_user:
            assert user.limit is not None and request.gpus > user.limit
        elif w.reason is WaitReason.quota_group:
            assert group is not None and group.limit is not None
            assert request.gpus > group.limit
        elif w.reason is WaitReason.pool_drained:
            assert request.gpus > largest
        else:
            room = user.guaranteed + (group.guaranteed if group is not None else 0.0)
            assert request.gpus > room + EPS


def check_reclaimed_in_time(state: SchedulerState) -> None:
    """Every request is granted within the longest minimum runtime plus the
    longest grace, plus a few steps."""
    acct = Accounting.of(state.policy, state.running)
    assert acct.borrowed == {r.lease_id for r in state.running}
    for request in state.pending:
        assert acct.within_guarantee(request.user, request.group, request.gpus)
        assert state.policy.classes[request.priority_class].preemptible
    wanted = {r.lease_id for r in state.pending}
    bound = T0 + seconds(MAX_MIN_RUNTIME + MAX_GRACE + 3 * STEP)
    now = T0
    while now <= bound and state.pending:
        _, state, now = run_pass(state, now)
    assert not state.pending, f"not granted by {bound:%H:%M} of {wanted}: {state.pending}"


@PROPERTIES
@given(reclaim_scenarios())
def test_request_within_guarantee_reclaims_from_borrowers_in_time(state: SchedulerState) -> None:
    check_reclaimed_in_time(state)


@PROPERTIES
@given(reclaim_scenarios(requesters=2) | reclaim_scenarios(requesters=3))
def test_requests_within_guarantee_on_one_node_all_reclaim_in_time(
    state: SchedulerState,
) -> None:
    check_reclaimed_in_time(state)


def test_second_request_within_guarantee_waits_one_grace_period_only() -> None:
    # one node of 4: borrowed interactive leases of xia on GPUs 0-2 and 3;
    # ana (guarantee 1) and ben (guarantee 3) ask for 1 and 3 GPUs at T0.
    # At 09:10 (min runtime) lease 1 (3 GPUs) is told for ana's 1 GPU. This
    # used to leave ben nothing (lease 1 told, lease 2 alone too small) until
    # lease 1 was gone; then lease 2 was told, and ben ran at 09:22, past
    # min runtime + grace (15 min). Lease 1's 2 spare devices count for ben.
    slots = tuple(Slot(f"GPU-a-{i}", "a", i) for i in range(4))
    three = tuple(f"GPU-a-{i}" for i in range(3))
    state = SchedulerState(
        slots,
        (
            Running(1, "xia", three, T0, priority_class="interactive"),
            Running(2, "xia", ("GPU-a-3",), T0, priority_class="interactive"),
        ),
        (
            Request(100, "ana", 1, T0, priority_class="batch"),
            Request(101, "ben", 3, T0, priority_class="batch"),
        ),
        Policy(user_quotas={"ana": Quota(1.0), "ben": Quota(3.0)}),
    )
    check_reclaimed_in_time(state)


def test_one_victim_is_not_preempted_for_two_requests() -> None:
    # one node of 2, one borrowed 2-GPU lease, two users within their 1-GPU
    # guarantees ask for 1 GPU each: the victim is told once, for one of them,
    # and both run once it is gone
    slots = (Slot("GPU-a-0", "a", 0), Slot("GPU-a-1", "a", 1))
    borrowed = Running(1, "xia", ("GPU-a-0", "GPU-a-1"), T0 - seconds(3600), priority_class="batch")
    state = SchedulerState(
        slots,
        (borrowed,),
        (Request(10, "ana", 1, T0), Request(11, "ben", 1, T0)),
        Policy(user_quotas={"ana": Quota(1.0), "ben": Quota(1.0)}),
    )
    d = schedule(state, T0)
    assert [(p.lease_id, p.for_lease) for p in d.preemptions] == [(1, 10)]
    now = T0
    for _ in range(3):
        _, state, now = run_pass(state, now)
    assert not state.pending
