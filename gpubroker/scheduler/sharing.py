"""Fractional slots: MIG instances in ``mig`` pools, time-sliced shares in
``timeslice`` pools (pure: no NVML, no clock).

MIG rules (placements, overlaps, compute slices, instance limits) are those
of :mod:`gpubroker.devices.mig`, taken from NVIDIA's MIG User Guide. The
broker's MIG placement is *least stranding, best fit*: among the devices
where the profile fits, the placement that strands the fewest compute
slices (:func:`~gpubroker.devices.mig.least_stranding_placement`: e.g. a
``3g`` at slot 0 of an H100 leaves slot 7 dead), then the device with the
fewest free compute slices (so empty devices stay empty for large
profiles), then the placement that keeps the largest profiles placeable
(:func:`~gpubroker.devices.mig.best_placement`).
``first-fit`` (the first device by node and index, the lowest start slot) is
the baseline the benchmark compares it with.

Shares: a ``timeslice`` device hands out at most ``memory_mib - reserve_mib``
MiB in shares; the shares of one request go to distinct devices of one node,
placed by :mod:`gpubroker.scheduler.packing`'s ``packing`` strategy (the
one the packing experiment measures): the node and devices whose expected
fragmentation rises least under its pool's *share mix* (the share sizes
the pool's leases hold and its requests wait for, each lease or request
counted once, plus ``SchedulerState.share_sizes``: :func:`pool_mixes`),
then best fit (the least room left on the devices taken, then on the
node). ``SchedulerState.share_placement`` picks a baseline instead. Units
are MiB of share room; host CPU and memory are not modelled. With no share
mix (nothing held or waiting) every gradient is 0 and best fit decides.

Weights (quotas and usage, in device units): a MIG instance counts its
compute slices / the device's compute slices; a share its memory / the
device's memory.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..devices import mig
from . import packing
from .placement import Best
from .types import (
    INTERACTIVE_POOLS,
    Instance,
    Part,
    PoolMode,
    Request,
    Running,
    Slot,
    SlotKind,
    WaitReason,
    in_pool,
)

#: MIG placement strategies: the broker's, and the first-fit baseline
STRATEGIES = ("least-fragmentation", "first-fit")


def mig_weight(model: str, profile: str) -> float:
    """Device units of one ``profile`` instance on a ``model`` GPU:
    compute slices / the GPU's compute slices (``1g`` on an H100: 1/7).

    Raises:
        KeyError: the model has no MIG catalog entry or no such profile.
    """
    spec = mig.spec_for(model)
    if spec is None:
        raise KeyError(f"{model!r} has no MIG catalog entry")
    return spec.profile(profile).compute_slices / spec.compute_slices


def share_weight(memory_mib: int, device_memory_mib: int) -> float:
    """Device units of a share: its memory / the device's memory (0..1)."""
    return min(1.0, memory_mib / device_memory_mib) if device_memory_mib > 0 else 1.0


@dataclass(frozen=True)
class Miss:
    """Why a fractional request cannot be placed now.

    Attributes:
        reason: ``Resources``, ``Fragmented`` or ``PoolDrained``.
        detail: a sentence naming the pool, the slot and, for
            ``Fragmented``, the instances in the way (with their leases).
        blockers: ``(device, profile, placement, lease id or None)`` of the
            instances in the way (``Fragmented`` only).
    """

    reason: WaitReason
    detail: str
    blockers: tuple[tuple[str, str, str, int | None], ...] = ()


#: the arguments of a MIG :class:`Part`: device, kind, weight, profile,
#: start, size, memory (MiB), instance UUID
_PartArgs = tuple[str, str, float, str, int, int, int, str]

#: a MIG layout in a hashable, order-free form: sorted (profile, start, size)
LayoutKey = tuple[tuple[str, int, int], ...]


@functools.lru_cache(maxsize=4096)
def _placement(start: int, size: int) -> mig.Placement:
    """``mig.Placement(start, size)``, one shared (immutable) object per value."""
    return mig.Placement(start, size)


