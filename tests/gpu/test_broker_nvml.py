"""The broker on real GPUs: a lease of a real device, the work on it as NVML
sees it, the culler's verdict on those readings, and a share's memory cap
enforced in a real PyTorch process.

Runs only where an NVIDIA driver and GPU exist. It changes no GPU setting:
no MIG mode, no MIG device, no MPS daemon. The work is done by child Python
processes that get the lease's environment, as a user's kernel would; the
PyTorch checks skip where PyTorch with CUDA is not installed.
"""

from __future__ import annotations

import datetime as dt
import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpubroker.core import Broker
from gpubroker.culler import Signals, Track, judge
from gpubroker.devices.base import DeviceUsage
from gpubroker.devices.nvml import NVMLDeviceBackend
from gpubroker.enforce.caps import framework_env
from gpubroker.store.db import make_engine, make_session_factory, upgrade

from . import require_nvml

require_nvml()

pytestmark = pytest.mark.gpu

#: the culler's default ``gpu_idle_threshold``, percent
THRESHOLD = 5.0
_GIB = 1024  # MiB

needs_torch = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="PyTorch is not installed here"
)

#: a child that holds ``size`` GiB on the first visible device and multiplies
#: matrices for ``seconds`` seconds; prints READY once its memory is taken
WORK = """
import sys, time, torch
size, seconds = float(sys.argv[1]), float(sys.argv[2])
assert torch.cuda.is_available(), "CUDA not available in the child"
hold = torch.empty(int(size * 2**30), dtype=torch.uint8, device="cuda")
a = torch.randn(8192, 8192, device="cuda")
torch.cuda.synchronize()
print("READY", flush=True)
end = time.monotonic() + seconds
while time.monotonic() < end:
    a = (a @ a).clamp_(-1, 1)
    torch.cuda.synchronize()
print("DONE", flush=True)
"""

#: a child that allocates each size in GiB in turn and prints what happened
ALLOCATE = """
import sys, torch
for size in map(float, sys.argv[1:]):
    try:
        block = torch.empty(int(size * 2**30), dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError as err:
        print(f"{size:g} OOM", flush=True)
    else:
        print(f"{size:g} OK", flush=True)
        del block
        torch.cuda.empty_cache()
"""


@pytest.fixture
def backend() -> Iterator[NVMLDeviceBackend]:
    backend = NVMLDeviceBackend()
    yield backend
    backend.close()


@pytest.fixture
def broker(tmp_path: Path, backend: NVMLDeviceBackend) -> Iterator[Broker]:
    """A broker over a migrated SQLite store and the machine's real GPUs."""
    url = f"sqlite:///{tmp_path / 'broker.sqlite'}"
    upgrade(url)
    broker = Broker(session_factory=make_session_factory(make_engine(url)), backend=backend)
    broker.sync_inventory()
    broker.adopt()
    yield broker


def whole_devices(backend: NVMLDeviceBackend) -> list[str]:
    """UUIDs of the devices with MIG mode off (a whole-GPU lease can hold them)."""
    return [d.uuid for d in backend.devices() if not d.mig_enabled]


def child_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_", "NVIDIA_"))}
    env.update(extra)
    return env


def sample(backend: NVMLDeviceBackend, uuid: str, seconds: float) -> list[DeviceUsage]:
    """NVML readings of ``uuid`` every 0.25 s for ``seconds`` seconds."""
    readings = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        readings.append(backend.usage(uuid))
        time.sleep(0.25)
    return readings


def test_a_whole_gpu_lease_holds_a_real_device(broker: Broker, backend: NVMLDeviceBackend):
    free = whole_devices(backend)
    if not free:
        pytest.skip("every GPU here has MIG mode on: no whole device to lease")
    lease = broker.request_lease("ann", "", 1)
    assert lease["state"] == "granted", lease
    [held] = [d["uuid"] for d in lease["devices"]]
    assert held in free
    assert lease["env"]["CUDA_VISIBLE_DEVICES"] == held
    assert lease["env"]["NVIDIA_VISIBLE_DEVICES"] == held
    # a second user waits for it when it is the only device, and gets it on release
    second = broker.request_lease("bob", "", 1)
    if len(free) == 1:
        assert second["state"] == "pending", second
        assert second["queue"]["position"] == 1
    released = broker.release_lease(lease["id"], "done")
    assert released["state"] == "released"
    second = broker.get_lease(second["id"])
    assert second["state"] == "granted"
    if len(free) == 1:
        assert [d["uuid"] for d in second["devices"]] == [held]
    broker.release_lease(second["id"], "done")


