"""MIG create/destroy through the NVML backend on a real GPU (opt-in: it CHANGES the GPU).

Runs only where an NVIDIA driver and GPU exist, and only when
``GPUBROKER_GPU_MIG_WRITE=1`` is set: it creates one MIG device of the
smallest catalog profile at a free placement on the first GPU whose MIG mode
is already on, checks it as :meth:`~NVMLDeviceBackend.mig_devices` and
:meth:`~NVMLDeviceBackend.usage` report it, and destroys it again (compute
instance, then GPU instance). It never changes MIG mode and never touches
existing MIG devices. Needs root (or the ``mig/config`` capability). This is
the path (``nvmlDeviceCreateGpuInstanceWithPlacement``) that the read-only
tests in ``test_nvml_mig.py`` do not reach.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from gpubroker.devices import mig
from gpubroker.devices.base import DeviceBackendError
from gpubroker.devices.nvml import NVMLDeviceBackend

from . import require_nvml

require_nvml()

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        os.environ.get("GPUBROKER_GPU_MIG_WRITE") != "1",
        reason="changes the GPU: set GPUBROKER_GPU_MIG_WRITE=1 to create and destroy a MIG device",
    ),
]


@pytest.fixture
def backend() -> Iterator[NVMLDeviceBackend]:
    backend = NVMLDeviceBackend()
    yield backend
    backend.close()


def test_create_and_destroy_one_mig_device(backend: NVMLDeviceBackend) -> None:
    reasons: list[str] = []
    for device in backend.devices():
        spec = mig.spec_for(device.name)
        if spec is None or not device.mig_enabled:
            reasons.append(
                f"device {device.index} ({device.name}): no MIG mode on / not in catalog"
            )
            continue
        try:
            before = backend.mig_devices(device.uuid)
        except DeviceBackendError as err:
            reasons.append(f"device {device.index}: cannot list MIG devices ({err})")
            continue
        layout = [(d.profile, d.placement) for d in before]
        smallest = min(spec.profiles.values(), key=lambda p: (p.memory_slices, p.compute_slices))
        placement = mig.best_placement(spec, layout, smallest)
        if placement is None:
            reasons.append(f"device {device.index}: no room for {smallest.name}")
            continue
        try:
            created = backend.create_mig_device(device.uuid, smallest.name, placement)
        except DeviceBackendError as err:
            if "needs root" in str(err):
                pytest.skip(f"not root: {err}")
            raise
        try:
            assert created.uuid.startswith("MIG-")
            assert (created.profile, created.placement) == (smallest.name, placement)
            assert created in backend.mig_devices(device.uuid)
            usage = backend.usage(created.uuid)
            assert usage.utilization_gpu is None  # not supported on MIG devices
            assert 0 <= usage.memory_used_mib <= created.memory_mib
        finally:
            backend.destroy_mig_device(device.uuid, created.uuid)
        assert backend.mig_devices(device.uuid) == before
        return
    pytest.skip("; ".join(reasons or ["no GPU"]))
