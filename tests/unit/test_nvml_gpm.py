"""The NVML backend's GPM sampling of MIG engine activity, with NVML's GPM
calls stood in for (no GPU here; tests/gpu runs the real ones): samples
are always freed, and readers within a second share one window."""

from __future__ import annotations

from typing import Any

import pytest

import gpubroker.devices.nvml as nvml


class _Query:
    def __init__(self) -> None:
        # as the real nvmlGpmMetric_t: its own status beside the value
        self.metrics = [type("Metric", (), {"value": 50.0, "metricId": 0, "nvmlReturn": 0})()]


@pytest.fixture
def gpm(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    counts = {"alloc": 0, "freed": 0}
    p = nvml.pynvml

    def alloc() -> object:
        counts["alloc"] += 1
        return object()

    def free(_sample: Any) -> None:
        counts["freed"] += 1

    monkeypatch.setattr(p, "nvmlDeviceGetDeviceHandleFromMigDeviceHandle", lambda h: "parent")
    monkeypatch.setattr(p, "nvmlDeviceGetGpuInstanceId", lambda h: 1)
    monkeypatch.setattr(p, "nvmlGpmSampleAlloc", alloc)
    monkeypatch.setattr(p, "nvmlGpmSampleFree", free)
    monkeypatch.setattr(p, "c_nvmlGpmMetricsGet_t", _Query)
    monkeypatch.setattr(p, "nvmlGpmMetricsGet", lambda q: q)
    return counts


def backend() -> Any:
    b = object.__new__(nvml.NVMLDeviceBackend)
    b._gpm_samples = {}
    return b


def test_a_gpu_without_gpm_frees_every_sample(gpm: dict[str, int], monkeypatch) -> None:
    def unsupported(*_: Any) -> None:
        raise nvml.pynvml.NVMLError(nvml.pynvml.NVML_ERROR_NOT_SUPPORTED)

    monkeypatch.setattr(nvml.pynvml, "nvmlGpmMigSampleGet", unsupported)
    b = backend()
    assert all(b._engine_activity("MIG-a100", "h") is None for _ in range(20))
    assert gpm["alloc"] == gpm["freed"] == 20 and b._gpm_samples == {}


def test_activity_is_measured_between_samples_and_shared_within_a_second(
    gpm: dict[str, int], monkeypatch
) -> None:
    monkeypatch.setattr(nvml.pynvml, "nvmlGpmMigSampleGet", lambda parent, gi, s: s)
    clock = [100.0]
    monkeypatch.setattr(nvml.time, "monotonic", lambda: clock[0])
    b = backend()
    assert b._engine_activity("MIG-h100", "h") is None  # the first sample
    clock[0] += 0.2
    assert b._engine_activity("MIG-h100", "h") is None  # another reader: the same window
    clock[0] += 5
    assert b._engine_activity("MIG-h100", "h") == 0.5
    clock[0] += 0.1
    assert b._engine_activity("MIG-h100", "h") == 0.5  # reused, no new sample
    assert gpm["alloc"] == 2 and gpm["freed"] == 1  # one kept for the next window
    clock[0] += 7200  # a MIG device gone for an hour is forgotten
    b._engine_activity("MIG-other", "h")
    assert set(b._gpm_samples) == {"MIG-other"} and gpm["freed"] == 2
