"""A SIMULATED device backend: made-up GPUs for demos, tests and development.

Nothing here touches a GPU. The inventory comes from configuration, the
usage from a JSON state file (or memory) that tests and the demo write.
MIG mode and MIG instances are simulated too, following NVIDIA's rules as
encoded in :mod:`gpubroker.devices.mig`, and kept in the same state.
"""

from __future__ import annotations

import functools
import json
import os
import re
import socket
import tempfile
import threading
import uuid as uuid_module
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

from traitlets import Dict, Enum, Int, List, Unicode, default

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
from .models import GPUModel, known_model_names, lookup_model
from .topology import LinkLevel, Topology, dgx_like, uniform

#: fixed namespace for the fake UUIDs, so a device keeps its UUID across restarts
FAKE_UUID_NAMESPACE = uuid_module.UUID("6b1f3c52-52b8-4c1e-9d0c-5a7e1f0b9a11")

#: PCI buses of the eight GPUs of a DGX H100 (``nvidia-smi`` Bus-Id column);
#: index 8 and up reuse them in the next PCI domain.
DGX_PCI_BUSES = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)

#: top-level key of the state that holds MIG mode and instances per GPU UUID
#: (cannot clash with a ``GPU-``/``MIG-`` UUID key)
MIG_STATE_KEY = "_mig"

_ENTRY = re.compile(r"^\s*(?:(?P<count>\d+)\s*[xX\u00d7]\s*)?(?P<model>\S.*?)\s*$")


def parse_inventory_entry(entry: str) -> tuple[int, GPUModel]:
    """Parse one inventory entry such as ``"8 x NVIDIA H100 80GB HBM3"``.

    Accepted forms: ``"N x MODEL"``, ``"NxMODEL"``, the same with the
    multiplication sign (U+00D7) instead of ``x``, or ``"MODEL"`` (one
    device). MODEL is an NVML name or an alias from
    :mod:`gpubroker.devices.models`, case-insensitive.

    Returns:
        ``(count, model)``, count >= 1.

    Raises:
        DeviceBackendError: the entry is malformed, the count is 0 or the
            model is unknown; the message names the entry and the known models.
    """
    match = _ENTRY.match(entry)
    if match is None:
        raise DeviceBackendError(f"bad fake GPU inventory entry {entry!r}: expected 'N x MODEL'")
    count = int(match["count"]) if match["count"] is not None else 1
    if count < 1:
        raise DeviceBackendError(f"bad fake GPU inventory entry {entry!r}: count must be >= 1")
    try:
        model = lookup_model(match["model"])
    except KeyError:
        known = ", ".join(known_model_names())
        raise DeviceBackendError(
            f"unknown GPU model {match['model']!r} in fake GPU inventory entry {entry!r};"
            f" known models: {known}"
        ) from None
    return count, model


def fake_uuid(node: str, index: int, model_name: str) -> str:
    """Return the NVML-style UUID ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`` of a fake device.

    Deterministic (``uuid5`` of node, index and model name in
    :data:`FAKE_UUID_NAMESPACE`), so the same configuration gives the same UUIDs.
    """
    return "GPU-" + str(uuid_module.uuid5(FAKE_UUID_NAMESPACE, f"{node}/{index}/{model_name}"))


def fake_pci_bus_id(index: int) -> str:
    """Return an NVML-style PCI bus id (``DDDDDDDD:BB:00.0``) for device ``index``.

    Indices 0-7 get the buses of a DGX H100; each further group of eight moves
    to the next PCI domain, so ids stay distinct.
    """
    domain, slot = divmod(index, len(DGX_PCI_BUSES))
    return f"{domain:08X}:{DGX_PCI_BUSES[slot]:02X}:00.0"


@dataclass(frozen=True)
class _Gpu:
    """One fake GPU: its inventory position, model, UUID and MIG geometry."""

    index: int
    model: GPUModel
    uuid: str
    spec: mig.GpuMigSpec | None

    def describe(self) -> str:
        """``device 0 (GPU-..., NVIDIA H100 80GB HBM3)``, for messages."""
        return f"device {self.index} ({self.uuid}, {self.model.name})"


class _MigRecord(NamedTuple):
    """The MIG state of one fake GPU: mode, the MIG devices on it, and how
    many were ever created on it (each creation gets a new UUID)."""

    enabled: bool
    instances: list[MigDevice]
    created: int = 0


@dataclass(frozen=True)
class _UsageTarget:
    """What the usage of one device reports (:meth:`FakeDeviceBackend._usage_target`).

    Attributes:
        memory_mib: its memory, MiB (the bound of what is used).
        mig_like: a MIG device or a GPU in MIG mode (no utilization reported).
        instances: a GPU in MIG mode: its MIG devices' UUIDs, whose usage
            its own aggregates.
        gpm: a MIG device on a GPU with GPM (Hopper and later), which
            reports an engine activity.
    """

    memory_mib: int
    mig_like: bool
    instances: tuple[str, ...] = ()
    gpm: bool = False


F = TypeVar("F", bound=Callable[..., Any])


def _locked(method: F) -> F:
    """Run a state-changing method under the backend's lock: the broker's
    actuator calls MIG methods from worker threads while the event loop
    reads the state."""

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return run  # type: ignore[return-value]


