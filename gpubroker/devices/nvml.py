"""The real device backend: NVIDIA GPUs read through NVML (``pynvml``).

Calls and units follow the NVML API reference (docs.nvidia.com/deploy/nvml-api)
as wrapped by ``nvidia-ml-py``: memory arrives in bytes and is reported here
in MiB (``// 2**20``), utilization in percent.

Inventory, usage and topology are read-only queries (``nvmlDeviceGet*``).
The backend changes the GPUs in exactly four ways, and only when the broker
asks: it creates and destroys MIG devices (GPU instance + compute instance:
``nvmlDeviceCreateGpuInstanceWithPlacement``,
``nvmlGpuInstanceCreateComputeInstance``, ``nvmlComputeInstanceDestroy``,
``nvmlGpuInstanceDestroy``) and turns MIG mode on or off
(``nvmlDeviceSetMigMode``). Those calls need root (or the
``/dev/nvidia-caps`` ``mig/config`` capability); NVML refuses them otherwise
and the backend reports that as :class:`DeviceBackendError`. NVIDIA's own
placement rules are in :mod:`gpubroker.devices.mig`; the driver has the last
word.
"""

from __future__ import annotations

import ctypes
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

import pynvml  # type: ignore[import-untyped]
from traitlets import Unicode, default

from . import mig
from .base import (
    DeviceBackend,
    DeviceBackendError,
    DeviceInfo,
    DeviceInUseError,
    DeviceUsage,
    MigDevice,
    MigPlacementError,
    ProcessInfo,
)
from .mig import Placement
from .topology import LinkLevel, Topology

_MIB = 2**20

#: ``nvmlDeviceGetTopologyCommonAncestor`` result (``nvmlGpuTopologyLevel_t``) -> LinkLevel.
#: ``NVML_TOPOLOGY_INTERNAL`` (two GPUs on one board, e.g. Tesla K80) counts as one
#: PCIe switch: such boards join their GPUs through an on-board PCIe switch.
_ANCESTOR_LEVELS: dict[int, LinkLevel] = {
    pynvml.NVML_TOPOLOGY_INTERNAL: LinkLevel.PCIE_SWITCH,
    pynvml.NVML_TOPOLOGY_SINGLE: LinkLevel.PCIE_SWITCH,
    pynvml.NVML_TOPOLOGY_MULTIPLE: LinkLevel.PCIE_MULTI,
    pynvml.NVML_TOPOLOGY_HOSTBRIDGE: LinkLevel.HOSTBRIDGE,
    pynvml.NVML_TOPOLOGY_NODE: LinkLevel.NUMA_NODE,
    pynvml.NVML_TOPOLOGY_SYSTEM: LinkLevel.SYSTEM,
}

#: NVML errors meaning "this query does not apply here" (no NVLink, link index
#: past the device's last link, function missing from an old driver)
_NOT_APPLICABLE = (
    pynvml.NVMLError_NotSupported,
    pynvml.NVMLError_InvalidArgument,
    pynvml.NVMLError_FunctionNotFound,
)


#: compute slices of a GPU instance -> the compute-instance profile that uses all of
#: them (``nvmlComputeInstanceProfileInfo_t.sliceCount``); tried first, before a scan
#: of every ``NVML_COMPUTE_INSTANCE_PROFILE_*``
_CI_PROFILE_BY_SLICES: dict[int, int] = {
    1: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE,
    2: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE,
    3: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE,
    4: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE,
    6: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_6_SLICE,
    7: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE,
    8: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_8_SLICE,
}


