"""Tests of the real NVML backend; they run only where an NVIDIA driver and GPU exist."""

from __future__ import annotations

import pytest

from gpubroker.devices import load_backend
from gpubroker.devices.nvml import NVMLDeviceBackend

from . import require_nvml

require_nvml()

pytestmark = pytest.mark.gpu


@pytest.fixture
def backend():
    backend = NVMLDeviceBackend()
    yield backend
    backend.close()


def test_devices_are_real_gpus(backend):
    devices = backend.devices()
    assert devices, "NVML initialised but reports no GPU"
    assert [d.index for d in devices] == list(range(len(devices)))
    for device in devices:
        assert device.uuid.startswith("GPU-")
        assert device.memory_total_mib > 0
        assert device.name
        assert ":" in device.pci_bus_id
        assert isinstance(device.mig_enabled, bool)


def test_usage_for_each_device(backend):
    for device in backend.devices():
        usage = backend.usage(device.uuid)
        assert usage.uuid == device.uuid
        assert 0 <= usage.memory_used_mib <= device.memory_total_mib
        assert usage.utilization_gpu is None or 0 <= usage.utilization_gpu <= 100
        assert all(p.pid > 0 and (p.used_memory_mib or 0) >= 0 for p in usage.processes)


def test_unknown_uuid_raises_keyerror(backend):
    with pytest.raises(KeyError):
        backend.usage("GPU-00000000-0000-0000-0000-000000000000")


def test_auto_picks_nvml_and_close_is_idempotent():
    backend = load_backend("auto")
    assert isinstance(backend, NVMLDeviceBackend)
    assert not backend.simulated
    backend.close()
    backend.close()


def test_topology_is_a_valid_matrix_of_the_device_count(backend):
    from gpubroker.devices.topology import LinkLevel, validate

    matrix = backend.topology()  # read-only NVML queries
    assert len(matrix) == len(backend.devices())
    assert validate(matrix) == matrix
    assert all(isinstance(level, LinkLevel) for row in matrix for level in row)
