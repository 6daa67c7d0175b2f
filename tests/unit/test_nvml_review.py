"""The NVML backend against NVIDIA's documented NVML behaviour (no GPU here).

Each test replaces the few ``pynvml`` functions the backend calls with
stand-ins that behave as the NVML API reference and nvidia-ml-py document:
the real pynvml error classes and ctypes structures, and where it matters
the real pynvml wrapper running over a stand-in C function. The docstring
of each test names the rule it follows.
"""

from __future__ import annotations

import ctypes
import threading
import time
from types import SimpleNamespace
from typing import Any

import pynvml  # type: ignore[import-untyped]
import pytest

import gpubroker.devices.nvml as nvml
from gpubroker.devices import mig
from gpubroker.devices.base import DeviceBackendError
from gpubroker.devices.mig import Placement

_MIB = 2**20


def _raise(code: int) -> Any:
    raise pynvml.NVMLError(code)


def _backend() -> nvml.NVMLDeviceBackend:
    return nvml.NVMLDeviceBackend(node_name="n")


@pytest.fixture
def base(monkeypatch: pytest.MonkeyPatch) -> None:
    """nvmlInit/nvmlShutdown and one H100 in MIG mode, ``GPU-a``, handle ``"gpu"``."""
    spec = mig.spec_for("NVIDIA H100 80GB HBM3")
    assert spec is not None
    by_const = {p.nvml_profile_value: p for p in spec.profiles.values()}

    def gi_profile_info(handle: Any, const: int, version: int = 2) -> Any:
        profile = by_const.get(const)
        if profile is None:
            return _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        info = pynvml.c_nvmlGpuInstanceProfileInfo_v2_t()
        info.id, info.sliceCount = profile.profile_id, profile.compute_slices
        info.name = f"MIG {profile.name}".encode()
        return info

    def handle_by_uuid(uuid: str) -> Any:
        if uuid == "GPU-a":
            return "gpu"
        if uuid.startswith("MIG-"):
            return ("mig", uuid)
        return _raise(pynvml.NVML_ERROR_NOT_FOUND)

    stubs = {
        "nvmlInit": lambda: None,
        "nvmlShutdown": lambda: None,
        "nvmlDeviceGetHandleByUUID": handle_by_uuid,
        "nvmlDeviceGetName": lambda h: "NVIDIA H100 80GB HBM3",
        "nvmlDeviceGetMigMode": lambda h: [1, 1],
        "nvmlDeviceGetGpuInstanceProfileInfo": gi_profile_info,
    }
    for name, stub in stubs.items():
        monkeypatch.setattr(pynvml, name, stub)


# --- 1. the placement goes to NVML by address --------------------------------------------