@functools.lru_cache(maxsize=1024)
def _profile_terms(spec_name: str, profile: str) -> tuple[float, int]:
    """(weight in device units, memory in MiB) of one ``profile`` instance
    on a ``spec_name`` device (compute slices / the device's)."""
    spec = mig.SPECS[spec_name]
    prof = spec.profile(profile)
    return prof.compute_slices / spec.compute_slices, prof.memory_mib or prof.memory_gib * 1024


@functools.lru_cache(maxsize=65536)
def _layout_of(key: LayoutKey) -> tuple[tuple[str, mig.Placement], ...]:
    return tuple((name, mig.Placement(start, size)) for name, start, size in key)


@functools.lru_cache(maxsize=65536)
def _free_compute(spec_name: str, key: LayoutKey) -> int:
    """Free compute slices of a ``spec_name`` device holding ``key``."""
    return mig.free_compute_slices(mig.SPECS[spec_name], _layout_of(key))


@functools.lru_cache(maxsize=65536)
def _mig_fit(
    spec_name: str, key: LayoutKey, profile: str, first_fit: bool
) -> tuple[int, int, int] | None:
    """Where a ``profile`` instance goes on a device holding ``key``:
    ``(start, size, compute slices stranded)`` or ``None``. Pure in its
    arguments (the MIG rules), so memoized across devices and passes."""
    spec = mig.SPECS[spec_name]
    layout = _layout_of(key)
    prof = spec.profile(profile)
    if _free_compute(spec_name, key) < prof.compute_slices or (
        mig.free_memory_slices(spec, layout) < prof.memory_slices
    ):
        return None  # cheap refusal before any placement is scored
    if first_fit:
        valid = mig.valid_placements(spec, layout, prof)
        return (valid[0].start, valid[0].size, 0) if valid else None
    found = mig.least_stranding_placement(spec, layout, prof)
    return None if found is None else (found[0].start, found[0].size, found[1])


@functools.lru_cache(maxsize=65536)
def _fragmented(spec_name: str, key: LayoutKey, profile: str) -> bool:
    return mig.is_fragmented(mig.SPECS[spec_name], _layout_of(key), profile)


@dataclass
class _Device:
    slot: Slot
    spec: mig.GpuMigSpec | None
    #: occupied MIG placements: (profile, placement) -> owning lease (None: foreign/static)
    layout: dict[tuple[str, mig.Placement], int | None] = field(default_factory=dict)
    free_static: list[Instance] = field(default_factory=list)
    reserved_mib: int = 0
    _key: LayoutKey | None = None
    #: MIG profile -> its score here (see SharingPool._mig_score), until changed()
    scores: dict[str, tuple[tuple[Any, ...], _PartArgs] | None] = field(default_factory=dict)
    _free: int | None = None

    @property
    def share_room(self) -> int:
        """MiB still grantable as shares."""
        return self.slot.memory_mib - self.slot.reserve_mib - self.reserved_mib

    @property
    def key(self) -> LayoutKey:
        """The layout, sorted (cached until :meth:`changed`)."""
        if self._key is None:
            self._key = tuple(sorted((n, p.start, p.size) for n, p in self.layout))
        return self._key

    def changed(self) -> None:
        """Its layout changed: forget the cached key and scores."""
        self._key = None
        self._free = None
        self.scores.clear()

    def free_compute(self) -> int:
        """Free compute slices (cached until :meth:`changed`)."""
        if self._free is None:
            assert self.spec is not None
            self._free = _free_compute(self.spec.name, self.key)
        return self._free


