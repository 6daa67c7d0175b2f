"""The MIG catalog (gpubroker.devices.mig) against real NVML; runs only where a GPU exists.

READ-ONLY: these tests never create or destroy MIG instances and never change
MIG mode. They read what the driver says about each catalog profile
(``nvmlDeviceGetGpuInstanceProfileInfo``,
``nvmlDeviceGetGpuInstancePossiblePlacements``) and the MIG devices that
already exist, and compare with the catalog. Where NVML cannot answer (MIG
mode off, profile not supported, no permission) they skip with the reason.
Every device and profile is checked before failing, so one run on a GPU
machine reports every mismatch at once.
"""

from __future__ import annotations

import ctypes
from typing import Any

import pynvml
import pytest

from gpubroker.devices import mig
from gpubroker.devices.base import DeviceBackendError, DeviceInfo
from gpubroker.devices.nvml import NVMLDeviceBackend

from . import require_nvml

require_nvml()

pytestmark = pytest.mark.gpu

_MIB = 2**20


@pytest.fixture
def backend():
    backend = NVMLDeviceBackend()
    yield backend
    backend.close()


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _mig_mode(handle: Any) -> tuple[int, int] | None:
    """(current, pending) MIG mode, or ``None`` where MIG is not supported."""
    try:
        current, pending = pynvml.nvmlDeviceGetMigMode(handle)
    except pynvml.NVMLError_NotSupported:
        return None
    return int(current), int(pending)


def _profile_info(handle: Any, constant: int) -> Any:
    try:
        return pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, constant)
    except pynvml.NVMLError_FunctionNotFound:
        return pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, constant, version=1)


def _possible_starts(handle: Any, profile_id: int) -> list[tuple[int, int]]:
    """``nvmlDeviceGetGpuInstancePossiblePlacements`` (the ``_v2`` function in
    current pynvml): ``[(start, size), ...]``."""
    count = ctypes.c_uint(0)
    pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, None, ctypes.byref(count))
    array = (pynvml.c_nvmlGpuInstancePlacement_t * max(count.value, 1))()
    pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(
        handle, profile_id, array, ctypes.byref(count)
    )
    return sorted((int(array[i].start), int(array[i].size)) for i in range(count.value))


def _memory_close(memory_mib: int, memory_gb: int, tolerance: float = 0.10) -> bool:
    """``memory_mib`` within ``tolerance`` of the name's "NNgb", read as GB or as GiB."""
    targets = (memory_gb * 1024, memory_gb * 10**9 / _MIB)
    return any(abs(memory_mib - target) <= tolerance * target for target in targets)


def _devices(backend: NVMLDeviceBackend) -> list[tuple[DeviceInfo, Any]]:
    return [(d, pynvml.nvmlDeviceGetHandleByUUID(d.uuid)) for d in backend.devices()]


def test_mig_mode_is_readable_and_matches_the_inventory(backend):
    for device, handle in _devices(backend):
        mode = _mig_mode(handle)
        if mode is None:
            assert device.mig_enabled is False
            assert backend.mig_devices(device.uuid) == []
            continue
        current, pending = mode
        assert current in (pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_ENABLE)
        assert pending in (pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_ENABLE)
        assert device.mig_enabled == (current == pynvml.NVML_DEVICE_MIG_ENABLE)
        if not device.mig_enabled:
            assert backend.mig_devices(device.uuid) == []


