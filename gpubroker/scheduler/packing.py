"""Where a fractional request goes on a node: fragmentation-aware packing (pure).

Devices are measured in *units* of free capacity. The packing experiment
counts milli-GPUs (:data:`UNIT` units are one whole device's compute and
memory, as Alibaba's traces count, so a whole-device part fits only an
empty device); the broker counts the MiB a time-sliced device can still
give as shares (:mod:`gpubroker.scheduler.sharing`). A :class:`Demand` asks
for ``count`` devices of one node with ``units`` each, and optionally host
CPU (milli-cores) and memory (MiB) on that node, and optionally the GPU
models it may run on (its ``gpu_spec``; none named: any). A node is seen as
a :class:`Node`: the free units of each of its devices, its free CPU and
memory (``None``: not modelled, never short) and its devices' model.

Fragmentation (Weng et al., "Beware of Fragmentation", USENIX ATC 2023,
section 4): for one demand ``d``, the fragment of a node is the free GPU
capacity that ``d`` cannot use there. If ``d`` does not fit on the node at
all (too few devices with room, too little CPU or memory, or a GPU model
``d`` does not accept), all its free units are fragment; otherwise the free
units of the devices that cannot hold one of ``d``'s parts (less than
``units`` free; for a whole device, any device already partly used). A
*mix* weighs demands by how often they come; the node's expected
fragmentation is the weighted sum (:func:`fragmentation`).

Strategies, for one demand over candidate nodes (:func:`score`, lower wins):

- ``first-fit``: the first node (by the caller's order) where it fits, the
  lowest device indices with room;
- ``best-fit``: the node, then the devices, with the fewest units left after;
- ``fgd``: the paper's fragmentation gradient descent: the placement that
  raises the node's expected fragmentation least (ties: the caller's order);
- ``packing`` (the broker's): FGD's gradient plus the gradient of the
  node's *stranded* capacity (:meth:`Scorer.stranded`: the free units its
  free CPU or memory cannot feed at the mix's CPU and memory per unit),
  weighted :data:`STRAND_WEIGHT`, then best fit among equal keys (fewest
  units left on the devices taken, then on the node). FGD sees host resources only
  at the edge (a demand fits or not); the stranding term steers CPU-heavy
  requests to CPU-rich nodes before that edge is reached, and the best-fit
  ties keep small parts off empty devices;
- ``random``: any node where it fits (the caller draws).

Pure: no clock, no I/O; every input is a value.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

#: units of one whole device (a milli-GPU each)
UNIT = 1000

#: the placement strategies, the broker's first
STRATEGIES = ("packing", "fgd", "best-fit", "first-fit", "random")

#: weight of the stranded capacity's gradient against fragmentation's
#: (``packing``; units per unit). Chosen on the openb default trace, seed 0:
#: 1 and 4 place within 0.05 % of 2
STRAND_WEIGHT = 2.0


@dataclass(frozen=True, slots=True)
class Demand:
    """What one request needs on one node.

    Attributes:
        count: devices, >= 1, all on one node.
        units: units of each device, >= 1 (in the experiment
            1..:data:`UNIT`; ``UNIT``: a whole, empty device).
        cpu: host milli-cores (0: none asked).
        memory: host memory, MiB (0: none asked).
        models: the GPU models it may run on (empty: any model).
    """

    count: int
    units: int
    cpu: int = 0
    memory: int = 0
    models: frozenset[str] = frozenset()

    @property
    def size(self) -> int:
        """Units asked in all (``count * units``)."""
        return self.count * self.units


@dataclass(frozen=True, slots=True)
class Node:
    """What a node has free.

    Attributes:
        free: free units of each device, by device index.
        cpu: free host milli-cores; ``None``: not modelled.
        memory: free host memory, MiB; ``None``: not modelled.
        model: its devices' GPU model (``""``: not modelled; only demands
            that accept any model fit then).
    """

    free: tuple[int, ...]
    cpu: int | None = None
    memory: int | None = None
    model: str = ""

    def key(self) -> tuple[tuple[int, ...], int | None, int | None, str]:
        """What fragmentation depends on (device order does not matter)."""
        return (tuple(sorted(self.free)), self.cpu, self.memory, self.model)


#: a mix: demands with their weights (any positive scale)
Mix = Sequence[tuple[Demand, float]]


def model_fits(node: Node, demand: Demand) -> bool:
    """Whether ``demand`` accepts the node's GPU model (it names none, or
    names the node's)."""
    return not demand.models or node.model in demand.models