def share_mix(
    running: Iterable[Running], pending: Iterable[Request] = (), sizes: Iterable[int] = ()
) -> packing.Mix:
    """The share sizes held and asked for: one :class:`~gpubroker.scheduler.packing.Demand`
    (count, MiB per share) per distinct size, weighted by how many leases
    hold it and requests wait for it (the broker's online estimate of what
    comes next, for :mod:`~gpubroker.scheduler.packing`), plus each of
    ``sizes`` (MiB, one share) once."""
    counts: dict[packing.Demand, int] = {}
    for size in sizes:
        _count(counts, packing.Demand(1, size))
    for lease in running:
        shares = [p for p in lease.parts if p.kind == "share"]  # SlotKind.share.value
        if shares:
            _count(counts, packing.Demand(len(shares), shares[0].memory_mib))
    for request in pending:
        if request.kind == "share" and request.memory_mib > 0:
            _count(counts, packing.Demand(request.gpus, request.memory_mib))
    return [(d, float(n)) for d, n in counts.items()]


def pool_mixes(
    pools: Iterable[str],
    pool_of: Mapping[str, str],
    running: Iterable[Running],
    pending: Iterable[Request] = (),
    sizes: Iterable[int] = (),
    batch: frozenset[str] = frozenset(),
) -> dict[str, packing.Mix]:
    """:func:`share_mix` per time-sliced pool: a lease counts in the pool of
    its devices (``pool_of``: device UUID -> pool), a request in the pool it
    names (every pool when it names none; every pool but the ``batch``
    ones for :data:`INTERACTIVE_POOLS`), ``sizes`` in every pool."""
    names = list(pools)
    held: dict[str, list[Running]] = {name: [] for name in names}
    for lease in running:
        shares = [p for p in lease.parts if p.kind == "share"]  # SlotKind.share.value
        pool = pool_of.get(shares[0].device) if shares else None
        if pool in held:
            held[pool].append(lease)
    sizes = list(sizes)
    waiting = [r for r in pending if r.kind == "share"]
    return {
        name: share_mix(held[name], [r for r in waiting if _asks(r.pool, name, batch)], sizes)
        for name in names
    }


def _count(counts: dict[packing.Demand, int], demand: packing.Demand) -> None:
    counts[demand] = counts.get(demand, 0) + 1


def _record(dev: _Device, lease_id: int, part: Part) -> None:
    """``dev`` now holds ``part`` of ``lease_id``: a share's memory, or a MIG
    instance's placement (a static instance is no longer free)."""
    if part.kind == "share":  # SlotKind.share.value
        dev.reserved_mib += part.memory_mib
        return
    dev.layout[(part.profile, _placement(part.start, part.size))] = lease_id
    dev.changed()
    if dev.free_static:
        dev.free_static = [
            s for s in dev.free_static if (s.start, s.size) != (part.start, part.size)
        ]


