"""MIG management in the simulated backend (and the NVML backend on a stubbed pynvml).

The rules are NVIDIA's (MIG User Guide tables and ``nvidia-smi mig -lgipp``
placements) as encoded in :mod:`gpubroker.devices.mig`; these tests check
that the fake backend obeys exactly those rules and keeps its MIG state.
"""

from __future__ import annotations

import itertools
import json
import re

import pytest

from gpubroker.devices import mig
from gpubroker.devices.base import (
    DeviceBackend,
    DeviceBackendError,
    DeviceInfo,
    DeviceInUseError,
    DeviceUsage,
    MigDevice,
    MigPlacementError,
    ProcessInfo,
)
from gpubroker.devices.fake import MIG_STATE_KEY, FakeDeviceBackend
from gpubroker.devices.mig import Placement

MIG_UUID_RE = re.compile(r"^MIG-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
H100 = "NVIDIA H100 80GB HBM3"


def fake(*inventory: str, **kwargs: object) -> FakeDeviceBackend:
    kwargs.setdefault("node_name", "node1")
    return FakeDeviceBackend(inventory=list(inventory), **kwargs)


def h100_spec() -> mig.GpuMigSpec:
    spec = mig.spec_for(H100)
    assert spec is not None
    return spec


def layout_of(devices: list[MigDevice]) -> list[tuple[str, Placement]]:
    return [(d.profile, d.placement) for d in devices]


# --- mode ------------------------------------------------------------------------------


def test_mig_mode_from_trait_and_default_off():
    backend = fake("2 x H100", mig_enabled=[1])
    assert [d.mig_enabled for d in backend.devices()] == [False, True]
    assert backend.mig_devices(backend.devices()[0].uuid) == []


def test_non_mig_model_in_mig_enabled_is_refused_naming_index_and_model():
    with pytest.raises(DeviceBackendError, match=r"device 1 is a Tesla T4.*does not support MIG"):
        fake("H100", "T4", mig_enabled=[0, 1])
    with pytest.raises(DeviceBackendError, match="no fake device 5"):
        fake("H100", mig_enabled=[5])


def test_create_refused_while_mig_mode_is_off():
    backend = fake("H100")
    uuid = backend.devices()[0].uuid
    with pytest.raises(MigPlacementError, match="MIG mode is off") as info:
        backend.create_mig_device(uuid, "1g.10gb", Placement(0, 1))
    message = str(info.value)
    assert "device 0" in message and uuid in message and "1g.10gb" in message and "0:1" in message


def test_create_on_non_mig_model_and_unknown_profile_refused():
    backend = fake("T4", "H100", mig_enabled=[1])
    t4, h100 = (d.uuid for d in backend.devices())
    with pytest.raises(MigPlacementError, match="does not support MIG"):
        backend.create_mig_device(t4, "1g.10gb", Placement(0, 1))
    with pytest.raises(MigPlacementError, match=r"no MIG profile '1g\.5gb'"):
        backend.create_mig_device(h100, "1g.5gb", Placement(0, 1))
    with pytest.raises(DeviceBackendError, match="does not support MIG"):
        backend.set_mig_mode(t4, True)


def test_unknown_parent_raises_keyerror():
    backend = fake("H100", mig_enabled=[0])
    bogus = "GPU-00000000-0000-0000-0000-000000000000"
    with pytest.raises(KeyError):
        backend.mig_devices(bogus)
    with pytest.raises(KeyError):
        backend.create_mig_device(bogus, "1g.10gb", Placement(0, 1))
    with pytest.raises(KeyError):
        backend.destroy_mig_device(bogus, "MIG-00000000-0000-0000-0000-000000000000")
    with pytest.raises(KeyError):
        backend.set_mig_mode(bogus, True)


# --- create ---------------------------------------------------------------------------------


def test_seven_1g_10gb_on_h100_then_the_eighth_is_refused():
    backend = fake("H100", mig_enabled=[0])
    parent = backend.devices()[0].uuid
    spec = h100_spec()
    created = []
    for _ in range(7):
        placement = mig.best_placement(spec, layout_of(created), "1g.10gb")
        assert placement is not None
        created.append(backend.create_mig_device(parent, "1g.10gb", placement))
    uuids = [d.uuid for d in created]
    assert len(set(uuids)) == 7
    assert all(MIG_UUID_RE.match(u) for u in uuids)
    assert sorted(d.placement.start for d in created) == [0, 1, 2, 3, 4, 5, 6]
    assert mig.is_valid_layout(spec, layout_of(created))
    assert sorted(d.gi_id for d in created) == [1, 2, 3, 4, 5, 6, 7]
    assert {d.ci_id for d in created} == {0}
    assert all(d.uuid == mig.mig_uuid(parent, d.gi_id, d.ci_id, i) for i, d in enumerate(created))
    assert all(d.parent_uuid == parent and d.profile == "1g.10gb" for d in created)
    # no 1-slice placement starts at slot 7 (nvidia-smi mig -lgipp), and 7 is the limit
    assert mig.best_placement(spec, layout_of(created), "1g.10gb") is None
    with pytest.raises(MigPlacementError, match=r"placement 7:1 not allowed for 1g\.10gb"):
        backend.create_mig_device(parent, "1g.10gb", Placement(7, 1))
    with pytest.raises(MigPlacementError, match=r"overlaps 1g\.10gb at 0:1"):
        backend.create_mig_device(parent, "1g.10gb", Placement(0, 1))
    assert backend.mig_devices(parent) == sorted(created, key=lambda d: d.gi_id)


def test_overlap_and_disallowed_placement_refused_with_rule():
    backend = fake("H100", mig_enabled=[0])
    parent = backend.devices()[0].uuid
    backend.create_mig_device(parent, "1g.10gb", Placement(2, 1))
    with pytest.raises(MigPlacementError) as info:
        backend.create_mig_device(parent, "2g.20gb", Placement(2, 2))
    assert "overlaps 1g.10gb at 2:1" in str(info.value)
    assert "2g.20gb" in str(info.value) and "2:2" in str(info.value) and parent in str(info.value)
    with pytest.raises(MigPlacementError, match=r"placement 3:2 not allowed for 2g\.20gb"):
        backend.create_mig_device(parent, "2g.20gb", Placement(3, 2))
    with pytest.raises(MigPlacementError, match=r"allowed starts 0,2,4"):
        backend.create_mig_device(parent, "2g.20gb", Placement(3, 2))
    assert len(backend.mig_devices(parent)) == 1


def test_compute_slices_instance_limit_and_media_extension_rules():
    backend = fake("H100", mig_enabled=[0])
    parent = backend.devices()[0].uuid
    backend.create_mig_device(parent, "4g.40gb", Placement(0, 4))
    backend.create_mig_device(parent, "1g.10gb+me", Placement(4, 1))
    with pytest.raises(MigPlacementError, match=r"one media-extension \(\+me\)"):
        backend.create_mig_device(parent, "1g.10gb+me", Placement(5, 1))
    backend.create_mig_device(parent, "1g.10gb", Placement(5, 1))
    backend.create_mig_device(parent, "1g.10gb", Placement(6, 1))
    # 4 + 1 + 1 + 1 = 7 compute slices: full, though slot 7 is free
    assert not mig.valid_placements(h100_spec(), layout_of(backend.mig_devices(parent)), "1g.10gb")

    other = fake("H100", mig_enabled=[0])
    gpu = other.devices()[0].uuid
    other.create_mig_device(gpu, "3g.40gb", Placement(0, 4))
    with pytest.raises(MigPlacementError, match=r"at most 1 4g\.40gb|overlaps"):
        other.create_mig_device(gpu, "4g.40gb", Placement(0, 4))
    other.create_mig_device(gpu, "3g.40gb", Placement(4, 4))
    assert [d.profile for d in other.mig_devices(gpu)] == ["3g.40gb", "3g.40gb"]


def test_fake_refuses_exactly_where_can_place_says_no():
    """Every profile at every slot, against a set of layouts: same answer as the catalog."""
    spec = h100_spec()
    layouts = [
        [],
        [("1g.10gb", Placement(2, 1))],
        [("3g.40gb", Placement(4, 4))],
        [("4g.40gb", Placement(0, 4)), ("1g.10gb+me", Placement(4, 1))],
        [("1g.10gb", Placement(i, 1)) for i in range(6)],
        [("2g.20gb", Placement(0, 2)), ("2g.20gb", Placement(2, 2)), ("1g.20gb", Placement(4, 2))],
    ]
    for layout in layouts:
        backend = fake("H100", mig_enabled=[0])
        parent = backend.devices()[0].uuid
        for name, placement in layout:
            backend.create_mig_device(parent, name, placement)
        for profile, start in itertools.product(spec.profiles.values(), range(8)):
            placement = Placement(start, profile.memory_slices)
            allowed = mig.can_place(spec, layout, profile, placement)
            problem = mig.placement_problem(spec, layout, profile, placement)
            assert (problem is None) == allowed, (layout, profile.name, placement, problem)
            if allowed:
                device = backend.create_mig_device(parent, profile.name, placement)
                backend.destroy_mig_device(parent, device.uuid)
            else:
                with pytest.raises(MigPlacementError) as info:
                    backend.create_mig_device(parent, profile.name, placement)
                assert problem is not None and problem in str(info.value)


def test_memory_of_mig_devices_in_mib():
    backend = fake("H100", "A100-40GB", mig_enabled=[0, 1])
    h100, a100 = (d.uuid for d in backend.devices())
    small = backend.create_mig_device(h100, "1g.10gb", Placement(0, 1))
    half = backend.create_mig_device(h100, "3g.40gb", Placement(4, 4))
    assert small.memory_mib == 81559 * 1 // 8
    assert half.memory_mib == 81559 * 4 // 8
    # A100 40GB: the catalog has the nvidia-smi mig -lgip figures
    assert backend.create_mig_device(a100, "1g.5gb", Placement(0, 1)).memory_mib == 4864


# --- destroy ----------------------------------------------------------------------------


def test_destroy_then_recreate_reuses_lowest_free_gi_id():
    backend = fake("H100", mig_enabled=[0])
    parent = backend.devices()[0].uuid
    first = backend.create_mig_device(parent, "1g.10gb", Placement(0, 1))
    second = backend.create_mig_device(parent, "1g.10gb", Placement(1, 1))
    assert (first.gi_id, second.gi_id) == (1, 2)
    backend.destroy_mig_device(parent, first.uuid)
    assert backend.mig_devices(parent) == [second]
    with pytest.raises(KeyError):
        backend.destroy_mig_device(parent, first.uuid)
    with pytest.raises(KeyError):
        backend.usage(first.uuid)
    again = backend.create_mig_device(parent, "1g.10gb", Placement(0, 1))
    assert again.gi_id == first.gi_id  # the lowest free GPU-instance ID again
    assert again.uuid != first.uuid  # but a new UUID, as a real driver gives
    assert again.uuid == mig.mig_uuid(parent, 1, 0, 2)  # the third creation on the GPU
    bigger = backend.create_mig_device(parent, "2g.20gb", Placement(2, 2))
    assert bigger.gi_id == 3


def test_destroy_in_use_is_refused():
    backend = fake("H100", mig_enabled=[0])
    parent = backend.devices()[0].uuid
    device = backend.create_mig_device(parent, "3g.40gb", Placement(0, 4))
    backend.set_usage(device.uuid, None, processes=[ProcessInfo(4242, 1024)])
    with pytest.raises(DeviceInUseError, match=r"in use by process\(es\) 4242") as info:
        backend.destroy_mig_device(parent, device.uuid)
    assert device.uuid in str(info.value)
    assert backend.mig_devices(parent) == [device]
    backend.set_usage(device.uuid, None, processes=[])
    backend.destroy_mig_device(parent, device.uuid)
    assert backend.mig_devices(parent) == []


def test_destroy_unknown_mig_uuid_or_other_gpus_device_raises_keyerror():
    backend = fake("2 x H100", mig_enabled=[0, 1])
    first, second = (d.uuid for d in backend.devices())
    device = backend.create_mig_device(first, "1g.10gb", Placement(0, 1))
    with pytest.raises(KeyError):
        backend.destroy_mig_device(first, "MIG-00000000-0000-0000-0000-000000000000")
    with pytest.raises(KeyError):
        backend.destroy_mig_device(second, device.uuid)


# --- set_mig_mode ---------------------------------------------------------------------


def test_set_mig_mode_refused_with_instances_or_processes():
    backend = fake("H100")
    parent = backend.devices()[0].uuid
    backend.set_mig_mode(parent, True)
    assert backend.devices()[0].mig_enabled
    backend.set_mig_mode(parent, True)  # already on: nothing to do
    device = backend.create_mig_device(parent, "7g.80gb", Placement(0, 8))
    with pytest.raises(DeviceInUseError, match=r"in use by 1 MIG device\(s\): 7g\.80gb at 0:8"):
        backend.set_mig_mode(parent, False)
    backend.destroy_mig_device(parent, device.uuid)
    backend.set_usage(parent, None, processes=[{"pid": 99, "used_memory_mib": 10}])
    with pytest.raises(DeviceInUseError, match=r"in use by process\(es\) 99"):
        backend.set_mig_mode(parent, False)
    backend.set_usage(parent, None, processes=[])
    backend.set_mig_mode(parent, False)
    assert not backend.devices()[0].mig_enabled
    with pytest.raises(MigPlacementError, match="MIG mode is off"):
        backend.create_mig_device(parent, "1g.10gb", Placement(0, 1))


def test_usage_follows_nvml_rules_for_mig_devices():
    """NVML reports no utilization for a MIG device or a GPU in MIG mode,
    and GPM activity only for MIG devices: the fake refuses what NVML
    would never report."""
    backend = fake("2 x H100", mig_enabled=[0])
    parent, whole = (d.uuid for d in backend.devices())
    device = backend.create_mig_device(parent, "1g.10gb", Placement(0, 1))
    for uuid in (device.uuid, parent):
        with pytest.raises(ValueError, match="reports no utilization"):
            backend.set_usage(uuid, utilization_gpu=80)
        assert backend.set_usage(uuid).utilization_gpu is None  # the default 0: not reported
    with pytest.raises(ValueError, match="engine_activity: only a MIG device"):
        backend.set_usage(whole, engine_activity=0.5)
    assert backend.set_usage(device.uuid, None, engine_activity=0.5).engine_activity == 0.5
    assert backend.set_usage(whole, utilization_gpu=80).utilization_gpu == 80


# --- persistence -------------------------------------------------------------------------


def test_state_survives_a_new_backend_on_the_same_state_file(tmp_path):
    state = tmp_path / "state.json"
    backend = fake("2 x H100", state_file=str(state), mig_enabled=[0])
    first, second = (d.uuid for d in backend.devices())
    device = backend.create_mig_device(first, "3g.40gb", Placement(4, 4))
    backend.set_mig_mode(second, True)
    backend.set_usage(device.uuid, None, 2048, [ProcessInfo(7, 2048)])

    data = json.loads(state.read_text())
    assert data[MIG_STATE_KEY][first] == {
        "enabled": True,
        "created": 1,
        "instances": [
            {
                "gi_id": 1,
                "ci_id": 0,
                "profile": "3g.40gb",
                "start": 4,
                "size": 4,
                "uuid": device.uuid,
            }
        ],
    }
    assert data[MIG_STATE_KEY][second] == {"enabled": True, "created": 0, "instances": []}
    assert data[device.uuid]["processes"] == [{"pid": 7, "used_memory_mib": 2048}]

    # a restarted broker, whose config no longer lists device 0: the state wins
    restarted = fake("2 x H100", state_file=str(state))
    assert [d.mig_enabled for d in restarted.devices()] == [True, True]
    assert restarted.mig_devices(first) == [device]
    assert restarted.usage(device.uuid).processes == (ProcessInfo(7, 2048),)
    with pytest.raises(DeviceInUseError):
        restarted.destroy_mig_device(first, device.uuid)
    # GPU usage reads still ignore the MIG key; in MIG mode a GPU reports
    # its instances' sum, as NVML does on the parent's handle
    assert restarted.usage(first).memory_used_mib == 2048
    assert restarted.usage(second).memory_used_mib == 0


def test_usage_of_gpu_ignores_the_mig_key_in_the_state_file(tmp_path):
    state = tmp_path / "state.json"
    backend = fake("H100", state_file=str(state))
    uuid = backend.devices()[0].uuid
    state.write_text(
        json.dumps({MIG_STATE_KEY: {}, uuid: {"utilization_gpu": 30, "memory_used_mib": 5}})
    )
    assert backend.usage(uuid).utilization_gpu == 30
    with pytest.raises(KeyError):
        backend.usage(MIG_STATE_KEY)


def test_malformed_mig_state_raises_with_path(tmp_path):
    state = tmp_path / "state.json"
    backend = fake("H100", state_file=str(state))
    uuid = backend.devices()[0].uuid
    state.write_text(json.dumps({MIG_STATE_KEY: {uuid: {"enabled": "yes"}}}))
    with pytest.raises(DeviceBackendError, match=re.escape(str(state))):
        backend.mig_devices(uuid)
    bad = {
        "enabled": True,
        "instances": [{"gi_id": 1, "profile": "3g.40gb", "start": 0, "size": 2}],
    }
    state.write_text(json.dumps({MIG_STATE_KEY: {uuid: bad}}))
    with pytest.raises(DeviceBackendError, match="memory slices"):
        backend.devices()


def test_in_memory_state_without_state_file():
    backend = fake("H100", mig_enabled=[0])
    parent = backend.devices()[0].uuid
    device = backend.create_mig_device(parent, "1g.10gb", Placement(3, 1))
    assert backend.mig_devices(parent) == [device]
    assert fake("H100", mig_enabled=[0]).mig_devices(parent) == []  # memory is per instance


# --- static layout -------------------------------------------------------------------------


def test_static_mig_layout_is_created_at_start_and_kept_on_restart(tmp_path):
    state = tmp_path / "state.json"
    config = {"mig_enabled": [0], "mig_layout": {"0": ["3g.40gb@4", "1g.10gb", "2g.20gb"]}}
    backend = fake("H100", state_file=str(state), **config)
    parent = backend.devices()[0].uuid
    devices = backend.mig_devices(parent)
    assert {(d.profile, d.placement.start) for d in devices} >= {("3g.40gb", 4)}
    assert sorted(d.profile for d in devices) == ["1g.10gb", "2g.20gb", "3g.40gb"]
    assert mig.is_valid_layout(h100_spec(), layout_of(devices))

    restarted = fake("H100", state_file=str(state), **config)
    assert restarted.mig_devices(parent) == devices  # nothing created twice

    # a static instance destroyed while the broker ran comes back at the next start
    one_g = next(d for d in devices if d.profile == "1g.10gb")
    restarted.destroy_mig_device(parent, one_g.uuid)
    again = fake("H100", state_file=str(state), **config)
    assert sorted(d.profile for d in again.mig_devices(parent)) == [
        "1g.10gb",
        "2g.20gb",
        "3g.40gb",
    ]


def test_static_mig_layout_int_keys_and_full_gpu():
    backend = fake("2 x H100", mig_enabled=[1], mig_layout={1: ["7g.80gb"]})
    parent = backend.devices()[1].uuid
    (device,) = backend.mig_devices(parent)
    assert (device.profile, device.placement, device.gi_id) == ("7g.80gb", Placement(0, 8), 1)


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        (
            {"0": ["7g.80gb", "1g.10gb"]},
            r"'1g\.10gb'.*every allowed start \(0,1,2,3,4,5,6\) overlaps 7g\.80gb at 0:8",
        ),
        ({"0": ["4g.40gb@0", "3g.40gb@0"]}, r"overlaps 4g\.40gb at 0:4"),
        ({"0": ["2g.20gb@3"]}, r"placement 3:2 not allowed for 2g\.20gb \(allowed starts 0,2,4"),
        ({"0": ["1g.5gb"]}, r"no MIG profile '1g\.5gb'"),
        ({"0": ["1g.10gb@x"]}, "START must be a memory-slice number"),
        ({"0": "1g.10gb"}, "expected a list"),
        ({"9": ["1g.10gb"]}, "no fake device 9"),
        ({"zero": ["1g.10gb"]}, "must be a device index"),
        ({"1": ["1g.10gb"]}, r"MIG mode is off on device 1; add 1 to"),
        ({"0": ["1g.10gb+me", "1g.10gb+me"]}, r"one media-extension"),
    ],
)
def test_invalid_static_layouts_are_refused(layout, message):
    with pytest.raises(DeviceBackendError, match=message):
        fake("2 x H100", mig_enabled=[0], mig_layout=layout)


