"""The usage ledger's sample when a MIG instance went away meanwhile (a
new-user trial of the demo: a bare ``KeyError`` warning 13 s after a job's
instance was destroyed)."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from gpubroker.devices.base import DeviceBackendError
from gpubroker.usage.ledger import Ledger

GPU = "GPU-eae60fa4-0000-0000-0000-000000000000"
GONE = "MIG-13de7bf6-0000-0000-0000-000000000000"
KEPT = "MIG-22aa0000-0000-0000-0000-000000000000"


class Backend:
    """Knows ``GPU`` and the MIG instance ``KEPT``; ``GONE`` was destroyed."""

    def __init__(self, broken: Exception | None = None) -> None:
        self.broken = broken

    def usage(self, uuid: str) -> Any:
        if self.broken is not None:
            raise self.broken
        if uuid not in (GPU, KEPT):
            raise KeyError(uuid)
        return SimpleNamespace(utilization_gpu=None, engine_activity=0.5)

    def mig_devices(self, uuid: str) -> list[Any]:
        return [SimpleNamespace(uuid=GONE, profile="1g.10gb", gi_id=9)]


def ledger(backend: Backend) -> Ledger:
    return Ledger(None, backend, clock=lambda: 1000.0)


#: an open slot interval of a MIG instance: (id, kind, device, slot, weight, start, end)
def mig_interval(slot: str) -> tuple[int, str, str, str, float, float, None]:
    return (1, "mig", GPU, slot, 1 / 7, 900.0, None)


def test_a_mig_instance_gone_before_its_read_is_skipped_with_a_debug_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    book = ledger(Backend())
    inventory = [(GPU, 0, "NVIDIA H100 80GB HBM3", "n1", True)]  # lists GONE: then it goes
    accrued, telemetry = book._measure(1000.0, inventory, [mig_interval(GONE)])
    assert accrued[1][0] == 0.0  # use unknown: nothing counted as used
    assert [labels.get("GPU_I_ID") for labels, _ in telemetry] == [None]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    gone = [r.getMessage() for r in caplog.records if GONE in r.getMessage()]
    assert gone and all("is gone" in m for m in gone)


def test_a_whole_gpu_the_backend_does_not_know_is_a_warning_in_words(
    caplog: pytest.LogCaptureFixture,
) -> None:
    book = ledger(Backend())
    book._measure(1000.0, [], [(1, "device", "GPU-unknown", "", 1.0, 900.0, None)])
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == [
        "Usage ledger: cannot read the use of GPU-unknown: the device backend has no such device"
    ]


def test_other_read_failures_are_warnings_saying_what_failed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ledger(Backend(DeviceBackendError("NVML: GPU is lost")))._read(KEPT, instance=True)
    ledger(Backend(ValueError("bad field")))._read(KEPT, instance=True)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == [
        f"Usage ledger: cannot read the use of {KEPT}: NVML: GPU is lost",
        f"Usage ledger: cannot read the use of {KEPT}: unexpected ValueError from the "
        "device backend: bad field",
    ]