def host_fits(node: Node, demand: Demand) -> bool:
    """Whether the node has the CPU and memory ``demand`` asks for, and a
    GPU model it accepts (:func:`model_fits`)."""
    return (
        (node.cpu is None or node.cpu >= demand.cpu)
        and (node.memory is None or node.memory >= demand.memory)
        and model_fits(node, demand)
    )


def fits(node: Node, demand: Demand) -> bool:
    """Whether ``demand`` can be placed on ``node`` now."""
    if not host_fits(node, demand):
        return False
    need = demand.units
    return sum(1 for f in node.free if f >= need) >= demand.count


def fragment(node: Node, demand: Demand) -> int:
    """Free units of ``node`` that ``demand`` cannot use (the paper's node
    fragmentation for one task): all of them where it does not fit (its
    GPU model not accepted included), else those of devices with too little
    room for one of its parts."""
    if not fits(node, demand):
        return sum(node.free)
    need = demand.units
    return sum(f for f in node.free if f < need)


def fragmentation(node: Node, mix: Mix) -> float:
    """The node's expected fragmentation under ``mix``, units (the weights
    are normalised to sum 1)."""
    total = sum(w for _, w in mix)
    if total <= 0:
        return 0.0
    return sum(w * fragment(node, d) for d, w in mix) / total


def options(node: Node, demand: Demand) -> list[tuple[int, ...]]:
    """The distinct ways to place ``demand`` on ``node``: tuples of
    ``count`` device indices, ascending. Devices with the same free units
    are alike, so each distinct combination of amounts of room that hold
    ``units`` is offered once, on the lowest indices with those amounts (a
    whole-device part fits only empty devices, all alike: one option)."""
    if not host_fits(node, demand):
        return []
    need, count = demand.units, demand.count
    by_amount: dict[int, list[int]] = {}
    for i, f in enumerate(node.free):
        if f >= need:
            by_amount.setdefault(f, []).append(i)
    if sum(len(v) for v in by_amount.values()) < count:
        return []
    amounts = sorted(by_amount)
    out: list[tuple[int, ...]] = []

    def pick(j: int, left: int, chosen: list[int]) -> None:
        if not left:
            out.append(tuple(sorted(chosen)))
            return
        if j == len(amounts):
            return
        devices = by_amount[amounts[j]]
        for k in range(min(left, len(devices)), -1, -1):
            pick(j + 1, left - k, chosen + devices[:k])

    pick(0, count, [])
    return out


def first_fit(node: Node, demand: Demand) -> tuple[int, ...] | None:
    """The ``count`` lowest device indices with room for ``demand``, or
    ``None`` (host CPU or memory short, a GPU model it does not accept, or
    too few devices)."""
    if not host_fits(node, demand):
        return None
    room = [i for i, f in enumerate(node.free) if f >= demand.units]
    return tuple(room[: demand.count]) if len(room) >= demand.count else None


def after(node: Node, demand: Demand, devices: Iterable[int]) -> Node:
    """``node`` once ``demand`` holds ``devices``."""
    free = list(node.free)
    for i in devices:
        free[i] -= demand.units
    return Node(
        tuple(free),
        None if node.cpu is None else node.cpu - demand.cpu,
        None if node.memory is None else node.memory - demand.memory,
        node.model,
    )