def test_static_layout_conflicting_with_state_is_refused(tmp_path):
    state = tmp_path / "state.json"
    backend = fake("H100", state_file=str(state), mig_enabled=[0])
    parent = backend.devices()[0].uuid
    backend.create_mig_device(parent, "4g.40gb", Placement(0, 4))
    with pytest.raises(DeviceBackendError, match=r"'3g\.40gb@0'.*overlaps 4g\.40gb at 0:4"):
        fake("H100", state_file=str(state), mig_enabled=[0], mig_layout={0: ["3g.40gb@0"]})


# --- usage of MIG devices ------------------------------------------------------------------


def test_usage_of_a_mig_uuid():
    backend = fake("H100", mig_enabled=[0])
    parent = backend.devices()[0].uuid
    device = backend.create_mig_device(parent, "1g.10gb", Placement(0, 1))
    idle = backend.usage(device.uuid)
    # as NVML: no utilization on MIG devices (nor on a GPU with MIG mode on)
    assert idle == DeviceUsage(device.uuid, None, 0, ())
    assert backend.usage(parent).utilization_gpu is None
    usage = backend.set_usage(device.uuid, None, processes=[ProcessInfo(1, 9000)])
    assert usage.memory_used_mib == 9000
    assert backend.usage(device.uuid) == usage
    with pytest.raises(ValueError, match=str(device.memory_mib)):
        backend.set_usage(device.uuid, None, device.memory_mib + 1)
    # NVML on the parent of MIG devices: the aggregate of its instances
    # (nvmlDeviceGetComputeRunningProcesses: "In MIG mode, if device handle
    # is provided, the API returns aggregate information")
    assert backend.usage(parent) == DeviceUsage(parent, None, 9000, (ProcessInfo(1, 9000),))
    with pytest.raises(KeyError):
        backend.usage("MIG-00000000-0000-0000-0000-000000000000")


