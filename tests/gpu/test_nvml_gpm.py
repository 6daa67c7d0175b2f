"""The NVML backend's GPM reading (``_gpm_utilization``) against a real GPU.

The backend reads GPM (GPU Performance Monitoring, Hopper and later) only
for MIG devices (``nvmlGpmMigSampleGet``). Where MIG mode is off this test
takes the same kind of samples of the whole device (``nvmlGpmSampleGet``,
read-only) and gives them to the backend's ``_gpm_utilization``: the
metrics query it builds must be accepted by the driver, and read near 0
on an idle device and high while a PyTorch process multiplies matrices on
it. It skips where GPM is not supported or PyTorch is missing. No GPU
setting is changed.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pynvml
import pytest

from gpubroker.devices import nvml

from . import require_nvml

require_nvml()

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        importlib.util.find_spec("torch") is None, reason="PyTorch is not installed here"
    ),
]

BUSY = """
import sys, time, torch
a = torch.randn(8192, 8192, device="cuda")
torch.cuda.synchronize()
print("READY", flush=True)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    a = (a @ a).clamp_(-1, 1)
    torch.cuda.synchronize()
"""


def _gpm_candidate(handle: Any) -> bool:
    """MIG mode off (or not supported) and GPM supported on the device."""
    try:
        if pynvml.nvmlDeviceGetMigMode(handle)[0] == pynvml.NVML_DEVICE_MIG_ENABLE:
            return False
    except pynvml.NVMLError_NotSupported:
        pass
    try:
        return bool(pynvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice)
    except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound):
        return False


@pytest.fixture
def handle() -> Iterator[Any]:
    """The first device with MIG mode off that supports GPM."""
    pynvml.nvmlInit()
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        found = next((h for h in handles if _gpm_candidate(h)), None)
        if found is None:
            pytest.skip("no GPU with MIG mode off supports GPM here (Hopper and later do)")
        yield found
    finally:
        pynvml.nvmlShutdown()


def activity(handle: Any, seconds: float) -> float | None:
    """GPM graphics activity (0..1) of the device over ``seconds``, as the backend computes it."""
    first, second = pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()
    try:
        pynvml.nvmlGpmSampleGet(handle, first)
        time.sleep(seconds)
        pynvml.nvmlGpmSampleGet(handle, second)
        return nvml._gpm_utilization(first, second)
    finally:
        nvml._free(first)
        nvml._free(second)


def test_gpm_activity_reads_idle_then_busy(handle: Any) -> None:
    uuid = pynvml.nvmlDeviceGetUUID(handle)
    uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
    idle = activity(handle, 1.0)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_")}
    child = subprocess.Popen(
        [sys.executable, "-c", BUSY, "6"],
        env={**env, "CUDA_VISIBLE_DEVICES": uuid},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "READY"
        busy = activity(handle, 2.0)
        assert child.wait(timeout=60) == 0
    finally:
        child.kill()
    print(f"\nGPM graphics activity: idle {idle}, busy {busy}")
    assert idle is not None and busy is not None, "the driver refused the GPM metrics query"
    assert idle < 0.05
    assert busy > 0.5
