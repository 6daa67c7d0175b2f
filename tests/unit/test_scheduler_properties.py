"""Property tests of the broker's scheduling policy over random workloads.

Hypothesis draws small clusters (1-4 nodes of 1-8 devices, some drained, some
with a DGX-like topology), running leases on disjoint devices, pending
requests, quotas and past usage, and checks:

* one pass (:func:`check_pass`): no device in two leases, grants on one node
  with exactly the requested count of in-service devices, every request gets
  exactly one grant or wait, waits numbered 1..n, no grant over a limit, and
  preemptions/evictions/withdrawals only of leases that may have them;
* a simulation (:func:`run_pass`, :func:`expire`) that applies the decisions
  the way the broker does and advances the clock: the same invariants at
  every step, liveness of finite workloads, and that a request within its
  guarantee gets its devices back from borrowers within grace + minimum
  runtime.
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
    schedule,
)
from gpubroker.scheduler.accounting import Accounting
from gpubroker.scheduler.fairshare import decay, running_usage

T0 = dt.datetime(2026, 1, 5, 9, 0, tzinfo=dt.timezone.utc)
STEP = 60.0
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
    first_id: int = 1,
) -> tuple[Running, ...]:
    """Leases on disjoint devices, one node each, started in the past.

    ``finite``: every lease has an end (in the future).
    """
    by_node: dict[str, list[str]] = defaultdict(list)
    for slot in slots:
        by_node[slot.node].append(slot.uuid)
    fields = st.tuples(
        st.sampled_from(users),
        st.sampled_from(groups),
        st.sampled_from(sorted(classes)),
        st.integers(0, 7200),  # age, seconds
        st.integers(60, 3600) if finite else st.none() | st.integers(60, 7200),  # remaining
    )
    leases: list[Running] = []
    for uuids in by_node.values():
        order = draw(st.permutations(uuids))
        chunks = draw(st.lists(st.tuples(st.integers(1, 8), st.none() | fields), max_size=5))
        at = 0
        for size, lease in chunks:
            devices = tuple(order[at : at + size])
            at += size
            if not devices:
                break
            if lease is None:  # a gap: these devices stay free
                continue
            user, group, cls, age, remaining = lease
            leases.append(
                Running(
                    lease_id=first_id + len(leases),
                    user=user,
                    devices=devices,
                    started=T0 - seconds(age),
                    group=group,
                    priority_class=cls,
                    ends=None if remaining is None else T0 + seconds(remaining),
                )
            )
    return tuple(leases)


@st.composite
def pending_requests(
    draw: st.DrawFn,
    classes: Iterable[str],
    max_gpus: int = 8,
    finite: bool = False,
    first_id: int = 100,
    max_size: int = 8,
) -> tuple[Request, ...]:
    """Requests of a few users and groups, created in the past.

    ``finite``: every request has a time limit.
    """
    limits = st.integers(60, 1800) if finite else st.none() | st.integers(60, 7200)
    fields = st.tuples(
        st.sampled_from(USERS),
        st.sampled_from((*GROUPS, None)),
        st.integers(1, max(max_gpus, 1)),
        st.sampled_from(sorted(classes)),
        limits,
        st.integers(0, 3600),  # age, seconds
    )
    drawn = draw(st.lists(fields, max_size=max_size))
    return tuple(
        Request(
            lease_id=first_id + k,
            user=user,
            gpus=gpus,
            created=T0 - seconds(age),
            group=group,
            priority_class=cls,
            time_limit=None if limit is None else float(limit),
        )
        for k, (user, group, gpus, cls, limit, age) in enumerate(drawn)
    )


@st.composite
def policies(draw: st.DrawFn, classes: Mapping[str, PriorityClass]) -> Policy:
    return Policy(
        classes=classes,
        user_quotas=draw(st.dictionaries(st.sampled_from(USERS), quotas(), max_size=3)),
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
def worlds(draw: st.DrawFn, finite: bool = False) -> SchedulerState:
    """A random state at ``T0``.

    ``finite``: every running lease ends, every request has a time limit and
    fits on some node's in-service devices (when any node has some).
    """
    slots, topology = draw(inventories())
    classes = draw(st.sampled_from((DEFAULTS, WITH_DEDICATED)))
    running = draw(running_leases(slots, classes, finite=finite))
    largest = max(in_service_by_node(slots).values(), default=0)
    pending = draw(pending_requests(classes, max_gpus=largest if finite else 8, finite=finite))
    return SchedulerState(
        slots=slots,
        running=running,
        pending=pending,
        policy=draw(policies(classes)),
        usage=draw(usage_records()),
        topology=topology,
    )


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


def check_pass(state: SchedulerState, now: dt.datetime, d: Decisions) -> None:
    """Invariants of one pass's decisions over ``state`` at ``now``."""
    slots = {s.uuid: s for s in state.slots}
    in_service = {u for u, s in slots.items() if not s.drained}
    pending = {r.lease_id: r for r in state.pending}
    running = {r.lease_id: r for r in state.running}
    classes = state.policy.classes

    # evictions: only told leases whose grace is over; withdrawals: only told leases
    evicted = {e.lease_id for e in d.evictions}
    assert len(evicted) == len(d.evictions), "a lease evicted twice"
    for lease_id in evicted:
        deadline = running[lease_id].preempt_deadline
        assert deadline is not None and deadline <= now, f"lease {lease_id} evicted early"
    assert len(set(d.withdrawn)) == len(d.withdrawn)
    for lease_id in d.withdrawn:
        assert running[lease_id].preempt_deadline is not None
        assert lease_id not in evicted

    # grants: exactly `gpus` in-service devices of one node, held by nobody else
    held = {u for r in running.values() if r.lease_id not in evicted for u in r.devices}
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

    # every pending request: exactly one grant or wait; waits numbered 1..n
    decided = [g.lease_id for g in d.grants] + [w.lease_id for w in d.waits]
    assert sorted(decided) == sorted(pending), "not exactly one grant or wait per request"
    assert [w.position for w in d.waits] == list(range(1, len(d.waits) + 1))
    for w in d.waits:
        assert set(w.earmarked) <= in_service
        if w.reason is not WaitReason.preempting:
            assert w.earmarked == (), f"{w} carries earmarks but is not Preempting"

    # limits: no one granted anything ends above a limit
    after = [r for r in running.values() if r.lease_id not in evicted]
    after += [_as_running(pending[g.lease_id], g.devices, now) for g in d.grants]
    granted = {f"user:{pending[g.lease_id].user}" for g in d.grants}
    granted |= {f"group:{pending[g.lease_id].group}" for g in d.grants}  # "group:None": no-op
    assert not over_limit(state, after) & granted, "a grant exceeds a limit"

    # preemptions: of running, told-for-the-first-time, preemptible leases past
    # their minimum runtime, for a request now waiting on those devices
    waits = {w.lease_id: w for w in d.waits}
    for p in d.preemptions:
        victim = running[p.lease_id]
        vcls = classes[victim.priority_class]
        assert p.lease_id not in evicted and victim.preempt_deadline is None
        assert vcls.preemptible, f"{p} of a non-preemptible class"
        assert (now - victim.started).total_seconds() >= vcls.min_runtime
        assert p.deadline == now + seconds(vcls.grace)
        assert set(p.devices) <= set(victim.devices)
        wait = waits[p.for_lease]
        assert wait.reason is WaitReason.preempting
        assert set(p.devices) <= set(wait.earmarked)


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