def _error_text(err: Exception) -> str:
    """``NVML_ERROR_IN_USE (In use)``-style text of an NVML error, for messages.

    pynvml's own text is "NVML Error with code N" for codes it has no words for
    (e.g. ``NVML_ERROR_INSUFFICIENT_RESOURCES``), so the constant's name is added.
    """
    value = getattr(err, "value", None)
    for name in dir(pynvml):
        if name.startswith("NVML_ERROR_") and getattr(pynvml, name) == value:
            return f"{name} ({err})"
    return str(err)


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
        #: the last GPM sample of each MIG device: (sample, monotonic time, figure)
        self._gpm_samples: dict[str, tuple[Any, float, float | None]] = {}
        with _nvml_errors("initialise (is the NVIDIA driver installed?)"):
            pynvml.nvmlInit()
        self._initialised = True
        self.log.info("NVML initialised on node %s", self.node_name)

    def devices(self) -> list[DeviceInfo]:
        """Return this node's GPUs ordered by NVML index.

        A GPU NVML cannot read (``NVML_ERROR_GPU_IS_LOST``: fallen off the
        bus; ``NVML_ERROR_NO_PERMISSION``: hidden by a cgroup) is left out,
        with an error in the log, so that the others stay in service; the
        broker marks it absent (leases on it keep it, nothing new is
        granted on it).

        Raises:
            DeviceBackendError: the count cannot be read, or no GPU of a
                count above 0 can (NVML itself fails: the inventory is
                unknown, not empty).
        """
        with _nvml_errors("list devices"):
            count = pynvml.nvmlDeviceGetCount()
        found, errors = [], []
        for index in range(count):
            try:
                found.append(self._device(index))
            except pynvml.NVMLError as err:
                errors.append(err)
                self.log.error("NVML: GPU %s cannot be read (%s): left out", index, err)
        if count and not found:
            raise DeviceBackendError(f"NVML: cannot read any of {count} GPUs: {errors[0]}")
        return found

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

        ``uuid`` may be a GPU (``GPU-...``) or a MIG device (``MIG-...``):
        ``nvmlDeviceGetHandleByUUID`` accepts both. For a MIG device memory
        and processes are the instance's own, and utilization is ``None``
        (``nvmlDeviceGetUtilizationRates`` is not supported on MIG devices);
        its ``engine_activity`` is the GPU Performance Monitoring metric
        ``NVML_GPM_METRIC_GRAPHICS_UTIL`` of its GPU instance between this
        call and the previous one for the same device (``None`` at the first
        call, and where GPM is not supported: before Hopper).

        Raises:
            KeyError: no device with this UUID on this node.
            DeviceBackendError: an NVML query failed.
        """
        handle = self._handle(uuid)
        with _nvml_errors(f"query {uuid}"):
            return DeviceUsage(
                uuid=uuid,
                utilization_gpu=_utilization(handle),
                memory_used_mib=_memory_used_mib(handle),
                processes=_processes(handle),
                engine_activity=self._engine_activity(uuid, handle),
            )

    def _engine_activity(self, uuid: str, handle: Any) -> float | None:
        """GPM graphics-engine activity (0..1) of MIG device ``uuid`` since
        the previous sample of it; ``None`` for a GPU, at the first sample,
        or where GPM is not supported. A read within :data:`GPM_MIN_WINDOW`
        seconds of the last sample (another caller's) gets the last figure,
        so callers do not shorten each other's window. Thread-safe: the
        samples are taken and freed under :data:`_GPM_LOCK`."""
        if not uuid.startswith("MIG-"):
            return None
        # usage() runs on the event loop (culler, share guard) and in worker
        # threads (usage ledger, panel) at once: two readers of one MIG device
        # must not both free its previous sample (nvmlGpmSampleFree twice is a
        # double free in the C library) nor lose each other's new one
        with _GPM_LOCK:
            return self._engine_activity_locked(uuid, handle)

    def _engine_activity_locked(self, uuid: str, handle: Any) -> float | None:
        """:meth:`_engine_activity` with :data:`_GPM_LOCK` held."""
        now = time.monotonic()
        previous = self._gpm_samples.get(uuid)
        if previous is not None and now - previous[1] < GPM_MIN_WINDOW:
            return previous[2]
        try:
            parent = pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle)
            gi_id = int(pynvml.nvmlDeviceGetGpuInstanceId(handle))
        except pynvml.NVMLError:
            return None
        try:
            sample = pynvml.nvmlGpmSampleAlloc()
        except pynvml.NVMLError:
            return None
        try:
            pynvml.nvmlGpmMigSampleGet(parent, gi_id, sample)
        except pynvml.NVMLError:
            _free(sample)  # no GPM here (before Hopper): nothing kept
            return None
        value = None if previous is None else _gpm_utilization(previous[0], sample)
        if previous is not None:
            _free(previous[0])
        self._gpm_samples[uuid] = (sample, now, value)
        self._forget_gpm(now)
        return value

    def _forget_gpm(self, now: float) -> None:
        """Free the samples of MIG devices not read for an hour (gone ones)."""
        for uuid, (sample, taken, _value) in list(self._gpm_samples.items()):
            if now - taken > 3600:
                _free(sample)
                del self._gpm_samples[uuid]

    def topology(self) -> Topology:
        """Return the interconnect of this node's GPUs, read from NVML (read-only).

        For each pair ``i < j`` (NVML indices):

        * :attr:`LinkLevel.NVLINK` if an active NVLink of one ends at the
          other (``nvmlDeviceGetNvLinkState`` == ``NVML_FEATURE_ENABLED`` and
          ``nvmlDeviceGetNvLinkRemotePciInfo(...).busId`` is the other's bus
          id), or if both have active NVLinks to NVSwitches
          (``nvmlDeviceGetNvLinkRemoteDeviceType`` ==
          ``NVML_NVLINK_DEVICE_TYPE_SWITCH``; HGX/DGX A100/H100, where the
          remote end of every link is a switch, not a GPU). Without that call
          (old driver) switch links are not recognised and the pair falls
          back to its PCIe level. NVLink partitions that isolate GPUs behind
          one switch fabric are not detected.
        * else ``nvmlDeviceGetTopologyCommonAncestor`` mapped to a
          :class:`LinkLevel` (``INTERNAL``/``SINGLE`` -> ``PCIE_SWITCH``,
          ``MULTIPLE`` -> ``PCIE_MULTI``, ``HOSTBRIDGE``, ``NODE`` ->
          ``NUMA_NODE``, ``SYSTEM``); ``SYSTEM`` where NVML does not support
          the query or returns an unknown level.

        Returns:
            The square, symmetric matrix indexed like :meth:`devices`.

        Raises:
            DeviceBackendError: an NVML query failed for another reason.
        """
        with _nvml_errors("read the GPU topology"):
            count = pynvml.nvmlDeviceGetCount()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            buses = [_pci_key(pynvml.nvmlDeviceGetPciInfo(h).busId) for h in handles]
            links = [_nvlinks(h) for h in handles]
            return _matrix(handles, buses, links)

    # --- MIG management ---------------------------------------------------------

    def mig_devices(self, parent_uuid: str) -> list[MigDevice]:
        """Return the MIG devices of the GPU ``parent_uuid``, by GPU-instance ID.

        NVML: ``nvmlDeviceGetMaxMigDeviceCount``, then for each index
        ``nvmlDeviceGetMigDeviceHandleByIndex`` (indices without a MIG device
        are skipped), ``nvmlDeviceGetUUID``, ``nvmlDeviceGetGpuInstanceId``,
        ``nvmlDeviceGetComputeInstanceId``, ``nvmlDeviceGetMemoryInfo``
        (MiB) and the GPU instance's ``nvmlGpuInstanceGetInfo`` (placement,
        profile ID). The profile ID is mapped to a catalog name through
        ``nvmlDeviceGetGpuInstanceProfileInfo`` of each catalog profile of the
        model (:func:`gpubroker.devices.mig.spec_for`), else to the name the
        driver gives (``nvmlGpuInstanceProfileInfo_v2_t.name`` without
        its ``MIG`` prefix).

        Returns:
            ``[]`` when MIG mode is off or not supported.

        Raises:
            KeyError: ``parent_uuid`` is not a GPU (``GPU-...``) on this node.
            DeviceBackendError: an NVML query failed; NVML documents
                ``nvmlDeviceGetGpuInstanceById`` as "requires privileged user"
                (root or the ``mig/monitor`` capability), so a non-root broker
                may get ``NVML_ERROR_NO_PERMISSION`` here once MIG devices exist.
        """
        handle = self._parent_handle(parent_uuid)
        try:
            with _nvml_errors(f"list the MIG devices of {parent_uuid}"):
                if not _mig_enabled(handle):
                    return []
                names = _ProfileNames(handle)
                found = [
                    _mig_device(parent_uuid, handle, mig_handle, names)
                    for mig_handle in _mig_handles(handle)
                ]
        except DeviceBackendError as err:
            if isinstance(err.__cause__, pynvml.NVMLError_NoPermission):
                raise DeviceBackendError(
                    f"{err} (reading GPU instances, nvmlDeviceGetGpuInstanceById, needs root"
                    " or the mig/monitor capability)"
                ) from err.__cause__
            raise
        return sorted(found, key=lambda d: (d.gi_id, d.ci_id))

    def create_mig_device(self, parent_uuid: str, profile: str, placement: Placement) -> MigDevice:
        """Create a GPU instance of ``profile`` at ``placement`` plus one compute
        instance using all its compute slices, on ``parent_uuid``.

        NVML: ``nvmlDeviceGetGpuInstanceProfileInfo`` (profile constant from
        the catalog, :attr:`MigProfile.nvml_profile`, else found by the
        driver's profile name), ``nvmlDeviceCreateGpuInstanceWithPlacement``,
        then ``nvmlGpuInstanceGetComputeInstanceProfileInfo`` for the
        compute-instance profile whose ``sliceCount`` equals the GPU
        instance's and ``nvmlGpuInstanceCreateComputeInstance``. If the
        compute instance cannot be created the GPU instance is destroyed
        (``nvmlGpuInstanceDestroy``). Needs root or the ``mig/config``
        capability. The driver decides; when it refuses, the message adds the
        rule :func:`gpubroker.devices.mig.placement_problem` names, if any.

        Returns:
            The new :class:`MigDevice` as :meth:`mig_devices` reports it.

        Raises:
            KeyError: ``parent_uuid`` is not a GPU on this node.
            MigPlacementError: MIG mode is off, the profile is unknown for this
                GPU, or NVML refused the placement
                (``NVML_ERROR_INSUFFICIENT_RESOURCES``, ``..._INVALID_ARGUMENT``,
                ``..._NOT_SUPPORTED``).
            DeviceBackendError: any other NVML failure (e.g.
                ``NVML_ERROR_NO_PERMISSION``: not root).
        """
        handle = self._parent_handle(parent_uuid)
        with _nvml_errors(f"read {parent_uuid}"):
            name = _text(pynvml.nvmlDeviceGetName(handle))
            enabled = _mig_enabled(handle)
        prefix = f"cannot create MIG {profile} at {placement} on {parent_uuid} ({name})"
        if not enabled:
            raise MigPlacementError(f"{prefix}: MIG mode is off")
        spec = mig.spec_for(name)
        with _nvml_errors(f"read the MIG profiles of {parent_uuid}"):
            names = _ProfileNames(handle)
            resolved = names.constant(profile)
        if resolved is None:
            known = ", ".join(names.all_names()) or "none"
            raise MigPlacementError(f"{prefix}: no such MIG profile on this GPU (known: {known})")
        constant, profile_name = resolved
        with _nvml_errors(f"read MIG profile {profile_name} of {parent_uuid}"):
            info = _gi_profile_info(handle, constant)
        c_placement = pynvml.c_nvmlGpuInstancePlacement_t()
        c_placement.start = placement.start
        c_placement.size = placement.size
        try:
            gpu_instance = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(
                handle, info.id, _PlacementPointer(c_placement)
            )
        except pynvml.NVMLError as err:
            raise self._create_error(
                prefix, err, parent_uuid, spec, profile_name, placement
            ) from err
        compute_instance = None
        try:
            compute_instance = _create_full_compute_instance(gpu_instance, int(info.sliceCount))
            gi_id = int(pynvml.nvmlGpuInstanceGetInfo(gpu_instance).id)
            ci_id = int(pynvml.nvmlComputeInstanceGetInfo(compute_instance).id)
        except (pynvml.NVMLError, DeviceBackendError) as err:
            try:
                # nvmlGpuInstanceDestroy refuses (NVML_ERROR_IN_USE) while the GPU
                # instance still has a compute instance: destroy that one first
                if compute_instance is not None:
                    pynvml.nvmlComputeInstanceDestroy(compute_instance)
                pynvml.nvmlGpuInstanceDestroy(gpu_instance)
            except pynvml.NVMLError as undo:
                self.log.error(
                    "NVML: GPU instance of %s at %s on %s left behind: destroy failed: %s",
                    profile_name,
                    placement,
                    parent_uuid,
                    undo,
                )
            raise DeviceBackendError(f"{prefix}: compute instance: {_error_text(err)}") from err
        self.log.info(
            "MIG device %s at %s created on %s (GPU instance %d, compute instance %d)",
            profile_name,
            placement,
            parent_uuid,
            gi_id,
            ci_id,
        )
        for device in self.mig_devices(parent_uuid):
            if (device.gi_id, device.ci_id) == (gi_id, ci_id):
                return device
        raise DeviceBackendError(
            f"NVML: created GPU instance {gi_id} / compute instance {ci_id} on {parent_uuid}"
            " but no MIG device handle shows it"
        )

    def _create_error(
        self,
        prefix: str,
        err: Exception,
        parent_uuid: str,
        spec: mig.GpuMigSpec | None,
        profile: str,
        placement: Placement,
    ) -> DeviceBackendError:
        """Turn a failed ``nvmlDeviceCreateGpuInstanceWithPlacement`` into an error."""
        if isinstance(err, pynvml.NVMLError_NoPermission):
            return DeviceBackendError(
                f"{prefix}: NVML: {_error_text(err)} (creating MIG instances needs root or the"
                " mig/config capability)"
            )
        refused = (
            pynvml.NVMLError_InsufficientResources,
            pynvml.NVMLError_InvalidArgument,
            pynvml.NVMLError_NotSupported,
        )
        if not isinstance(err, refused):
            return DeviceBackendError(f"{prefix}: NVML: {_error_text(err)}")
        why = ""
        if spec is not None and profile in spec.profiles:
            try:
                layout = [(d.profile, d.placement) for d in self.mig_devices(parent_uuid)]
                problem = mig.placement_problem(spec, layout, profile, placement)
            except (KeyError, DeviceBackendError):
                problem = None  # a profile outside the catalog: no explanation
            if problem is not None:
                why = f"; {problem}"
        return MigPlacementError(f"{prefix}: NVML: {_error_text(err)}{why}")

    def destroy_mig_device(self, parent_uuid: str, mig_uuid: str) -> None:
        """Destroy the MIG device ``mig_uuid``: its compute instance, then its GPU instance.

        NVML: ``nvmlDeviceGetGpuInstanceById``,
        ``nvmlGpuInstanceGetComputeInstanceById``,
        ``nvmlComputeInstanceDestroy``, ``nvmlGpuInstanceDestroy`` (needs
        root or ``mig/config``). The driver refuses with
        ``NVML_ERROR_IN_USE`` while a process runs on it. Where other compute
        instances (made outside the broker) share the GPU instance, only the
        compute instance is destroyed.

        Raises:
            KeyError: ``parent_uuid`` is not a GPU on this node, or
                ``mig_uuid`` is not one of its MIG devices.
            DeviceInUseError: NVML said ``NVML_ERROR_IN_USE`` ("in use").
            DeviceBackendError: any other NVML failure.
        """
        handle = self._parent_handle(parent_uuid)
        devices = self.mig_devices(parent_uuid)
        target = next((d for d in devices if d.uuid == mig_uuid), None)
        if target is None:
            raise KeyError(mig_uuid)
        prefix = f"cannot destroy MIG {target.profile} {mig_uuid} on {parent_uuid}"
        shared = any(d.gi_id == target.gi_id and d.uuid != mig_uuid for d in devices)
        try:
            gpu_instance = pynvml.nvmlDeviceGetGpuInstanceById(handle, target.gi_id)
            compute_instance = pynvml.nvmlGpuInstanceGetComputeInstanceById(
                gpu_instance, target.ci_id
            )
            pynvml.nvmlComputeInstanceDestroy(compute_instance)
            if not shared:
                pynvml.nvmlGpuInstanceDestroy(gpu_instance)
        except pynvml.NVMLError_InUse as err:
            raise DeviceInUseError(f"{prefix}: in use (NVML: {_error_text(err)})") from err
        except pynvml.NVMLError_NoPermission as err:
            raise DeviceBackendError(
                f"{prefix}: NVML: {_error_text(err)} (destroying MIG instances needs root or the"
                " mig/config capability)"
            ) from err
        except pynvml.NVMLError as err:
            raise DeviceBackendError(f"{prefix}: NVML: {_error_text(err)}") from err
        self.log.info("MIG device %s destroyed on %s", mig_uuid, parent_uuid)

    def set_mig_mode(self, uuid: str, enabled: bool) -> None:
        """Turn MIG mode of ``uuid`` on or off (``nvmlDeviceSetMigMode``).

        Needs root. Does nothing when the current and pending modes
        (``nvmlDeviceGetMigMode``) already equal the wanted one. Refused
        before calling NVML while MIG devices exist or compute processes run
        (``nvmlDeviceGetComputeRunningProcesses``). On some GPUs and
        platforms (e.g. A100 and pass-through VMs) the new mode stays
        *pending* until the GPU is reset (``nvidia-smi -r``) or the VM
        reboots; that is reported as an error saying "pending", and
        :attr:`DeviceInfo.mig_enabled` keeps showing the current mode.

        Raises:
            KeyError: ``uuid`` is not a GPU on this node.
            DeviceInUseError: MIG devices or processes on the GPU, or NVML said
                ``NVML_ERROR_IN_USE`` ("in use").
            DeviceBackendError: MIG not supported, no permission, the change is
                pending a GPU reset, or another NVML failure.
        """
        handle = self._parent_handle(uuid)
        mode = "on" if enabled else "off"
        wanted = pynvml.NVML_DEVICE_MIG_ENABLE if enabled else pynvml.NVML_DEVICE_MIG_DISABLE
        prefix = f"cannot turn MIG mode {mode} on {uuid}"
        try:
            current, pending = pynvml.nvmlDeviceGetMigMode(handle)
        except pynvml.NVMLError_NotSupported as err:
            raise DeviceBackendError(f"{prefix}: the GPU does not support MIG ({err})") from err
        except pynvml.NVMLError as err:
            raise DeviceBackendError(f"{prefix}: NVML: {_error_text(err)}") from err
        if current == wanted and pending == wanted:
            return
        devices = self.mig_devices(uuid)
        if devices:
            names = ", ".join(f"{d.profile} at {d.placement} ({d.uuid})" for d in devices)
            raise DeviceInUseError(f"{prefix}: in use by {len(devices)} MIG device(s): {names}")
        with _nvml_errors(f"list the processes of {uuid}"):
            try:
                pids = [p.pid for p in _processes(handle)]
            except pynvml.NVMLError_NotSupported:
                pids = []
        if pids:
            raise DeviceInUseError(f"{prefix}: in use by process(es) {', '.join(map(str, pids))}")
        try:
            status = pynvml.nvmlDeviceSetMigMode(handle, wanted)
        except pynvml.NVMLError_InUse as err:
            raise DeviceInUseError(f"{prefix}: in use (NVML: {_error_text(err)})") from err
        except pynvml.NVMLError_NoPermission as err:
            raise DeviceBackendError(f"{prefix}: NVML: {_error_text(err)} (needs root)") from err
        except pynvml.NVMLError as err:
            raise DeviceBackendError(f"{prefix}: NVML: {_error_text(err)}") from err
        with _nvml_errors(f"read the MIG mode of {uuid}"):
            current, pending = pynvml.nvmlDeviceGetMigMode(handle)
        if status != pynvml.NVML_SUCCESS or current != wanted:
            activation = (
                _error_text(pynvml.NVMLError(status)) if status != pynvml.NVML_SUCCESS else "ok"
            )
            raise DeviceBackendError(
                f"MIG mode {mode} on {uuid} is pending (activation: {activation}); reset the"
                " GPU (nvidia-smi -r) or reboot to apply it"
            )
        self.log.info("MIG mode %s on %s", mode, uuid)

    def _parent_handle(self, uuid: str) -> Any:
        """The handle of GPU ``uuid``; KeyError for an unknown or a MIG UUID."""
        if not uuid.startswith("GPU-"):
            raise KeyError(uuid)
        return self._handle(uuid)

    def _handle(self, uuid: str) -> Any:
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(uuid)
        except (pynvml.NVMLError_NotFound, pynvml.NVMLError_InvalidArgument):
            raise KeyError(uuid) from None
        except pynvml.NVMLError as err:
            raise DeviceBackendError(f"NVML: cannot find {uuid}: {err}") from err

    def close(self) -> None:
        """Free the GPM samples and shut NVML down (``nvmlShutdown``); only
        the first call does anything."""
        if not self._initialised:
            return
        with _GPM_LOCK:
            for sample, _taken, _value in self._gpm_samples.values():
                _free(sample)
            self._gpm_samples.clear()
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


#: seconds within which a second read of a MIG device's GPM activity reuses
#: the last figure instead of taking a new sample
GPM_MIN_WINDOW = 1.0

#: guards every backend's GPM samples (``_gpm_samples``): taken, compared and
#: freed by one reader at a time
_GPM_LOCK = threading.Lock()


def _free(sample: Any) -> None:
    with suppress(pynvml.NVMLError):
        pynvml.nvmlGpmSampleFree(sample)


def _gpm_utilization(first: Any, second: Any) -> float | None:
    """``NVML_GPM_METRIC_GRAPHICS_UTIL`` between two GPM samples, 0..1.

    NVML reports the metric in percent (0.0-100.0). ``nvmlGpmMetricsGet`` can
    succeed as a whole while one metric fails: per ``nvmlGpmMetric_t``, its
    ``value`` is valid only when its own ``nvmlReturn`` is ``NVML_SUCCESS``;
    otherwise (and on any NVML error) the figure is unknown: ``None``.
    """
    try:
        query = pynvml.c_nvmlGpmMetricsGet_t()
        query.version = pynvml.NVML_GPM_METRICS_GET_VERSION
        query.numMetrics = 1
        query.sample1, query.sample2 = first, second
        query.metrics[0].metricId = pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL
        pynvml.nvmlGpmMetricsGet(query)
        metric = query.metrics[0]
        if metric.nvmlReturn != pynvml.NVML_SUCCESS:
            return None
        value = float(metric.value) / 100.0
    except pynvml.NVMLError:
        return None
    return min(max(value, 0.0), 1.0)


def _utilization(handle: Any) -> int | None:
    """GPU utilization in percent; ``None`` where NVML does not report it (MIG on)."""
    try:
        return int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except pynvml.NVMLError_NotSupported:
        return None


def _processes(handle: Any) -> tuple[ProcessInfo, ...]:
    """Compute processes, CUDA MPS clients included; memory in MiB, ``None``
    where NVML does not know it (``usedGpuMemory`` is ``None``: pynvml's
    form of ``NVML_VALUE_NOT_AVAILABLE``).

    Under MPS, ``nvmlDeviceGetComputeRunningProcesses`` lists the MPS
    server, and the clients (the users' processes) come from
    ``nvmlDeviceGetMPSComputeRunningProcesses`` (NVML API reference,
    Device Queries); without MPS, or where the driver lacks that call, the
    second list is empty. A PID in both is listed once, from the first.
    """
    found = _process_list(handle, mps=False)
    with suppress(pynvml.NVMLError):  # no MPS clients (not supported, old driver)
        found += _process_list(handle, mps=True)
    seen: dict[int, ProcessInfo] = {}
    for p in found:
        pid = int(p.pid)
        used = None if p.usedGpuMemory is None else int(p.usedGpuMemory) // _MIB
        seen.setdefault(pid, ProcessInfo(pid=pid, used_memory_mib=used))
    return tuple(seen.values())


def _memory_used_mib(handle: Any) -> int:
    """Device memory allocated on ``handle``, MiB, without what the driver
    and firmware reserve for themselves: ``nvmlDeviceGetMemoryInfo_v2``'s
    ``used`` (``nvmlMemory_v2_t``: total = reserved + free + used), as
    ``nvidia-smi`` shows it; v1's ``used`` counts the reserved memory too
    (about 0.5 GiB on an idle H100/H200). Where the driver or the device
    (a MIG device) lacks v2, or pynvml takes no ``version``, v1's figure.

    Raises:
        pynvml.NVMLError: v1 failed too.
    """
    try:
        info = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
    except (pynvml.NVMLError, TypeError, AttributeError):
        info = pynvml.nvmlDeviceGetMemoryInfo(handle)
    return int(info.used) // _MIB


def _process_list(handle: Any, mps: bool) -> list[Any]:
    """``nvmlDevice[MPS]ComputeRunningProcesses``, on drivers without ``_v3`` too.

    pynvml's unversioned call uses the ``_v3`` C function; where the driver
    is older and lacks it, pynvml raises ``NVMLLibraryMismatchError``, which
    is *not* an ``NVMLError``, and asks for a versioned call: the ``_v2``
    one (same fields the backend reads: ``pid``, ``usedGpuMemory``) is
    used then.

    Raises:
        pynvml.NVMLError: the query failed (``_v2`` included).
    """
    name = "nvmlDevice" + ("GetMPSComputeRunningProcesses" if mps else "GetComputeRunningProcesses")
    try:
        return list(getattr(pynvml, name)(handle))
    except pynvml.NVMLLibraryMismatchError:
        return list(getattr(pynvml, f"{name}_v2")(handle))


class _PlacementPointer(ctypes._Pointer):  # type: ignore[type-arg]
    """A pointer to a ``nvmlGpuInstancePlacement_t``.

    ``nvmlDeviceCreateGpuInstanceWithPlacement`` takes ``const
    nvmlGpuInstancePlacement_t *placement`` (NVML API reference, Multi
    Instance GPU Management), and pynvml hands its ``placement`` argument to
    ctypes unchanged with no declared argument types: a structure given there
    would be passed *by value* and read by the driver as an address (a
    segmentation fault of the broker). A pointer is passed as an address;
    ``start``/``size`` read through it, so it still looks like the placement.
    """

    _type_ = pynvml.c_nvmlGpuInstancePlacement_t

    def __getattr__(self, name: str) -> Any:
        return getattr(self.contents, name)


# --- MIG helpers ---------------------------------------------------------------------


def _gi_profile_info(handle: Any, constant: int) -> Any:
    """``nvmlDeviceGetGpuInstanceProfileInfo``: v2 (with the profile name), else v1."""
    try:
        return pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, constant)
    except pynvml.NVMLError_FunctionNotFound:
        return pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, constant, version=1)


def _ci_profile_info(gpu_instance: Any, constant: int) -> Any:
    """``nvmlGpuInstanceGetComputeInstanceProfileInfo`` (v2, else v1), shared engines."""
    engines = pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
    try:
        return pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gpu_instance, constant, engines)
    except pynvml.NVMLError_FunctionNotFound:
        return pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
            gpu_instance, constant, engines, version=1
        )


def _create_full_compute_instance(gpu_instance: Any, slices: int) -> Any:
    """Create the compute instance that uses all ``slices`` compute slices of the GPU instance.

    Tries :data:`_CI_PROFILE_BY_SLICES` first, then every
    ``NVML_COMPUTE_INSTANCE_PROFILE_*`` whose ``sliceCount`` is ``slices``.

    Raises:
        pynvml.NVMLError: creation failed.
        DeviceBackendError: no compute-instance profile has that many slices.
    """
    first = _CI_PROFILE_BY_SLICES.get(slices)
    count = getattr(pynvml, "NVML_COMPUTE_INSTANCE_PROFILE_COUNT", 9)
    candidates = [c for c in (first, *range(count)) if c is not None]
    for constant in dict.fromkeys(candidates):
        try:
            info = _ci_profile_info(gpu_instance, constant)
        except _NOT_APPLICABLE:
            continue
        if int(info.sliceCount) == slices:
            return pynvml.nvmlGpuInstanceCreateComputeInstance(gpu_instance, info.id)
    raise DeviceBackendError(f"no compute-instance profile with {slices} slice(s)")


class _ProfileNames:
    """GPU-instance profile IDs of one GPU and their names.

    Catalog names (:func:`gpubroker.devices.mig.spec_for`) come first: each
    catalog profile's NVML constant is asked for its ID. Profiles outside the
    catalog get the driver's name (``nvmlGpuInstanceProfileInfo_v2_t.name``
    without the ``MIG`` prefix), read on first need.
    """

    def __init__(self, handle: Any) -> None:
        self._handle = handle
        self._spec = mig.spec_for(_text(pynvml.nvmlDeviceGetName(handle)))
        #: profile ID -> (NVML constant, name)
        self._by_id: dict[int, tuple[int, str]] = {}
        self._scanned = False
        if self._spec is not None:
            for profile in self._spec.profiles.values():
                try:
                    info = _gi_profile_info(handle, profile.nvml_profile_value)
                except _NOT_APPLICABLE:
                    continue
                self._by_id[int(info.id)] = (profile.nvml_profile_value, profile.name)

    def _scan(self) -> None:
        if self._scanned:
            return
        self._scanned = True
        count = getattr(pynvml, "NVML_GPU_INSTANCE_PROFILE_COUNT", 10)
        for constant in range(count):
            try:
                info = _gi_profile_info(self._handle, constant)
            except _NOT_APPLICABLE:
                continue
            name = _text(getattr(info, "name", b"")).removeprefix("MIG ").strip()
            self._by_id.setdefault(int(info.id), (constant, name or f"profile-{int(info.id)}"))

    def name(self, profile_id: int) -> str:
        """Name of the GPU-instance profile ``profile_id`` (e.g. ``1g.10gb``)."""
        if profile_id not in self._by_id:
            self._scan()
        return self._by_id.get(profile_id, (-1, f"profile-{profile_id}"))[1]

    def constant(self, profile: str) -> tuple[int, str] | None:
        """``(NVML constant, name)`` of the profile called ``profile``, or ``None``."""
        key = profile.removeprefix("MIG ").strip()
        if self._spec is not None and key in self._spec.profiles:
            wanted = self._spec.profiles[key]
            return wanted.nvml_profile_value, wanted.name
        self._scan()
        for constant, name in self._by_id.values():
            if name == key:
                return constant, name
        return None

    def all_names(self) -> list[str]:
        """Every profile name this GPU offers."""
        self._scan()
        return sorted({name for _constant, name in self._by_id.values()})


def _mig_handles(handle: Any) -> Iterator[Any]:
    """MIG device handles of ``handle`` (indices without one are skipped)."""
    for index in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
        try:
            yield pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)
        except (pynvml.NVMLError_NotFound, pynvml.NVMLError_InvalidArgument):
            continue


def _mig_device(parent_uuid: str, handle: Any, mig_handle: Any, names: _ProfileNames) -> MigDevice:
    """Read one MIG device (see :meth:`NVMLDeviceBackend.mig_devices`)."""
    gi_id = int(pynvml.nvmlDeviceGetGpuInstanceId(mig_handle))
    ci_id = int(pynvml.nvmlDeviceGetComputeInstanceId(mig_handle))
    info = pynvml.nvmlGpuInstanceGetInfo(pynvml.nvmlDeviceGetGpuInstanceById(handle, gi_id))
    return MigDevice(
        parent_uuid=parent_uuid,
        uuid=_text(pynvml.nvmlDeviceGetUUID(mig_handle)),
        profile=names.name(int(info.profileId)),
        placement=Placement(int(info.placement.start), int(info.placement.size)),
        gi_id=gi_id,
        ci_id=ci_id,
        memory_mib=int(pynvml.nvmlDeviceGetMemoryInfo(mig_handle).total) // _MIB,
    )


@dataclass(frozen=True)
class _NvLinks:
    """The active NVLinks of one GPU.

    Attributes:
        peers: normalised PCI bus ids at the remote ends that are not NVSwitches.
        switched: whether at least one active link ends at an NVSwitch.
    """

    peers: frozenset[str]
    switched: bool


def _pci_key(bus_id: str | bytes) -> str:
    """Normalise a PCI bus id to ``DDDDDDDD:BB:DD.F`` (upper-case hex).

    NVML writes the domain with 8 digits in ``busId`` and 4 in
    ``busIdLegacy``; parsing makes both forms compare equal. An id that
    does not parse is returned stripped and upper-cased.
    """
    text = _text(bus_id).strip().upper()
    try:
        domain, bus, rest = text.split(":")
        device, function = rest.split(".")
        return f"{int(domain, 16):08X}:{int(bus, 16):02X}:{int(device, 16):02X}.{int(function, 16)}"
    except ValueError:
        return text


def _nvlinks(handle: Any) -> _NvLinks:
    """Active NVLinks of ``handle``, links ``0 .. NVML_NVLINK_MAX_LINKS - 1``."""
    peers: set[str] = set()
    switched = False
    for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
        if not _link_active(handle, link):
            continue
        if _remote_is_switch(handle, link):
            switched = True
            continue
        remote = _remote_bus(handle, link)
        if remote is not None:
            peers.add(remote)
    return _NvLinks(frozenset(peers), switched)


def _link_active(handle: Any, link: int) -> bool:
    """``nvmlDeviceGetNvLinkState`` == enabled; ``False`` where there is no such link."""
    try:
        return bool(pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED)
    except _NOT_APPLICABLE:
        return False


def _remote_is_switch(handle: Any, link: int) -> bool:
    """Whether ``link`` ends at an NVSwitch (``nvmlDeviceGetNvLinkRemoteDeviceType``).

    ``False`` where the call is missing from pynvml or the driver, or not supported.
    """
    query = getattr(pynvml, "nvmlDeviceGetNvLinkRemoteDeviceType", None)
    switch = getattr(pynvml, "NVML_NVLINK_DEVICE_TYPE_SWITCH", None)
    if query is None or switch is None:
        return False
    try:
        return bool(query(handle, link) == switch)
    except _NOT_APPLICABLE:
        return False


def _remote_bus(handle: Any, link: int) -> str | None:
    """Normalised PCI bus id at the remote end of ``link``; ``None`` if unknown."""
    try:
        return _pci_key(pynvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId)
    except _NOT_APPLICABLE:
        return None


def _common_ancestor(first: Any, second: Any) -> LinkLevel:
    """PCIe level of two GPUs (``nvmlDeviceGetTopologyCommonAncestor``); SYSTEM if unknown."""
    try:
        value = pynvml.nvmlDeviceGetTopologyCommonAncestor(first, second)
    except _NOT_APPLICABLE:
        return LinkLevel.SYSTEM
    return _ANCESTOR_LEVELS.get(value, LinkLevel.SYSTEM)


def _matrix(handles: Sequence[Any], buses: Sequence[str], links: Sequence[_NvLinks]) -> Topology:
    """Build the symmetric topology matrix from per-GPU handles, bus ids and NVLinks."""
    n = len(handles)
    rows = [[LinkLevel.SELF] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            nvlinked = (
                buses[j] in links[i].peers
                or buses[i] in links[j].peers
                or (links[i].switched and links[j].switched)
            )
            level = LinkLevel.NVLINK if nvlinked else _common_ancestor(handles[i], handles[j])
            rows[i][j] = rows[j][i] = level
    return tuple(tuple(row) for row in rows)
