"""Sharing through the broker core: MIG instances made on demand by the fake
backend (which enforces NVIDIA's placement rules), time-sliced shares, pools,
weights in quotas. Real SQLite store; only the GPUs are simulated."""

from __future__ import annotations

from pathlib import Path

import pytest
from traitlets.config import Config

from gpubroker.core import Broker
from gpubroker.devices import mig
from gpubroker.devices.fake import FakeDeviceBackend
from gpubroker.errors import BadRequest, Forbidden
from gpubroker.store.db import make_engine, make_session_factory

H100 = mig.spec_for("NVIDIA H100 80GB HBM3")
assert H100 is not None

POOLS = [
    {"name": "mig", "mode": "mig", "devices": ["node-a:0-1"]},
    {"name": "shared", "mode": "timeslice", "devices": ["node-a:2-3"], "reserve_gib": 2},
]


def sharing_broker(db_url: str, tmp_path: Path, **policy: object) -> Broker:
    config = Config()
    config.Pools.pools = POOLS
    backend = FakeDeviceBackend(
        inventory=["8 x H100"],
        node_name="node-a",
        mig_enabled=[0, 1],
        state_file=str(tmp_path / "fake-gpus.json"),
    )
    engine = make_engine(db_url)
    broker = Broker(session_factory=make_session_factory(engine), backend=backend, config=config)
    for key, value in policy.items():
        setattr(broker.policy, key, value)
    broker.sync_inventory()
    broker.adopt()
    return broker


@pytest.fixture
def broker(db_url: str, tmp_path: Path) -> Broker:
    return sharing_broker(db_url, tmp_path)


def layout_of(broker: Broker, device: str) -> list[tuple[str, mig.Placement]]:
    return [(m.profile, m.placement) for m in broker.backend.mig_devices(device)]


def test_seven_1g_instances_on_one_h100_then_the_eighth_waits(broker: Broker) -> None:
    gpu0 = broker.backend.devices()[0].uuid
    leases = [
        broker.request_lease(f"u{i}", "", mig_profile="1g.10gb", pool="mig") for i in range(16)
    ]
    granted = [x for x in leases if x["state"] == "granted"]
    assert len(granted) == 14  # seven on each of the two MIG devices
    first_seven = [x for x in granted if x["slots"][0]["device"] == gpu0]
    assert len(first_seven) == 7
    uuids = {x["env"]["CUDA_VISIBLE_DEVICES"] for x in granted}
    assert len(uuids) == 14 and all(mig.is_mig_uuid(u) for u in uuids)
    assert mig.is_valid_layout(H100, layout_of(broker, gpu0))
    assert {str(p) for _n, p in layout_of(broker, gpu0)} == {f"{i}:1" for i in range(7)}
    for lease in granted:
        assert lease["kind"] == "mig" and lease["summary"] == "1 x MIG 1g.10gb"
        assert lease["weight"] == pytest.approx(1 / 7)
        assert "isolated in hardware" in lease["guarantee"] and "1/7" in lease["guarantee"]
    waiting = [x for x in leases if x["state"] == "pending"]
    assert len(waiting) == 2
    assert waiting[0]["queue"]["reason"] == "Resources"
    assert "no free slot for MIG 1g.10gb in pool mig" in waiting[0]["queue"]["message"]


def test_3g_fits_after_releases_else_waits_fragmented_naming_blockers(broker: Broker) -> None:
    gpu0, gpu1 = (d.uuid for d in broker.backend.devices()[:2])
    broker.request_mig_mode(gpu1, False)  # one MIG device only
    leases = [broker.request_lease(f"u{i}", "", mig_profile="1g.10gb") for i in range(7)]
    by_start = {x["slots"][0]["placement"]: x for x in leases}
    # free slots 1, 2 and 5 (and 7): 4 memory and 3 compute slices free, but
    # scattered: no 3g placement (start 0 or 4, four slices) is free
    for start in ("1:1", "2:1", "5:1"):
        broker.release_lease(by_start[start]["id"], "done")
    big = broker.request_lease("big", "", mig_profile="3g.40gb")
    assert big["state"] == "pending"
    assert big["queue"]["reason"] == "Fragmented"
    message = big["queue"]["message"]
    for start in ("0:1", "3:1", "4:1", "6:1"):
        assert f"1g.10gb at {start} (lease {by_start[start]['id']})" in message
    # free slots 4 and 6 too: 3g at 4:4 fits
    for start in ("4:1", "6:1"):
        broker.release_lease(by_start[start]["id"], "done")
    granted = broker.get_lease(big["id"])
    assert granted["state"] == "granted"
    assert granted["slots"][0]["placement"] == "4:4"
    assert mig.is_valid_layout(H100, layout_of(broker, gpu0))