def _as_running(request: Request, devices: tuple[str, ...], now: dt.datetime) -> Running:
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
    past = (
        0.0 if old is None else decay(old.gpu_seconds, (now - old.as_of).total_seconds(), half_life)
    )
    spent = running_usage(lease.gpus, lease.started, now, half_life)
    usage[lease.user] = UsageRecord(past + spent, now)


def apply(state: SchedulerState, d: Decisions, now: dt.datetime) -> SchedulerState:
    """The broker's side of a pass: grants start, victims are told or evicted,
    withdrawn victims keep running, waiting requests keep their earmarks."""
    evicted = {e.lease_id for e in d.evictions}
    withdrawn = set(d.withdrawn)
    deadlines: dict[int, dt.datetime] = {}
    for p in d.preemptions:
        deadlines[p.lease_id] = min(p.deadline, deadlines.get(p.lease_id, p.deadline))
    usage = dict(state.usage)
    running: list[Running] = []
    for lease in state.running:
        if lease.lease_id in evicted:
            _charge(usage, lease, now, state.policy.half_life)
            continue
        if lease.lease_id in withdrawn:
            lease = replace(lease, preempt_deadline=None)
        if lease.lease_id in deadlines:
            lease = replace(lease, preempt_deadline=deadlines[lease.lease_id])
        running.append(lease)
    pending = {r.lease_id: r for r in state.pending}
    running += [_as_running(pending[g.lease_id], g.devices, now) for g in d.grants]
    waiting = tuple(replace(pending[w.lease_id], earmarked=w.earmarked) for w in d.waits)
    return replace(state, running=tuple(running), pending=waiting, usage=usage)


def expire(state: SchedulerState, now: dt.datetime) -> SchedulerState:
    """End the leases whose time limit has run out by ``now``."""
    usage = dict(state.usage)
    running = []
    for lease in state.running:
        if lease.ends is not None and lease.ends <= now:
            _charge(usage, lease, now, state.policy.half_life)
        else:
            running.append(lease)
    return replace(state, running=tuple(running), usage=usage)


