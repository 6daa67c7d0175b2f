"""GPU interconnect topology of one node: how "far apart" two GPUs are.

Pure data and helpers (no NVML, no clock), so the scheduler may use them for
topology-aware gang placement: a multi-GPU request should get devices joined
by NVLink, else devices behind the same PCIe switch, and only then devices
further apart.

A topology is a square matrix indexed by NVML device index (0-based, PCI bus
order, the same index as :attr:`gpubroker.devices.base.DeviceInfo.index`);
entry ``[i][j]`` is the :class:`LinkLevel` between device ``i`` and device
``j``. The diagonal is :attr:`LinkLevel.SELF`; the matrix is symmetric.

Sources:
    * NVML API reference, ``nvmlDeviceGetTopologyCommonAncestor`` and the enum
      ``nvmlGpuTopologyLevel_t`` (docs.nvidia.com/deploy/nvml-api, "Topology
      Queries"): the PCIe levels and their numeric values.
    * NVML API reference, ``nvmlDeviceGetNvLinkState``,
      ``nvmlDeviceGetNvLinkRemotePciInfo_v2`` and
      ``nvmlDeviceGetNvLinkRemoteDeviceType`` ("NvLink Methods"): which GPUs
      are joined by NVLink (directly or through NVSwitches).
    * ``nvidia-smi topo -m``, whose legend (NV#, PIX, PXB, PHB, NODE, SYS)
      names the same levels.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from enum import IntEnum

__all__ = [
    "ISLAND_SIZE",
    "LinkLevel",
    "Topology",
    "dgx_like",
    "uniform",
    "validate",
    "worst_link",
]


class LinkLevel(IntEnum):
    """Distance of the link between two GPUs of one node; lower is closer.

    The PCIe values equal NVML's ``nvmlGpuTopologyLevel_t`` (the result of
    ``nvmlDeviceGetTopologyCommonAncestor``), so an NVML level converts with
    ``LinkLevel(value)`` (except ``NVML_TOPOLOGY_INTERNAL``, see
    :mod:`gpubroker.devices.nvml`). :attr:`NVLINK` is ours: NVML reports NVLink
    through ``nvmlDeviceGetNvLinkState`` / ``nvmlDeviceGetNvLinkRemotePciInfo``,
    not as a topology level; it sits below every PCIe level because NVLink
    beats any PCIe path (``nvidia-smi topo -m`` shows it as ``NV#``).

    Members:
        SELF: the same GPU (the diagonal of a matrix).
        NVLINK: joined by at least one active NVLink, directly or through
            NVSwitches (``NV#``).
        PCIE_SWITCH: behind one PCIe switch (``NVML_TOPOLOGY_SINGLE``, ``PIX``).
        PCIE_MULTI: behind several PCIe switches, no host bridge between them
            (``NVML_TOPOLOGY_MULTIPLE``, ``PXB``).
        HOSTBRIDGE: through a PCIe host bridge (``NVML_TOPOLOGY_HOSTBRIDGE``, ``PHB``).
        NUMA_NODE: through the interconnect between host bridges of one NUMA
            node / CPU socket (``NVML_TOPOLOGY_NODE``, ``NODE``).
        SYSTEM: through the link between NUMA nodes / CPU sockets (SMP
            interconnect, e.g. QPI/UPI; ``NVML_TOPOLOGY_SYSTEM``, ``SYS``).
    """

    SELF = 0
    NVLINK = 5
    PCIE_SWITCH = 10
    PCIE_MULTI = 20
    HOSTBRIDGE = 30
    NUMA_NODE = 40
    SYSTEM = 50


#: Square matrix indexed by NVML device index; entries are :class:`LinkLevel` values.
Topology = tuple[tuple[int, ...], ...]

#: GPUs per NVLink island in :func:`dgx_like` (a DGX-1 has two islands of four)
ISLAND_SIZE = 4


def uniform(n: int, level: LinkLevel | int) -> Topology:
    """Return the topology of ``n`` GPUs that are all ``level`` apart.

    Args:
        n: number of GPUs (>= 0).
        level: the level of every pair of distinct GPUs (not ``SELF``).

    Returns:
        An ``n`` x ``n`` matrix with ``SELF`` on the diagonal and ``level``
        elsewhere.

    Raises:
        ValueError: ``n`` is negative, ``level`` is not a :class:`LinkLevel`
            value or is ``SELF``.
    """
    if n < 0:
        raise ValueError(f"number of GPUs must be >= 0, not {n}")
    level = _level(level, "level")
    if level == LinkLevel.SELF:
        raise ValueError("level between distinct GPUs cannot be SELF")
    return tuple(tuple(LinkLevel.SELF if i == j else level for j in range(n)) for i in range(n))


def dgx_like(n: int = 8) -> Topology:
    """Return a DGX-1-style hybrid topology of ``n`` GPUs, where placement matters.

    For ``n == 8`` (the default):

    * two NVLink islands, GPUs 0-3 and 4-7, fully NVLinked inside an island
      (:attr:`LinkLevel.NVLINK`), no NVLink between islands;
    * PCIe: pairs (0,1), (2,3), (4,5), (6,7) share a PCIe switch
      (:attr:`LinkLevel.PCIE_SWITCH`), but inside an island NVLink is closer
      and wins (the entry is the minimum of the NVLink and PCIe levels);
    * GPUs 0-3 hang off NUMA node / CPU socket 0, GPUs 4-7 off socket 1, so
      across islands the level is :attr:`LinkLevel.SYSTEM`.

    A real DGX-1 also has some NVLinks between islands (hybrid cube-mesh);
    this model leaves them out on purpose so that a 4-GPU request placed
    across islands is clearly worse than one inside an island.

    Other ``n``: GPU ``i`` is in island ``i // 4`` (the last island has fewer
    GPUs when ``n`` is not a multiple of 4), each island on its own NUMA node
    (so any two islands are ``SYSTEM`` apart), and GPUs ``2k`` and ``2k+1``
    share a PCIe switch. Pairs never straddle islands, so the matrix holds
    only ``SELF``, ``NVLINK`` and ``SYSTEM``; ``n <= 4`` gives one fully
    NVLinked island.

    Args:
        n: number of GPUs (>= 0).

    Returns:
        The ``n`` x ``n`` topology (symmetric, ``SELF`` on the diagonal).

    Raises:
        ValueError: ``n`` is negative.
    """
    if n < 0:
        raise ValueError(f"number of GPUs must be >= 0, not {n}")
    return tuple(tuple(_dgx_level(i, j) for j in range(n)) for i in range(n))


def _dgx_level(i: int, j: int) -> LinkLevel:
    """Level between GPUs ``i`` and ``j`` of :func:`dgx_like`."""
    if i == j:
        return LinkLevel.SELF
    if i // ISLAND_SIZE != j // ISLAND_SIZE:
        return LinkLevel.SYSTEM  # other island = other NUMA node / CPU socket
    pcie = LinkLevel.PCIE_SWITCH if i // 2 == j // 2 else LinkLevel.NUMA_NODE
    return min(LinkLevel.NVLINK, pcie)


def validate(matrix: Sequence[Sequence[int]]) -> Topology:
    """Check that ``matrix`` is a topology and return it as one.

    A topology is square, holds only :class:`LinkLevel` values, has ``SELF``
    (0) on the diagonal and nowhere else, and is symmetric.

    Args:
        matrix: rows of levels (any sequences of ints, e.g. lists).

    Returns:
        The same matrix as a tuple of tuples of :class:`LinkLevel`.

    Raises:
        ValueError: the message names the problem and the offending row or
            entry: not square, unknown level, nonzero diagonal, ``SELF``
            between distinct GPUs, or not symmetric.
    """
    n = len(matrix)
    for i, row in enumerate(matrix):
        if len(row) != n:
            raise ValueError(f"topology is not square: row {i} has {len(row)} entries, not {n}")
    result = tuple(
        tuple(_level(value, f"entry [{i}][{j}]") for j, value in enumerate(row))
        for i, row in enumerate(matrix)
    )
    for i in range(n):
        if result[i][i] != LinkLevel.SELF:
            raise ValueError(
                f"topology diagonal entry [{i}][{i}] is {_show(result[i][i])}, not SELF (0)"
            )
        for j in range(i + 1, n):
            if result[i][j] != result[j][i]:
                raise ValueError(
                    f"topology is not symmetric: [{i}][{j}] is {_show(result[i][j])}"
                    f" but [{j}][{i}] is {_show(result[j][i])}"
                )
            if result[i][j] == LinkLevel.SELF:
                raise ValueError(f"topology entry [{i}][{j}] is SELF (0) between distinct GPUs")
    return result


def worst_link(matrix: Topology, indices: Iterable[int]) -> LinkLevel:
    """Return the farthest link among the GPUs ``indices`` (a gang's bottleneck).

    Args:
        matrix: a valid topology.
        indices: NVML device indices of the gang (duplicates are ignored).

    Returns:
        The largest level between any two of them; ``SELF`` for zero or one GPU.

    Raises:
        IndexError: an index is outside the matrix.
    """
    chosen = sorted(set(indices))
    if chosen and (chosen[0] < 0 or chosen[-1] >= len(matrix)):
        raise IndexError(f"device indices {chosen} outside 0-{len(matrix) - 1}")
    levels = [matrix[i][j] for k, i in enumerate(chosen) for j in chosen[k + 1 :]]
    return LinkLevel(max(levels, default=LinkLevel.SELF))


def _show(level: LinkLevel) -> str:
    """``NAME (value)``, for error messages."""
    return f"{level.name} ({level.value})"


def _level(value: int, what: str) -> LinkLevel:
    """``value`` as a :class:`LinkLevel`; ValueError naming ``what`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"topology {what} is {value!r}, not a link level")
    try:
        return LinkLevel(value)
    except ValueError:
        valid = ", ".join(f"{m.name}={m.value}" for m in LinkLevel)
        raise ValueError(f"topology {what} is {value}, not a link level ({valid})") from None
