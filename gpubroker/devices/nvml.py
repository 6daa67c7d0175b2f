"""The real device backend: NVIDIA GPUs read through NVML (``pynvml``).

Calls and units follow the NVML API reference (docs.nvidia.com/deploy/nvml-api)
as wrapped by ``nvidia-ml-py``: memory arrives in bytes and is reported here
in MiB (``// 2**20``), utilization in percent.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pynvml
from traitlets import Unicode, default

from .base import DeviceBackend, DeviceBackendError, DeviceInfo, DeviceUsage, ProcessInfo

_MIB = 2**20


def _text(value: str | bytes) -> str:
    """Return ``value`` as str (older pynvml versions return bytes)."""
    return value.decode() if isinstance(value, bytes) else value


@contextmanager
def _nvml_errors(what: str) -> Iterator[None]:
    """Turn ``pynvml.NVMLError`` raised inside into :class:`DeviceBackendError`."""
    try:
        yield
    except pynvml.NVMLError as err:
        raise DeviceBackendError(f"NVML: cannot {what}: {err}") from err


class NVMLDeviceBackend(DeviceBackend):
    """The GPUs of this node as NVML reports them.

    Raises DeviceBackendError on construction when NVML cannot be initialised
    (no driver: ``NVMLError_LibraryNotFound``; driver not loaded, ...).
    Call :meth:`close` to shut NVML down.
    """

    kind = "nvml"
    simulated = False

    node_name = Unicode(
        help="Name of this node, as leases and reports show it (default: this host's name)."
    ).tag(config=True)

    @default("node_name")
    def _default_node_name(self) -> str:
        return socket.gethostname()

    def __init__(self, **kwargs: Any) -> None:
        """Initialise NVML (``nvmlInit``); raises DeviceBackendError when it fails."""
        super().__init__(**kwargs)
        self._initialised = False
        with _nvml_errors("initialise (is the NVIDIA driver installed?)"):
            pynvml.nvmlInit()
        self._initialised = True
        self.log.info("NVML initialised on node %s", self.node_name)

    def devices(self) -> list[DeviceInfo]:
        """Return this node's GPUs ordered by NVML index.

        Raises:
            DeviceBackendError: an NVML query failed.
        """
        with _nvml_errors("list devices"):
            count = pynvml.nvmlDeviceGetCount()
            return [self._device(index) for index in range(count)]

    def _device(self, index: int) -> DeviceInfo:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        return DeviceInfo(
            node=self.node_name,
            index=index,
            uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
            name=_text(pynvml.nvmlDeviceGetName(handle)),
            memory_total_mib=pynvml.nvmlDeviceGetMemoryInfo(handle).total // _MIB,
            pci_bus_id=_text(pynvml.nvmlDeviceGetPciInfo(handle).busId),
            mig_enabled=_mig_enabled(handle),
        )

    def usage(self, uuid: str) -> DeviceUsage:
        """Return utilization (percent, ``None`` where unsupported), memory used (MiB)
        and compute processes of ``uuid``.

        Raises:
            KeyError: no device with this UUID on this node.
            DeviceBackendError: an NVML query failed.
        """
        handle = self._handle(uuid)
        with _nvml_errors(f"query {uuid}"):
            return DeviceUsage(
                uuid=uuid,
                utilization_gpu=_utilization(handle),
                memory_used_mib=pynvml.nvmlDeviceGetMemoryInfo(handle).used // _MIB,
                processes=_processes(handle),
            )

    def _handle(self, uuid: str) -> Any:
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(uuid)
        except (pynvml.NVMLError_NotFound, pynvml.NVMLError_InvalidArgument):
            raise KeyError(uuid) from None
        except pynvml.NVMLError as err:
            raise DeviceBackendError(f"NVML: cannot find {uuid}: {err}") from err

    def close(self) -> None:
        """Shut NVML down (``nvmlShutdown``); only the first call does anything."""
        if not self._initialised:
            return
        self._initialised = False
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as err:
            self.log.warning("nvmlShutdown failed: %s", err)


def _mig_enabled(handle: Any) -> bool:
    """Whether MIG mode is currently on; ``False`` where MIG is not supported."""
    try:
        current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
    except pynvml.NVMLError_NotSupported:
        return False
    return bool(current == pynvml.NVML_DEVICE_MIG_ENABLE)


def _utilization(handle: Any) -> int | None:
    """GPU utilization in percent; ``None`` where NVML does not report it (MIG on)."""
    try:
        return int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except pynvml.NVMLError_NotSupported:
        return None


def _processes(handle: Any) -> tuple[ProcessInfo, ...]:
    """Compute processes; memory in MiB, 0 where NVML does not know it."""
    return tuple(
        ProcessInfo(pid=int(p.pid), used_memory_mib=(p.usedGpuMemory or 0) // _MIB)
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    )
