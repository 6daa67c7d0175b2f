"""Fractional slots through the pure scheduler: MIG instances in ``mig``
pools (on demand, static layouts, foreign instances), time-sliced shares in
``timeslice`` pools, pool filters, wait reasons and the two MIG placement
strategies. Every case goes through :func:`gpubroker.scheduler.schedule`."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Sequence
from dataclasses import replace

import pytest

from gpubroker.devices import mig
from gpubroker.scheduler import (
    Decisions,
    Grant,
    Instance,
    Part,
    Policy,
    Quota,
    Request,
    Running,
    SchedulerState,
    Slot,
    WaitReason,
    schedule,
)
from gpubroker.scheduler.sharing import STRATEGIES, SharingPool, mig_weight, share_weight

T0 = dt.datetime(2026, 3, 2, 9, 0, tzinfo=dt.timezone.utc)

H100 = "NVIDIA H100 80GB HBM3"
H100_MIB = 81559
A30 = "NVIDIA A30"
A30_MIB = 24576
A100_40 = "NVIDIA A100-SXM4-40GB"
A100_40_MIB = 40960
GIB = 1024

_H100_SPEC = mig.spec_for(H100)
assert _H100_SPEC is not None
H100_SPEC: mig.GpuMigSpec = _H100_SPEC


# --- builders ------------------------------------------------------------------------


def mig_slot(uuid: str, node: str = "n0", index: int = 0, pool: str = "mig", **kw: object) -> Slot:
    defaults: dict[str, object] = {"model": H100, "memory_mib": H100_MIB}
    return Slot(uuid, node, index, pool=pool, mode="mig", **{**defaults, **kw})  # type: ignore[arg-type]


def ts_slot(
    uuid: str, node: str = "n0", index: int = 0, pool: str = "shared", reserve_gib: int = 2
) -> Slot:
    return Slot(
        uuid,
        node,
        index,
        pool=pool,
        mode="timeslice",
        model=H100,
        memory_mib=H100_MIB,
        reserve_mib=reserve_gib * GIB,
    )


def mig_request(
    lease_id: int, profile: str, pool: str | None = None, user: str = "ana", model: str = H100
) -> Request:
    return Request(
        lease_id,
        user,
        1,
        T0 + dt.timedelta(seconds=lease_id),
        kind="mig",
        mig_profile=profile,
        pool=pool,
        weight=mig_weight(model, profile),
    )


def share_request(
    lease_id: int, memory_gib: float, count: int = 1, pool: str | None = None, user: str = "ana"
) -> Request:
    memory = round(memory_gib * GIB)
    return Request(
        lease_id,
        user,
        count,
        T0 + dt.timedelta(seconds=lease_id),
        kind="share",
        memory_mib=memory,
        pool=pool,
        weight=count * share_weight(memory, H100_MIB),
    )


def mig_part(device: str, profile: str, start: int, model: str = H100, instance: str = "") -> Part:
    spec = mig.spec_for(model)
    assert spec is not None
    prof = spec.profile(profile)
    return Part(
        device,
        "mig",
        mig_weight(model, profile),
        profile,
        start,
        prof.memory_slices,
        prof.memory_mib or prof.memory_gib * GIB,
        instance,
    )


def mig_lease(lease_id: int, device: str, profile: str, start: int, user: str = "zoe") -> Running:
    return Running(
        lease_id, user, (), T0 - dt.timedelta(hours=1), parts=(mig_part(device, profile, start),)
    )


def run(
    slots: Sequence[Slot],
    pending: Iterable[Request],
    running: Iterable[Running] = (),
    strategy: str = "least-fragmentation",
    policy: Policy | None = None,
) -> Decisions:
    state = SchedulerState(
        tuple(slots),
        tuple(running),
        tuple(pending),
        policy or Policy(),
        sharing_strategy=strategy,
    )
    return schedule(state, T0)


def granted(d: Decisions) -> dict[int, Grant]:
    return {g.lease_id: g for g in d.grants}


def waits(d: Decisions) -> dict[int, tuple[WaitReason, str]]:
    return {w.lease_id: (w.reason, w.message) for w in d.waits}


def one_by_one(
    slots: Sequence[Slot], requests: Sequence[Request], strategy: str = "least-fragmentation"
) -> tuple[list[Running], Decisions]:
    """Requests arriving one per pass; the grants become running leases."""
    running: list[Running] = []
    d = Decisions()
    for request in requests:
        d = run(slots, [request], running, strategy)
        for g in d.grants:
            running.append(Running(g.lease_id, request.user, g.devices, T0, parts=g.parts))
    return running, d


# --- MIG on demand -------------------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_seven_1g_on_one_h100_then_the_eighth_waits_for_resources(strategy: str) -> None:
    slot = mig_slot("GPU-0")
    d = run([slot], [mig_request(i, "1g.10gb") for i in range(1, 9)], strategy=strategy)
    grants = granted(d)
    assert sorted(grants) == list(range(1, 8))
    parts = [p for g in grants.values() for p in g.parts]
    assert all(g.devices == () and len(g.parts) == 1 for g in grants.values())
    assert sorted(p.start for p in parts) == list(range(7))
    assert {(p.device, p.size, p.profile, p.kind) for p in parts} == {
        ("GPU-0", 1, "1g.10gb", "mig")
    }
    assert all(p.weight == pytest.approx(1 / 7) and p.instance == "" for p in parts)
    layout = [(p.profile, mig.Placement(p.start, p.size)) for p in parts]
    assert mig.is_valid_layout(H100_SPEC, layout)
    reason, message = waits(d)[8]
    assert reason is WaitReason.resources
    assert "no free slot for MIG 1g.10gb in the MIG pools" in message
    assert message.startswith("waiting: ") and "1st in the queue" in message


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_seven_1g_arriving_one_per_pass_fill_slots_0_to_6(strategy: str) -> None:
    slot = mig_slot("GPU-0")
    running, d = one_by_one([slot], [mig_request(i, "1g.10gb") for i in range(1, 9)], strategy)
    assert sorted(r.parts[0].start for r in running) == list(range(7))
    assert waits(d)[8][0] is WaitReason.resources


def test_the_least_fragmentation_fill_order_of_1g_on_an_h100() -> None:
    running, _ = one_by_one([mig_slot("GPU-0")], [mig_request(i, "1g.10gb") for i in range(1, 8)])
    order = [r.parts[0].start for r in running]
    assert order[0] == 6  # keeps 4g (0-3), a 3g and every 2g placement possible
    expected = []
    layout: list[tuple[str, mig.Placement]] = []
    for _ in range(7):
        best = mig.best_placement(H100_SPEC, layout, "1g.10gb")
        assert best is not None
        expected.append(best.start)
        layout.append(("1g.10gb", best))
    assert order == expected


def test_fragmented_names_the_instances_in_the_way_and_their_leases() -> None:
    # 1g at slots 1 and 5: 5 compute and 6 memory slices free, yet no 3g
    # placement (0:4, 4:4) and no 4g placement (0:4) is free
    slot = mig_slot("GPU-0")
    running = [mig_lease(1, "GPU-0", "1g.10gb", 1), mig_lease(2, "GPU-0", "1g.10gb", 5)]
    d = run([slot], [mig_request(10, "3g.40gb"), mig_request(11, "4g.40gb")], running)
    assert d.grants == ()
    reason, message = waits(d)[10]
    assert reason is WaitReason.fragmented
    assert "MIG 3g.40gb does not fit although device 0 on n0 has 5 compute slices free" in message
    assert "1g.10gb at 1:1 (lease 1)" in message and "1g.10gb at 5:1 (lease 2)" in message
    reason, message = waits(d)[11]
    assert reason is WaitReason.fragmented
    assert "1g.10gb at 1:1 (lease 1)" in message and "lease 2" not in message

    pool = SharingPool.build([slot], running)
    part, miss = pool.place_mig(mig_request(10, "3g.40gb"))
    assert part is None and miss is not None
    assert miss.blockers == (("GPU-0", "1g.10gb", "1:1", 1), ("GPU-0", "1g.10gb", "5:1", 2))


def test_a_full_device_is_resources_not_fragmented() -> None:
    # 3g at 0 and 3g at 4: one compute slice left, no memory slice: Resources
    slot = mig_slot("GPU-0")
    running = [mig_lease(1, "GPU-0", "3g.40gb", 0), mig_lease(2, "GPU-0", "3g.40gb", 4)]
    d = run([slot], [mig_request(10, "1g.10gb"), mig_request(11, "2g.20gb")], running)
    assert d.grants == ()
    assert waits(d)[10][0] is WaitReason.resources
    assert waits(d)[11][0] is WaitReason.resources


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_3g_placed_when_there_is_room(strategy: str) -> None:
    slot = mig_slot("GPU-0")
    running = [mig_lease(1, "GPU-0", "1g.10gb", 6)]
    d = run([slot], [mig_request(10, "3g.40gb"), mig_request(11, "3g.40gb")], running, strategy)
    (part,) = granted(d)[10].parts
    assert (part.device, part.profile, part.start, part.size) == ("GPU-0", "3g.40gb", 0, 4)
    assert part.weight == pytest.approx(3 / 7)
    assert part.memory_mib == 40 * GIB
    # the second 3g: 3 compute but only 3 memory slices (4, 5, 7) free: no room
    assert waits(d)[11][0] is WaitReason.resources


def test_a_profile_no_device_offers_waits_pool_drained() -> None:
    d = run([mig_slot("GPU-0")], [mig_request(10, "4g.24gb", model=A30)])
    reason, message = waits(d)[10]
    assert reason is WaitReason.pool_drained
    assert "no device in the MIG pools offers MIG 4g.24gb" in message


def test_drained_mig_devices_take_no_new_instances() -> None:
    slots = [mig_slot("GPU-0", drained=True), mig_slot("GPU-1", index=1)]
    d = run(slots, [mig_request(10, "7g.80gb"), mig_request(11, "7g.80gb")])
    assert granted(d)[10].parts[0].device == "GPU-1"
    assert waits(d)[11][0] is WaitReason.resources
    d = run(slots[:1], [mig_request(10, "1g.10gb")])
    assert waits(d)[10][0] is WaitReason.pool_drained


def test_mig_weights_follow_the_devices_compute_slices() -> None:
    slots = [mig_slot("GPU-0"), mig_slot("GPU-1", index=1, model=A30, memory_mib=A30_MIB)]
    d = run(slots, [mig_request(10, "2g.20gb"), mig_request(11, "2g.12gb", model=A30)])
    assert granted(d)[10].parts[0].weight == pytest.approx(2 / 7)
    a30 = granted(d)[11].parts[0]
    assert (a30.device, a30.size) == ("GPU-1", 2)
    assert a30.weight == pytest.approx(2 / 4)
    lease = Running(11, "ana", (), T0, parts=granted(d)[11].parts + granted(d)[10].parts)
    assert lease.gpus == pytest.approx(2 / 4 + 2 / 7)


def test_a_device_held_whole_takes_no_instances() -> None:
    # a device moved into the MIG pool while a lease held it whole
    slots = [mig_slot("GPU-0")]
    whole = Running(1, "zoe", ("GPU-0",), T0 - dt.timedelta(hours=1))
    d = run(slots, [mig_request(10, "1g.10gb")], [whole])
    assert d.grants == ()
    assert waits(d)[10][0] in (WaitReason.resources, WaitReason.pool_drained)


def test_whole_gpu_requests_never_land_on_sharing_devices() -> None:
    slots = [mig_slot("GPU-0"), ts_slot("GPU-1", index=1), Slot("GPU-2", "n0", 2)]
    d = run(slots, [Request(10, "ana", 1, T0), Request(11, "ben", 1, T0 + dt.timedelta(1))])
    assert granted(d)[10].devices == ("GPU-2",) and granted(d)[10].parts == ()
    assert 11 in waits(d)


# --- pools ---------------------------------------------------------------------------


def test_the_pool_filter_is_respected() -> None:
    # "a" has a half-full device (best fit), "b" an empty one
    slots = [mig_slot("GPU-a", "n0", 0, pool="a"), mig_slot("GPU-b", "n1", 0, pool="b")]
    running = [mig_lease(1, "GPU-a", "3g.40gb", 0)]
    d = run(slots, [mig_request(10, "1g.10gb", pool="b")], running)
    assert granted(d)[10].parts[0].device == "GPU-b"
    d = run(slots, [mig_request(10, "1g.10gb")], running)
    assert granted(d)[10].parts[0].device == "GPU-a"  # any pool: best fit
    d = run(slots, [mig_request(10, "7g.80gb", pool="a")], running)
    reason, message = waits(d)[10]
    assert reason is WaitReason.resources and "in pool a" in message  # though "b" is empty
    d = run(slots, [mig_request(10, "1g.10gb", pool="nope")])
    assert waits(d)[10][0] is WaitReason.pool_drained


def test_shares_keep_to_their_pool() -> None:
    slots = [ts_slot("GPU-a", "n0", 0, pool="a"), ts_slot("GPU-b", "n1", 0, pool="b")]
    d = run(slots, [share_request(10, 10, pool="b"), share_request(11, 10, pool="a")])
    assert granted(d)[10].parts[0].device == "GPU-b"
    assert granted(d)[11].parts[0].device == "GPU-a"
    d = run(slots, [share_request(10, 10, count=2, pool="a")])
    assert waits(d)[10][0] is WaitReason.pool_drained  # one device per node in pool a


# --- shares --------------------------------------------------------------------------


def test_two_40gib_shares_with_a_2gib_reserve_go_to_two_devices() -> None:
    slots = [ts_slot("GPU-0", index=0), ts_slot("GPU-1", index=1)]
    d = run(slots, [share_request(10, 40), share_request(11, 40), share_request(12, 40)])
    (a,) = granted(d)[10].parts
    (b,) = granted(d)[11].parts
    assert {a.device, b.device} == {"GPU-0", "GPU-1"}
    assert a.kind == b.kind == "share" and a.memory_mib == b.memory_mib == 40 * GIB
    assert a.weight == pytest.approx(40 * GIB / H100_MIB)
    reason, message = waits(d)[12]
    assert reason is WaitReason.resources
    assert "no 1 device(s) in the time-sliced pools have 40 GiB free" in message


def test_shares_go_where_they_strand_least_then_best_fit() -> None:
    slots = [ts_slot("GPU-0", index=0, reserve_gib=0), ts_slot("GPU-1", index=1, reserve_gib=0)]
    d = run(slots, [share_request(10, 30), share_request(11, 30)])
    # stacking both 30 GiB shares on one device would leave 19.6 GiB there that
    # no share of the mix (30 GiB) can use: the second goes to the other device
    assert granted(d)[10].parts[0].device != granted(d)[11].parts[0].device
    d = run(slots, [share_request(10, 40), share_request(11, 39)])
    # 40 + 39 GiB fit one device and strand nothing either way: best fit stacks them
    assert granted(d)[10].parts[0].device == granted(d)[11].parts[0].device


def test_the_shares_of_one_request_go_to_distinct_devices_of_one_node() -> None:
    slots = [ts_slot("GPU-0", "n0", 0), ts_slot("GPU-1", "n0", 1), ts_slot("GPU-2", "n1", 0)]
    d = run(slots, [share_request(10, 10, count=2)])
    parts = granted(d)[10].parts
    assert len(parts) == 2 and {p.device for p in parts} == {"GPU-0", "GPU-1"}
    assert all(p.memory_mib == 10 * GIB and p.kind == "share" for p in parts)
    lease = Running(10, "ana", (), T0, parts=parts)
    assert lease.gpus == pytest.approx(2 * 10 * GIB / H100_MIB)


def test_share_sizes_and_placement_are_configurable() -> None:
    slots = [ts_slot("GPU-0", index=0, reserve_gib=0), ts_slot("GPU-1", index=1, reserve_gib=0)]
    held = Running(1, "zoe", (), T0, parts=(Part("GPU-0", "share", 0.38, memory_mib=30 * GIB),))
    request = share_request(10, 30)

    def device(**extra: object) -> str:
        state = SchedulerState(tuple(slots), (held,), (request,), Policy(), **extra)  # type: ignore[arg-type]
        return schedule(state, T0).grants[0].parts[0].device

    # the mix is two 30 GiB shares: a second one on GPU-1 strands nothing
    assert device() == "GPU-1"
    # with a 50 GiB size counted too, stacking keeps GPU-1's 80 GB for it
    assert device(share_sizes=(50 * GIB,)) == "GPU-0"
    assert device(share_placement="best-fit") == "GPU-0"
    assert device(share_placement="first-fit") == "GPU-0"
    with pytest.raises(ValueError, match="random is for the packing experiment"):
        device(share_placement="random")


def test_a_share_too_big_for_any_device_waits_pool_drained() -> None:
    slots = [ts_slot("GPU-0", index=0), ts_slot("GPU-1", index=1)]
    d = run(slots, [share_request(10, 77), share_request(11, 78), share_request(12, 1, count=3)])
    assert granted(d)[10].parts[0].memory_mib == 77 * GIB  # 79,511 MiB hand-out-able
    reason, message = waits(d)[11]
    assert reason is WaitReason.pool_drained
    assert "no node in the time-sliced pools has 1 device(s) able to hold 78 GiB" in message
    assert waits(d)[12][0] is WaitReason.pool_drained  # three shares, two devices


def test_running_shares_count_against_the_room() -> None:
    slots = [ts_slot("GPU-0")]
    held = Running(1, "zoe", (), T0, parts=(Part("GPU-0", "share", 0.5, memory_mib=70 * GIB),))
    d = run(slots, [share_request(10, 8), share_request(11, 7)], [held])
    assert 10 in waits(d) and waits(d)[10][0] is WaitReason.resources  # 79,511 - 71,680 < 8 GiB
    assert granted(d)[11].parts[0].device == "GPU-0"


def test_a_share_grant_over_the_user_limit_waits() -> None:
    slots = [ts_slot("GPU-0"), ts_slot("GPU-1", index=1)]
    policy = Policy(user_quotas={"ana": Quota(0.0, 0.5)})
    d = run(slots, [share_request(10, 30), share_request(11, 30)], policy=policy)
    assert 10 in granted(d)
    assert waits(d)[11][0] is WaitReason.quota_user


def test_a_share_on_a_smaller_device_stays_within_the_limit() -> None:
    slots = [
        ts_slot("GPU-big", index=0, reserve_gib=0),
        replace(
            ts_slot("GPU-small", index=1, reserve_gib=0), model=A100_40, memory_mib=A100_40_MIB
        ),
    ]
    request = share_request(10, 20, user="ben")  # estimate: 20 GiB / 81,559 MiB = 0.25
    policy = Policy(user_quotas={"ben": Quota(0.0, 0.45)})
    d = run(slots, [request], policy=policy)
    # placement finds the 40 GB device (it fills it exactly), where it would weigh
    # 20 GiB / 40 GiB = 0.5, over the limit: the share goes to the large device,
    # where it weighs 0.25
    (part,) = granted(d)[10].parts
    assert part.device == "GPU-big" and part.weight == pytest.approx(20 * 1024 / 81559)
    d = run(slots, [request], policy=Policy(user_quotas={"ben": Quota(0.0, 0.2)}))
    assert d.grants == ()  # too heavy everywhere: held at the limit, never over it
    assert waits(d)[10][0] is WaitReason.quota_user
    d = run(slots, [request], policy=Policy(user_quotas={"ben": Quota(0.0, 0.6)}))
    (part,) = granted(d)[10].parts
    assert part.device == "GPU-small" and part.weight == pytest.approx(20 / 40)


def test_a_request_for_a_full_pool_reserves_nothing_in_another_pool() -> None:
    slots = [Slot("GPU-a", "n0", 0, pool="a"), Slot("GPU-b", "n0", 1, pool="b")]
    busy = Running(1, "zoe", ("GPU-a",), T0 - dt.timedelta(hours=1))
    first = Request(10, "ana", 1, T0, pool="a")  # pool a is full, with no end in sight
    second = Request(11, "ben", 1, T0 + dt.timedelta(seconds=1))  # any pool
    d = run(slots, [first, second], [busy])
    assert granted(d)[11].devices == ("GPU-b",)  # not held back for ana
    assert waits(d)[10][0] is WaitReason.resources  # not "Reserved" with an ETA of now


# --- static layouts and foreign instances ---------------------------------------------


STATIC = (
    Instance("3g.40gb", 0, 4, "MIG-11111111-1111-5111-8111-111111111111", memory_mib=40320),
    Instance("2g.20gb", 4, 2, "MIG-22222222-2222-5222-8222-222222222222"),
    Instance("1g.10gb", 6, 1, "MIG-33333333-3333-5333-8333-333333333333"),
)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_static_instance_is_handed_out_with_its_mig_uuid(strategy: str) -> None:
    slot = mig_slot("GPU-0", static=STATIC)
    assert mig.is_valid_layout(
        H100_SPEC, [(i.profile, mig.Placement(i.start, i.size)) for i in STATIC]
    )
    d = run([slot], [mig_request(10, "1g.10gb"), mig_request(11, "3g.40gb")], strategy=strategy)
    one = granted(d)[10].parts[0]
    assert (one.profile, one.start, one.size, one.instance) == ("1g.10gb", 6, 1, STATIC[2].uuid)
    three = granted(d)[11].parts[0]
    assert (three.start, three.size, three.instance) == (0, 4, STATIC[0].uuid)
    assert three.memory_mib == 40320  # as the driver reports it
    assert one.memory_mib == 10 * GIB  # unknown: the profile's


def test_a_static_layout_never_makes_other_instances() -> None:
    slot = mig_slot("GPU-0", static=STATIC)
    running = [
        Running(1, "zoe", (), T0, parts=(mig_part("GPU-0", "1g.10gb", 6, instance=STATIC[2].uuid),))
    ]
    # 1g taken; the 3g and 2g instances are free, but the layout has no second 1g
    d = run([slot], [mig_request(10, "1g.10gb"), mig_request(11, "4g.40gb")], running)
    assert d.grants == ()
    assert waits(d)[10][0] is WaitReason.resources
    assert waits(d)[11][0] is WaitReason.resources  # not Fragmented: nothing is created here
    d = run([slot], [mig_request(10, "2g.20gb"), mig_request(11, "2g.20gb")], running)
    assert granted(d)[10].parts[0].instance == STATIC[1].uuid
    assert waits(d)[11][0] is WaitReason.resources


def test_foreign_instances_occupy_their_slices() -> None:
    foreign = (Instance("1g.10gb", 3, 1, "MIG-f"),)
    slot = mig_slot("GPU-0", foreign=foreign)
    d = run([slot], [mig_request(10, "4g.40gb"), mig_request(11, "3g.40gb")])
    reason, message = waits(d)[10]
    assert reason is WaitReason.fragmented
    assert "1g.10gb at 3:1" in message and "(lease" not in message
    pool = SharingPool.build([slot], [])
    _part, miss = pool.place_mig(mig_request(10, "4g.40gb"))
    assert miss is not None and miss.blockers == (("GPU-0", "1g.10gb", "3:1", None),)
    three = granted(d)[11].parts[0]
    assert (three.start, three.size) == (4, 4)
    layout = [("1g.10gb", mig.Placement(3, 1)), ("3g.40gb", mig.Placement(4, 4))]
    assert mig.is_valid_layout(H100_SPEC, layout)
    # compute: a foreign 4g and a 3g fill the device
    slot = mig_slot("GPU-0", foreign=(Instance("4g.40gb", 0, 4, "MIG-g"),))
    d = run([slot], [mig_request(10, "3g.40gb"), mig_request(11, "1g.10gb")])
    assert granted(d)[10].parts[0].start == 4
    assert waits(d)[11][0] is WaitReason.resources


# --- strategies -----------------------------------------------------------------------


def test_first_fit_and_least_fragmentation_differ_on_an_empty_h100() -> None:
    slots = [mig_slot("GPU-0")]
    ff = run(slots, [mig_request(10, "1g.10gb")], strategy="first-fit")
    lf = run(slots, [mig_request(10, "1g.10gb")])
    assert granted(ff)[10].parts[0].start == 0
    assert granted(lf)[10].parts[0].start == 6


def test_least_fragmentation_keeps_room_for_a_4g_where_first_fit_does_not() -> None:
    slots = [mig_slot("GPU-0")]
    requests = [mig_request(10, "1g.10gb"), mig_request(11, "4g.40gb")]
    _, ff = one_by_one(slots, requests, "first-fit")
    assert waits(ff)[11][0] is WaitReason.fragmented
    running, lf = one_by_one(slots, requests)
    assert lf.grants and lf.grants[0].parts[0].start == 0
    assert {r.parts[0].profile: r.parts[0].start for r in running} == {"1g.10gb": 6, "4g.40gb": 0}


def test_least_fragmentation_packs_the_fullest_device_first_fit_the_first() -> None:
    slots = [mig_slot("GPU-0", index=0), mig_slot("GPU-1", index=1)]
    running = [mig_lease(1, "GPU-1", "3g.40gb", 0)]
    ff = run(slots, [mig_request(10, "1g.10gb")], running, "first-fit")
    assert granted(ff)[10].parts[0].device == "GPU-0"
    lf = run(slots, [mig_request(10, "1g.10gb")], running)
    part = granted(lf)[10].parts[0]
    assert part.device == "GPU-1"
    best = mig.best_placement(H100_SPEC, [("3g.40gb", mig.Placement(0, 4))], "1g.10gb")
    assert best is not None and part.start == best.start


def test_an_unknown_strategy_is_refused() -> None:
    state = SchedulerState((mig_slot("GPU-0"),), (), (), sharing_strategy="best-effort")
    with pytest.raises(ValueError, match="strategy"):
        schedule(state, T0)


def test_fractional_requests_do_not_block_each_other() -> None:
    # a 7g that cannot fit does not hold back the 1g behind it (no reservations)
    slots = [mig_slot("GPU-0")]
    running = [mig_lease(1, "GPU-0", "1g.10gb", 6)]
    d = run(slots, [mig_request(10, "7g.80gb"), mig_request(11, "1g.10gb")], running)
    assert waits(d)[10][0] is WaitReason.resources
    assert 11 in granted(d)