class FakeDeviceBackend(DeviceBackend):
    """SIMULATION: GPUs that do not exist. Never use it to schedule real work.

    The inventory is configured by :attr:`inventory` (e.g. ``["8 x H100"]``);
    names, memory totals and MIG capability come from the real catalog in
    :mod:`gpubroker.devices.models`, UUIDs and PCI bus ids are made up in
    NVML's formats. Usage (utilization percent, memory MiB, processes) is
    whatever was written with :meth:`set_usage` or into :attr:`state_file`;
    by default every device is idle (0 %, 0 MiB).

    MIG: devices listed in :attr:`mig_enabled` start with MIG mode on, and
    :attr:`mig_layout` creates static MIG instances at start-up. The broker
    then creates and destroys MIG devices with :meth:`create_mig_device` and
    :meth:`destroy_mig_device`, following NVIDIA's rules as encoded in
    :mod:`gpubroker.devices.mig` (profiles, placements, instance limits per
    GPU model). MIG mode and instances are kept in the same state as usage
    (under the key ``"_mig"``), so they survive a broker restart when
    :attr:`state_file` is set.
    """

    kind = "fake"
    simulated = True

    inventory = List(
        Unicode(),
        default_value=["8 x NVIDIA H100 80GB HBM3"],
        help="""SIMULATED GPUs of this node, one entry per group: "N x MODEL".

        MODEL is an NVML product name (e.g. "NVIDIA H100 80GB HBM3") or an
        alias ("H100", "A100-80GB", "A100-40GB", "H200", "A30", "L40S", "T4");
        "NxMODEL", the multiplication sign (U+00D7) for "x" and a bare "MODEL"
        (one device) are accepted too. Devices are numbered across entries
        in order.
        """,
    ).tag(config=True)

    node_name = Unicode(
        help="Name of the node the simulated GPUs are on (default: this host's name)."
    ).tag(config=True)

    state_file = Unicode(
        "",
        help="""JSON file holding the SIMULATED usage of each device and the MIG state.

        Format: {"GPU-...": {"utilization_gpu": 80, "memory_used_mib": 20480,
        "processes": [{"pid": 123, "used_memory_mib": 20480}]}}; a process's
        "used_memory_mib": null is memory NVML does not report for it
        (NVML_VALUE_NOT_AVAILABLE), which the device's "memory_used_mib"
        still counts. MIG devices
        have usage entries too, keyed by their "MIG-..." UUID (with
        "engine_activity", 0..1, on Hopper and later GPUs only: NVML's GPM);
        a GPU in MIG mode reports the sum of its own entry and its MIG
        devices' entries, as NVML does on the parent's handle. MIG mode and
        instances live under the key "_mig": {"_mig": {"GPU-...": {"enabled":
        true, "instances": [{"gi_id": 1, "ci_id": 0, "profile": "1g.10gb",
        "start": 6, "size": 1}]}}}; once a GPU has an entry there, its mode
        there overrides mig_enabled. Re-read on every query, so tests and the
        demo can change it while the broker runs. Empty: keep everything in
        memory only.
        """,
    ).tag(config=True)

    topology_model = Enum(
        ["dgx", "uniform"],
        default_value="dgx",
        help="""SIMULATED interconnect of the fake GPUs (see gpubroker.devices.topology).

        "dgx": a DGX-1-style hybrid: NVLink islands of 4 GPUs by index (0-3,
        4-7, ...), fully NVLinked inside an island; different islands are on
        different CPU sockets (SYSTEM apart), so placing a gang across islands
        is clearly worse. "uniform": every pair of GPUs behind several PCIe
        switches (PCIE_MULTI), i.e. placement does not matter. Applies by
        index across all inventory entries, whatever their models.
        """,
    ).tag(config=True)

    mig_enabled = List(
        Int(),
        help="""Indices of the SIMULATED GPUs that start with MIG mode on.

        Only MIG-capable models (A30, A100, H100, H200) may be listed; any
        other is an error at start-up. Once the state (state_file) holds a
        GPU's MIG mode, for example after set_mig_mode or after a MIG device
        was created, the state wins over this list.
        """,
    ).tag(config=True)

    fail_mig_creates = Int(
        0,
        help="""Refuse the next N SIMULATED MIG instance creations with a
        DeviceBackendError ("injected failure"), as a driver that fails now
        and then would (for tests and fault drills; 0: never).""",
    ).tag(config=True)

    mig_layout = Dict(
        help="""Static SIMULATED MIG instances to create at start-up, by device index.

        Maps a device index (an integer, or a string of digits) to a list of
        GPU-instance profiles, each "PROFILE" or "PROFILE@START", e.g.
        {0: ["3g.40gb@4", "1g.10gb"]}. START is the first memory slice
        (nvidia-smi mig -lgipp); without it the placement that fragments the
        GPU least is chosen (gpubroker.devices.mig.best_placement), after all
        placed entries. Each device listed must be in mig_enabled. Instances
        already in the state are kept, and only missing ones are created. A
        layout NVIDIA's rules forbid is an error at start-up.
        """,
    ).tag(config=True)

    @default("node_name")
    def _default_node_name(self) -> str:
        return socket.gethostname()

    def __init__(self, **kwargs: Any) -> None:
        """Create the backend.

        Raises:
            DeviceBackendError: a bad inventory, a non-MIG GPU in
                :attr:`mig_enabled`, an invalid :attr:`mig_layout`, or an
                unreadable / unwritable state file.
        """
        self._lock = threading.RLock()
        super().__init__(**kwargs)
        self._memory_state: dict[str, Any] = {}
        gpus = self._gpus()
        self._check_mig_enabled(gpus)
        self._apply_mig_layout(gpus, self._parse_mig_layout(gpus))
        self.log.info(
            "SIMULATED GPUs on node %s: %d device(s) from %s",
            self.node_name,
            len(gpus),
            self.inventory,
        )

    # --- inventory ---------------------------------------------------------------

    def devices(self) -> list[DeviceInfo]:
        """Return the simulated inventory, ordered by index (0-based, across entries).

        :attr:`DeviceInfo.mig_enabled` is the current simulated MIG mode
        (the state's, else :attr:`mig_enabled`).

        Raises:
            DeviceBackendError: an inventory entry is malformed or names an
                unknown model, or the state file is unreadable.
        """
        state = self._read_state()
        return [self._device(gpu, self._mig_record(state, gpu).enabled) for gpu in self._gpus()]

    def topology(self) -> Topology:
        """Return the SIMULATED interconnect chosen by :attr:`topology_model`.

        Returns:
            ``dgx_like(n)`` for "dgx", ``uniform(n, PCIE_MULTI)`` for
            "uniform", where ``n`` is the number of devices; indexed like
            :meth:`devices`.

        Raises:
            DeviceBackendError: an inventory entry is malformed.
        """
        n = len(self._gpus())
        if self.topology_model == "uniform":
            return uniform(n, LinkLevel.PCIE_MULTI)
        return dgx_like(n)

    def _gpus(self) -> list[_Gpu]:
        """The configured GPUs (computed once per node name and inventory:
        a lookup by UUID must not rebuild 1,024 UUIDs each time)."""
        key = (self.node_name, tuple(self.inventory))
        cached = getattr(self, "_gpus_cache", None)
        if cached is not None and cached[0] == key:
            return list(cached[1])
        result: list[_Gpu] = []
        for entry in self.inventory:
            count, model = parse_inventory_entry(entry)
            for _ in range(count):
                index = len(result)
                uuid = fake_uuid(self.node_name, index, model.name)
                spec = mig.spec_for(model.name) if model.mig_capable else None
                result.append(_Gpu(index, model, uuid, spec))
        self._gpus_cache = (key, tuple(result))
        return result

    def _device(self, gpu: _Gpu, mig_enabled: bool) -> DeviceInfo:
        return DeviceInfo(
            node=self.node_name,
            index=gpu.index,
            uuid=gpu.uuid,
            name=gpu.model.name,
            memory_total_mib=gpu.model.memory_total_mib,
            pci_bus_id=fake_pci_bus_id(gpu.index),
            mig_enabled=mig_enabled,
        )

    def _gpu(self, uuid: str) -> _Gpu:
        for gpu in self._gpus():
            if gpu.uuid == uuid:
                return gpu
        raise KeyError(uuid)

    # --- usage -------------------------------------------------------------------

    def usage(self, uuid: str) -> DeviceUsage:
        """Return the simulated usage of ``uuid`` (percent, MiB, processes).

        ``uuid`` is a GPU (``GPU-...``) or one of its current MIG devices
        (``MIG-...``). A device absent from the state (or a missing state
        file) is idle: 0 MiB, no processes, and 0 % utilization -- except
        that, as with NVML (``nvmlDeviceGetUtilizationRates`` is not
        supported there), a MIG device or a GPU with MIG mode on reports
        ``None``. A GPU with MIG mode on reports, as NVML does on the
        parent's handle, the sum of its own entry's and its MIG devices'
        memory (MiB, at most its total) and all their processes.

        Raises:
            KeyError: ``uuid`` is not a device or MIG device of this backend.
            DeviceBackendError: the state file is unreadable or malformed.
        """
        state = self._read_state()
        target = self._usage_target(state, uuid)
        own = self._entry_usage(state, uuid, target.mig_like)
        if not target.instances:
            return own
        # NVML on the parent of MIG devices: the aggregate of its instances
        # (nvmlDeviceGetComputeRunningProcesses, nvmlDeviceGetMemoryInfo)
        parts = [own, *(self._entry_usage(state, i, True) for i in target.instances)]
        return DeviceUsage(
            uuid,
            None,
            min(sum(u.memory_used_mib for u in parts), target.memory_mib),
            tuple(p for u in parts for p in u.processes),
        )

    def _entry_usage(self, state: Mapping[str, Any], uuid: str, mig_like: bool) -> DeviceUsage:
        """The usage the state file holds for ``uuid`` alone (idle when absent).

        Raises:
            DeviceBackendError: its entry is malformed.
        """
        entry = state.get(uuid)
        if entry is None:
            return DeviceUsage(
                uuid=uuid, utilization_gpu=None if mig_like else 0, memory_used_mib=0
            )
        try:
            return _usage_from_entry(uuid, entry)
        except (TypeError, ValueError, KeyError) as err:
            raise DeviceBackendError(
                f"bad entry for {uuid} in fake GPU state {self._state_name()}: {err}"
            ) from err

    @_locked
    def set_usage(
        self,
        uuid: str,
        utilization_gpu: int | None = 0,
        memory_used_mib: int | None = None,
        processes: Iterable[ProcessInfo | Mapping[str, int]] = (),
        engine_activity: float | None = None,
    ) -> DeviceUsage:
        """Set the simulated usage of ``uuid`` and return it.

        Args:
            uuid: a device of this backend, or one of its current MIG devices.
            utilization_gpu: percent 0-100, or ``None`` (not reported). A
                MIG device, or a GPU in MIG mode, reports none (NVML's
                ``nvmlDeviceGetUtilizationRates`` is not supported there):
                ``None``, or the default 0, stored as ``None``.
            memory_used_mib: MiB in use, 0 to the device's total (a MIG
                device's :attr:`MigDevice.memory_mib`); ``None`` means the sum
                of the processes' memory.
            processes: :class:`ProcessInfo` objects or mappings with ``pid``
                and ``used_memory_mib`` (MiB; ``None``: NVML does not
                report it, as :class:`ProcessInfo`; give the device's
                ``memory_used_mib`` then, which counts it).
            engine_activity: for a MIG device on a GPU with GPM (Hopper and
                later, :attr:`GPUModel.gpm_capable`) only, the fraction 0..1
                of time its engine was active (what NVML's GPM gives);
                ``None``: not known.

        The state file, if configured, is rewritten atomically (temporary file
        in the same directory, then ``os.replace``); concurrent writers may
        still lose each other's updates.

        Raises:
            KeyError: unknown ``uuid``.
            TypeError: a value is not an integer.
            ValueError: a value out of range, a utilization for a MIG
                device or a GPU in MIG mode, or an engine activity for
                anything but a MIG device on a GPU with GPM.
            DeviceBackendError: the state file cannot be read or written.
        """
        state = dict(self._read_state())
        target = self._usage_target(state, uuid)
        memory_total_mib, mig_like = target.memory_mib, target.mig_like
        if mig_like and utilization_gpu == 0:
            utilization_gpu = None  # the default: not reported there
        if mig_like and utilization_gpu is not None:
            raise ValueError(
                f"utilization_gpu: {uuid} is a MIG device or a GPU in MIG mode, which "
                "reports no utilization (NVML: not supported); give None"
            )
        if engine_activity is not None and not uuid.startswith("MIG-"):
            raise ValueError(f"engine_activity: only a MIG device has one, not {uuid}")
        if engine_activity is not None and not target.gpm:
            raise ValueError(
                f"engine_activity: {uuid} is on a GPU without GPM (before Hopper), where"
                " NVML reports none; give None"
            )
        procs = tuple(_process(p) for p in processes)
        if utilization_gpu is not None:
            utilization_gpu = _int(utilization_gpu, "utilization_gpu")
        if memory_used_mib is None:
            memory_used_mib = _known_mib(procs)
        if engine_activity is not None:
            engine_activity = _fraction(engine_activity, "engine_activity")
        usage = DeviceUsage(
            uuid, utilization_gpu, _int(memory_used_mib, "memory_used_mib"), procs, engine_activity
        )
        _check_usage(usage, memory_total_mib)
        state[uuid] = _entry_from_usage(usage)
        self._write_state(state)
        return usage

    def _usage_target(self, state: Mapping[str, Any], uuid: str) -> _UsageTarget:
        """What NVML's usage calls on ``uuid`` (a GPU or MIG device) report.

        Raises KeyError for an unknown UUID.
        """
        gpus = self._gpus()
        for gpu in gpus:
            if gpu.uuid == uuid:
                record = self._mig_record(state, gpu)
                instances = tuple(d.uuid for d in record.instances) if record.enabled else ()
                return _UsageTarget(gpu.model.memory_total_mib, record.enabled, instances)
        if uuid.startswith("MIG-"):
            for gpu in gpus:
                for device in self._mig_record(state, gpu).instances:
                    if device.uuid == uuid:
                        return _UsageTarget(device.memory_mib, True, gpm=gpu.model.gpm_capable)
        raise KeyError(uuid)

    # --- MIG -----------------------------------------------------------------------

    def mig_devices(self, parent_uuid: str) -> list[MigDevice]:
        """Return the simulated MIG devices of ``parent_uuid``, by GPU-instance ID.

        Returns:
            ``[]`` when MIG mode is off or the model is not MIG-capable.

        Raises:
            KeyError: ``parent_uuid`` is not a GPU of this backend.
            DeviceBackendError: the state file is unreadable or malformed.
        """
        gpu = self._gpu(parent_uuid)
        record = self._mig_record(self._read_state(), gpu)
        return sorted(record.instances, key=lambda d: d.gi_id) if record.enabled else []

    @_locked
    def create_mig_device(self, parent_uuid: str, profile: str, placement: Placement) -> MigDevice:
        """Create a simulated MIG device (GPU instance + one compute instance).

        Refused exactly where :func:`gpubroker.devices.mig.can_place` says no,
        with the rule :func:`~gpubroker.devices.mig.placement_problem` names
        (allowed start slots from ``nvidia-smi mig -lgipp``, no overlapping
        memory slices, compute slices, the profile's instance limit, one
        ``+me`` per GPU; NVIDIA MIG User Guide).

        IDs: the GPU instance gets the lowest free ID from 1 up and the
        compute instance ID 0. That is what the FAKE does; the real driver
        numbers GPU instances from its own per-placement table (e.g. on an
        A100 a ``7g`` instance gets ID 0 and ``1g`` ones 7-13), so nothing
        should rely on the numbers. The UUID is
        :func:`gpubroker.devices.mig.mig_uuid` of parent, GI and CI IDs.

        Memory (MiB): the profile's ``nvidia-smi mig -lgip`` figure where the
        catalog has it (:attr:`MigProfile.memory_mib`), else
        ``floor(GPU memory MiB * profile memory slices / GPU memory slices)``.

        Returns:
            The new :class:`MigDevice`.

        Raises:
            KeyError: ``parent_uuid`` is not a GPU of this backend.
            MigPlacementError: the model has no MIG catalog entry, the profile
                is not one of the model's, MIG mode is off, or the placement
                breaks a rule; the message names device, profile, placement
                and rule.
            DeviceBackendError: the state file cannot be read or written, or
                a failure was injected (:attr:`fail_mig_creates`).
        """
        gpu = self._gpu(parent_uuid)
        state = self._read_state()
        record = self._mig_record(state, gpu)
        prefix = f"cannot create MIG {profile} at {placement} on {gpu.describe()}"
        if self.fail_mig_creates > 0:
            self.fail_mig_creates -= 1
            raise DeviceBackendError(f"{prefix}: injected failure (fail_mig_creates)")
        if gpu.spec is None:
            raise MigPlacementError(f"{prefix}: the model does not support MIG")
        try:
            wanted = gpu.spec.profile(profile)
        except KeyError as err:
            raise MigPlacementError(f"{prefix}: {err.args[0]}") from None
        if not record.enabled:
            raise MigPlacementError(f"{prefix}: MIG mode is off")
        layout = [(d.profile, d.placement) for d in record.instances]
        problem = mig.placement_problem(gpu.spec, layout, wanted, placement)
        if problem is not None:
            raise MigPlacementError(f"{prefix}: {problem}")
        used = {d.gi_id for d in record.instances}
        gi_id = next(i for i in range(1, len(used) + 2) if i not in used)
        device = _mig_device(gpu, wanted, placement, gi_id, 0, record.created)
        self._save_mig(
            state, gpu, _MigRecord(True, [*record.instances, device], record.created + 1)
        )
        self.log.info(
            "SIMULATED MIG device %s (%s at %s, GI %d) created on device %d",
            device.uuid,
            device.profile,
            placement,
            gi_id,
            gpu.index,
        )
        return device

    @_locked
    def destroy_mig_device(self, parent_uuid: str, mig_uuid: str) -> None:
        """Destroy a simulated MIG device (its compute, then its GPU instance).

        Refused while the state records processes on ``mig_uuid`` (NVML would
        answer ``NVML_ERROR_IN_USE``). Its usage entry is removed with it.

        Raises:
            KeyError: ``parent_uuid`` is not a GPU of this backend, or
                ``mig_uuid`` is not one of its MIG devices.
            DeviceInUseError: processes run on it ("in use").
            DeviceBackendError: the state file cannot be read or written, or
                a failure was injected (:attr:`fail_mig_creates`).
        """
        gpu = self._gpu(parent_uuid)
        state = self._read_state()
        record = self._mig_record(state, gpu)
        target = next((d for d in record.instances if d.uuid == mig_uuid), None)
        if target is None or not record.enabled:
            raise KeyError(mig_uuid)
        pids = self._pids(state, mig_uuid)
        if pids:
            raise DeviceInUseError(
                f"cannot destroy MIG {target.profile} {mig_uuid} at {target.placement} on "
                f"{gpu.describe()}: in use by process(es) {', '.join(map(str, pids))}"
            )
        remaining = [d for d in record.instances if d.uuid != mig_uuid]
        state = {key: value for key, value in state.items() if key != mig_uuid}
        self._save_mig(state, gpu, _MigRecord(True, remaining, record.created))
        self.log.info("SIMULATED MIG device %s destroyed on device %d", mig_uuid, gpu.index)

    @_locked
    def set_mig_mode(self, uuid: str, enabled: bool) -> None:
        """Turn simulated MIG mode on or off; takes effect at once (no GPU reset).

        Setting the current mode does nothing. Otherwise refused while MIG
        devices exist on the GPU or the state records processes on it (NVML
        answers ``NVML_ERROR_IN_USE``). The count of MIG devices ever
        created on the GPU is kept across the change, so a MIG device made
        afterwards never gets the UUID of one made before (a real driver
        never reuses MIG UUIDs).

        Raises:
            KeyError: ``uuid`` is not a GPU of this backend.
            DeviceBackendError: the model does not support MIG (NVML:
                ``NVML_ERROR_NOT_SUPPORTED``), or the state file cannot be
                read or written.
            DeviceInUseError: MIG devices or processes on the GPU ("in use").
        """
        gpu = self._gpu(uuid)
        state = self._read_state()
        record = self._mig_record(state, gpu)
        mode = "on" if enabled else "off"
        if gpu.spec is None:
            raise DeviceBackendError(
                f"cannot turn MIG mode {mode} on {gpu.describe()}: the model does not support MIG"
            )
        if record.enabled == enabled:
            return
        if record.instances:
            names = ", ".join(f"{d.profile} at {d.placement} ({d.uuid})" for d in record.instances)
            raise DeviceInUseError(
                f"cannot turn MIG mode {mode} on {gpu.describe()}: in use by "
                f"{len(record.instances)} MIG device(s): {names}"
            )
        pids = self._pids(state, gpu.uuid)
        if pids:
            raise DeviceInUseError(
                f"cannot turn MIG mode {mode} on {gpu.describe()}: in use by process(es) "
                f"{', '.join(map(str, pids))}"
            )
        # the creation counter survives the change: a real driver never
        # gives a MIG device a UUID another had before
        self._save_mig(state, gpu, _MigRecord(enabled, [], record.created))
        self.log.info("SIMULATED MIG mode %s on device %d", mode, gpu.index)

    def _pids(self, state: Mapping[str, Any], uuid: str) -> list[int]:
        entry = state.get(uuid)
        if entry is None:
            return []
        try:
            return [p.pid for p in _usage_from_entry(uuid, entry).processes]
        except (TypeError, ValueError, KeyError) as err:
            raise DeviceBackendError(
                f"bad entry for {uuid} in fake GPU state {self._state_name()}: {err}"
            ) from err

    def _mig_record(self, state: Mapping[str, Any], gpu: _Gpu) -> _MigRecord:
        """The MIG mode and instances of ``gpu``: from the state, else the traits."""
        if gpu.spec is None:
            return _MigRecord(False, [])
        section = state.get(MIG_STATE_KEY, {})
        if not isinstance(section, dict):
            raise DeviceBackendError(
                f"fake GPU state {self._state_name()}: {MIG_STATE_KEY!r} must be a JSON object"
            )
        raw = section.get(gpu.uuid)
        if raw is None:
            return _MigRecord(gpu.index in self.mig_enabled, [])
        try:
            return _record_from_json(gpu, raw)
        except (TypeError, ValueError, KeyError) as err:
            raise DeviceBackendError(
                f"bad MIG entry for {gpu.uuid} in fake GPU state {self._state_name()}: {err}"
            ) from err

    def _save_mig(self, state: Mapping[str, Any], gpu: _Gpu, record: _MigRecord) -> None:
        new_state = dict(state)
        section = dict(new_state.get(MIG_STATE_KEY) or {})
        section[gpu.uuid] = {
            "enabled": record.enabled,
            "created": record.created,
            "instances": [
                {
                    "gi_id": d.gi_id,
                    "ci_id": d.ci_id,
                    "profile": d.profile,
                    "start": d.placement.start,
                    "size": d.placement.size,
                    "uuid": d.uuid,
                }
                for d in sorted(record.instances, key=lambda d: d.gi_id)
            ],
        }
        new_state[MIG_STATE_KEY] = section
        self._write_state(new_state)

    # --- MIG configuration at start-up --------------------------------------------------

    def _check_mig_enabled(self, gpus: list[_Gpu]) -> None:
        for index in self.mig_enabled:
            if not 0 <= index < len(gpus):
                raise DeviceBackendError(
                    f"FakeDeviceBackend.mig_enabled: no fake device {index}"
                    f" (the inventory has {len(gpus)})"
                )
            gpu = gpus[index]
            if gpu.spec is None:
                raise DeviceBackendError(
                    f"FakeDeviceBackend.mig_enabled: device {index} is a {gpu.model.name},"
                    " which does not support MIG (MIG-capable: A30, A100, H100, H200)"
                )

    def _parse_mig_layout(self, gpus: list[_Gpu]) -> dict[int, list[_LayoutEntry]]:
        """Parse and check :attr:`mig_layout` against NVIDIA's rules (state not read)."""
        result: dict[int, list[_LayoutEntry]] = {}
        for key, entries in self.mig_layout.items():
            where = f"FakeDeviceBackend.mig_layout[{key!r}]"
            if isinstance(key, bool) or not (
                isinstance(key, int) or (isinstance(key, str) and key.strip().isdigit())
            ):
                raise DeviceBackendError(f"{where}: the key must be a device index")
            index = int(key)
            if not 0 <= index < len(gpus):
                raise DeviceBackendError(
                    f"{where}: no fake device {index} (the inventory has {len(gpus)})"
                )
            if index in result:
                raise DeviceBackendError(f"{where}: device {index} is listed twice")
            gpu = gpus[index]
            if gpu.spec is None:
                raise DeviceBackendError(
                    f"{where}: device {index} is a {gpu.model.name}, which does not support MIG"
                )
            if index not in self.mig_enabled:
                raise DeviceBackendError(
                    f"{where}: MIG mode is off on device {index}; add {index} to"
                    " FakeDeviceBackend.mig_enabled"
                )
            if not isinstance(entries, (list, tuple)) or not all(
                isinstance(e, str) for e in entries
            ):
                raise DeviceBackendError(
                    f"{where}: expected a list of 'PROFILE' or 'PROFILE@START' strings,"
                    f" not {entries!r}"
                )
            parsed = [_parse_layout_entry(gpu, gpu.spec, where, e) for e in entries]
            _plan_layout(gpu, gpu.spec, where, parsed, [])  # the layout alone must be valid
            result[index] = parsed
        return result

    def _apply_mig_layout(self, gpus: list[_Gpu], layouts: dict[int, list[_LayoutEntry]]) -> None:
        """Create the static instances of :attr:`mig_layout` that the state lacks."""
        for index, entries in sorted(layouts.items()):
            gpu = gpus[index]
            assert gpu.spec is not None  # checked by _parse_mig_layout
            state = self._read_state()
            record = self._mig_record(state, gpu)
            if not record.enabled:
                self.log.warning(
                    "SIMULATED MIG mode is off on device %d (set in the state %s);"
                    " its mig_layout is not applied",
                    index,
                    self._state_name(),
                )
                continue
            where = f"FakeDeviceBackend.mig_layout[{index}]"
            missing = _plan_layout(gpu, gpu.spec, where, entries, record.instances)
            if not missing:
                continue
            instances, created = list(record.instances), record.created
            for name, placement in missing:
                used = {d.gi_id for d in instances}
                gi_id = next(i for i in range(1, len(used) + 2) if i not in used)
                profile = gpu.spec.profile(name)
                instances.append(_mig_device(gpu, profile, placement, gi_id, 0, created))
                created += 1
            self._save_mig(state, gpu, _MigRecord(True, instances, created))
            self.log.info(
                "SIMULATED MIG layout on device %d: created %s",
                index,
                ", ".join(f"{name} at {placement}" for name, placement in missing),
            )

    # --- state ---------------------------------------------------------------------------

    def _state_name(self) -> str:
        return repr(self.state_file) if self.state_file else "(in memory)"

    def _read_state(self) -> dict[str, Any]:
        if not self.state_file:
            return self._memory_state
        try:
            with open(self.state_file, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as err:
            raise DeviceBackendError(
                f"cannot read fake GPU state file {self.state_file!r}: {err}"
            ) from err
        if not isinstance(data, dict):
            raise DeviceBackendError(
                f"fake GPU state file {self.state_file!r} must hold a JSON object keyed by UUID"
            )
        return data

    def _write_state(self, state: dict[str, Any]) -> None:
        if not self.state_file:
            self._memory_state = state
            return
        directory = os.path.dirname(os.path.abspath(self.state_file))
        try:
            fd, tmp = tempfile.mkstemp(prefix=".gpubroker-fake-", dir=directory)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump(state, f, indent=2, sort_keys=True)
                os.replace(tmp, self.state_file)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as err:
            raise DeviceBackendError(
                f"cannot write fake GPU state file {self.state_file!r}: {err}"
            ) from err


# --- MIG helpers ---------------------------------------------------------------------


class _LayoutEntry(NamedTuple):
    """One parsed :attr:`FakeDeviceBackend.mig_layout` entry."""

    text: str
    profile: mig.MigProfile
    placement: Placement | None


def _parse_layout_entry(gpu: _Gpu, spec: mig.GpuMigSpec, where: str, text: str) -> _LayoutEntry:
    """Parse ``"PROFILE"`` or ``"PROFILE@START"`` for ``gpu``; DeviceBackendError if bad."""
    name, sep, start = text.partition("@")
    try:
        profile = spec.profile(name.strip())
    except KeyError as err:
        raise DeviceBackendError(
            f"{where}: {text!r} on device {gpu.index}: {err.args[0]}"
        ) from None
    if not sep:
        return _LayoutEntry(text, profile, None)
    if not start.strip().isdigit():
        raise DeviceBackendError(
            f"{where}: {text!r}: START must be a memory-slice number, e.g. '{profile.name}@0'"
        )
    return _LayoutEntry(text, profile, Placement(int(start), profile.memory_slices))


def _plan_layout(
    gpu: _Gpu,
    spec: mig.GpuMigSpec,
    where: str,
    entries: list[_LayoutEntry],
    existing: list[MigDevice],
) -> list[tuple[str, Placement]]:
    """The instances of ``entries`` to create next to ``existing``, in order.

    An entry already satisfied by an existing instance (same profile, and
    same start when the entry has one) is not created again. Entries with a
    placement go first, then the others at :func:`mig.best_placement`.

    Raises:
        DeviceBackendError: an entry cannot be placed; the message names the
            device, the entry and the rule broken.
    """
    layout: list[tuple[str, Placement]] = [(d.profile, d.placement) for d in existing]
    unmatched = list(existing)
    missing: list[tuple[str, Placement]] = []
    placed = [e for e in entries if e.placement is not None]
    floating = [e for e in entries if e.placement is None]
    for entry in [*placed, *floating]:
        match = next(
            (
                d
                for d in unmatched
                if d.profile == entry.profile.name
                and (entry.placement is None or d.placement == entry.placement)
            ),
            None,
        )
        if match is not None:
            unmatched.remove(match)
            continue
        placement = entry.placement
        prefix = f"{where}: cannot create {entry.text!r} on {gpu.describe()}"
        if placement is None:
            placement = mig.best_placement(spec, layout, entry.profile)
            if placement is None:
                raise DeviceBackendError(f"{prefix}: {_no_room(spec, layout, entry.profile)}")
        problem = mig.placement_problem(spec, layout, entry.profile, placement)
        if problem is not None:
            raise DeviceBackendError(f"{prefix}: {problem}")
        layout.append((entry.profile.name, placement))
        missing.append((entry.profile.name, placement))
    return missing


def _no_room(spec: mig.GpuMigSpec, layout: mig.Layout, profile: mig.MigProfile) -> str:
    """Why ``profile`` fits nowhere next to ``layout`` (no valid placement left)."""
    problems = [mig.placement_problem(spec, layout, profile, p) for p in profile.placements]
    # compute slices, instance limit and +me do not depend on the placement
    for problem in problems:
        if problem is not None and not problem.startswith("overlaps"):
            return problem
    taken = ", ".join(f"{name} at {placement}" for name, placement in layout)
    starts = ",".join(str(p.start) for p in profile.placements)
    return f"no valid placement left: every allowed start ({starts}) overlaps {taken}"


def _mig_device(
    gpu: _Gpu,
    profile: mig.MigProfile,
    placement: Placement,
    gi_id: int,
    ci_id: int,
    generation: int = 0,
    uuid: str | None = None,
) -> MigDevice:
    """A simulated :class:`MigDevice`; memory as documented in ``create_mig_device``."""
    assert gpu.spec is not None
    if profile.memory_mib is not None:
        memory_mib = profile.memory_mib
    else:
        memory_mib = gpu.model.memory_total_mib * profile.memory_slices // gpu.spec.memory_slices
    return MigDevice(
        parent_uuid=gpu.uuid,
        uuid=uuid or mig.mig_uuid(gpu.uuid, gi_id, ci_id, generation),
        profile=profile.name,
        placement=placement,
        gi_id=gi_id,
        ci_id=ci_id,
        memory_mib=memory_mib,
    )


def _record_from_json(gpu: _Gpu, raw: Any) -> _MigRecord:
    """Parse one ``"_mig"`` entry of the state; TypeError/ValueError/KeyError if bad."""
    assert gpu.spec is not None
    if not isinstance(raw, dict):
        raise TypeError(f"expected an object, not {raw!r}")
    enabled = raw.get("enabled", False)
    if not isinstance(enabled, bool):
        raise TypeError(f"'enabled' must be true or false, not {enabled!r}")
    instances: list[MigDevice] = []
    for item in raw.get("instances", []):
        if not isinstance(item, dict):
            raise TypeError(f"expected an instance object, not {item!r}")
        profile = gpu.spec.profile(str(item["profile"]))
        placement = Placement(_int(item["start"], "start"), _int(item["size"], "size"))
        if placement.size != profile.memory_slices:
            raise ValueError(
                f"{profile.name} occupies {profile.memory_slices} memory slices,"
                f" not {placement.size}"
            )
        gi_id = _int(item["gi_id"], "gi_id")
        ci_id = _int(item.get("ci_id", 0), "ci_id")
        if any(d.gi_id == gi_id for d in instances):
            raise ValueError(f"GPU instance ID {gi_id} appears twice")
        stored = item.get("uuid")
        if stored is not None and not (isinstance(stored, str) and mig.is_mig_uuid(stored)):
            raise ValueError(f"'uuid' must be a MIG UUID, not {stored!r}")
        instances.append(_mig_device(gpu, profile, placement, gi_id, ci_id, uuid=stored))
    created = _int(raw.get("created", len(instances)), "created")
    # instances cannot exist with MIG mode off; a hand-edited state may say so anyway
    return _MigRecord(enabled, instances if enabled else [], max(created, len(instances)))


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an integer, not {value!r}")
    return value


def _process(value: ProcessInfo | Mapping[str, int | None]) -> ProcessInfo:
    """A process of a usage entry; ``used_memory_mib`` ``None`` (JSON
    ``null``): not reported, as NVML's ``NVML_VALUE_NOT_AVAILABLE``."""
    if isinstance(value, ProcessInfo):
        return value
    used = value.get("used_memory_mib", 0)
    return ProcessInfo(
        pid=_int(value["pid"], "pid"),
        used_memory_mib=None if used is None else _int(used, "used_memory_mib"),
    )


def _known_mib(procs: tuple[ProcessInfo, ...]) -> int:
    """The memory of the processes that report theirs, MiB."""
    return sum(p.used_memory_mib or 0 for p in procs)


def _usage_from_entry(uuid: str, entry: Any) -> DeviceUsage:
    if not isinstance(entry, dict):
        raise TypeError(f"expected an object, not {entry!r}")
    utilization = entry.get("utilization_gpu", 0)
    if utilization is not None:
        utilization = _int(utilization, "utilization_gpu")
    procs = tuple(_process(p) for p in entry.get("processes", []))
    memory = entry.get("memory_used_mib")
    if memory is None:
        memory = _known_mib(procs)
    activity = entry.get("engine_activity")
    if activity is not None:
        activity = _fraction(activity, "engine_activity")
    return DeviceUsage(uuid, utilization, _int(memory, "memory_used_mib"), procs, activity)


def _fraction(value: Any, name: str) -> float:
    """A number 0..1 (a fraction of time).

    Raises:
        TypeError: not a number.
        ValueError: outside 0..1.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, not {value!r}")
    if not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"{name} must be 0-1, not {value}")
    return float(value)


def _check_usage(usage: DeviceUsage, memory_total_mib: int) -> None:
    if usage.utilization_gpu is not None and not 0 <= usage.utilization_gpu <= 100:
        raise ValueError(f"utilization_gpu must be 0-100 percent, not {usage.utilization_gpu}")
    if not 0 <= usage.memory_used_mib <= memory_total_mib:
        raise ValueError(
            f"memory_used_mib must be 0-{memory_total_mib} MiB, not {usage.memory_used_mib}"
        )
    for proc in usage.processes:
        if proc.used_memory_mib is not None and proc.used_memory_mib < 0:
            raise ValueError(f"process {proc.pid}: used_memory_mib must be >= 0")


def _entry_from_usage(usage: DeviceUsage) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "utilization_gpu": usage.utilization_gpu,
        "memory_used_mib": usage.memory_used_mib,
        "processes": [
            {"pid": p.pid, "used_memory_mib": p.used_memory_mib} for p in usage.processes
        ],
    }
    if usage.engine_activity is not None:
        entry["engine_activity"] = usage.engine_activity
    return entry