# --- the interface defaults ------------------------------------------------------------------


class _Minimal(DeviceBackend):
    def devices(self) -> list[DeviceInfo]:
        return [DeviceInfo("n", 0, "GPU-a", "NVIDIA H100 80GB HBM3", 81559, "0:0:0.0")]

    def usage(self, uuid: str) -> DeviceUsage:
        raise KeyError(uuid)


def test_interface_defaults_say_not_supported():
    backend = _Minimal()
    assert backend.mig_devices("GPU-a") == []
    with pytest.raises(KeyError):
        backend.mig_devices("GPU-z")
    for call in (
        lambda: backend.create_mig_device("GPU-a", "1g.10gb", Placement(0, 1)),
        lambda: backend.destroy_mig_device("GPU-a", "MIG-x"),
        lambda: backend.set_mig_mode("GPU-a", True),
    ):
        with pytest.raises(DeviceBackendError, match="does not support MIG management"):
            call()


# --- NVML backend against a stubbed pynvml driver (the real one runs in tests/gpu) ---------


class _StubDriver:
    """A tiny NVML driver model of one H100 80GB, MIG mode on, obeying mig.can_place."""

    def __init__(self) -> None:
        self.spec = h100_spec()
        self.by_const = {p.nvml_profile_value: p for p in self.spec.profiles.values()}
        self.gis: dict[int, tuple[str, Placement]] = {}  # gi id -> (profile, placement)
        self.cis: dict[int, int] = {}  # gi id -> ci id (one CI per GI)
        self.busy: set[int] = set()  # gi ids with a process
        self.mig_mode = 1
        self.fail_ci = False


