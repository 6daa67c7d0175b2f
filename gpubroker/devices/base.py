"""The device backend interface: what the broker needs to know about GPUs.

A backend reports the devices of one node (inventory) and how busy they are
(usage). The broker never talks to NVML or to the fake directly, only through
this interface, so the real backend (:mod:`gpubroker.devices.nvml`) and the
simulated one (:mod:`gpubroker.devices.fake`) are interchangeable.

A backend may also manage MIG (Multi-Instance GPU) instances on its devices
(:meth:`DeviceBackend.mig_devices`, :meth:`~DeviceBackend.create_mig_device`,
:meth:`~DeviceBackend.destroy_mig_device`, :meth:`~DeviceBackend.set_mig_mode`);
the rules of what may be created where are NVIDIA's, encoded in
:mod:`gpubroker.devices.mig`. The default implementations say "not
supported", so a backend without MIG management still satisfies the interface.

Units: memory in MiB (NVML reports bytes; we divide by 2**20), utilization in
percent (0-100, NVML's ``nvmlUtilization_t.gpu``), times in UTC.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

from traitlets import MetaHasTraits
from traitlets.config import LoggingConfigurable

from .mig import Placement
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
        used_memory_mib: device memory the process holds, MiB; ``None``
            where NVML does not report it (``NVML_VALUE_NOT_AVAILABLE``,
            which pynvml gives as ``usedGpuMemory = None``: e.g. a driver
            without the permission to read other processes' memory). The
            device's own ``memory_used_mib`` still counts that memory.
    """

    pid: int
    used_memory_mib: int | None


@dataclass(frozen=True)
class DeviceUsage:
    """How busy one device (or one MIG device) is right now.

    Attributes:
        uuid: the device's NVML UUID (``GPU-...``), or a MIG device's UUID
            (``MIG-...``) where the backend supports MIG.
        utilization_gpu: percent of time over the last sample period during
            which a kernel ran (``nvmlDeviceGetUtilizationRates().gpu``), 0-100;
            ``None`` where NVML does not report it (e.g. MIG mode on).
        memory_used_mib: device memory in use, MiB (for a MIG device: of
            that instance's memory).
        processes: compute processes on the device.
        engine_activity: for a MIG device, the fraction (0..1) of the last
            sample period in which its graphics/compute engine was active:
            NVML's GPU Performance Monitoring metric
            ``NVML_GPM_METRIC_GRAPHICS_UTIL`` for the instance, the figure
            DCGM exports as ``DCGM_FI_PROF_GR_ENGINE_ACTIVE`` (Hopper and
            later); ``None`` where it is not known (other devices, older
            GPUs, the first sample).
    """

    uuid: str
    utilization_gpu: int | None
    memory_used_mib: int
    processes: tuple[ProcessInfo, ...] = field(default_factory=tuple)
    engine_activity: float | None = None