def test_release_destroys_the_instance(broker: Broker) -> None:
    gpu0 = broker.backend.devices()[0].uuid
    lease = broker.request_lease("ann", "", mig_profile="3g.40gb")
    device = lease["slots"][0]["device"]
    assert len(layout_of(broker, device)) == 1
    broker.release_lease(lease["id"], "done")
    assert layout_of(broker, device) == [] and layout_of(broker, gpu0) == []


def test_a_mig_instance_that_fails_to_be_made_leaves_nothing_and_the_retry_succeeds(
    broker: Broker,
) -> None:
    broker.backend.fail_mig_creates = 1  # the driver refuses once
    lease = broker.request_lease("ann", "", mig_profile="3g.40gb")
    # back to waiting, with the driver's word as the reason; nothing half-made
    assert lease["state"] == "pending" and lease["slots"] == []
    assert "injected failure" in lease["queue"]["message"]
    assert all(layout_of(broker, d.uuid) == [] for d in broker.backend.devices()[:2])
    events = broker.lease_events(lease["id"])
    assert [e["kind"] for e in events] == ["requested", "grant-failed", "waiting"]
    assert "injected failure" in events[1]["reason"] and events[1]["actor"] == "scheduler"
    # the next pass tries again, and the instance is made
    broker.schedule_now()
    again = broker.get_lease(lease["id"])
    assert again["state"] == "granted" and again["slots"][0]["profile"] == "3g.40gb"
    assert [(p, str(at)) for p, at in layout_of(broker, again["slots"][0]["device"])] == [
        ("3g.40gb", again["slots"][0]["placement"])
    ]
    assert [e["kind"] for e in broker.lease_events(lease["id"])][-1] == "granted"
    assert broker.validate_state([lease["id"]]) == []


def test_two_40gib_shares_with_reserve_land_on_two_devices(broker: Broker) -> None:
    first = broker.request_lease("ann", "", memory_gib=40)
    second = broker.request_lease("bob", "", memory_gib=40)
    assert first["state"] == second["state"] == "granted"
    assert first["slots"][0]["device"] != second["slots"][0]["device"]
    assert first["kind"] == "share" and "memory cap of 40 GiB" in first["guarantee"]
    env = first["env"]
    assert env["CUDA_VISIBLE_DEVICES"] == first["slots"][0]["device"]
    assert env["GPUBROKER_SHARE_MEMORY_MIB"] == str(40 * 1024)
    assert float(env["XLA_PYTHON_CLIENT_MEM_FRACTION"]) <= 40 * 1024 / 81559
    # the allocators get the share less the CUDA context (Broker.framework_context_mib)
    assert env["GPUBROKER_MEMORY_LIMIT_MIB"] == str(40 * 1024 - 512)
    third = broker.request_lease("cat", "", memory_gib=40)
    assert third["state"] == "pending" and third["queue"]["reason"] == "Resources"


def test_two_shares_of_one_request_go_to_two_devices(broker: Broker) -> None:
    lease = broker.request_lease("ann", "", memory_gib=10, count=2)
    assert lease["state"] == "granted"
    devices = [s["device"] for s in lease["slots"]]
    assert len(set(devices)) == 2
    assert lease["env"]["CUDA_VISIBLE_DEVICES"] == ",".join(devices)
    assert lease["weight"] == pytest.approx(2 * 10 * 1024 / 81559)


