"""A review of the fake GPU backend against NVIDIA's rules: a GPU in MIG
mode reports its instances' usage, GPM exists from Hopper on, a usage write
never loses a MIG creation made meanwhile, and the hint for "N instances"
compares memory slices, not rounded names."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from gpubroker.devices.base import DeviceUsage, ProcessInfo
from gpubroker.devices.fake import FakeDeviceBackend
from gpubroker.devices.mig import Placement, profile_for_many


def fake(*inventory: str, **kw: Any) -> FakeDeviceBackend:
    kw.setdefault("node_name", "node1")
    return FakeDeviceBackend(inventory=list(inventory), **kw)


@pytest.mark.parametrize(
    "profile,count,model,expected",
    [
        # names round the GB: four 1g.12gb (4 slices) fit a 4g.47gb, 47 < 48
        ("1g.12gb", 4, "H100-94GB", "4g.47gb"),
        ("1g.24gb", 2, "H100-94GB", "3g.47gb"),
        ("1g.18gb", 2, "H200-141GB", "2g.35gb"),
        ("1g.18gb", 4, "H200-141GB", "4g.71gb"),
        ("1g.10gb", 2, "H100-80GB", "2g.20gb"),
    ],
)
def test_the_hint_for_several_instances_compares_memory_slices(
    profile: str, count: int, model: str, expected: str
) -> None:
    assert profile_for_many(profile, count)[model] == expected


def test_a_gpu_in_mig_mode_reports_its_instances_usage() -> None:
    """NVML, nvmlDeviceGetComputeRunningProcesses: "In MIG mode, if device
    handle is provided, the API returns aggregate information"."""
    backend = fake("H100", mig_enabled=[0])
    gpu = backend.devices()[0].uuid
    one = backend.create_mig_device(gpu, "3g.40gb", Placement(4, 4))
    two = backend.create_mig_device(gpu, "1g.10gb", Placement(0, 1))
    backend.set_usage(one.uuid, None, 5000, [ProcessInfo(4242, 5000)])
    backend.set_usage(two.uuid, None, processes=[ProcessInfo(7, 1000)])
    assert backend.usage(gpu) == DeviceUsage(
        gpu, None, 6000, (ProcessInfo(4242, 5000), ProcessInfo(7, 1000))
    )
    assert backend.usage(one.uuid).memory_used_mib == 5000  # each instance its own


def test_an_engine_activity_is_only_for_a_mig_instance_of_a_gpu_with_gpm() -> None:
    """GPM (NVML's GPU Performance Monitoring) is Hopper and later: an A100's
    MIG instance reports no engine activity, so the fake must not take one
    (a culler test could otherwise rely on what never happens)."""
    backend = fake("A100-80GB", "H100", mig_enabled=[0, 1])
    a100, h100 = (d.uuid for d in backend.devices())
    old = backend.create_mig_device(a100, "1g.10gb", Placement(0, 1))
    new = backend.create_mig_device(h100, "1g.10gb", Placement(0, 1))
    with pytest.raises(ValueError, match=r"engine_activity: .* without GPM"):
        backend.set_usage(old.uuid, None, 0, engine_activity=0.0)
    assert backend.set_usage(new.uuid, None, 0, engine_activity=0.5).engine_activity == 0.5


def test_a_usage_write_never_loses_a_mig_creation_made_meanwhile() -> None:
    """``set_usage`` read the state and wrote it back without the backend's
    lock: a MIG instance the actuator's worker thread made in between was
    lost, so the broker held a MIG UUID the fake no longer had."""
    backend = fake("2 x H100", mig_enabled=[0])
    gpu0, gpu1 = (d.uuid for d in backend.devices())
    created: list[Any] = []
    original = backend._usage_target
    workers: list[threading.Thread] = []

    def racing(state: Any, uuid: str) -> Any:
        worker = threading.Thread(
            target=lambda: created.append(
                backend.create_mig_device(gpu0, "1g.10gb", Placement(6, 1))
            )
        )
        worker.start()
        workers.append(worker)
        worker.join(timeout=1.0)  # under the lock, the worker waits for set_usage
        return original(state, uuid)

    backend._usage_target = racing  # type: ignore[method-assign]
    backend.set_usage(gpu1, 10, 100)
    backend._usage_target = original  # type: ignore[method-assign]
    workers[0].join(timeout=10)
    assert [d.uuid for d in backend.mig_devices(gpu0)] == [created[0].uuid]