@pytest.fixture
def stub_driver(monkeypatch):
    from types import SimpleNamespace

    import pynvml

    drv = _StubDriver()

    def error(code):
        raise pynvml.NVMLError(code)

    def gi_profile_info(handle, const, version=2):
        profile = drv.by_const.get(const)
        if profile is None:
            error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return SimpleNamespace(
            id=profile.profile_id,
            sliceCount=profile.compute_slices,
            name=f"MIG {profile.name}".encode(),
        )

    def by_id(pid):
        return next(p for p in drv.spec.profiles.values() if p.profile_id == pid)

    def create_gi(handle, profile_id, placement):
        profile = by_id(profile_id)
        place = Placement(placement.start, placement.size)
        if not mig.can_place(drv.spec, list(drv.gis.values()), profile, place):
            error(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        gi_id = max([0, *drv.gis]) + 1
        drv.gis[gi_id] = (profile.name, place)
        return ("gi", gi_id)

    def ci_profile_info(gi, const, engines, version=2):
        slices = {0: 1, 1: 2, 2: 3, 3: 4, 4: 7}.get(const)
        if slices is None:
            error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return SimpleNamespace(id=const, sliceCount=slices)

    def create_ci(gi, ci_profile_id):
        if drv.fail_ci:
            error(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        drv.cis[gi[1]] = 0
        return ("ci", gi[1], 0)

    def gi_destroy(gi):
        if gi[1] in drv.cis:
            error(pynvml.NVML_ERROR_IN_USE)
        del drv.gis[gi[1]]

    def ci_destroy(ci):
        if ci[1] in drv.busy:
            error(pynvml.NVML_ERROR_IN_USE)
        del drv.cis[ci[1]]

    def mig_handles():
        return [gi_id for gi_id in sorted(drv.gis) if gi_id in drv.cis]

    def mig_handle_by_index(handle, index):
        handles = mig_handles()
        if index >= len(handles):
            error(pynvml.NVML_ERROR_NOT_FOUND)
        return ("mig", handles[index])

    def handle_by_uuid(uuid):
        if uuid == "GPU-a":
            return "gpu"
        for gi_id in mig_handles():
            if uuid == mig.mig_uuid("GPU-a", gi_id, 0):
                return ("mig", gi_id)
        error(pynvml.NVML_ERROR_NOT_FOUND)

    def memory_info(handle):
        if handle == "gpu":
            return SimpleNamespace(total=81559 * 2**20, used=0)
        profile = drv.spec.profiles[drv.gis[handle[1]][0]]
        return SimpleNamespace(total=profile.memory_slices * 10000 * 2**20, used=2**20)

    def set_mode(handle, mode):
        drv.mig_mode = mode
        return pynvml.NVML_SUCCESS

    stubs = {
        "nvmlInit": lambda: None,
        "nvmlShutdown": lambda: None,
        "nvmlDeviceGetHandleByUUID": handle_by_uuid,
        "nvmlDeviceGetName": lambda h: b"NVIDIA H100 80GB HBM3",
        "nvmlDeviceGetMigMode": lambda h: [drv.mig_mode, drv.mig_mode],
        "nvmlDeviceSetMigMode": set_mode,
        "nvmlDeviceGetGpuInstanceProfileInfo": gi_profile_info,
        "nvmlDeviceCreateGpuInstanceWithPlacement": create_gi,
        "nvmlGpuInstanceGetComputeInstanceProfileInfo": ci_profile_info,
        "nvmlGpuInstanceCreateComputeInstance": create_ci,
        "nvmlGpuInstanceGetInfo": lambda gi: SimpleNamespace(
            id=gi[1],
            profileId=drv.spec.profiles[drv.gis[gi[1]][0]].profile_id,
            placement=SimpleNamespace(start=drv.gis[gi[1]][1].start, size=drv.gis[gi[1]][1].size),
        ),
        "nvmlComputeInstanceGetInfo": lambda ci: SimpleNamespace(id=ci[2]),
        "nvmlGpuInstanceDestroy": gi_destroy,
        "nvmlComputeInstanceDestroy": ci_destroy,
        "nvmlDeviceGetGpuInstanceById": lambda h, gi_id: ("gi", gi_id),
        "nvmlGpuInstanceGetComputeInstanceById": lambda gi, ci_id: ("ci", gi[1], ci_id),
        "nvmlDeviceGetMaxMigDeviceCount": lambda h: 7,
        "nvmlDeviceGetMigDeviceHandleByIndex": mig_handle_by_index,
        "nvmlDeviceGetUUID": lambda h: mig.mig_uuid("GPU-a", h[1], 0).encode(),
        "nvmlDeviceGetGpuInstanceId": lambda h: h[1],
        "nvmlDeviceGetComputeInstanceId": lambda h: 0,
        "nvmlDeviceGetMemoryInfo": memory_info,
        "nvmlDeviceGetUtilizationRates": lambda h: error(pynvml.NVML_ERROR_NOT_SUPPORTED),
        "nvmlDeviceGetComputeRunningProcesses": lambda h: [
            SimpleNamespace(pid=100 + h[1], usedGpuMemory=2**20)
            for _ in [0]
            if isinstance(h, tuple) and h[1] in drv.busy
        ],
    }
    for name, stub in stubs.items():
        monkeypatch.setattr(pynvml, name, stub)
    return drv


def test_nvml_backend_mig_operations_with_stubbed_pynvml(stub_driver):
    from gpubroker.devices.nvml import NVMLDeviceBackend

    backend = NVMLDeviceBackend(node_name="n")
    assert backend.mig_devices("GPU-a") == []
    with pytest.raises(KeyError):
        backend.mig_devices("MIG-00000000-0000-0000-0000-000000000000")

    small = backend.create_mig_device("GPU-a", "1g.10gb", Placement(6, 1))
    assert (small.profile, small.placement, small.gi_id, small.ci_id) == (
        "1g.10gb",
        Placement(6, 1),
        1,
        0,
    )
    assert small.uuid == mig.mig_uuid("GPU-a", 1, 0) and small.memory_mib == 10000
    half = backend.create_mig_device("GPU-a", "MIG 3g.40gb", Placement(0, 4))
    assert backend.mig_devices("GPU-a") == [small, half]

    with pytest.raises(
        MigPlacementError, match=r"INSUFFICIENT_RESOURCES.*overlaps 3g\.40gb at 0:4"
    ):
        backend.create_mig_device("GPU-a", "2g.20gb", Placement(2, 2))
    with pytest.raises(MigPlacementError, match="no such MIG profile"):
        backend.create_mig_device("GPU-a", "9g.99gb", Placement(0, 1))

    stub_driver.fail_ci = True
    with pytest.raises(DeviceBackendError, match="compute instance"):
        backend.create_mig_device("GPU-a", "1g.10gb", Placement(4, 1))
    assert len(stub_driver.gis) == 2  # the GPU instance was rolled back
    stub_driver.fail_ci = False

    usage = backend.usage(small.uuid)
    assert (usage.uuid, usage.utilization_gpu, usage.memory_used_mib) == (small.uuid, None, 1)

    stub_driver.busy.add(small.gi_id)
    with pytest.raises(DeviceInUseError, match="in use"):
        backend.destroy_mig_device("GPU-a", small.uuid)
    stub_driver.busy.clear()
    with pytest.raises(DeviceInUseError, match=r"in use by 2 MIG device\(s\)"):
        backend.set_mig_mode("GPU-a", False)
    backend.destroy_mig_device("GPU-a", small.uuid)
    backend.destroy_mig_device("GPU-a", half.uuid)
    assert stub_driver.gis == {} and backend.mig_devices("GPU-a") == []
    with pytest.raises(KeyError):
        backend.destroy_mig_device("GPU-a", half.uuid)

    backend.set_mig_mode("GPU-a", False)
    assert stub_driver.mig_mode == 0
    with pytest.raises(MigPlacementError, match="MIG mode is off"):
        backend.create_mig_device("GPU-a", "1g.10gb", Placement(0, 1))
    backend.close()