def test_bad_requests_name_the_field_and_limit(broker: Broker) -> None:
    cases = [
        ({"mig_profile": "5g.1gb"}, "mig_profile: no device of the MIG pools offers '5g.1gb'"),
        ({"memory_gib": 79}, "memory_gib: at most 77.6"),
        ({"memory_gib": 10, "count": 3}, "count: at most 2 shares"),
        ({"gpus": 1, "pool": "mig"}, "pool: 'mig' is a mig pool; gpus needs an exclusive pool"),
        ({"mig_profile": "1g.10gb", "pool": "nope"}, "pool: no pool 'nope' has devices"),
        ({"gpus": 5}, "gpus: must be between 1 and 4"),
    ]
    for kwargs, message in cases:
        with pytest.raises(BadRequest, match=message.replace("(", r"\(")):
            broker.request_lease("ann", "", **kwargs)
    assert broker.list_leases() == []


def test_quota_counts_mig_and_share_weights(db_url: str, tmp_path: Path) -> None:
    broker = sharing_broker(db_url, tmp_path, user_quotas={"ann": {"limit": 0.5}})
    broker.request_lease("ann", "a", mig_profile="2g.20gb")  # 2/7
    broker.request_lease("ann", "b", mig_profile="1g.10gb")  # 1/7: 3/7 in all
    with pytest.raises(Forbidden, match=r"more would exceed the user limit of 0\.5"):
        broker.request_lease("ann", "c", mig_profile="1g.10gb")
    quota = broker.availability("ann")["quota"]
    assert quota["held"] == pytest.approx(3 / 7, abs=1e-3)
    assert quota["remaining"] == pytest.approx(0.5 - 3 / 7, abs=1e-3)


def test_availability_per_pool(broker: Broker) -> None:
    broker.request_lease("ann", "", mig_profile="3g.40gb")
    broker.request_lease("bob", "", memory_gib=30)
    pools = {p["name"]: p for p in broker.availability("ann")["pools"]}
    assert set(pools) == {"mig", "shared", "default"}
    assert pools["default"]["free"]["gpus"] == 4
    assert pools["default"]["free"]["gpus_one_node"] == 4  # one node here
    assert pools["mig"]["free"]["mig"]["7g.80gb"] == 1
    assert pools["mig"]["free"]["mig"]["1g.10gb"] == 7 + 4
    assert pools["shared"]["free"]["share_gib"] == pytest.approx(81559 / 1024 - 2)


def test_mig_mode_change_waits_until_the_device_is_empty(broker: Broker) -> None:
    gpu0 = broker.backend.devices()[0].uuid
    broker.request_mig_mode(broker.backend.devices()[1].uuid, False)
    lease = broker.request_lease("ann", "", mig_profile="1g.10gb")
    answer = broker.request_mig_mode(gpu0, False)
    assert answer == {"uuid": gpu0, "mig_enabled": True, "mig_target": False}
    queued = broker.request_lease("bob", "", mig_profile="1g.10gb")
    assert queued["state"] == "pending"  # drained meanwhile
    broker.release_lease(lease["id"], "done")
    assert broker.sharing.apply_mig_modes() == [gpu0]
    assert broker.backend.devices()[0].mig_enabled is False


def test_restart_keeps_instances_of_active_leases(db_url: str, tmp_path: Path) -> None:
    broker = sharing_broker(db_url, tmp_path)
    lease = broker.request_lease("ann", "", mig_profile="1g.10gb")
    again = sharing_broker(db_url, tmp_path)
    device = lease["slots"][0]["device"]
    assert [m.uuid for m in again.backend.mig_devices(device)] == [
        lease["env"]["CUDA_VISIBLE_DEVICES"]
    ]
    assert again.sharing.clean_mig() == []  # held: not foreign
    again.release_lease(lease["id"], "done")
    assert again.backend.mig_devices(device) == []