def run_pass(
    state: SchedulerState, now: dt.datetime, earmarks: bool = False
) -> tuple[Decisions, SchedulerState, dt.datetime]:
    """One simulated step: schedule, check, apply, advance the clock, expire."""
    d = schedule(state, now)
    check_pass(state, now, d)
    if earmarks:
        check_earmarks(d)
    state = apply(state, d, now)
    check_state(state)
    now += seconds(STEP)
    return d, expire(state, now), now


# --- a. one pass ---------------------------------------------------------------------


@PROPERTIES
@given(worlds())
def test_one_pass_keeps_the_invariants(state: SchedulerState) -> None:
    d = schedule(state, T0)
    check_pass(state, T0, d)
    assert schedule(state, T0) == d, "not deterministic"


@pytest.mark.skip(
    reason="bug: policy.schedule may preempt one victim for two requests in one pass and "
    "earmark the same devices for both (find_victims sees the victim untold and ignores "
    "pool.earmarked); see test_one_victim_is_not_preempted_for_two_requests"
)
@PROPERTIES
@given(worlds())
def test_one_pass_earmarks_devices_for_one_request_only(state: SchedulerState) -> None:
    check_earmarks(schedule(state, T0))


# --- b. simulation -------------------------------------------------------------------


@PROPERTIES
@given(worlds())
def test_simulation_keeps_the_invariants_at_every_step(state: SchedulerState) -> None:
    within = {f"user:{u}" for u in USERS} | {f"group:{g}" for g in GROUPS}
    within -= over_limit(state, state.running)
    now = T0
    for _ in range(40):
        _, state, now = run_pass(state, now)
        assert not over_limit(state, state.running) & within, "a limit was exceeded"


@PROPERTIES
@given(worlds(finite=True))
def test_finite_workload_is_granted_or_held_for_good(state: SchedulerState) -> None:
    # while anything runs, time moves towards its end; when nothing runs, the
    # first request that may be granted is: so the union of lease lifetimes
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
        cuts = sorted(
            draw(
                st.sets(st.integers(1, total - 1), min_size=requesters - 1, max_size=requesters - 1)
            )
        )
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


def check_reclaimed_in_time(state: SchedulerState) -> None:
    acct = Accounting.of(state.policy, state.running)
    assert acct.borrowed == {r.lease_id for r in state.running}
    for request in state.pending:
        assert acct.within_guarantee(request.user, request.group, request.gpus)
        assert state.policy.classes[request.priority_class].preemptible
    bound = T0 + seconds(MAX_GRACE + MAX_MIN_RUNTIME + 3 * STEP)
    wanted = {r.lease_id for r in state.pending}
    now = T0
    while now <= bound and state.pending:
        _, state, now = run_pass(state, now)
    assert not state.pending, f"not granted by {bound:%H:%M} of {wanted}: {state.pending}"


@PROPERTIES
@given(reclaim_scenarios())
def test_request_within_guarantee_reclaims_from_borrowers_in_time(state: SchedulerState) -> None:
    check_reclaimed_in_time(state)


@pytest.mark.skip(
    reason="bug: two requests within guarantee reclaiming on one node in one pass get the "
    "same victim and the same earmarked devices; the second then waits for the first's "
    "lease to end while other reclaimed devices sit idle; see "
    "test_one_victim_is_not_preempted_for_two_requests"
)
@PROPERTIES
@given(reclaim_scenarios(requesters=2) | reclaim_scenarios(requesters=3))
def test_requests_within_guarantee_on_one_node_all_reclaim_in_time(
    state: SchedulerState,
) -> None:
    check_reclaimed_in_time(state)


@pytest.mark.skip(
    reason="bug: find_victims (preemption.py) picks a victim already told in this pass "
    "and reclaims its devices again, ignoring pool.earmarked"
)
def test_one_victim_is_not_preempted_for_two_requests() -> None:
    # minimal example: one node of 2, one borrowed 2-GPU lease, two users
    # within their 1-GPU guarantees ask for 1 GPU each
    slots = (Slot("GPU-a-0", "a", 0), Slot("GPU-a-1", "a", 1))
    borrowed = Running(1, "xia", ("GPU-a-0", "GPU-a-1"), T0 - seconds(3600), priority_class="batch")
    state = SchedulerState(
        slots,
        (borrowed,),
        (Request(10, "ana", 1, T0), Request(11, "ben", 1, T0)),
        Policy(user_quotas={"ana": Quota(1.0), "ben": Quota(1.0)}),
    )
    d = schedule(state, T0)
    check_earmarks(d)  # today: lease 1 told twice, GPU-a-0 earmarked for 10 and 11
    now = T0
    for _ in range(5):
        _, state, now = run_pass(state, now)
    assert not state.pending  # today: 11 waits on GPU-a-0 (held by 10), GPU-a-1 idle
