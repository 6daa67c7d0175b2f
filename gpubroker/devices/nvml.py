"""The real device backend: NVIDIA GPUs read through NVML (``pynvml``).

Calls and units follow the NVML API reference (docs.nvidia.com/deploy/nvml-api)
as wrapped by ``nvidia-ml-py``: memory arrives in bytes and is reported here
in MiB (``// 2**20``), utilization in percent. Every call is a read-only query
(``nvmlDeviceGet*``); the backend never changes a GPU setting.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pynvml
from traitlets import Unicode, default

from .base import DeviceBackend, DeviceBackendError, DeviceInfo, DeviceUsage, ProcessInfo
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
