"""The simulated cluster: nodes of whole GPUs, from a spec or a file.

Specs: ``NODESxGPUSxMODEL`` (``64x8xA100-80GB``: 64 nodes of 8 A100s),
``NODESxGPUS`` (model ``GPU``), several joined by ``+``
(``8x8xH100+4x4xV100``). A file lists one node group per line, either as a
spec or as ``NAME GPUS [MODEL]`` (one named node); ``#`` starts a comment.

The scheduler core knows no GPU models: the model only labels the output.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..scheduler import PoolMode, Slot, Topology

_SPEC = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*(?:[xX]\s*(\S+))?\s*$")


class ClusterError(ValueError):
    """The cluster spec or file cannot be read."""


@dataclass(frozen=True)
class Node:
    """One node: its name, how many GPUs it has, and their model.

    ``mode`` (a :class:`~gpubroker.scheduler.PoolMode` value) other than
    ``exclusive`` puts its GPUs in a pool of that name handed out as MIG
    instances or time-sliced shares; ``model`` is then the NVML product name
    (for the MIG catalog) and ``memory_mib`` each GPU's memory, MiB.
    Specs and files only make exclusive nodes.
    """

    name: str
    gpus: int
    model: str = "GPU"
    mode: str = PoolMode.exclusive.value
    memory_mib: int = 0


@dataclass(frozen=True)
class Cluster:
    """The nodes, and the slots the scheduler sees.

    Attributes:
        nodes: every node, in order.
        spec: how it was given (for the output).
        topology: link matrix per node name (empty: all pairs equally far).
    """

    nodes: tuple[Node, ...]
    spec: str = ""
    topology: tuple[tuple[str, Topology], ...] = ()

    @property
    def total_gpus(self) -> int:
        """GPUs in the cluster."""
        return sum(n.gpus for n in self.nodes)

    @property
    def largest_node(self) -> int:
        """GPUs of the largest node: no request larger than this can run."""
        return max((n.gpus for n in self.nodes), default=0)

    def slots(self) -> tuple[Slot, ...]:
        """One :class:`~gpubroker.scheduler.Slot` per GPU (UUID ``node/index``)."""
        return tuple(
            Slot(f"{node.name}/{i}", node.name, i)
            if node.mode == PoolMode.exclusive.value
            else Slot(
                f"{node.name}/{i}",
                node.name,
                i,
                pool=node.mode,
                mode=node.mode,
                model=node.model,
                memory_mib=node.memory_mib,
            )
            for node in self.nodes
            for i in range(node.gpus)
        )

    def models(self) -> dict[str, int]:
        """GPUs per model."""
        counts: dict[str, int] = {}
        for node in self.nodes:
            counts[node.model] = counts.get(node.model, 0) + node.gpus
        return counts

    def describe(self) -> str:
        """``"128 GPUs on 16 nodes (128 x A100-80GB)"``."""
        models = ", ".join(f"{n} x {m}" for m, n in self.models().items())
        return f"{self.total_gpus} GPUs on {len(self.nodes)} nodes ({models})"

    def with_dgx_topology(self) -> Cluster:
        """The same cluster with a DGX-like topology on every node (NVLink islands of 4)."""
        from ..devices.topology import dgx_like

        return Cluster(self.nodes, self.spec, tuple((n.name, dgx_like(n.gpus)) for n in self.nodes))


def _group(count: int, gpus: int, model: str, first: int) -> list[Node]:
    return [Node(f"node{first + i:04d}", gpus, model) for i in range(count)]


def parse_spec(spec: str) -> Cluster:
    """A cluster from ``NODESxGPUS[xMODEL][+...]``.

    Raises:
        ClusterError: the spec does not parse, or has no GPUs.
    """
    nodes: list[Node] = []
    for part in spec.split("+"):
        match = _SPEC.match(part)
        if not match:
            raise ClusterError(
                f"cluster spec {part.strip()!r}: expected NODESxGPUSxMODEL, e.g. 64x8xA100-80GB"
            )
        count, gpus, model = int(match[1]), int(match[2]), match[3] or "GPU"
        if count < 1 or gpus < 1:
            raise ClusterError(f"cluster spec {part.strip()!r}: need at least 1 node of 1 GPU")
        nodes += _group(count, gpus, model, len(nodes))
    return Cluster(tuple(nodes), spec)


def read_file(path: Path) -> Cluster:
    """A cluster from a file: per line a spec or ``NAME GPUS [MODEL]``.

    Raises:
        ClusterError: unreadable or not UTF-8, a line does not parse, a
            name repeats, or no GPUs.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ClusterError(f"cannot read cluster file {path}: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise ClusterError(
            f"cluster file {path} is not UTF-8 text ({err.reason} at byte {err.start})"
        ) from None
    nodes: list[Node] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _SPEC.match(line)
        if match:
            count, gpus, model = int(match[1]), int(match[2]), match[3] or "GPU"
            nodes += _group(count, gpus, model, len(nodes))
            continue
        fields = line.split()
        if len(fields) not in (2, 3) or not fields[1].isdigit() or int(fields[1]) < 1:
            raise ClusterError(
                f"{path}, line {number}: expected NAME GPUS [MODEL] or NODESxGPUSxMODEL, "
                f"got {raw.strip()!r}"
            )
        nodes.append(Node(fields[0], int(fields[1]), fields[2] if len(fields) == 3 else "GPU"))
    names = [n.name for n in nodes]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ClusterError(f"{path}: node names repeat: {', '.join(duplicates)}")
    if not nodes:
        raise ClusterError(f"{path}: no nodes")
    return Cluster(tuple(nodes), str(path))


def load_cluster(spec: str) -> Cluster:
    """A spec like ``16x8xA100-80GB``, or the path of a cluster file."""
    path = Path(spec)
    if not _SPEC.match(spec.split("+")[0]) and path.is_file():
        return read_file(path)
    return parse_spec(spec)