def test_static_layout_hands_out_the_admins_instances_and_keeps_them(
    db_url: str, tmp_path: Path
) -> None:
    config = Config()
    config.Pools.pools = [
        {"name": "static", "mode": "mig", "devices": ["node-a:0"], "mig_layout": "static"}
    ]
    backend = FakeDeviceBackend(
        inventory=["2 x H100"],
        node_name="node-a",
        mig_enabled=[0],
        mig_layout={0: ["3g.40gb@4", "1g.10gb@0", "1g.10gb@1"]},
        state_file=str(tmp_path / "static.json"),
    )
    broker = Broker(
        session_factory=make_session_factory(make_engine(db_url)), backend=backend, config=config
    )
    broker.sync_inventory()
    gpu0 = backend.devices()[0].uuid
    made = {m.uuid for m in backend.mig_devices(gpu0)}
    first = broker.request_lease("ann", "", mig_profile="1g.10gb")
    second = broker.request_lease("bob", "", mig_profile="1g.10gb")
    third = broker.request_lease("cat", "", mig_profile="1g.10gb")
    big = broker.request_lease("dan", "", mig_profile="3g.40gb")
    assert {first["slots"][0]["uuid"], second["slots"][0]["uuid"]} <= made
    assert big["slots"][0]["placement"] == "4:4" and big["slots"][0]["uuid"] in made
    driver_mib = {m.uuid: m.memory_mib for m in backend.mig_devices(gpu0)}
    assert big["slots"][0]["memory_mib"] == driver_mib[big["slots"][0]["uuid"]]
    assert third["state"] == "pending"  # the broker never creates one in a static pool
    assert {m.uuid for m in backend.mig_devices(gpu0)} == made
    broker.release_lease(first["id"], "done")
    assert {m.uuid for m in backend.mig_devices(gpu0)} == made  # nor destroys one
    assert broker.get_lease(third["id"])["slots"][0]["uuid"] == first["slots"][0]["uuid"]


def test_culler_reads_a_share_by_its_own_processes_and_a_mig_lease_by_its_instance(
    broker: Broker,
) -> None:
    from gpubroker.culler import Culler
    from gpubroker.store.models import Lease

    mine = broker.request_lease("ann", "", memory_gib=10)
    other = broker.request_lease("bob", "", memory_gib=10)
    small = broker.request_lease("cat", "", mig_profile="1g.10gb")
    device = mine["slots"][0]["device"]
    assert other["slots"][0]["device"] == device
    owners = {11: mine["id"], 22: other["id"]}
    culler = Culler(broker, None, pid_lease=owners.get)
    broker.backend.set_usage(
        device,
        utilization_gpu=95,
        processes=[{"pid": 11, "used_memory_mib": 512}, {"pid": 22, "used_memory_mib": 9000}],
    )
    broker.backend.set_usage(small["slots"][0]["uuid"], utilization_gpu=None, memory_used_mib=700)
    with broker.session_factory() as session:
        for lease_id, expected in ((mine["id"], (None, 512)), (small["id"], (None, 700))):
            lease = session.get(Lease, lease_id)
            assert lease is not None
            (allocation,) = lease.allocations
            assert culler._slot_usage(lease, allocation) == expected
    # where the GPU has GPM (Hopper), a MIG instance's activity is its use
    broker.backend.set_usage(
        small["slots"][0]["uuid"], utilization_gpu=None, memory_used_mib=700, engine_activity=0.42
    )
    with broker.session_factory() as session:
        lease = session.get(Lease, small["id"])
        assert lease is not None
        assert culler._slot_usage(lease, lease.allocations[0]) == (42, 700)


def test_model_selectors_match_aliases_and_nvml_names() -> None:
    from gpubroker.pools import check_selector, matches

    h100 = "NVIDIA H100 80GB HBM3"
    assert matches("model=H100", "GPU-x", "n", 0, h100)
    assert matches("model=h100 80gb", "GPU-x", "n", 0, h100)  # part of the NVML name
    assert matches("model=H200 NVL", "GPU-x", "n", 0, "NVIDIA H200 NVL")  # not in the fake
    assert not matches("model=A100", "GPU-x", "n", 0, h100)
    with pytest.raises(ValueError, match="bad device selector"):
        check_selector("gpu-a")


