"""The device backend interface: what the broker needs to know about GPUs.

A backend reports the devices of one node (inventory) and how busy they are
(usage). The broker never talks to NVML or to the fake directly, only through
this interface, so the real backend (:mod:`gpubroker.devices.nvml`) and the
simulated one (:mod:`gpubroker.devices.fake`) are interchangeable.

Units: memory in MiB (NVML reports bytes; we divide by 2**20), utilization in
percent (0-100, NVML's ``nvmlUtilization_t.gpu``), times in UTC.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

from traitlets import MetaHasTraits
from traitlets.config import LoggingConfigurable

from .topology import LinkLevel, Topology, uniform


@dataclass(frozen=True)
class DeviceInfo:
    """One physical GPU as the inventory sees it.

    Attributes:
        node: name of the node (host) the device is on.
        index: NVML device index on that node (0-based, PCI bus order).
        uuid: NVML UUID, ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``.
        name: product name as NVML reports it, e.g. ``NVIDIA H100 80GB HBM3``.
        memory_total_mib: framebuffer memory in MiB (``nvmlDeviceGetMemoryInfo().total``).
        pci_bus_id: PCI bus id as NVML formats it, e.g. ``00000000:18:00.0``.
        mig_enabled: whether MIG mode is currently on (``nvmlDeviceGetMigMode``);
            ``False`` where the device does not support MIG.
    """

    node: str
    index: int
    uuid: str
    name: str
    memory_total_mib: int
    pci_bus_id: str
    mig_enabled: bool = False

    @property
    def memory_total_gib(self) -> float:
        """Total memory in GiB (MiB / 1024)."""
        return self.memory_total_mib / 1024


@dataclass(frozen=True)
class ProcessInfo:
    """A process using a device (``nvmlDeviceGetComputeRunningProcesses``).

    Attributes:
        pid: process id on the node.
        used_memory_mib: device memory the process holds, MiB.
    """

    pid: int
    used_memory_mib: int


@dataclass(frozen=True)
class DeviceUsage:
    """How busy one device is right now.

    Attributes:
        uuid: the device's NVML UUID.
        utilization_gpu: percent of time over the last sample period during
            which a kernel ran (``nvmlDeviceGetUtilizationRates().gpu``), 0-100;
            ``None`` where NVML does not report it (e.g. MIG mode on).
        memory_used_mib: device memory in use, MiB.
        processes: compute processes on the device.
    """

    uuid: str
    utilization_gpu: int | None
    memory_used_mib: int
    processes: tuple[ProcessInfo, ...] = field(default_factory=tuple)


class _BackendMeta(MetaHasTraits, abc.ABCMeta):
    """Metaclass of both traitlets and ABCs (``LoggingConfigurable`` + ``abc.ABC``
    alone raises "metaclass conflict")."""


class DeviceBackend(LoggingConfigurable, metaclass=_BackendMeta):
    """Interface of a device backend.

    Subclasses are traitlets ``Configurable`` so each one's options live in
    the broker's config file under its class name.
    """

    #: short name, as used by ``GPUBrokerApp.device_backend``
    kind: str = "base"
    #: ``True`` for a backend that simulates GPUs; the broker says so loudly
    simulated: bool = False

    @abc.abstractmethod
    def devices(self) -> list[DeviceInfo]:
        """Return the inventory of this node, ordered by index.

        Raises:
            DeviceBackendError: when the inventory cannot be read.
        """

    @abc.abstractmethod
    def usage(self, uuid: str) -> DeviceUsage:
        """Return the current usage of the device ``uuid``.

        Raises:
            KeyError: ``uuid`` is not a device of this backend.
            DeviceBackendError: when the device cannot be queried.
        """

    def topology(self) -> Topology:
        """Return how the devices of this node are interconnected.

        Used for topology-aware gang placement: a multi-GPU request should get
        devices joined by NVLink, else behind one PCIe switch.

        Returns:
            A square matrix indexed by NVML device index (the order of
            :meth:`devices`); entry ``[i][j]`` is the
            :class:`~gpubroker.devices.topology.LinkLevel` between devices
            ``i`` and ``j`` (lower is closer, ``SELF`` = 0 on the diagonal).
            This default knows nothing of the hardware and says every pair is
            ``SYSTEM`` apart (all equally far); backends override it.

        Raises:
            DeviceBackendError: when the inventory or topology cannot be read.
        """
        return uniform(len(self.devices()), LinkLevel.SYSTEM)

    def close(self) -> None:
        """Release what the backend holds (e.g. ``nvmlShutdown``)."""


class DeviceBackendError(RuntimeError):
    """A backend could not be initialised or queried."""