def test_catalog_profiles_match_nvml(backend):
    """Slices, memory, instance limit, ID, name and placements of each catalog profile."""
    failures: list[str] = []
    skipped: list[str] = []
    checked = 0
    for device, handle in _devices(backend):
        spec = mig.spec_for(device.name)
        if spec is None:
            skipped.append(f"{device.name}: not in the MIG catalog")
            continue
        mode = _mig_mode(handle)
        if mode is None:
            failures.append(f"{device.name} is in the MIG catalog but NVML says MIG not supported")
            continue
        mig_on = mode[0] == pynvml.NVML_DEVICE_MIG_ENABLE
        try:
            existing = backend.mig_devices(device.uuid)
        except DeviceBackendError as err:
            existing = None  # unknown: fall back to the subset check
            skipped.append(f"{device.name}: cannot list MIG devices ({err})")
        for profile in spec.profiles.values():
            where = f"{device.name} ({spec.name}) {profile.name}"
            constant = getattr(pynvml, profile.nvml_profile, None)
            if constant is None:
                skipped.append(f"{where}: pynvml has no {profile.nvml_profile}")
                continue
            try:
                info = _profile_info(handle, constant)
            except pynvml.NVMLError_NotSupported as err:
                skipped.append(f"{where}: NVML says not supported ({err})")
                continue
            except pynvml.NVMLError as err:
                if mig_on:
                    failures.append(f"{where}: nvmlDeviceGetGpuInstanceProfileInfo failed: {err}")
                else:
                    skipped.append(f"{where}: MIG mode is off and NVML answers {err}")
                continue
            checked += 1
            if int(info.sliceCount) != profile.compute_slices:
                failures.append(
                    f"{where}: sliceCount {info.sliceCount} != {profile.compute_slices}"
                )
            if not _memory_close(int(info.memorySizeMB), profile.memory_gib):
                failures.append(
                    f"{where}: memorySizeMB {info.memorySizeMB} MiB not within 10% of"
                    f" {profile.memory_gib} GB"
                )
            if int(info.instanceCount) != profile.max_count:
                failures.append(
                    f"{where}: instanceCount {info.instanceCount} != max_count {profile.max_count}"
                )
            if profile.profile_id is not None and int(info.id) != profile.profile_id:
                failures.append(f"{where}: profile ID {info.id} != catalog {profile.profile_id}")
            driver_name = _text(getattr(info, "name", b"")).removeprefix("MIG ").strip()
            if driver_name and driver_name != profile.name:
                failures.append(f"{where}: the driver calls it {driver_name!r}")
            try:
                found = _possible_starts(handle, int(info.id))
            except pynvml.NVMLError as err:
                skipped.append(f"{where}: possible placements not readable ({err})")
                continue
            catalog = sorted((p.start, p.size) for p in profile.placements)
            if existing == []:
                if found != catalog:
                    failures.append(f"{where}: placements {found} != catalog {catalog}")
            elif not set(found) <= set(catalog):
                failures.append(f"{where}: placements {found} not a subset of catalog {catalog}")
    print("\n".join(["skipped:", *skipped]) if skipped else "nothing skipped")
    assert not failures, "\n".join(failures)
    if checked == 0:
        pytest.skip("no catalog profile could be read: " + "; ".join(skipped or ["no GPU"]))


def test_existing_mig_devices_parse_into_catalog_profiles(backend):
    """MIG devices that exist (made by an admin or the broker) fit the catalog's rules."""
    seen = 0
    reasons: list[str] = []
    for device, _handle in _devices(backend):
        if not device.mig_enabled:
            reasons.append(f"device {device.index} ({device.name}): MIG mode is off")
            continue
        try:
            devices = backend.mig_devices(device.uuid)
        except DeviceBackendError as err:
            reasons.append(f"device {device.index}: cannot list MIG devices ({err})")
            continue
        if not devices:
            reasons.append(f"device {device.index}: MIG mode on but no MIG devices")
            continue
        spec = mig.spec_for(device.name)
        for item in devices:
            seen += 1
            assert item.parent_uuid == device.uuid
            assert mig.is_mig_uuid(item.uuid), item.uuid
            assert 0 < item.memory_mib <= device.memory_total_mib
            usage = backend.usage(item.uuid)  # a MIG UUID works like a GPU UUID
            assert usage.uuid == item.uuid
            assert 0 <= usage.memory_used_mib <= item.memory_mib
            assert usage.utilization_gpu is None or 0 <= usage.utilization_gpu <= 100
        if spec is None:
            continue
        instances = {d.gi_id: (d.profile, d.placement) for d in devices}  # one per GPU instance
        for name, placement in instances.values():
            assert name in spec.profiles, f"{name} is not a {spec.name} catalog profile"
            assert placement in spec.profiles[name].placements, (name, placement)
        assert mig.is_valid_layout(spec, list(instances.values())), instances
    if seen == 0:
        why = "no MIG device exists to check, and this test must not create one: "
        pytest.skip(why + "; ".join(reasons or ["no GPU"]))