def test_create_passes_the_placement_as_a_pointer(
    base: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``nvmlDeviceCreateGpuInstanceWithPlacement(device, profileId, const
    nvmlGpuInstancePlacement_t *placement, nvmlGpuInstance_t *gpuInstance)``
    (NVML API reference, Multi Instance GPU Management) takes the placement
    by address, and pynvml forwards its ``placement`` argument unchanged to
    ctypes with no declared argument types. The real pynvml wrapper runs here
    over a stand-in C function: a ``Structure`` reaching it would have been
    passed by value, which the real driver reads as a pointer (the broker
    dies with a segmentation fault; tried against a C function with that
    signature). The stand-in answers ``NVML_ERROR_NO_PERMISSION`` (not root)
    after reading the placement, so nothing else is needed."""
    seen: list[tuple[int, int]] = []

    def c_create(device: Any, profile_id: int, placement: Any, out: Any) -> int:
        if isinstance(placement, ctypes.Structure):
            raise AssertionError("placement passed by value: NVML would dereference garbage")
        target = placement.contents if isinstance(placement, ctypes._Pointer) else placement._obj
        assert isinstance(target, pynvml.c_nvmlGpuInstancePlacement_t)
        seen.append((int(target.start), int(target.size)))
        return int(pynvml.NVML_ERROR_NO_PERMISSION)

    real_lookup = pynvml._nvmlGetFunctionPointer

    def lookup(name: str) -> Any:
        if name == "nvmlDeviceCreateGpuInstanceWithPlacement":
            return c_create
        return real_lookup(name)

    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer", lookup)
    backend = _backend()
    with pytest.raises(DeviceBackendError, match="needs root"):
        backend.create_mig_device("GPU-a", "1g.10gb", Placement(4, 1))
    assert seen == [(4, 1)]


# --- 2. a failed create leaves no GPU instance behind -----------------------------------------


def test_a_failed_create_destroys_its_compute_instance_then_its_gpu_instance(
    base: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``nvmlGpuInstanceDestroy`` answers ``NVML_ERROR_IN_USE`` while the GPU
    instance still has a compute instance (destroy order: compute instances
    first, then the GPU instance). When the compute instance was created but
    reading it back fails (here ``NVML_ERROR_UNKNOWN`` from
    ``nvmlComputeInstanceGetInfo``), the undo must destroy it first, or the
    GPU instance stays, invisible to ``mig_devices`` (no MIG device handle)."""
    live: dict[str, set[str]] = {"gi": set(), "ci": set()}

    def create_gi(handle: Any, profile_id: int, placement: Any) -> Any:
        live["gi"].add("gi1")
        return "gi1"

    def ci_profile_info(gi: Any, const: int, engines: int, version: int = 2) -> Any:
        info = pynvml.c_nvmlComputeInstanceProfileInfo_v2_t()
        info.id, info.sliceCount = const, {0: 1, 1: 2, 2: 3, 3: 4, 4: 7}.get(const, 99)
        return info

    def create_ci(gi: Any, profile_id: int) -> Any:
        live["ci"].add("ci1")
        return "ci1"

    def gi_destroy(gi: Any) -> int:
        if live["ci"]:
            _raise(pynvml.NVML_ERROR_IN_USE)
        live["gi"].discard(gi)
        return int(pynvml.NVML_SUCCESS)

    def ci_destroy(ci: Any) -> int:
        live["ci"].discard(ci)
        return int(pynvml.NVML_SUCCESS)

    info = pynvml.c_nvmlGpuInstanceInfo_t()
    info.id = 7
    stubs = {
        "nvmlDeviceCreateGpuInstanceWithPlacement": create_gi,
        "nvmlGpuInstanceGetComputeInstanceProfileInfo": ci_profile_info,
        "nvmlGpuInstanceCreateComputeInstance": create_ci,
        "nvmlGpuInstanceGetInfo": lambda gi: info,
        "nvmlComputeInstanceGetInfo": lambda ci: _raise(pynvml.NVML_ERROR_UNKNOWN),
        "nvmlGpuInstanceDestroy": gi_destroy,
        "nvmlComputeInstanceDestroy": ci_destroy,
    }
    for name, stub in stubs.items():
        monkeypatch.setattr(pynvml, name, stub)
    with pytest.raises(DeviceBackendError, match="compute instance"):
        _backend().create_mig_device("GPU-a", "1g.10gb", Placement(4, 1))
    assert live == {"gi": set(), "ci": set()}


# --- 3. running processes on drivers without the _v3 call ----------------------------------


def test_processes_on_a_driver_without_the_v3_call(
    base: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pynvml's unversioned ``nvmlDeviceGetComputeRunningProcesses`` calls the
    ``_v3`` C function; on a driver without it, pynvml's
    ``throwOnVersionMismatch`` raises ``NVMLLibraryMismatchError`` (a plain
    ``Exception``, not an ``NVMLError``) and asks for a versioned call. The
    real pynvml wrappers run here over stand-in C functions: ``_v3`` missing
    (``NVML_ERROR_FUNCTION_NOT_FOUND`` from the symbol lookup), ``_v2``
    answering with the documented two-call protocol
    (``NVML_ERROR_INSUFFICIENT_SIZE`` with the count, then the array)."""

    def c_v2(handle: Any, count_ref: Any, infos: Any) -> int:
        count = count_ref._obj
        if infos is None:
            count.value = 1
            return int(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        infos[0].pid, infos[0].usedGpuMemory = 42, 1024 * _MIB
        count.value = 1
        return int(pynvml.NVML_SUCCESS)

    real_lookup = pynvml._nvmlGetFunctionPointer

    def lookup(name: str) -> Any:
        if name.endswith("RunningProcesses_v3"):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        if name == "nvmlDeviceGetComputeRunningProcesses_v2":
            return c_v2
        if name == "nvmlDeviceGetMPSComputeRunningProcesses_v2":
            return lambda h, count_ref, infos: pynvml.NVML_SUCCESS  # no MPS clients
        return real_lookup(name)

    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer", lookup)
    monkeypatch.setattr(
        pynvml, "nvmlDeviceGetUtilizationRates", lambda h: SimpleNamespace(gpu=30, memory=0)
    )
    monkeypatch.setattr(
        pynvml, "nvmlDeviceGetMemoryInfo", lambda h: SimpleNamespace(total=80 * 1024 * _MIB, used=0)
    )
    usage = _backend().usage("GPU-a")
    assert [(p.pid, p.used_memory_mib) for p in usage.processes] == [(42, 1024)]


# --- 4. GPM: a metric NVML could not compute is unknown, not 0 -------------------------------


def test_a_gpm_metric_with_an_error_status_is_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    """``nvmlGpmMetric_t.value`` "is only valid if nvmlReturn is 0
    (NVML_SUCCESS)" (NVML API reference, GPM Structs): ``nvmlGpmMetricsGet``
    can succeed while one metric fails. Such a metric must read as unknown
    (``None``), not as 0 % activity, which would make a busy MIG instance look
    idle to the culler. The real ``c_nvmlGpmMetricsGet_t`` is used."""

    def metrics_get(query: Any) -> Any:
        query.metrics[0].nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        query.metrics[0].value = 0.0
        return query

    monkeypatch.setattr(pynvml, "nvmlGpmMetricsGet", metrics_get)
    first, second = pynvml.c_nvmlGpmSample_t(), pynvml.c_nvmlGpmSample_t()
    assert nvml._gpm_utilization(first, second) is None

    def metrics_ok(query: Any) -> Any:
        assert query.metrics[0].metricId == pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL
        query.metrics[0].nvmlReturn = pynvml.NVML_SUCCESS
        query.metrics[0].value = 37.5  # percent, 0.0-100.0
        return query

    monkeypatch.setattr(pynvml, "nvmlGpmMetricsGet", metrics_ok)
    assert nvml._gpm_utilization(first, second) == pytest.approx(0.375)


# --- 5. GPM samples under concurrent readers ------------------------------------------------


def test_concurrent_readers_never_free_a_gpm_sample_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """``nvmlGpmSampleFree`` releases a buffer from ``nvmlGpmSampleAlloc``
    (NVML API reference, GPM Functions): freeing one twice is a double free
    in the C library, and a sample overwritten without a free leaks. The
    broker reads ``usage()`` from the event loop (culler, share guard) and
    from worker threads (usage ledger, panel) at once, and NVML itself is
    thread-safe, so two readers of one MIG device can overlap. Reader A is
    held inside ``nvmlGpmMigSampleGet`` while reader B runs."""
    allocated: list[Any] = []
    freed: list[int] = []
    entered, release = threading.Event(), threading.Event()
    hold = {"next": False}

    def alloc() -> Any:
        sample = pynvml.c_nvmlGpmSample_t()
        allocated.append(sample)
        return sample

    def sample_get(parent: Any, gi_id: int, sample: Any) -> Any:
        if hold["next"]:
            hold["next"] = False
            entered.set()
            release.wait(5)
        return sample

    def metrics_get(query: Any) -> Any:
        query.metrics[0].nvmlReturn = pynvml.NVML_SUCCESS
        query.metrics[0].value = 50.0
        return query

    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    stubs = {
        "nvmlDeviceGetDeviceHandleFromMigDeviceHandle": lambda h: "gpu",
        "nvmlDeviceGetGpuInstanceId": lambda h: 3,
        "nvmlGpmSampleAlloc": alloc,
        "nvmlGpmSampleFree": lambda s: freed.append(id(s)),
        "nvmlGpmMigSampleGet": sample_get,
        "nvmlGpmMetricsGet": metrics_get,
    }
    for name, stub in stubs.items():
        monkeypatch.setattr(pynvml, name, stub)
    backend = object.__new__(nvml.NVMLDeviceBackend)
    backend._gpm_samples = {}
    assert backend._engine_activity("MIG-x", "h") is None  # the first sample
    clock[0] += 5
    hold["next"] = True
    results: list[float | None] = []
    a = threading.Thread(target=lambda: results.append(backend._engine_activity("MIG-x", "h")))
    b = threading.Thread(target=lambda: results.append(backend._engine_activity("MIG-x", "h")))
    a.start()
    assert entered.wait(5)
    b.start()
    time.sleep(0.2)  # B runs now, or waits for A
    release.set()
    a.join(5)
    b.join(5)
    assert results == [0.5, 0.5]
    assert len(freed) == len(set(freed)), "a GPM sample was freed twice"
    kept = {id(sample) for sample, _t, _v in backend._gpm_samples.values()}
    assert {id(s) for s in allocated} == set(freed) | kept, "a GPM sample leaked"


# --- 6. one GPU NVML cannot read does not take the node's others out --------------------------


def test_a_lost_gpu_is_left_out_and_the_others_stay(monkeypatch: pytest.MonkeyPatch) -> None:
    """``nvmlDeviceGet*`` on a GPU that fell off the bus raises
    ``NVMLError_GpuIsLost`` (NVML API reference, Return Values:
    NVML_ERROR_GPU_IS_LOST), and on one a cgroup hides
    ``NVMLError_NoPermission``; the other GPUs answer. One such GPU made the
    whole node's inventory fail. When NVML fails for every GPU, the
    inventory is unknown, not empty."""
    lost = {1}
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlShutdown", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: 3)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda i: i)

    def uuid(handle: int) -> str:
        if handle in lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return f"GPU-{handle}"

    monkeypatch.setattr(pynvml, "nvmlDeviceGetUUID", uuid)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetName", lambda h: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(
        pynvml, "nvmlDeviceGetMemoryInfo", lambda h: SimpleNamespace(total=80 * 1024 * _MIB)
    )
    monkeypatch.setattr(
        pynvml, "nvmlDeviceGetPciInfo", lambda h: SimpleNamespace(busId=f"0000:0{h}:00.0")
    )
    monkeypatch.setattr(
        pynvml, "nvmlDeviceGetMigMode", lambda h: _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
    )
    backend = _backend()
    assert [d.uuid for d in backend.devices()] == ["GPU-0", "GPU-2"]
    lost.update({0, 2})
    with pytest.raises(DeviceBackendError, match="cannot read any of 3 GPUs"):
        backend.devices()


# --- 7. memory used: without what the driver reserves ------------------------------------------


def test_memory_used_leaves_out_the_drivers_reserved_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``nvmlDeviceGetMemoryInfo`` (v1) counts the memory the driver and
    firmware reserve as used (615 MiB on an idle H200, measured in
    tests/gpu); ``nvmlDeviceGetMemoryInfo_v2`` reports it apart
    (``nvmlMemory_v2_t.reserved``; NVML API reference, Device Queries), as
    nvidia-smi shows it. The real pynvml wrapper runs over stand-in C
    functions; a driver without the v2 call (``NVML_ERROR_FUNCTION_NOT_FOUND``)
    gives v1's figure."""
    gib, reserved = 2**30, 615 * _MIB

    def v1(handle: Any, out: Any) -> int:
        memory = out._obj
        memory.total, memory.free, memory.used = 80 * gib, 80 * gib - reserved, reserved
        return pynvml.NVML_SUCCESS

    def v2(handle: Any, out: Any) -> int:
        memory = out._obj
        assert memory.version == pynvml.nvmlMemory_v2
        memory.total, memory.reserved = 80 * gib, reserved
        memory.used, memory.free = 2 * gib, 80 * gib - reserved - 2 * gib
        return pynvml.NVML_SUCCESS

    functions: dict[str, Any] = {"nvmlDeviceGetMemoryInfo": v1, "nvmlDeviceGetMemoryInfo_v2": v2}

    def lookup(name: str) -> Any:
        if name not in functions:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return functions[name]

    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer", lookup)
    assert nvml._memory_used_mib("gpu") == 2048
    del functions["nvmlDeviceGetMemoryInfo_v2"]  # an older driver
    assert nvml._memory_used_mib("gpu") == 615