@needs_torch
def test_real_work_on_the_leased_gpu_is_seen_and_judged_busy_then_idle(
    broker: Broker, backend: NVMLDeviceBackend
):
    if not whole_devices(backend):
        pytest.skip("every GPU here has MIG mode on: no whole device to lease")
    lease = broker.request_lease("ann", "", 1)
    [uuid] = [d["uuid"] for d in lease["devices"]]
    before = backend.usage(uuid)
    child = subprocess.Popen(
        [sys.executable, "-c", WORK, "4", "8"],
        env=child_env(lease["env"]),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "READY"
        busy = sample(backend, uuid, 4.0)
        assert child.wait(timeout=60) == 0
    finally:
        child.kill()
    after = sample(backend, uuid, 3.0)
    broker.release_lease(lease["id"], "done")

    peak_util = max(r.utilization_gpu or 0 for r in busy)
    peak_memory = max(r.memory_used_mib for r in busy)
    pids = {p.pid for r in busy for p in r.processes}
    print(
        f"\nbefore: {before.utilization_gpu}% {before.memory_used_mib} MiB;"
        f" busy: peak {peak_util}% {peak_memory} MiB, pids {sorted(pids)} (child {child.pid});"
        f" after: {[(r.utilization_gpu, r.memory_used_mib) for r in after[-3:]]}"
    )
    assert peak_util >= 50, f"a matmul loop read as {peak_util}% busy"
    assert peak_memory - before.memory_used_mib >= 4 * _GIB
    assert child.pid in pids, f"NVML listed {sorted(pids)}, not the child {child.pid}"
    last = after[-1]
    assert (last.utilization_gpu or 0) < THRESHOLD
    assert last.memory_used_mib - before.memory_used_mib < 1 * _GIB
    assert child.pid not in {p.pid for p in last.processes}

    # the culler's verdict on those readings (Culler._slot_usage reads a whole
    # device's utilization and memory, as here)
    granted = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    now = granted + dt.timedelta(hours=2)
    track = Track(gpu_active=granted)
    idle_kernel = granted  # no kernel activity since the grant

    def signals(reading: DeviceUsage) -> Signals:
        return Signals(
            hub_activity=None,
            kernel_activity=idle_kernel,
            kernels=1,
            busy=False,
            gpu_util=reading.utilization_gpu,
            gpu_memory_mib=reading.memory_used_mib,
        )

    peak = max(busy, key=lambda r: r.utilization_gpu or 0)
    working = judge(signals(peak), track, granted, now, 3600, THRESHOLD, 1800, False)
    assert not working.cull and working.idle == 0, working
    later = now + dt.timedelta(hours=1, seconds=1)
    idle = judge(signals(last), track, granted, later, 3600, THRESHOLD, 1800, False)
    assert idle.cull and idle.idle > 3600, idle


@needs_torch
def test_a_share_memory_cap_stops_pytorch_at_its_share(backend: NVMLDeviceBackend):
    """``framework_env`` (what a share's server gets) caps PyTorch's allocator
    at the share's memory on a real device; within the share it allocates."""
    devices = [d for d in backend.devices() if not d.mig_enabled]
    if not devices:
        pytest.skip("every GPU here has MIG mode on")
    device = devices[0]
    share_mib = 10 * _GIB
    env = framework_env(share_mib, device.memory_total_mib, os.environ.get("PYTHONPATH"))
    env["CUDA_VISIBLE_DEVICES"] = device.uuid
    result = subprocess.run(
        [sys.executable, "-c", ALLOCATE, "6", "14", "8"],
        env=child_env(env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    print(result.stdout, result.stderr)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:3] == ["6 OK", "14 OOM", "8 OK"]
    uncapped = subprocess.run(
        [sys.executable, "-c", ALLOCATE, "14"],
        env=child_env({"CUDA_VISIBLE_DEVICES": device.uuid}),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert uncapped.stdout.strip() == "14 OK", uncapped.stderr