def test_an_empty_static_pool_never_gets_an_instance_made(db_url: str, tmp_path: Path) -> None:
    config = Config()
    config.Pools.pools = [
        {"name": "static", "mode": "mig", "devices": ["node-a:0"], "mig_layout": "static"}
    ]
    backend = FakeDeviceBackend(inventory=["1 x H100"], node_name="node-a", mig_enabled=[0])
    broker = Broker(
        session_factory=make_session_factory(make_engine(db_url)), backend=backend, config=config
    )
    broker.sync_inventory()
    lease = broker.request_lease("ann", "", mig_profile="1g.10gb")
    assert lease["state"] == "pending" and lease["queue"]["reason"] == "Resources"
    assert backend.mig_devices(backend.devices()[0].uuid) == []


def test_a_lease_whose_instance_vanished_is_evicted_at_restart(db_url: str, tmp_path: Path) -> None:
    import json

    broker = sharing_broker(db_url, tmp_path)
    lease = broker.request_lease("ann", "", mig_profile="1g.10gb")
    state_file = tmp_path / "fake-gpus.json"
    state = json.loads(state_file.read_text())
    state["_mig"][lease["slots"][0]["device"]]["instances"] = []  # a GPU reset
    state_file.write_text(json.dumps(state))
    again = sharing_broker(db_url, tmp_path)
    gone = again.get_lease(lease["id"])
    assert gone["state"] == "released"
    assert "no longer exists" in gone["release_reason"]
    fresh = again.request_lease("bob", "", mig_profile="1g.10gb")
    assert fresh["state"] == "granted"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"memory_gib": float("nan")}, "memory_gib: must be between 0.25 and 1024"),
        ({"memory_gib": float("inf")}, "memory_gib: must be between 0.25 and 1024"),
        ({"memory_gib": -1}, "memory_gib: must be between 0.25 and 1024"),
        ({"memory_gib": 4, "count": -2}, "count: must be at least 1"),
        ({"gpus": 1.5}, "gpus: must be an integer"),
    ],
)
def test_the_core_checks_numbers_itself(broker: Broker, kwargs: dict, message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        broker.request_lease("ann", "", **kwargs)
    assert broker.list_leases(active=False) == []


def test_pool_selectors_with_huge_or_reversed_ranges() -> None:
    from gpubroker.pools import check_selector, matches

    assert matches("node-a:0-999999999", "GPU-x", "node-a", 12345, "NVIDIA H100 80GB HBM3")
    with pytest.raises(ValueError, match="bad index range 5-2"):
        check_selector("node-a:5-2")


def test_mig_mode_goes_on_only_in_mig_pools(broker: Broker) -> None:
    whole = broker.backend.devices()[4].uuid  # the default, exclusive pool
    with pytest.raises(BadRequest, match="MIG mode goes on only in pools of mode mig"):
        broker.request_mig_mode(whole, True)
    (device,) = [d for d, _ in broker.device_rows() if d.uuid == whole]
    assert device.mig_target is None and not device.mig_enabled
    assert broker.request_lease("ann", "", gpus=1)["state"] == "granted"


def test_a_refused_restart_leaves_the_previous_lease_and_its_instance(broker: Broker) -> None:
    from gpubroker.errors import Forbidden

    first = broker.request_lease("ann", "", mig_profile="3g.40gb")
    assert first["state"] == "granted"
    instance = first["slots"][0]["uuid"]
    parent = first["slots"][0]["device"]
    broker.set_quota("user", "ann", 0.0, 1.0)
    with pytest.raises(Forbidden, match="quota: user ann holds or waits for 0 GPUs; 2 more"):
        broker.request_lease("ann", "", gpus=2, restart_of=first["id"])
    # a refusal changes nothing: the lease holds its instance, which still exists
    assert broker.get_lease(first["id"])["state"] == "granted"
    assert instance in {m.uuid for m in broker.backend.mig_devices(parent)}
    # within the limit, the restart replaces the lease (its own share not counted)
    again = broker.request_lease("ann", "", mig_profile="3g.40gb", restart_of=first["id"])
    assert broker.get_lease(first["id"])["release_reason"] == "server restarted"
    assert again["restarts"] == 1
