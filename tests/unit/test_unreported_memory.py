"""Processes whose memory NVML does not report (``usedGpuMemory`` is
``None``, NVML_VALUE_NOT_AVAILABLE): they are unknown, not 0 MiB. The share
watchdog and the culler judge them from the device's total where all of
them on a device belong to one lease, and say so where they cannot."""

from __future__ import annotations

import datetime as dt
import logging
from pathlib import Path

import pytest

from gpubroker.core import Broker
from gpubroker.devices.base import DeviceUsage, ProcessInfo
from gpubroker.enforce.watchdog import Overuse, ProcessSample, ShareCap, ShareWatchdog, Terminate

GPU = "GPU-11111111-2222-3333-4444-555555555555"
T0 = dt.datetime(2001, 2, 3, 4, 5, 6, tzinfo=dt.timezone.utc)
CAPS = [ShareCap(1, "ann", GPU, 1000), ShareCap(2, "bob", GPU, 4000)]
PIDS = {100: 1, 101: 1, 200: 2, 201: 2}


def _dog() -> ShareWatchdog:
    return ShareWatchdog(grace=60, tolerance_mib=0, check_uid=False)


def test_an_unreported_process_of_one_lease_is_judged_by_the_devices_total() -> None:
    dog = _dog()
    # bob's process reports 1,500 MiB; ann's none; the device holds 6,500
    samples = [ProcessSample(GPU, 100, None), ProcessSample(GPU, 200, 1500)]
    (warn,) = dog.judge(samples, CAPS, PIDS.get, T0, {GPU: 6500})
    assert isinstance(warn, Overuse)
    assert (warn.lease_id, warn.pid, warn.used_mib, warn.lease_used_mib) == (1, 100, 5000, 5000)
    (end,) = dog.judge(samples, CAPS, PIDS.get, T0 + dt.timedelta(seconds=60), {GPU: 6500})
    assert isinstance(end, Terminate) and end.pid == 100
    assert "estimated from the device's total" in end.reason


def test_several_unreported_processes_of_one_lease_share_the_remainder() -> None:
    dog = _dog()
    samples = [ProcessSample(GPU, 101, None), ProcessSample(GPU, 100, None)]
    actions = dog.judge(samples, CAPS, PIDS.get, T0, {GPU: 3001})
    assert [(a.pid, a.used_mib, a.lease_used_mib) for a in actions] == [
        (100, 1501, 3001),  # lowest pid takes the odd MiB; largest first
        (101, 1500, 3001),
    ]


def test_within_the_cap_an_unreported_process_is_left_alone() -> None:
    dog = _dog()
    samples = [ProcessSample(GPU, 100, None), ProcessSample(GPU, 200, 1500)]
    assert dog.judge(samples, CAPS, PIDS.get, T0, {GPU: 2400}) == []


def test_unreported_processes_of_two_leases_cannot_be_told_apart_and_say_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    dog = _dog()
    samples = [ProcessSample(GPU, 100, None), ProcessSample(GPU, 200, None)]
    with caplog.at_level(logging.WARNING):
        assert dog.judge(samples, CAPS, PIDS.get, T0, {GPU: 70000}) == []
        assert dog.judge(samples, CAPS, PIDS.get, T0, {GPU: 70000}) == []
    warned = [r for r in caplog.records if "NVML reports no memory" in r.getMessage()]
    assert len(warned) == 1  # once, until that changes
    assert "not fully enforced" in warned[0].getMessage()
    # their reported neighbours are still judged
    samples.append(ProcessSample(GPU, 201, 9000))
    (warn,) = dog.judge(samples, CAPS, PIDS.get, T0, {GPU: 70000})
    assert (warn.lease_id, warn.pid, warn.used_mib) == (2, 201, 9000)


def test_without_the_devices_total_an_unreported_process_counts_nothing() -> None:
    dog = _dog()
    assert dog.judge([ProcessSample(GPU, 100, None)], CAPS, PIDS.get, T0) == []


def test_the_fake_backend_reports_unknown_process_memory_as_nvml_does(tmp_path: Path) -> None:
    from gpubroker.devices.fake import FakeDeviceBackend

    backend = FakeDeviceBackend(inventory=["1 x H100"], state_file=str(tmp_path / "s.json"))
    (device,) = backend.devices()
    backend.set_usage(
        device.uuid,
        memory_used_mib=6000,
        processes=[{"pid": 7, "used_memory_mib": None}, {"pid": 8, "used_memory_mib": 1000}],
    )
    usage = backend.usage(device.uuid)
    assert usage.memory_used_mib == 6000
    assert usage.processes == (ProcessInfo(7, None), ProcessInfo(8, 1000))


async def test_the_share_guard_ends_an_over_cap_process_nvml_gives_no_memory_for(
    db_url: str, tmp_path: Path
) -> None:
    from gpubroker.share_guard import ShareGuard

    from .test_sharing_core import sharing_broker

    broker = sharing_broker(db_url, tmp_path)
    lease = broker.request_lease("ann", "", memory_gib=10, pool="shared")
    ((_ref, device, cap_mib),) = [c for c in broker.share_caps() if c[0].id == lease["id"]]
    broker.backend.set_usage(
        device, memory_used_mib=cap_mib + 5000, processes=[{"pid": 4321, "used_memory_mib": None}]
    )
    guard = ShareGuard(broker, pid_lease={4321: lease["id"]}.get)
    guard.watchdog.check_uid = False
    (warn,) = await guard.check_once(T0)
    assert isinstance(warn, Overuse)
    assert (warn.pid, warn.used_mib, warn.cap_mib) == (4321, cap_mib + 5000, cap_mib)


def test_the_culler_counts_an_unreported_process_by_the_devices_total(broker: Broker) -> None:
    from gpubroker.culler import Culler
    from gpubroker.model.holdings import LeaseRef

    culler = Culler(broker, None)  # type: ignore[arg-type]
    culler.pid_lease = {1: 10, 2: 10, 3: 20}.get
    mine = LeaseRef(10, "ann", "", "server", "interactive", T0, T0, None, None, None, None, ())
    alone = DeviceUsage(GPU, 50, 9000, (ProcessInfo(1, None), ProcessInfo(3, 2000)))
    assert culler._share_memory(mine, alone) == 7000
    known = DeviceUsage(GPU, 50, 9000, (ProcessInfo(1, 500), ProcessInfo(2, 700)))
    assert culler._share_memory(mine, known) == 1200
    shared = DeviceUsage(GPU, 50, 9000, (ProcessInfo(1, None), ProcessInfo(3, None)))
    assert culler._share_memory(mine, shared) == 0  # cannot be told apart