class SharingPool:
    """The ``mig`` and ``timeslice`` devices of one pass and what they hold.

    Build it with :meth:`build`; :meth:`place_mig` and :meth:`place_shares`
    choose slots (``None`` plus a :class:`Miss` when there are none) and
    :meth:`take` records a grant, so later requests of the pass see it.

    Answers are indexed per request *shape* (profile or share size and
    count, pool): the best device or node is kept in a lazy heap that only
    rescores what a :meth:`take` changed, and a miss is remembered until
    the next take of the same kind. The answers are those of a full scan.
    """

    def __init__(self, devices: dict[str, _Device], strategy: str) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy: must be one of {STRATEGIES}, got {strategy!r}")
        self.devices = devices
        self.strategy = strategy
        self._groups: dict[tuple[str, str | None, bool], tuple[_Device, ...]] = {}
        self._mig_best: dict[tuple[str, str | None], Best[str, Any]] = {}
        self._share_best: dict[tuple[int, int, str | None, bool], Best[str, Any]] = {}
        self._room_best: dict[str | None, Best[str, Any]] = {}
        self._mig_misses: dict[tuple[str, str | None], Miss] = {}
        self._share_misses: dict[tuple[int, int, str | None], Miss] = {}
        self._static_misses: dict[tuple[Any, ...], Miss | None] = {}
        self._share_able: dict[tuple[int, str | None], dict[str, list[_Device]]] = {}
        #: scores share placements (:meth:`set_share_mix`), per pool
        self.scorers: dict[str, packing.Scorer] = {}
        self._placement = "packing"
        #: per pool asked for (None: any), the in-service time-sliced devices by node
        self._share_full: dict[str | None, dict[str, list[_Device]]] = {}
        #: counts :meth:`take` calls that changed a device: answers stay valid while unchanged
        self.version = 0

    @classmethod
    def build(
        cls,
        slots: Iterable[Slot],
        running: Iterable[Running],
        strategy: str = "least-fragmentation",
        pending: Iterable[Request] = (),
        share_placement: str = "packing",
        share_sizes: Iterable[int] = (),
    ) -> SharingPool:
        """The fractional devices of ``slots`` with the parts ``running`` holds.

        Devices held whole by a lease (e.g. moved into a sharing pool while
        a lease held them) are left out until released. Shares are placed
        with ``share_placement`` (a :mod:`~gpubroker.scheduler.packing`
        strategy other than ``random``) under the share mix of ``running``,
        ``pending`` and ``share_sizes`` (:func:`share_mix`).

        Raises:
            ValueError: an unknown MIG strategy or share placement.
        """
        running = list(running)
        whole = {d for lease in running if lease.devices for d in lease.devices}
        devices: dict[str, _Device] = {}
        specs: dict[str, mig.GpuMigSpec | None] = {}
        for slot in slots:
            if slot.mode == "exclusive" or slot.uuid in whole:  # PoolMode.exclusive
                continue
            spec = None
            if slot.mode == "mig":
                if slot.model not in specs:
                    specs[slot.model] = mig.spec_for(slot.model)
                spec = specs[slot.model]
            dev = _Device(slot, spec)
            for inst in slot.foreign:
                dev.layout[(inst.profile, _placement(inst.start, inst.size))] = None
            dev.free_static = list(slot.static)
            devices[slot.uuid] = dev
        pool = cls(devices, strategy)
        shared = {d.slot.uuid: d.slot.pool for d in devices.values() if d.slot.mode == "timeslice"}
        batch = frozenset(d.slot.pool for d in devices.values() if d.slot.batch)
        mixes = pool_mixes(
            sorted(set(shared.values())), shared, running, pending, share_sizes, batch
        )
        pool.set_share_mix(mixes, share_placement)
        for lease in running:  # nothing is indexed yet: record without invalidating
            for part in lease.parts:
                held = devices.get(part.device)
                if held is not None:
                    _record(held, lease.lease_id, part)
        return pool

    def set_share_mix(self, mixes: Mapping[str, packing.Mix], placement: str = "packing") -> None:
        """Score share placements with strategy ``placement``, on each pool's
        devices under that pool's mix (demands in MiB of share room, see
        :func:`pool_mixes`); forgets the answers kept so far.

        Raises:
            ValueError: ``placement`` is ``random`` (it needs draws) or unknown.
        """
        if placement == "random":
            raise ValueError("share placement: random is for the packing experiment only")
        self._placement = placement
        self.scorers = {name: packing.Scorer(placement, mix) for name, mix in mixes.items()}
        if not self.scorers:
            packing.Scorer(placement)  # checks the name when there is no pool
        self._share_best.clear()

    def _scorer(self, pool: str) -> packing.Scorer:
        scorer = self.scorers.get(pool)
        if scorer is None:
            scorer = self.scorers[pool] = packing.Scorer(self._placement)
        return scorer

    # -- bookkeeping ---------------------------------------------------------------

    def take(self, lease_id: int, parts: Iterable[Part]) -> None:
        """Record that ``lease_id`` holds ``parts``."""
        for part in parts:
            dev = self.devices.get(part.device)
            if dev is None:
                continue
            self.version += 1
            _record(dev, lease_id, part)
            if part.kind == "share":  # SlotKind.share.value
                self._share_misses.clear()
                for best in self._share_best.values():
                    best.touch(dev.slot.node)
                for room in self._room_best.values():
                    room.touch(dev.slot.uuid)
                continue
            self._mig_misses.clear()
            for mbest in self._mig_best.values():
                mbest.touch(dev.slot.uuid)

    def _candidates(self, request: Request, mode: str, drained: bool = False) -> list[_Device]:
        """Devices of ``mode`` pools (of ``request.pool`` when named); drained
        ones only with ``drained``."""
        return list(self._group(mode, request.pool, drained))

    def _group(self, mode: str, pool: str | None, drained: bool = False) -> tuple[_Device, ...]:
        """:meth:`_candidates` by node and index (the device set is fixed for a pass)."""
        key = (mode, pool, drained)
        found = self._groups.get(key)
        if found is None:
            found = tuple(
                sorted(
                    (
                        d
                        for d in self.devices.values()
                        if d.slot.mode == mode
                        and (drained or not d.slot.drained)
                        and in_pool(d.slot, pool)
                    ),
                    key=lambda d: (d.slot.node, d.slot.index),
                )
            )
            self._groups[key] = found
        return found

    # -- MIG ------------------------------------------------------------------------

    def place_mig(self, request: Request) -> tuple[Part | None, Miss | None]:
        """A MIG instance of ``request.mig_profile``, or why there is none.

        Returns:
            ``(part, None)`` with the device, placement and weight (and the
            instance UUID for a static layout), or ``(None, miss)``.
        """
        profile, pool = request.mig_profile, request.pool
        where = _where(pool, "MIG")
        drained = self._mig_drained(profile, pool, where)
        if drained is not None:
            return None, drained
        best = self._mig_best.get((profile, pool))
        if best is None:
            able = self._mig_able(profile, pool)
            best = Best([d.slot.uuid for d in able], lambda uuid: self._mig_score(uuid, profile))
            self._mig_best[(profile, pool)] = best
        found = best.best()
        if found is not None:
            args = found[2]
            assert isinstance(args, tuple)
            return Part(*args), None
        miss = self._mig_misses.get((profile, pool))
        if miss is None:
            miss = self._mig_miss(list(self._mig_able(profile, pool)), profile, where)
            self._mig_misses[(profile, pool)] = miss
        return None, miss

    def _mig_able(self, profile: str, pool: str | None) -> tuple[_Device, ...]:
        """Devices in service of ``mig`` pools (``pool`` when named) offering ``profile``."""
        return tuple(
            d
            for d in self._group(PoolMode.mig.value, pool, drained=False)
            if d.spec is not None and profile in d.spec.profiles
        )

    def _mig_drained(self, profile: str, pool: str | None, where: str) -> Miss | None:
        """``PoolDrained`` when no device in service offers ``profile`` (fixed for a pass)."""
        key = ("mig", profile, pool)
        if key in self._static_misses:
            return self._static_misses[key]
        offering = [
            d
            for d in self._group(PoolMode.mig.value, pool, drained=True)
            if d.spec is not None and profile in d.spec.profiles
        ]
        miss = None
        if not any(not d.slot.drained for d in offering):
            detail = f"no device in {where} offers MIG {profile}"
            if offering:
                detail = (
                    f"every device in {where} that offers MIG {profile} is drained"
                    " or has MIG mode off"
                )
            miss = Miss(WaitReason.pool_drained, detail)
        self._static_misses[key] = miss
        return miss

    def _mig_score(self, uuid: str, profile: str) -> tuple[tuple[Any, ...], _PartArgs] | None:
        """The key a device has among those where ``profile`` fits (lower
        wins), with the arguments of its :class:`Part`. Cached on the device
        until its layout changes (the heaps of a profile in different pools
        share it)."""
        dev = self.devices[uuid]
        scores = dev.scores
        if profile in scores:
            cached: tuple[tuple[Any, ...], _PartArgs] | None = scores[profile]
            return cached
        found = self._mig_on(dev, profile)
        score: tuple[tuple[Any, ...], _PartArgs] | None = None
        if found is not None:
            args, stranded = found
            if self.strategy == "first-fit":
                score = (dev.slot.node, dev.slot.index), args
            else:
                key = (stranded, dev.free_compute(), args[4], dev.slot.node, dev.slot.index)
                score = key, args
        scores[profile] = score
        return score

    def _mig_on(self, dev: _Device, profile: str) -> tuple[_PartArgs, int] | None:
        """The :class:`Part` ``dev`` would give (its arguments), with the
        compute slices it strands."""
        assert dev.spec is not None
        weight, memory = _profile_terms(dev.spec.name, profile)
        if dev.slot.static or dev.slot.mig_static:
            for inst in dev.free_static:
                if inst.profile == profile:
                    memory = inst.memory_mib or memory
                    args = (dev.slot.uuid, "mig", weight, profile, inst.start, inst.size)
                    return (*args, memory, inst.uuid), 0
            return None
        found = _mig_fit(dev.spec.name, dev.key, profile, self.strategy == "first-fit")
        if found is None:
            return None
        start, size, stranded = found
        return (dev.slot.uuid, "mig", weight, profile, start, size, memory, ""), stranded

    def _mig_miss(self, able: list[_Device], profile: str, where: str) -> Miss:
        for dev in sorted(able, key=lambda d: -d.free_compute()):
            assert dev.spec is not None
            static = dev.slot.static or dev.slot.mig_static
            if static or not _fragmented(dev.spec.name, dev.key, profile):
                continue
            blockers = tuple(
                (dev.slot.uuid, name, str(placement), dev.layout[(name, placement)])
                for name, placement in mig.blocking(
                    dev.spec, sorted(dev.layout, key=lambda i: i[1].start), profile
                )
            )
            named = ", ".join(
                f"{name} at {placement}" + (f" (lease {owner})" if owner is not None else "")
                for _d, name, placement, owner in blockers
            )
            detail = (
                f"MIG {profile} does not fit although device {dev.slot.index} on "
                f"{dev.slot.node} has {dev.free_compute()} compute slices free; "
                f"in the way: {named}"
            )
            return Miss(WaitReason.fragmented, detail, blockers)
        return Miss(WaitReason.resources, f"no free slot for MIG {profile} in {where}")

    # -- shares ---------------------------------------------------------------------

    def place_shares(
        self, request: Request, lightest: bool = False
    ) -> tuple[tuple[Part, ...] | None, Miss | None]:
        """``request.gpus`` shares of ``request.memory_mib`` MiB on distinct
        devices of one node, or why not. Best fit (the least memory left);
        with ``lightest``, the devices where the share weighs least (the
        largest), for a request a limit would hold on smaller devices."""
        need, count, pool = request.memory_mib, request.gpus, request.pool
        where = _where(pool, "time-sliced")
        by_node, drained = self._share_nodes(need, count, pool, where)
        if drained is not None:
            return None, drained
        shape = (need, count, pool, lightest)
        best = self._share_best.get(shape)
        if best is None:
            best = Best(
                by_node,
                lambda node: self._share_score(by_node[node], need, count, lightest, pool),
            )
            self._share_best[shape] = best
        found = best.best()
        if found is None:
            miss = self._share_misses.get((need, count, pool))
            if miss is None:
                room = self._most_room(pool)
                detail = (
                    f"no {count} device(s) in {where} have {need / 1024:g} GiB free"
                    f" (most free on one device: {room / 1024:g} GiB)"
                )
                miss = Miss(WaitReason.resources, detail)
                self._share_misses[(need, count, pool)] = miss
            return None, miss
        chosen = found[2]
        assert isinstance(chosen, list)
        parts = tuple(
            Part(
                d.slot.uuid,
                SlotKind.share.value,
                share_weight(need, d.slot.memory_mib),
                memory_mib=need,
            )
            for d in sorted(chosen, key=lambda d: d.slot.index)
        )
        return parts, None

    def _share_nodes(
        self, need: int, count: int, pool: str | None, where: str
    ) -> tuple[dict[str, list[_Device]], Miss | None]:
        """Per node, the devices in service able to hold a share of ``need``
        MiB at all, by node and index; ``PoolDrained`` when no node has
        ``count`` of them (both fixed for a pass)."""
        key = ("share", need, count, pool)
        able = self._group("timeslice", pool)
        by_node = self._share_able.get((need, pool))
        if by_node is None:
            by_node = defaultdict(list)
            for dev in able:
                if dev.slot.memory_mib - dev.slot.reserve_mib >= need:
                    by_node[dev.slot.node].append(dev)
            self._share_able[(need, pool)] = by_node
        if key not in self._static_misses:
            miss = None
            if not any(len(devs) >= count for devs in by_node.values()):
                biggest = max((d.slot.memory_mib - d.slot.reserve_mib for d in able), default=0)
                detail = (
                    f"no node in {where} has {count} device(s) able to hold "
                    f"{need / 1024:g} GiB (largest share: {biggest / 1024:g} GiB)"
                )
                miss = Miss(WaitReason.pool_drained, detail)
            self._static_misses[key] = miss
        return by_node, self._static_misses[key]

    def _share_score(
        self, devs: list[_Device], need: int, count: int, lightest: bool, pool: str | None
    ) -> tuple[tuple[Any, ...], list[_Device]] | None:
        """The best ``count`` devices of one node for shares of ``need`` MiB
        and their key (lower wins), or ``None`` when fewer have room.
        ``lightest``: the largest devices (where the share weighs least),
        then best fit; otherwise the score of the node's pool's scorer
        (:meth:`set_share_mix`) over the share room of all the node's
        in-service devices of the pools asked for (``pool``; None: all)."""
        if not lightest:
            node_name = devs[0].slot.node
            full = self._full(pool)[node_name]
            node = packing.Node(tuple(d.share_room for d in full))
            demand = packing.Demand(count, need)
            scorer = self._scorer(devs[0].slot.pool)
            found = scorer.score(node, demand)
            if found is None:
                return None
            indices = scorer.place(node, demand)
            assert indices is not None
            return (found[0], node_name), [full[i] for i in indices]
        fits = sorted(
            (d for d in devs if d.share_room >= need),
            key=lambda d: (-d.slot.memory_mib, d.share_room),
        )
        if len(fits) < count:
            return None
        chosen = fits[:count]
        weight = sum(share_weight(need, d.slot.memory_mib) for d in chosen)
        return (round(weight, 9), sum(d.share_room for d in chosen), chosen[0].slot.node), chosen

    def _full(self, pool: str | None) -> dict[str, list[_Device]]:
        """The in-service time-sliced devices (of ``pool`` when named) by node,
        by index (fixed for a pass)."""
        found = self._share_full.get(pool)
        if found is None:
            found = defaultdict(list)
            for dev in self._group("timeslice", pool):
                found[dev.slot.node].append(dev)
            self._share_full[pool] = found
        return found

    def _most_room(self, pool: str | None) -> int:
        """Most MiB free for shares on one device in service (of ``pool`` when named)."""
        best = self._room_best.get(pool)
        if best is None:
            devices = {d.slot.uuid: d for d in self._group("timeslice", pool)}
            best = Best(devices, lambda uuid: ((-devices[uuid].share_room, uuid), None))
            self._room_best[pool] = best
        found = best.best()
        return 0 if found is None else -found[0][0]


def _asks(wanted: str | None, name: str, batch: frozenset[str]) -> bool:
    """Whether a request for ``wanted`` may be placed in pool ``name``."""
    if wanted is None or wanted == name:
        return True
    return wanted == INTERACTIVE_POOLS and name not in batch


def _where(pool: str | None, mode: str) -> str:
    """The pools a request asks for, in words (for wait messages)."""
    if pool is None:
        return f"the {mode} pools"
    if pool == INTERACTIVE_POOLS:
        return f"the interactive {mode} pools"
    return f"pool {pool}"
