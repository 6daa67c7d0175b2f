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
best fit (the devices with the least memory left that still fits).

Weights (quotas and usage, in device units): a MIG instance counts its
compute slices / the device's compute slices; a share its memory / the
device's memory.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..devices import mig
from .types import Instance, Part, PoolMode, Request, Running, Slot, SlotKind, WaitReason

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


@dataclass
class _Device:
    slot: Slot
    spec: mig.GpuMigSpec | None
    #: occupied MIG placements: (profile, placement) -> owning lease (None: foreign/static)
    layout: dict[tuple[str, mig.Placement], int | None] = field(default_factory=dict)
    free_static: list[Instance] = field(default_factory=list)
    reserved_mib: int = 0

    @property
    def share_room(self) -> int:
        """MiB still grantable as shares."""
        return self.slot.memory_mib - self.slot.reserve_mib - self.reserved_mib

    def free_compute(self) -> int:
        assert self.spec is not None
        return mig.free_compute_slices(self.spec, list(self.layout))


class SharingPool:
    """The ``mig`` and ``timeslice`` devices of one pass and what they hold.

    Build it with :meth:`build`; :meth:`place_mig` and :meth:`place_shares`
    choose slots (``None`` plus a :class:`Miss` when there are none) and
    :meth:`take` records a grant, so later requests of the pass see it.
    """

    def __init__(self, devices: dict[str, _Device], strategy: str) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy: must be one of {STRATEGIES}, got {strategy!r}")
        self.devices = devices
        self.strategy = strategy

    @classmethod
    def build(
        cls,
        slots: Iterable[Slot],
        running: Iterable[Running],
        strategy: str = "least-fragmentation",
    ) -> SharingPool:
        """The fractional devices of ``slots`` with the parts ``running`` holds.

        Devices held whole by a lease (e.g. moved into a sharing pool while
        a lease held them) are left out until released.
        """
        whole = {d for lease in running for d in lease.devices}
        devices: dict[str, _Device] = {}
        for slot in slots:
            if slot.mode == PoolMode.exclusive.value or slot.uuid in whole:
                continue
            dev = _Device(slot, mig.spec_for(slot.model) if slot.mode == "mig" else None)
            for inst in slot.foreign:
                dev.layout[(inst.profile, mig.Placement(inst.start, inst.size))] = None
            dev.free_static = list(slot.static)
            devices[slot.uuid] = dev
        pool = cls(devices, strategy)
        for lease in running:
            pool.take(lease.lease_id, lease.parts)
        return pool

    # -- bookkeeping ---------------------------------------------------------------

    def take(self, lease_id: int, parts: Iterable[Part]) -> None:
        """Record that ``lease_id`` holds ``parts``."""
        for part in parts:
            dev = self.devices.get(part.device)
            if dev is None:
                continue
            if part.kind == SlotKind.share.value:
                dev.reserved_mib += part.memory_mib
                continue
            placement = mig.Placement(part.start, part.size)
            dev.layout[(part.profile, placement)] = lease_id
            dev.free_static = [
                s for s in dev.free_static if (s.start, s.size) != (part.start, part.size)
            ]

    def _candidates(self, request: Request, mode: str, drained: bool = False) -> list[_Device]:
        """Devices of ``mode`` pools (of ``request.pool`` when named); drained
        ones only with ``drained``."""
        return sorted(
            (
                d
                for d in self.devices.values()
                if d.slot.mode == mode
                and (drained or not d.slot.drained)
                and (request.pool is None or d.slot.pool == request.pool)
            ),
            key=lambda d: (d.slot.node, d.slot.index),
        )

    # -- MIG ------------------------------------------------------------------------

    def place_mig(self, request: Request) -> tuple[Part | None, Miss | None]:
        """A MIG instance of ``request.mig_profile``, or why there is none.

        Returns:
            ``(part, None)`` with the device, placement and weight (and the
            instance UUID for a static layout), or ``(None, miss)``.
        """
        profile = request.mig_profile
        offering = [
            d
            for d in self._candidates(request, PoolMode.mig.value, drained=True)
            if (spec := mig.spec_for(d.slot.model)) is not None and profile in spec.profiles
        ]
        able = [d for d in offering if not d.slot.drained]
        where = f"pool {request.pool}" if request.pool else "the MIG pools"
        if not able:
            detail = f"no device in {where} offers MIG {profile}"
            if offering:
                detail = (
                    f"every device in {where} that offers MIG {profile} is drained"
                    " or has MIG mode off"
                )
            return None, Miss(WaitReason.pool_drained, detail)
        best: tuple[tuple[int, int, int, str, int], Part] | None = None
        for dev in able:
            found = self._mig_on(dev, profile)
            if found is None:
                continue
            part, stranded = found
            if self.strategy == "first-fit":
                return part, None
            key = (stranded, dev.free_compute(), part.start, dev.slot.node, dev.slot.index)
            if best is None or key < best[0]:
                best = (key, part)
        if best is not None:
            return best[1], None
        return None, self._mig_miss(able, profile, where)

    def _mig_on(self, dev: _Device, profile: str) -> tuple[Part, int] | None:
        """The part ``dev`` would give, with the compute slices it strands."""
        assert dev.spec is not None
        prof = dev.spec.profile(profile)
        weight = prof.compute_slices / dev.spec.compute_slices
        memory = prof.memory_mib or prof.memory_gib * 1024
        if dev.slot.static or dev.slot.mig_static:
            for inst in dev.free_static:
                if inst.profile == profile:
                    memory = inst.memory_mib or memory
                    part = Part(
                        dev.slot.uuid,
                        "mig",
                        weight,
                        profile,
                        inst.start,
                        inst.size,
                        memory,
                        inst.uuid,
                    )
                    return part, 0
            return None
        layout = list(dev.layout)
        if dev.free_compute() < prof.compute_slices or (
            mig.free_memory_slices(dev.spec, layout) < prof.memory_slices
        ):
            return None  # cheap refusal before any placement is scored
        if self.strategy == "first-fit":
            valid = mig.valid_placements(dev.spec, layout, prof)
            found = (valid[0], 0) if valid else None
        else:
            found = mig.least_stranding_placement(dev.spec, layout, prof)
        if found is None:
            return None
        placement, stranded = found
        part = Part(dev.slot.uuid, "mig", weight, profile, placement.start, placement.size, memory)
        return part, stranded

    def _mig_miss(self, able: list[_Device], profile: str, where: str) -> Miss:
        for dev in sorted(able, key=lambda d: -d.free_compute()):
            assert dev.spec is not None
            static = dev.slot.static or dev.slot.mig_static
            if static or not mig.is_fragmented(dev.spec, list(dev.layout), profile):
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
        need, count = request.memory_mib, request.gpus
        able = [d for d in self._candidates(request, "timeslice")]
        where = f"pool {request.pool}" if request.pool else "the time-sliced pools"
        by_node: dict[str, list[_Device]] = defaultdict(list)
        for dev in able:
            if dev.slot.memory_mib - dev.slot.reserve_mib >= need:
                by_node[dev.slot.node].append(dev)
        if not any(len(devs) >= count for devs in by_node.values()):
            biggest = max((d.slot.memory_mib - d.slot.reserve_mib for d in able), default=0)
            detail = (
                f"no node in {where} has {count} device(s) able to hold "
                f"{need / 1024:g} GiB (largest share: {biggest / 1024:g} GiB)"
            )
            return None, Miss(WaitReason.pool_drained, detail)
        best: tuple[tuple[float, int, str], list[_Device]] | None = None
        for node, devs in by_node.items():
            fits = sorted(
                (d for d in devs if d.share_room >= need),
                key=lambda d: (-d.slot.memory_mib, d.share_room) if lightest else d.share_room,
            )
            if len(fits) < count:
                continue
            chosen = fits[:count]
            weight = sum(share_weight(need, d.slot.memory_mib) for d in chosen)
            key = (round(weight, 9) if lightest else 0, sum(d.share_room for d in chosen), node)
            if best is None or key < best[0]:
                best = (key, chosen)
        if best is None:
            room = max((d.share_room for d in able), default=0)
            detail = (
                f"no {count} device(s) in {where} have {need / 1024:g} GiB free"
                f" (most free on one device: {room / 1024:g} GiB)"
            )
            return None, Miss(WaitReason.resources, detail)
        parts = tuple(
            Part(
                d.slot.uuid,
                SlotKind.share.value,
                share_weight(need, d.slot.memory_mib),
                memory_mib=need,
            )
            for d in sorted(best[1], key=lambda d: d.slot.index)
        )
        return parts, None
