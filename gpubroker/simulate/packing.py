"""The packing experiment: how much of a cluster's GPU capacity a placement
strategy fills when GPU-sharing pods arrive in order and never leave.

The setup of Weng et al., "Beware of Fragmentation" (USENIX ATC 2023), on
Alibaba's openb trace: pods are drawn from the trace's GPU pods at random
(with replacement, seeded) until the GPU capacity they ask for reaches a
target share of the cluster's (e.g. 130 %); each is placed when it arrives
or fails (nothing waits, nothing departs). The measure is the requested GPU
capacity placed / the cluster's GPU capacity, read when the arrivals reach
each checkpoint (one run serves 100 % and 130 %: the draws of the longer run
begin with those of the shorter). Also reported: the paper's fragmentation
(the expected free capacity that a pod of the workload's mix could not use,
:func:`gpubroker.scheduler.packing.fragmentation`) / capacity at the end.

What is modelled: each GPU as :data:`~gpubroker.scheduler.packing.UNIT`
milli-GPU units of compute and memory; a pod's ``num_gpu`` devices of
``gpu_milli`` units each on one node (whole devices must be empty); its
``gpu_spec`` models; and, as the paper's simulator does, each node's CPU
(milli-cores) and memory (MiB) against the pods' requests (``host=False``
leaves them out). Not modelled: the paper's other Kubernetes filters
(affinity, taints), and GPU memory apart from compute (openb gives one
fraction for both).

Every placement goes through :func:`gpubroker.scheduler.apply` (a share
grant on the node's devices, checked against what their leases hold), the
code the broker applies its decisions with, so a placement that would
overfill a device is an error, not a result.
"""

from __future__ import annotations

import bisect
import csv
import datetime as dt
import heapq
import random
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..scheduler import Decisions, Grant, Part, Request, Running, SchedulerState, Slot
from ..scheduler.apply import ApplyError, apply
from ..scheduler.packing import (
    STRATEGIES,
    UNIT,
    Demand,
    Node,
    Scorer,
    fits,
    fragmentation,
    options,
)
from .readers import Trace, TraceError

#: the pool of every device in the experiment
POOL = "packing"
#: the time of every grant (nothing in the experiment depends on time)
T0 = dt.datetime(2023, 7, 1, tzinfo=dt.timezone.utc)
#: checkpoints of arrived demand / capacity, by default
CHECKPOINTS = (1.0, 1.3)


class PackingError(ValueError):
    """The experiment cannot run (no nodes, no GPU pods, a bad argument)."""


@dataclass(frozen=True)
class HostNode:
    """One node of the experiment's cluster.

    Attributes:
        name: its name.
        gpus: its GPUs.
        model: their model.
        cpu_milli: its CPU, milli-cores (``None``: not modelled).
        memory_mib: its memory, MiB (``None``: not modelled).
    """

    name: str
    gpus: int
    model: str
    cpu_milli: int | None = None
    memory_mib: int | None = None


@dataclass(frozen=True)
class Pod:
    """One pod of the workload: its demand and the GPU models it accepts
    (empty: any). :func:`pods_of` puts the models in the demand too
    (:attr:`Demand.models`), which is what placement and fragmentation
    read; a pod whose ``models`` name more than its demand's is still
    placed only on them."""

    name: str
    demand: Demand
    models: frozenset[str] = frozenset()


