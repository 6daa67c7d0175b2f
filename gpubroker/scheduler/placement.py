"""Where a request's devices go: the pass's device pool and topology-aware
gang placement (all devices of a request on one node, joined as closely as
the node's topology allows: NVLink, then one PCIe switch, ...).
"""

from __future__ import annotations

import datetime as dt
import heapq
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from .types import Slot, Topology, in_pool

#: a time later than any other, for devices with no known end
NEVER = dt.datetime.max.replace(tzinfo=dt.timezone.utc)


def link_cost(topology: Topology | None, indices: tuple[int, ...]) -> tuple[int, int]:
    """(worst, total) link level over all pairs of ``indices``; lower is closer."""
    if topology is None or len(indices) < 2:
        return (0, 0)
    levels = [topology[a][b] for i, a in enumerate(indices) for b in indices[i + 1 :]]
    return (max(levels), sum(levels))


def closest_set(slots: list[Slot], k: int, topology: Topology | None) -> tuple[Slot, ...]:
    """``k`` of ``slots`` (one node) joined as closely as possible.

    Greedy from every seed: add the device nearest to those chosen; keep the
    set with the lowest (worst link, total link, indices). ``O(n^2 k)``.
    """
    ordered = sorted(slots, key=lambda s: s.index)
    if topology is None or k < 2 or len(ordered) == k:
        return tuple(ordered[:k])
    best: tuple[tuple[int, int, tuple[int, ...]], tuple[Slot, ...]] | None = None
    for seed in ordered:
        chosen = [seed]
        rest = [s for s in ordered if s is not seed]
        while len(chosen) < k:
            nxt = min(
                rest, key=lambda s: (max(topology[c.index][s.index] for c in chosen), s.index)
            )
            chosen.append(nxt)
            rest.remove(nxt)
        indices = tuple(sorted(s.index for s in chosen))
        key = (*link_cost(topology, indices), indices)
        if best is None or key < best[0]:
            best = (key, tuple(sorted(chosen, key=lambda s: s.index)))
    assert best is not None
    return best[1]


K = TypeVar("K")
T = TypeVar("T", bound=Hashable)


class Best(Generic[T, K]):
    """The item of least key among ``items``, kept current as items change.

    ``score(item)`` gives its key (unique per item) with a payload, or
    ``None`` when the item does not qualify. :meth:`touch` marks an item
    changed; it is scored again on the next :meth:`best` (lazy heap).
    """

    def __init__(self, items: Iterable[T], score: Callable[[T], tuple[K, object] | None]) -> None:
        self.score = score
        self.members = set(items)
        self.current: dict[T, tuple[K, object] | None] = {}
        self.heap: list[tuple[K, T]] = []
        self.stale: set[T] = set(self.members)

    def touch(self, item: T) -> None:
        """``item`` changed: score it again before the next answer."""
        if item in self.members:
            self.stale.add(item)

    def best(self) -> tuple[K, T, object] | None:
        """``(key, item, payload)`` of the least key, or ``None``."""
        if self.stale:
            for item in self.stale:
                found = self.score(item)
                self.current[item] = found
                if found is not None:
                    heapq.heappush(self.heap, (found[0], item))
            self.stale.clear()
        heap = self.heap
        while heap:
            key, item = heap[0]
            found = self.current.get(item)
            if found is not None and found[0] == key:
                return key, item, found[1]
            heapq.heappop(heap)
        return None


