"""A SIMULATED device backend: made-up GPUs for demos, tests and development.

Nothing here touches a GPU. The inventory comes from configuration, the
usage from a JSON state file (or memory) that tests and the demo write.
"""

from __future__ import annotations

import json
import os
import re
import socket
import tempfile
import uuid as uuid_module
from collections.abc import Iterable, Mapping
from typing import Any

from traitlets import Enum, List, Unicode, default

from .base import DeviceBackend, DeviceBackendError, DeviceInfo, DeviceUsage, ProcessInfo
from .models import GPUModel, known_model_names, lookup_model
from .topology import LinkLevel, Topology, dgx_like, uniform

#: fixed namespace for the fake UUIDs, so a device keeps its UUID across restarts
FAKE_UUID_NAMESPACE = uuid_module.UUID("6b1f3c52-52b8-4c1e-9d0c-5a7e1f0b9a11")

#: PCI buses of the eight GPUs of a DGX H100 (``nvidia-smi`` Bus-Id column);
#: index 8 and up reuse them in the next PCI domain.
DGX_PCI_BUSES = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)

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


class FakeDeviceBackend(DeviceBackend):
    """SIMULATION: GPUs that do not exist. Never use it to schedule real work.

    The inventory is configured by :attr:`inventory` (e.g. ``["8 x H100"]``);
    names, memory totals and MIG capability come from the real catalog in
    :mod:`gpubroker.devices.models`, UUIDs and PCI bus ids are made up in
    NVML's formats. Usage (utilization percent, memory MiB, processes) is
    whatever was written with :meth:`set_usage` or into :attr:`state_file`;
    by default every device is idle (0 %, 0 MiB).
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
        help="""JSON file holding the SIMULATED usage of each device.

        Format: {"GPU-...": {"utilization_gpu": 80, "memory_used_mib": 20480,
        "processes": [{"pid": 123, "used_memory_mib": 20480}]}}. Re-read on
        every usage query, so tests and the demo can change it while the broker
        runs. Empty: keep usage in memory only.
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

    @default("node_name")
    def _default_node_name(self) -> str:
        return socket.gethostname()

    def __init__(self, **kwargs: Any) -> None:
        """Create the backend; raises DeviceBackendError for a bad inventory."""
        super().__init__(**kwargs)
        self._memory_state: dict[str, Any] = {}
        devices = self.devices()
        self.log.info(
            "SIMULATED GPUs on node %s: %d device(s) from %s",
            self.node_name,
            len(devices),
            self.inventory,
        )

    def devices(self) -> list[DeviceInfo]:
        """Return the simulated inventory, ordered by index (0-based, across entries).

        Raises:
            DeviceBackendError: an inventory entry is malformed or names an
                unknown model.
        """
        result: list[DeviceInfo] = []
        for entry in self.inventory:
            count, model = parse_inventory_entry(entry)
            for _ in range(count):
                result.append(self._device(len(result), model))
        return result

    def topology(self) -> Topology:
        """Return the SIMULATED interconnect chosen by :attr:`topology_model`.

        Returns:
            ``dgx_like(n)`` for "dgx", ``uniform(n, PCIE_MULTI)`` for
            "uniform", where ``n`` is the number of devices; indexed like
            :meth:`devices`.

        Raises:
            DeviceBackendError: an inventory entry is malformed.
        """
        n = len(self.devices())
        if self.topology_model == "uniform":
            return uniform(n, LinkLevel.PCIE_MULTI)
        return dgx_like(n)

    def _device(self, index: int, model: GPUModel) -> DeviceInfo:
        return DeviceInfo(
            node=self.node_name,
            index=index,
            uuid=fake_uuid(self.node_name, index, model.name),
            name=model.name,
            memory_total_mib=model.memory_total_mib,
            pci_bus_id=fake_pci_bus_id(index),
            mig_enabled=False,
        )

    def _device_by_uuid(self, uuid: str) -> DeviceInfo:
        for device in self.devices():
            if device.uuid == uuid:
                return device
        raise KeyError(uuid)

    def usage(self, uuid: str) -> DeviceUsage:
        """Return the simulated usage of ``uuid`` (percent, MiB, processes).

        A device absent from the state (or a missing state file) is idle:
        0 %, 0 MiB, no processes.

        Raises:
            KeyError: ``uuid`` is not a device of this backend.
            DeviceBackendError: the state file is unreadable or malformed.
        """
        self._device_by_uuid(uuid)
        entry = self._read_state().get(uuid)
        if entry is None:
            return DeviceUsage(uuid=uuid, utilization_gpu=0, memory_used_mib=0)
        try:
            return _usage_from_entry(uuid, entry)
        except (TypeError, ValueError, KeyError) as err:
            raise DeviceBackendError(
                f"bad entry for {uuid} in fake GPU state {self._state_name()}: {err}"
            ) from err

    def set_usage(
        self,
        uuid: str,
        utilization_gpu: int | None = 0,
        memory_used_mib: int | None = None,
        processes: Iterable[ProcessInfo | Mapping[str, int]] = (),
    ) -> DeviceUsage:
        """Set the simulated usage of ``uuid`` and return it.

        Args:
            uuid: a device of this backend.
            utilization_gpu: percent 0-100, or ``None`` (not reported).
            memory_used_mib: MiB in use, 0 to the device's total; ``None``
                means the sum of the processes' memory.
            processes: :class:`ProcessInfo` objects or mappings with ``pid``
                and ``used_memory_mib`` (MiB).

        The state file, if configured, is rewritten atomically (temporary file
        in the same directory, then ``os.replace``); concurrent writers may
        still lose each other's updates.

        Raises:
            KeyError: unknown ``uuid``.
            TypeError: a value is not an integer.
            ValueError: a value out of range.
            DeviceBackendError: the state file cannot be read or written.
        """
        device = self._device_by_uuid(uuid)
        procs = tuple(_process(p) for p in processes)
        if utilization_gpu is not None:
            utilization_gpu = _int(utilization_gpu, "utilization_gpu")
        if memory_used_mib is None:
            memory_used_mib = sum(p.used_memory_mib for p in procs)
        usage = DeviceUsage(uuid, utilization_gpu, _int(memory_used_mib, "memory_used_mib"), procs)
        _check_usage(usage, device.memory_total_mib)
        state = dict(self._read_state())
        state[uuid] = _entry_from_usage(usage)
        self._write_state(state)
        return usage

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


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an integer, not {value!r}")
    return value