def read_openb_nodes(path: str | Path) -> list[HostNode]:
    """The openb node list (``sn, cpu_milli, memory_mib, gpu, model``);
    nodes without GPUs are left out. Names and models are stripped of
    spaces.

    Raises:
        TraceError: unreadable, a column missing or not a number, a name
            repeated, or a node with GPUs but no model (placement and
            fragmentation match models against pods' ``gpu_spec``).
    """
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except OSError as err:
        raise TraceError(f"cannot read node list {path}: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise TraceError(f"node list {path} is not UTF-8 text ({err.reason})") from None
    reader = csv.DictReader(text.splitlines())
    need = {"sn", "cpu_milli", "memory_mib", "gpu", "model"}
    if not need <= set(reader.fieldnames or ()):
        raise TraceError(f"{path}: not an openb node list (needs {', '.join(sorted(need))})")
    nodes = []
    names: set[str] = set()
    for row in reader:
        where = f"{path}, line {reader.line_num}"
        try:
            gpus = int(row["gpu"])
            node = HostNode(
                (row["sn"] or "").strip(),
                gpus,
                (row["model"] or "").strip(),
                int(row["cpu_milli"]),
                int(row["memory_mib"]),
            )
        except (TypeError, ValueError):
            raise TraceError(f"{where}: not numbers: {row}") from None
        if min(gpus, node.cpu_milli or 0, node.memory_mib or 0) < 0:
            raise TraceError(f"{where}: gpu, cpu_milli and memory_mib must be >= 0: {row}")
        if gpus > 0 and not node.model:
            raise TraceError(f"{where}: node {node.name} has {gpus} GPUs but no model")
        if node.name in names:
            raise TraceError(f"{where}: node {node.name} is listed twice")
        names.add(node.name)
        if gpus > 0:
            nodes.append(node)
    if not nodes:
        raise TraceError(f"{path}: no node with GPUs")
    return nodes


def pods_of(trace: Trace, host: bool = True) -> list[Pod]:
    """The trace's GPU pods as demands (:func:`~gpubroker.simulate.readers.read_openb_pods`);
    ``host``: keep their CPU and memory requests (an empty one counts as 0;
    the reader counts such pods in :attr:`Trace.defaulted`). Each demand carries its
    pod's ``gpu_spec`` models, so that fragmentation and FGD count a GPU
    of another model as fragment for it (as the paper does)."""
    pods = []
    for job in trace.jobs:
        units = round((job.share if job.share is not None else 1.0) * UNIT)
        models = frozenset(job.gpu_models)
        demand = Demand(
            job.gpus,
            units,
            (job.cpu_milli or 0) if host else 0,
            (job.memory_mib or 0) if host else 0,
            models,
        )
        pods.append(Pod(job.job_id, demand, models))
    return pods


def draw(pods: Sequence[Pod], capacity: int, target: float, seed: int) -> list[Pod]:
    """Pods drawn from ``pods`` at random (with replacement, ``seed``) until
    the units they ask for reach ``target`` x ``capacity`` units."""
    if not pods:
        raise PackingError("no GPU pods to draw from")
    rng = random.Random(seed)
    drawn: list[Pod] = []
    total = 0
    while total < target * capacity:
        pod = pods[rng.randrange(len(pods))]
        drawn.append(pod)
        total += pod.demand.size
    return drawn


def workload_mix(pods: Iterable[Pod]) -> list[tuple[Demand, float]]:
    """Each demand of ``pods`` with how often it comes (the paper's
    popularity, known in advance as FGD assumes)."""
    counts: dict[Demand, int] = {}
    for pod in pods:
        counts[pod.demand] = counts.get(pod.demand, 0) + 1
    return [(d, float(n)) for d, n in counts.items()]


class OnlineMix:
    """The mix learned from recent arrivals: the last ``window`` demands
    (the broker's policy learns it; it does not know the workload in
    advance).

    It is handed to a new scorer early and often while few demands have
    been seen, then every ``refresh`` arrivals: after the 1st, 2nd, 3rd,
    5th, 9th, 17th, 33rd, ... arrival (whenever the arrivals since the last hand-on
    reach half of those seen), until that spacing reaches ``refresh``. A
    mix of the first few pods alone steers the first placements, which
    decide how the cluster fills; handing on only every 500 arrivals left
    the first 500 scored by one pod's demand. On the openb default list at
    130 %, share placed, median (lowest) of ten seeds, before and after:
    seeds 0-9 0.9602 (0.9526) and 0.9598 (0.9589); seeds 10-19, not used to
    choose this, 0.9589 (0.9518) and 0.9598 (0.9580).
    """

    def __init__(self, window: int = 2000, refresh: int = 500) -> None:
        if window < 1 or refresh < 1:
            raise PackingError("the online mix needs window >= 1 and refresh >= 1")
        self.window, self.refresh = window, refresh
        self.recent: list[Demand] = []
        self._since = 0
        self._seen = 0

    def see(self, demand: Demand) -> bool:
        """Count an arrival; ``True`` when the mix is due to be handed on."""
        self.recent.append(demand)
        if len(self.recent) > 2 * self.window:
            del self.recent[: -self.window]
        self._since += 1
        self._seen += 1
        if self._since >= min(self.refresh, self._seen // 2):
            self._since = 0
            return True
        return False

    def mix(self) -> list[tuple[Demand, float]]:
        """The demands of the window with their counts."""
        counts: dict[Demand, int] = {}
        for demand in self.recent[-self.window :]:
            counts[demand] = counts.get(demand, 0) + 1
        return [(d, float(n)) for d, n in counts.items()]


class Packer:
    """The cluster's free capacity, placing pods one at a time.

    Nodes in the same state (model, free units per device, CPU, memory)
    are alike: they are kept in groups, and for each demand a lazy heap
    holds the groups' scores, rescored only for the groups that changed
    since that demand last came (so a pod costs work per change, not per
    node).
    """

    def __init__(self, nodes: Sequence[HostNode], scorer: Scorer, seed: int = 0) -> None:
        if not nodes:
            raise PackingError("no nodes")
        self.nodes = list(nodes)
        self.rng = random.Random(seed)
        self.state = [Node((UNIT,) * n.gpus, n.cpu_milli, n.memory_mib, n.model) for n in nodes]
        self.slots = [
            tuple(
                Slot(
                    f"{n.name}/{i}",
                    n.name,
                    i,
                    pool=POOL,
                    mode="timeslice",
                    model=n.model,
                    memory_mib=UNIT,
                )
                for i in range(n.gpus)
            )
            for n in nodes
        ]
        #: device index on its node, by device UUID
        self.device_index = {s.uuid: s.index for slots in self.slots for s in slots}
        self.leases: list[list[Running]] = [[] for _ in nodes]
        self.groups: dict[tuple[str, Any], list[int]] = {}
        self._keys = [self._key(i) for i in range(len(nodes))]
        for index in range(len(nodes)):
            bisect.insort(self.groups.setdefault(self._keys[index], []), index)
        self._next_id = 1
        #: groups changed, in order (what each demand's heap has not seen yet)
        self._changes: list[tuple[str, Any]] = []
        self._heaps: dict[Demand, tuple[list[tuple[tuple[float, ...], int, Any]], int]] = {}
        self.scorer = scorer

    @property
    def scorer(self) -> Scorer:
        """The scorer; a new one drops every demand's heap."""
        return self._scorer

    @scorer.setter
    def scorer(self, scorer: Scorer) -> None:
        self._scorer = scorer
        self._heaps = {}

    def _key(self, index: int) -> tuple[str, Any]:
        return (self.nodes[index].model, self.state[index].key())

    def _move(self, index: int, node: Node) -> None:
        """Node ``index`` is now in state ``node``: move it between groups."""
        old = self._keys[index]
        members = self.groups[old]
        members.remove(index)
        if not members:
            del self.groups[old]
        self.state[index] = node
        new = self._keys[index] = self._key(index)
        bisect.insort(self.groups.setdefault(new, []), index)
        self._changes += [old, new]

    def _heap(self, demand: Demand) -> list[tuple[tuple[float, ...], int, Any]]:
        """The demand's heap of (score, first member, group), brought up to
        date with the groups changed since it was last used."""
        found = self._heaps.get(demand)
        heap: list[tuple[tuple[float, ...], int, Any]]
        if found is None:
            heap, keys = [], list(self.groups)
        else:
            heap, seen = found
            keys = list(dict.fromkeys(self._changes[seen:]))
        score = self._scorer.score
        for key in keys:
            members = self.groups.get(key)
            if members:
                scored = score(self.state[members[0]], demand)
                if scored is not None:
                    heapq.heappush(heap, (scored[0], members[0], key))
        self._heaps[demand] = (heap, len(self._changes))
        return heap

    def choose(self, pod: Pod) -> tuple[int, tuple[int, ...]] | None:
        """The node index and device indices for ``pod``, or ``None``."""
        if self._scorer.strategy == "random":
            return self._random(pod)
        demand, models = pod.demand, pod.models
        heap = self._heap(demand)
        skipped = []
        index = None
        while heap:
            _, first, key = heap[0]
            members = self.groups.get(key)
            if not members or members[0] != first:
                heapq.heappop(heap)  # stale: the group changed (it was pushed again)
                continue
            if models and key[0] not in models:
                skipped.append(heapq.heappop(heap))
                continue
            index = first
            break
        for entry in skipped:
            heapq.heappush(heap, entry)
        if index is None:
            return None
        devices = self._scorer.place(self.state[index], demand)
        assert devices is not None
        return index, devices

    def _random(self, pod: Pod) -> tuple[int, tuple[int, ...]] | None:
        able = [
            members
            for (model, _), members in self.groups.items()
            if (not pod.models or model in pod.models) and fits(self.state[members[0]], pod.demand)
        ]
        pick = self.rng.randrange(sum(len(m) for m in able)) if able else -1
        for members in able:
            if pick < len(members):
                index = members[pick]
                choices = options(self.state[index], pod.demand)
                return index, choices[self.rng.randrange(len(choices))]
            pick -= len(members)
        return None

    def place(self, pod: Pod) -> bool:
        """Place ``pod`` (through :func:`~gpubroker.scheduler.apply`); ``False``
        when it fits nowhere.

        Raises:
            PackingError: the placement overfills a device, or puts the pod
                on a GPU model outside its ``models`` (a bug).
        """
        found = self.choose(pod)
        if found is None:
            return False
        index, devices = found
        model = self.nodes[index].model
        if (pod.models and model not in pod.models) or (
            pod.demand.models and model not in pod.demand.models
        ):
            raise PackingError(
                f"pod {pod.name} placed on {self.nodes[index].name}, a {model}, "
                f"outside its models {sorted(pod.models | pod.demand.models)}"
            )
        self.hold(index, self._grant(index, pod, devices), pod.demand)
        return True

    def hold(self, index: int, lease: Running, demand: Demand) -> None:
        """Node ``index`` now holds ``lease`` (its share parts) and the host
        CPU and memory of ``demand``."""
        node = self.state[index]
        free = list(node.free)
        for part in lease.parts:
            free[self.device_index[part.device]] -= part.memory_mib
        self._move(
            index,
            Node(
                tuple(free),
                None if node.cpu is None else node.cpu - demand.cpu,
                None if node.memory is None else node.memory - demand.memory,
                node.model,
            ),
        )
        self.leases[index].append(lease)

    def _grant(self, index: int, pod: Pod, devices: tuple[int, ...]) -> Running:
        lease_id, self._next_id = self._next_id, self._next_id + 1
        units = pod.demand.units
        slots = self.slots[index]
        request = Request(
            lease_id, "openb", pod.demand.count, T0, kind="share", memory_mib=units, pool=POOL
        )
        parts = tuple(Part(slots[i].uuid, "share", units / UNIT, memory_mib=units) for i in devices)
        state = SchedulerState(slots=slots, running=tuple(self.leases[index]), pending=(request,))
        try:
            applied = apply(state, Decisions(grants=(Grant(lease_id, (), parts),)), T0)
        except ApplyError as err:
            raise PackingError(f"pod {pod.name} on {self.nodes[index].name}: {err}") from err
        return applied.granted[0]

    def fragmentation(self, mix: Sequence[tuple[Demand, float]]) -> float:
        """Expected fragmentation of the whole cluster under ``mix``, units."""
        return sum(fragmentation(self.state[m[0]], mix) * len(m) for m in self.groups.values())


@dataclass
class PackRun:
    """One strategy on one drawn workload.

    Attributes:
        strategy: the strategy.
        seed: the draw's seed.
        allocated: placed units / capacity at each checkpoint.
        failed: pods that fit nowhere.
        placed: pods placed.
        fragmentation: the paper's fragmentation / capacity at the end.
        place_us: per-pod placement time, microseconds (median).
    """

    strategy: str
    seed: int
    allocated: dict[float, float] = field(default_factory=dict)
    failed: int = 0
    placed: int = 0
    fragmentation: float = 0.0
    place_us: float = 0.0


def run_one(
    nodes: Sequence[HostNode],
    pods: Sequence[Pod],
    strategy: str,
    seed: int,
    checkpoints: Sequence[float] = CHECKPOINTS,
    online: tuple[int, int] = (2000, 500),
) -> PackRun:
    """Place ``pods`` drawn for the largest checkpoint with ``seed`` under
    ``strategy``; read the allocation at each checkpoint.

    ``fgd`` scores with the workload's mix known in advance, as in the
    paper: the mix of ``pods``, the population the draw samples (each
    demand weighted by how often it is in ``pods``, the expected mix of any
    draw), so that a checkpoint's figure does not depend on which larger
    checkpoints are asked for; ``packing`` learns its mix online
    (``online``: window and refresh, arrivals). The allocation at each
    checkpoint depends only on the pods drawn up to it (the draws of a
    longer run begin with those of a shorter one); the fragmentation is
    read at the end, after the largest checkpoint's arrivals, under the
    same population mix.

    Raises:
        PackingError: bad strategy or checkpoints, no nodes or pods.
    """
    if strategy not in STRATEGIES:
        raise PackingError(f"strategy {strategy!r}: use some of {', '.join(STRATEGIES)}")
    marks = sorted(checkpoints)
    if not marks or marks[0] <= 0:
        raise PackingError("checkpoints must be > 0")
    capacity = UNIT * sum(n.gpus for n in nodes)
    drawn = draw(pods, capacity, marks[-1], seed)
    # the population's mix, not the draw's: the draw's depends on its length,
    # so FGD's placements up to 100 % changed with the largest checkpoint
    full_mix = workload_mix(pods)
    learner = OnlineMix(*online) if strategy == "packing" else None
    packer = Packer(nodes, Scorer(strategy, full_mix if strategy == "fgd" else ()), seed)
    result = PackRun(strategy, seed)
    arrived = placed = 0
    times: list[float] = []
    pending_marks = list(marks)
    for pod in drawn:
        if learner is not None and learner.see(pod.demand):
            packer.scorer = Scorer(strategy, learner.mix())
        started = time.perf_counter()
        ok = packer.place(pod)
        times.append(time.perf_counter() - started)
        arrived += pod.demand.size
        if ok:
            placed += pod.demand.size
            result.placed += 1
        else:
            result.failed += 1
        while pending_marks and arrived >= pending_marks[0] * capacity:
            result.allocated[pending_marks.pop(0)] = placed / capacity
    for mark in pending_marks:
        result.allocated[mark] = placed / capacity
    result.fragmentation = packer.fragmentation(full_mix) / capacity
    result.place_us = 1e6 * statistics.median(times)
    return result


def experiment(
    nodes: Sequence[HostNode],
    pods: Sequence[Pod],
    strategies: Sequence[str] = STRATEGIES,
    seeds: Sequence[int] = range(5),
    checkpoints: Sequence[float] = CHECKPOINTS,
) -> dict[str, list[PackRun]]:
    """Every strategy on the same drawn workloads (one per seed)."""
    return {s: [run_one(nodes, pods, s, seed, checkpoints) for seed in seeds] for s in strategies}


def summarise(runs: Mapping[str, list[PackRun]], baseline: str = "best-fit") -> dict[str, Any]:
    """Median, min and max over seeds per strategy and checkpoint, and the
    ratio of each median to ``baseline``'s (when it ran)."""
    out: dict[str, Any] = {}
    for strategy, results in runs.items():
        marks = sorted(results[0].allocated)
        out[strategy] = {
            "seeds": [r.seed for r in results],
            "allocated": {
                f"{m:g}": {
                    "median": statistics.median(r.allocated[m] for r in results),
                    "min": min(r.allocated[m] for r in results),
                    "max": max(r.allocated[m] for r in results),
                }
                for m in marks
            },
            "fragmentation_median": statistics.median(r.fragmentation for r in results),
            "failed_median": statistics.median(r.failed for r in results),
            "place_us_median": statistics.median(r.place_us for r in results),
        }
    if baseline in out:
        for row in out.values():
            for mark, figures in row["allocated"].items():
                base = out[baseline]["allocated"][mark]["median"]
                figures[f"ratio_to_{baseline}"] = figures["median"] / base if base else None
    return out