@dataclass
class Pool:
    """The devices of one pass: which are free, reserved, and when others free up.

    Attributes:
        now: the pass's time.
        free: free devices per node (not drained, not held, not earmarked).
        reserved_from: earliest reservation start per reserved device; a
            request may use such a device now only if it ends before then.
        available_from: when each device is next free for planning
            (``NEVER`` when unknown).
    """

    now: dt.datetime
    slots: dict[str, Slot]
    topology: Mapping[str, Topology]
    free: dict[str, dict[str, Slot]] = field(default_factory=lambda: defaultdict(dict))
    by_node: dict[str, list[Slot]] = field(default_factory=lambda: defaultdict(list))
    reserved_from: dict[str, dt.datetime] = field(default_factory=dict)
    available_from: dict[str, dt.datetime] = field(default_factory=dict)
    earmarked: set[str] = field(default_factory=set)
    _largest: int | None = None
    #: :meth:`largest_node` per pool asked for (not ``None``)
    _largest_in: dict[str, int] = field(default_factory=dict)
    _largest_free: int | None = None
    _times: dict[str, list[dt.datetime]] = field(default_factory=dict)
    #: per node, per pool: sorted next-free times of its devices of that pool
    _pool_times_cache: dict[str, dict[str, list[dt.datetime]]] = field(default_factory=dict)
    #: per (gpus, pool asked for): the node whose ``gpus``-th device frees up first
    _reserve_best: dict[tuple[int, str | None], Best[str, tuple[dt.datetime, str]]] = field(
        default_factory=dict
    )
    #: counts changes of ``free`` (grants, earmarks): answers cached by the
    #: pass stay valid while it is unchanged
    version: int = 0
    _fits: dict[tuple[int, str | None], tuple[int, bool]] = field(default_factory=dict)
    #: counts changes of anything a reservation reads (free and earmarked
    #: devices, next-free times, reservation starts)
    plan_version: int = 0
    #: reservations that changed nothing: (gpus, duration, pool) ->
    #: (plan version, answer); asked again unchanged, the answer is the same
    _idle_reservations: dict[
        tuple[int, float | None, str | None],
        tuple[int, tuple[dt.datetime, tuple[str, ...]] | None],
    ] = field(default_factory=dict)
    #: (the pool of every device in service, or None), once known
    _only_pool: tuple[str | None] | None = None

    @classmethod
    def build(
        cls,
        slots: Iterable[Slot],
        busy_until: Mapping[str, dt.datetime],
        earmarked: Iterable[str],
        topology: Mapping[str, Topology],
        now: dt.datetime,
    ) -> Pool:
        """A pool where ``busy_until`` maps held devices to their expected end."""
        in_service = {s.uuid: s for s in slots if not s.drained}
        pool = cls(now, in_service, topology, earmarked=set(earmarked))
        for slot in in_service.values():
            pool.by_node[slot.node].append(slot)
            if slot.uuid in busy_until:
                pool.available_from[slot.uuid] = busy_until[slot.uuid]
            else:
                pool.available_from[slot.uuid] = now
                if slot.uuid not in pool.earmarked:
                    pool.free[slot.node][slot.uuid] = slot
        return pool

    def node_of(self, uuid: str) -> str | None:
        """The node of an in-service device (``None`` if drained or unknown)."""
        slot = self.slots.get(uuid)
        return None if slot is None else slot.node

    def largest_node(self, pool: str | None = None) -> int:
        """Devices in service on the node with the most of them (fixed for
        the pass): of all devices, or, when ``pool`` is given (a pool's name
        or :data:`~gpubroker.scheduler.types.INTERACTIVE_POOLS`), of the
        devices a request for ``pool`` may use (:func:`in_pool`); 0 when
        there are none."""
        if pool is None or pool == self.only_pool():
            if self._largest is None:
                self._largest = max((len(v) for v in self.by_node.values()), default=0)
            return self._largest
        largest = self._largest_in.get(pool)
        if largest is None:
            largest = self._largest_in[pool] = max(
                (sum(1 for s in v if in_pool(s, pool)) for v in self.by_node.values()), default=0
            )
        return largest

    def largest_free(self) -> int:
        """Most free devices on one node, reservations aside (cached until a change)."""
        if self._largest_free is None:
            self._largest_free = max((len(v) for v in self.free.values()), default=0)
        return self._largest_free

    def take(self, uuids: Iterable[str], until: dt.datetime) -> None:
        """Mark ``uuids`` held until ``until`` (``NEVER`` if unknown)."""
        for uuid in uuids:
            self._unfree(uuid)
            self.set_available(uuid, until)

    def set_available(self, uuid: str, when: dt.datetime) -> None:
        """Record that ``uuid`` is next free at ``when``."""
        if self.available_from.get(uuid) == when:
            return  # no change: what is cached about its node still holds
        self.available_from[uuid] = when
        self.plan_version += 1
        slot = self.slots.get(uuid)
        if slot is not None:
            self._node_changed(slot.node)

    def earmark(self, uuids: Iterable[str]) -> None:
        """Keep ``uuids`` for the request they are being reclaimed for."""
        for uuid in uuids:
            self._unfree(uuid)
            self.earmarked.add(uuid)

    def _unfree(self, uuid: str) -> None:
        self._largest_free = None
        self.version += 1
        self.plan_version += 1
        node = self.slots[uuid].node
        self._node_changed(node)
        free = self.free.get(node)
        if free is not None:
            free.pop(uuid, None)
            if not free:
                del self.free[node]

    def _node_changed(self, node: str) -> None:
        """Forget what is cached about ``node``'s next-free times."""
        self._times.pop(node, None)
        self._pool_times_cache.pop(node, None)
        for best in self._reserve_best.values():
            best.touch(node)

    def usable(self, node: str, ends: dt.datetime, pool: str | None = None) -> list[Slot]:
        """Free devices of ``node`` (of pool ``pool`` when given) a request
        ending at ``ends`` may use now."""
        return [
            s
            for s in self.free.get(node, {}).values()
            if ends <= self.reserved_from.get(s.uuid, NEVER) and (pool is None or in_pool(s, pool))
        ]

    def place(
        self,
        gpus: int,
        ends: dt.datetime,
        pool: str | None = None,
        prefer: tuple[str, ...] = (),
    ) -> tuple[str, ...] | None:
        """Devices for a request of ``gpus`` ending at ``ends``, or ``None``.

        ``prefer`` (``gpus`` devices of one node, e.g. those a restarted
        server held) wins when every one of them is usable now. Otherwise,
        among nodes with room, the one with the fewest usable devices (best
        fit), then the closest set by topology. ``pool``: only devices of
        that pool.
        """
        if gpus > self.largest_free():
            return None
        if len(prefer) == gpus:
            home = self.node_of(prefer[0])
            ready = {s.uuid for s in self.usable(home, ends, pool)} if home else set()
            if ready.issuperset(prefer):
                return tuple(sorted(prefer, key=lambda uuid: self.slots[uuid].index))
        best: tuple[tuple[int, int, int, str], tuple[Slot, ...]] | None = None
        for node, free in self.free.items():
            if len(free) < gpus:
                continue
            usable = self.usable(node, ends, pool)
            if len(usable) < gpus:
                continue
            chosen = closest_set(usable, gpus, self.topology.get(node))
            cost = link_cost(self.topology.get(node), tuple(s.index for s in chosen))
            key = (len(usable), *cost, node)
            if best is None or key < best[0]:
                best = (key, chosen)
        return None if best is None else tuple(s.uuid for s in best[1])

    def only_pool(self) -> str | None:
        """The pool of every device in service when they are all of one (else ``None``)."""
        if self._only_pool is None:
            pools = {s.pool for s in self.slots.values()}
            self._only_pool = (pools.pop() if len(pools) == 1 else None,)
        return self._only_pool[0]

    def fits_ignoring_reservations(self, gpus: int, pool: str | None = None) -> bool:
        """Whether ``gpus`` free devices (of ``pool`` when given) exist on one
        node, reservations aside."""
        if pool is None or pool == self.only_pool():
            return self.largest_free() >= gpus
        cached = self._fits.get((gpus, pool))
        if cached is not None and (cached[0] == self.version or not cached[1]):
            return cached[1]  # free devices only go during a pass: a "no" stays "no"
        fits = any(
            sum(1 for s in free.values() if in_pool(s, pool)) >= gpus for free in self.free.values()
        )
        self._fits[(gpus, pool)] = (self.version, fits)
        return fits

    def reserve(
        self, gpus: int, duration: float | None, pool: str | None = None
    ) -> tuple[dt.datetime, tuple[str, ...]] | None:
        """Reserve the ``gpus`` devices of one node that free up first.

        Returns:
            (start, devices): ``start`` is ``NEVER`` when some device has no
            known end; such a reservation still holds the node's free devices
            back from requests behind it. ``None`` when no node is big enough.

        A reservation that changes nothing (e.g. behind another of the same
        size on devices with no known end) is remembered: asked again before
        anything changed, the same answer is given without a search.
        """
        key = (gpus, duration, pool)
        idle = self._idle_reservations.get(key)
        if idle is not None and idle[0] == self.plan_version:
            return idle[1]
        before = self.plan_version
        answer = self._reserve(gpus, duration, pool)
        if self.plan_version == before:
            self._idle_reservations[key] = (before, answer)
        return answer

    def _reserve(
        self, gpus: int, duration: float | None, pool: str | None
    ) -> tuple[dt.datetime, tuple[str, ...]] | None:
        """:meth:`reserve`, searched."""
        found = self._first_free(gpus, pool)
        if found is None:
            return None
        start, node = found
        candidates = [
            s
            for s in self.by_node[node]
            if s.uuid not in self.earmarked and (pool is None or in_pool(s, pool))
        ]
        chosen = sorted(candidates, key=lambda s: (self.available_from[s.uuid], s.index))[:gpus]
        hold_from = start if start < NEVER else self.now
        end = (
            NEVER if duration is None or start >= NEVER else start + dt.timedelta(seconds=duration)
        )
        moved = False
        available = self.available_from
        for slot in chosen:
            uuid = slot.uuid
            if hold_from < self.reserved_from.get(uuid, NEVER):
                self.reserved_from[uuid] = hold_from
                self.plan_version += 1
            if end > available[uuid]:
                available[uuid] = end
                moved = True
        if moved:  # set_available for each, with the node's caches dropped once
            self.plan_version += 1
            self._node_changed(node)
        return start, tuple(s.uuid for s in chosen)

    def _first_free(self, gpus: int, pool: str | None) -> tuple[dt.datetime, str] | None:
        """``(start, node)``: the node where ``gpus`` devices (of ``pool`` when
        named, not earmarked) are free first, at ``start``; the least such
        pair (ties: node name). ``None`` when no node has that many devices.

        Kept in a lazy heap per ``(gpus, pool)``: only nodes whose times
        changed are scored again (the answer is that of a scan of all nodes).
        """
        if pool is not None and pool == self.only_pool():
            pool = None  # every device is of that pool: the same answer as for any pool
        best = self._reserve_best.get((gpus, pool))
        if best is None:

            def score(node: str) -> tuple[tuple[dt.datetime, str], None] | None:
                times = self._node_times(node) if pool is None else self._pool_times(node, pool)
                return ((times[gpus - 1], node), None) if len(times) >= gpus else None

            best = Best(self.by_node, score)
            self._reserve_best[(gpus, pool)] = best
        found = best.best()
        return None if found is None else found[0]

    def _pool_times(self, node: str, pool: str) -> list[dt.datetime]:
        """Sorted next-free times of ``node``'s devices of ``pool`` not earmarked (cached)."""
        per_pool = self._pool_times_cache.setdefault(node, {})
        times = per_pool.get(pool)
        if times is None:
            times = sorted(
                self.available_from[s.uuid]
                for s in self.by_node[node]
                if s.uuid not in self.earmarked and in_pool(s, pool)
            )
            per_pool[pool] = times
        return times

    def _node_times(self, node: str) -> list[dt.datetime]:
        """Sorted next-free times of ``node``'s devices not earmarked (cached)."""
        times = self._times.get(node)
        if times is None:
            times = sorted(
                self.available_from[s.uuid]
                for s in self.by_node[node]
                if s.uuid not in self.earmarked
            )
            self._times[node] = times
        return times