def _process(value: ProcessInfo | Mapping[str, int]) -> ProcessInfo:
    if isinstance(value, ProcessInfo):
        return value
    return ProcessInfo(
        pid=_int(value["pid"], "pid"),
        used_memory_mib=_int(value.get("used_memory_mib", 0), "used_memory_mib"),
    )


def _usage_from_entry(uuid: str, entry: Any) -> DeviceUsage:
    if not isinstance(entry, dict):
        raise TypeError(f"expected an object, not {entry!r}")
    utilization = entry.get("utilization_gpu", 0)
    if utilization is not None:
        utilization = _int(utilization, "utilization_gpu")
    procs = tuple(_process(p) for p in entry.get("processes", []))
    memory = entry.get("memory_used_mib")
    if memory is None:
        memory = sum(p.used_memory_mib for p in procs)
    return DeviceUsage(uuid, utilization, _int(memory, "memory_used_mib"), procs)


def _check_usage(usage: DeviceUsage, memory_total_mib: int) -> None:
    if usage.utilization_gpu is not None and not 0 <= usage.utilization_gpu <= 100:
        raise ValueError(f"utilization_gpu must be 0-100 percent, not {usage.utilization_gpu}")
    if not 0 <= usage.memory_used_mib <= memory_total_mib:
        raise ValueError(
            f"memory_used_mib must be 0-{memory_total_mib} MiB, not {usage.memory_used_mib}"
        )
    for proc in usage.processes:
        if proc.used_memory_mib < 0:
            raise ValueError(f"process {proc.pid}: used_memory_mib must be >= 0")


def _entry_from_usage(usage: DeviceUsage) -> dict[str, Any]:
    return {
        "utilization_gpu": usage.utilization_gpu,
        "memory_used_mib": usage.memory_used_mib,
        "processes": [
            {"pid": p.pid, "used_memory_mib": p.used_memory_mib} for p in usage.processes
        ],
    }