class Scorer:
    """Scores placements of demands on nodes under one strategy and mix,
    remembering expected fragmentation per node state (nodes in the same
    state score alike, so a cluster of many equal nodes is cheap).

    Args:
        strategy: one of :data:`STRATEGIES`.
        mix: the demands expected and their weights (``fgd`` and
            ``packing``; ignored by the others).

    Raises:
        ValueError: an unknown strategy.
    """

    def __init__(self, strategy: str, mix: Mix = ()) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy {strategy!r}: use one of {', '.join(STRATEGIES)}")
        self.strategy = strategy
        self.mix = list(mix)
        units = sum(w * d.size for d, w in self.mix)
        #: host milli-cores and MiB per GPU unit the mix asks for
        self.cpu_per_unit = sum(w * d.cpu for d, w in self.mix) / units if units else 0.0
        self.memory_per_unit = sum(w * d.memory for d, w in self.mix) / units if units else 0.0
        self._frag: dict[tuple[tuple[int, ...], int | None, int | None, str], float] = {}
        self._best: dict[
            tuple[object, Demand], tuple[tuple[float, ...], tuple[int, ...]] | None
        ] = {}

    def expected(self, node: Node) -> float:
        """:func:`fragmentation` of ``node`` under the scorer's mix (memoised)."""
        key = node.key()
        value = self._frag.get(key)
        if value is None:
            value = fragmentation(node, self.mix)
            self._frag[key] = value
        return value

    def stranded(self, node: Node) -> float:
        """Free units of ``node`` that its free CPU or memory cannot feed,
        at the mix's CPU and memory per unit (0 when host resources are not
        modelled or the mix asks for none)."""
        free = sum(node.free)
        short = 0.0
        if node.cpu is not None and self.cpu_per_unit:
            short = max(short, free - node.cpu / self.cpu_per_unit)
        if node.memory is not None and self.memory_per_unit:
            short = max(short, free - node.memory / self.memory_per_unit)
        return short

    def score(self, node: Node, demand: Demand) -> tuple[tuple[float, ...], tuple[int, ...]] | None:
        """The key of the best placement of ``demand`` on ``node`` (lower
        wins; compare keys across nodes, ties to the caller's order) and the
        free units of the devices it takes (ascending), or ``None`` when it
        does not fit. Memoised per node state (:meth:`place` turns the
        amounts into device indices of a given node)."""
        key = (node.key(), demand)
        if key in self._best:
            return self._best[key]
        found = self._score(node, demand)
        if found is not None:
            found = (found[0], tuple(sorted(node.free[i] for i in found[1])))
        self._best[key] = found
        return found

    def _score(
        self, node: Node, demand: Demand
    ) -> tuple[tuple[float, ...], tuple[int, ...]] | None:
        strategy = self.strategy
        if strategy in ("first-fit", "random"):
            lowest = first_fit(node, demand)
            return None if lowest is None else ((0.0,), lowest)
        choices = options(node, demand)
        if not choices:
            return None
        left_node = sum(node.free) - demand.size
        best: tuple[tuple[float, ...], tuple[int, ...]] | None = None
        before = self.expected(node) if strategy in ("fgd", "packing") else 0.0
        if strategy == "packing":
            before += STRAND_WEIGHT * self.stranded(node)
        for devices in choices:
            # room left on the devices it takes (one device: that device's)
            left_device = sum(node.free[i] for i in devices) - demand.size
            if strategy == "best-fit":
                key: tuple[float, ...] = (float(left_node), float(left_device))
            else:
                next_node = after(node, demand, devices)
                value = self.expected(next_node)
                if strategy == "packing":
                    value += STRAND_WEIGHT * self.stranded(next_node)
                gradient = round(value - before, 6)
                key = (gradient,) if strategy == "fgd" else (gradient, left_device, left_node)
            if best is None or key < best[0]:
                best = (key, devices)
        return best

    def place(self, node: Node, demand: Demand) -> tuple[int, ...] | None:
        """The devices of ``node`` that ``demand`` takes under the strategy,
        or ``None`` when it does not fit."""
        if self.strategy in ("first-fit", "random"):
            # by index, which the memo (keyed by the sorted room) does not keep
            return first_fit(node, demand)
        found = self.score(node, demand)
        if found is None:
            return None
        chosen: list[int] = []
        for amount in found[1]:  # the lowest index with each amount of room
            for i, f in enumerate(node.free):
                if f == amount and i not in chosen:
                    chosen.append(i)
                    break
        return tuple(sorted(chosen))


def choose(
    nodes: Mapping[str, Node], demand: Demand, scorer: Scorer, order: Sequence[str] | None = None
) -> tuple[str, tuple[int, ...]] | None:
    """The node and devices ``demand`` goes to among ``nodes``, or ``None``.

    ``order``: the nodes' order for ties and ``first-fit`` (default: the
    mapping's order). ``random`` is not chosen here: the caller draws among
    the nodes where :func:`fits`.
    """
    best: tuple[tuple[float, ...], int, str] | None = None
    for rank, name in enumerate(order if order is not None else list(nodes)):
        found = scorer.score(nodes[name], demand)
        if found is None:
            continue
        if best is None or found[0] < best[0]:
            best = (found[0], rank, name)
            if scorer.strategy == "first-fit":
                break
    if best is None:
        return None
    name = best[2]
    devices = scorer.place(nodes[name], demand)
    assert devices is not None
    return name, devices