@dataclass(frozen=True)
class MigDevice:
    """One MIG device: a GPU instance plus the compute instance inside it.

    This is what ``CUDA_VISIBLE_DEVICES`` names with :attr:`uuid` and what
    ``nvidia-smi -L`` lists under its parent GPU (NVIDIA MIG User Guide,
    "Device Names"). The broker creates each one with a single compute
    instance that uses all of the GPU instance's compute slices.

    Attributes:
        parent_uuid: UUID of the physical GPU, ``GPU-...``.
        uuid: the MIG device's UUID, ``MIG-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``
            (R470+ drivers, ``nvmlDeviceGetUUID`` of the MIG device handle).
        profile: GPU-instance profile name without the ``MIG`` prefix, e.g.
            ``1g.10gb`` (:attr:`gpubroker.devices.mig.MigProfile.name`).
        placement: the memory slices the GPU instance occupies,
            ``start:size`` (``nvmlGpuInstanceInfo_t.placement``).
        gi_id: GPU-instance ID (``nvmlDeviceGetGpuInstanceId``), unique per GPU.
        ci_id: compute-instance ID inside the GPU instance
            (``nvmlDeviceGetComputeInstanceId``); 0 for the first one.
        memory_mib: the MIG device's framebuffer memory, MiB.
    """

    parent_uuid: str
    uuid: str
    profile: str
    placement: Placement
    gi_id: int
    ci_id: int
    memory_mib: int


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
    #: ``True`` for the fake backend that ``auto`` fell back to (no driver),
    #: not one chosen (:func:`gpubroker.devices.load_backend`)
    fallback: bool = False

    @abc.abstractmethod
    def devices(self) -> list[DeviceInfo]:
        """Return the inventory of this node, ordered by index.

        Raises:
            DeviceBackendError: when the inventory cannot be read.
        """

    @abc.abstractmethod
    def usage(self, uuid: str) -> DeviceUsage:
        """Return the current usage of the device ``uuid``.

        ``uuid`` is a GPU UUID (``GPU-...``) or, on backends that manage MIG,
        the UUID of one of their MIG devices (``MIG-...``).

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

    # --- MIG management ---------------------------------------------------------
    #
    # The broker calls these, and only these, to change MIG instances. The
    # rules come from NVIDIA (see gpubroker.devices.mig); the NVML backend
    # leaves the final word to the driver.

    def mig_devices(self, parent_uuid: str) -> list[MigDevice]:
        """Return the MIG devices that exist on the GPU ``parent_uuid``.

        NVML: ``nvmlDeviceGetMaxMigDeviceCount`` +
        ``nvmlDeviceGetMigDeviceHandleByIndex`` for each index, then the
        MIG device's UUID, GPU/compute-instance IDs and the GPU instance's
        placement and profile (``nvmlGpuInstanceGetInfo``).

        Args:
            parent_uuid: a GPU of this backend, ``GPU-...``.

        Returns:
            The MIG devices ordered by GPU-instance ID; ``[]`` when MIG mode is
            off, the GPU does not support MIG, or the backend does not manage
            MIG (this default).

        Raises:
            KeyError: ``parent_uuid`` is not a GPU of this backend.
            DeviceBackendError: the instances cannot be read.
        """
        self._require_device(parent_uuid)
        return []

    def create_mig_device(self, parent_uuid: str, profile: str, placement: Placement) -> MigDevice:
        """Create a MIG device of ``profile`` at ``placement`` on ``parent_uuid``.

        Creates one GPU instance at exactly that placement, then one compute
        instance inside it that uses all of its compute slices (the GPU
        instance's default compute-instance profile, as ``nvidia-smi mig
        -cgi PROFILE -C`` does). NVML: ``nvmlDeviceGetGpuInstanceProfileInfo``,
        ``nvmlDeviceCreateGpuInstanceWithPlacement``,
        ``nvmlGpuInstanceGetComputeInstanceProfileInfo``,
        ``nvmlGpuInstanceCreateComputeInstance``; if the compute instance
        cannot be created the GPU instance is destroyed again.

        What may be created where follows the NVIDIA MIG User Guide ("Supported
        MIG Profiles" tables and ``nvidia-smi mig -lgipp`` placements), see
        :func:`gpubroker.devices.mig.can_place`; pick ``placement`` with
        :func:`gpubroker.devices.mig.best_placement`.

        Args:
            parent_uuid: a GPU of this backend with MIG mode on.
            profile: GPU-instance profile name, e.g. ``1g.10gb`` (a ``MIG``
                prefix is optional).
            placement: start memory slot and size in memory slices; the size
                must be the profile's.

        Returns:
            The new :class:`MigDevice` (memory in MiB).

        Raises:
            KeyError: ``parent_uuid`` is not a GPU of this backend.
            MigPlacementError: MIG mode is off, the GPU or profile is not a MIG
                one, or NVIDIA's rules forbid the placement; the message names
                the GPU, profile, placement and the rule.
            DeviceBackendError: the backend cannot create it (this default:
                "does not support MIG management"; NVML: no permission, ...).
        """
        self._require_device(parent_uuid)
        raise DeviceBackendError(
            f"{type(self).__name__} does not support MIG management "
            f"(cannot create {profile} at {placement} on {parent_uuid})"
        )

    def destroy_mig_device(self, parent_uuid: str, mig_uuid: str) -> None:
        """Destroy the MIG device ``mig_uuid`` of the GPU ``parent_uuid``.

        Destroys the compute instance, then its GPU instance (NVML:
        ``nvmlComputeInstanceDestroy`` then ``nvmlGpuInstanceDestroy``).
        Refused while a process runs on it (NVML answers
        ``NVML_ERROR_IN_USE``).

        Raises:
            KeyError: ``parent_uuid`` is not a GPU of this backend, or
                ``mig_uuid`` is not one of its MIG devices.
            DeviceInUseError: a process is running on the MIG device (the
                message says "in use").
            DeviceBackendError: it cannot be destroyed for another reason
                (this default: "does not support MIG management").
        """
        self._require_device(parent_uuid)
        raise DeviceBackendError(
            f"{type(self).__name__} does not support MIG management "
            f"(cannot destroy {mig_uuid} on {parent_uuid})"
        )

    def set_mig_mode(self, uuid: str, enabled: bool) -> None:
        """Turn MIG mode of the GPU ``uuid`` on (``True``) or off (``False``).

        NVML: ``nvmlDeviceSetMigMode`` (needs root; on some GPUs and
        platforms the new mode is pending until the GPU is reset). Setting
        the mode the GPU already has does nothing.

        Raises:
            KeyError: ``uuid`` is not a GPU of this backend.
            DeviceInUseError: a MIG device exists on the GPU, or a process runs
                on it (the message says "in use").
            DeviceBackendError: the GPU does not support MIG, or the backend
                cannot change the mode (this default: "does not support MIG
                management").
        """
        self._require_device(uuid)
        raise DeviceBackendError(
            f"{type(self).__name__} does not support MIG management "
            f"(cannot turn MIG mode {'on' if enabled else 'off'} on {uuid})"
        )

    def _require_device(self, uuid: str) -> None:
        """Raise KeyError unless ``uuid`` is one of :meth:`devices`."""
        if not any(device.uuid == uuid for device in self.devices()):
            raise KeyError(uuid)

    def close(self) -> None:
        """Release what the backend holds (e.g. ``nvmlShutdown``)."""


class DeviceBackendError(RuntimeError):
    """A backend could not be initialised, queried or changed."""


class MigPlacementError(DeviceBackendError):
    """A MIG device cannot be created: MIG mode is off, the GPU or profile is
    not a MIG one, or the placement breaks NVIDIA's rules
    (:func:`gpubroker.devices.mig.placement_problem` says which)."""


class DeviceInUseError(DeviceBackendError):
    """A MIG device or MIG mode cannot be changed because something uses it:
    a process runs on it, or (for a mode change) MIG devices exist
    (NVML's ``NVML_ERROR_IN_USE``)."""
