"""Plain, immutable data the scheduler reads and returns.

Nothing here touches I/O. Times are aware UTC datetimes passed in by callers;
durations are seconds (float); amounts of GPU are in whole-device units
(float, so that fractions can count later).
"""

from __future__ import annotations

import datetime as dt
import enum
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field


class WaitReason(str, enum.Enum):
    """Why a request waits; codes modelled on Slurm's ``squeue`` reasons.

    - ``Resources``: not enough devices free, and no request ahead of it that
      competes for the same devices (same kind, overlapping pool) is blocked.
    - ``Priority``: requests ahead of it (by class, fair share, age) that
      compete for the same devices are blocked too, and go first.
    - ``Reserved``: free devices exist but are reserved for a request ahead of
      it, and its time limit does not end before that reservation starts.
    - ``Preempting``: devices are being reclaimed for it (victims in grace).
    - ``QuotaUserLimit`` / ``QuotaGroupLimit``: granting it would exceed a limit.
    - ``OverGuarantee``: its priority class is not preemptible, so it may only
      run within a guarantee, and the guarantee is used up.
    - ``PoolDrained``: no node has that many devices in service in the pool
      it asks for (or, for a MIG instance or a share, no device of the pool
      can ever hold it).
    - ``Fragmented``: a MIG profile does not fit although enough compute and
      memory slices are free on some device: existing instances sit where it
      would go (the message names them).
    """

    resources = "Resources"
    priority = "Priority"
    reserved = "Reserved"
    preempting = "Preempting"
    quota_user = "QuotaUserLimit"
    quota_group = "QuotaGroupLimit"
    over_guarantee = "OverGuarantee"
    pool_drained = "PoolDrained"
    fragmented = "Fragmented"


class SlotKind(str, enum.Enum):
    """What a lease holds: whole devices, one MIG instance, or time-sliced shares."""

    gpus = "gpus"
    mig = "mig"
    share = "share"


class PoolMode(str, enum.Enum):
    """How the devices of a pool are handed out (DESIGN.md, "pool").

    - ``exclusive``: whole devices only.
    - ``mig``: MIG instances (created on demand or listed by the admin).
    - ``timeslice``: shares sized by memory, several per device.
    """

    exclusive = "exclusive"
    mig = "mig"
    timeslice = "timeslice"


@dataclass(frozen=True)
class PriorityClass:
    """A priority class (Kubernetes PriorityClass / Slurm QOS in spirit).

    Attributes:
        name: e.g. ``interactive``.
        rank: higher goes first and may preempt lower (if ``preempting``).
        preempting: requests of this class may preempt leases of lower-rank,
            preemptible classes.
        preemptible: leases of this class may be preempted or reclaimed. A
            class that is not preemptible only runs within guarantees (as in
            KAI-Scheduler), so guarantees always stay obtainable.
        min_runtime: seconds a lease runs before it may be preempted.
        grace: seconds between the preemption notice and the eviction.
    """

    name: str
    rank: int
    preempting: bool = False
    preemptible: bool = True
    min_runtime: float = 0.0
    grace: float = 30.0


#: the default classes: notebooks first; urgent batch may preempt batch and preemptible
DEFAULT_CLASSES: tuple[PriorityClass, ...] = (
    PriorityClass("interactive", 100, preempting=False, min_runtime=600, grace=300),
    PriorityClass("batch-urgent", 75, preempting=True, min_runtime=300, grace=120),
    PriorityClass("batch", 50, preempting=False, min_runtime=0, grace=60),
    PriorityClass("preemptible", 10, preempting=False, min_runtime=0, grace=30),
)


@dataclass(frozen=True)
class Quota:
    """GPUs a user or group may hold.

    Attributes:
        guaranteed: GPUs always obtainable (reclaimed from borrowers if needed).
        limit: the most GPUs ever held at once; ``None``: no limit.
    """

    guaranteed: float = 0.0
    limit: float | None = None


@dataclass(frozen=True)
class Policy:
    """Everything configurable about scheduling.

    Attributes:
        classes: the priority classes by name.
        user_quotas: quotas by user name.
        group_quotas: quotas by group name.
        default_user_quota: the quota of users not in ``user_quotas``.
        shares: fair-share weight by user (default 1).
        half_life: fair-share usage half-life, seconds.
        fairshare_resolution: fair-share factors are compared rounded to
            this step, so nearly equal users are ordered by age.
        max_reservations: how many blocked requests get a reservation (and an
            ETA) per pass; the rest wait with an unknown ETA.
    """

    classes: Mapping[str, PriorityClass] = field(
        default_factory=lambda: {c.name: c for c in DEFAULT_CLASSES}
    )
    user_quotas: Mapping[str, Quota] = field(default_factory=dict)
    group_quotas: Mapping[str, Quota] = field(default_factory=dict)
    default_user_quota: Quota = Quota()
    shares: Mapping[str, float] = field(default_factory=dict)
    half_life: float = 7 * 86400.0
    fairshare_resolution: float = 0.01
    max_reservations: int = 100

    def class_of(self, name: str) -> PriorityClass:
        """The class ``name``; an unknown one (removed from the config while
        leases still name it) ranks lowest and is not preemptible, as
        docs/scheduling.md promises ("Running leases of a class that no
        longer exists keep running and are never preempted"). Being not
        preemptible, its pending requests run only within guarantees, like
        those of any non-preemptible class."""
        return self.classes.get(name) or PriorityClass(name, rank=0, preemptible=False)

    @functools.cached_property
    def has_guarantees(self) -> bool:
        """Whether any user or group is guaranteed GPUs (else nothing is reclaimable)."""
        quotas = [*self.user_quotas.values(), *self.group_quotas.values(), self.default_user_quota]
        return any(q.guaranteed > 0 for q in quotas)

    def user_quota(self, user: str) -> Quota:
        """The quota of ``user``."""
        return self.user_quotas.get(user, self.default_user_quota)

    def group_quota(self, group: str | None) -> Quota | None:
        """The quota of ``group``, or ``None`` when it has none."""
        return None if group is None else self.group_quotas.get(group)


@dataclass(frozen=True)
class Instance:
    """A MIG instance that exists on a device independently of any new grant.

    Attributes:
        profile: its profile name, e.g. ``1g.10gb``.
        start: first memory slice of its placement.
        size: memory slices it occupies.
        uuid: its ``MIG-`` UUID (``""`` when unknown).
        memory_mib: its memory as the driver reports it, MiB (0: unknown).
    """

    profile: str
    start: int
    size: int
    uuid: str = ""
    memory_mib: int = 0


@dataclass(frozen=True)
class Slot:
    """A device and how it may be handed out.

    Attributes:
        uuid: NVML UUID of the device.
        node: node the device is on.
        index: NVML index on that node (row/column in the node's topology).
        drained: no new grants (running leases continue).
        pool: the name of its pool.
        mode: its pool's :class:`PoolMode` value.
        model: NVML product name (selects the MIG catalog entry).
        memory_mib: total memory, MiB.
        reserve_mib: memory of a ``timeslice`` device never handed out as
            shares (for the driver, the CUDA context of each process), MiB.
        static: in a ``mig`` pool with an admin-made layout, the instances
            that may be granted (the broker never creates or destroys any);
            empty: instances are created on demand.
        foreign: MIG instances present on the device that belong to no
            lease and are not ``static`` (left over, made by hand): they
            occupy their slices.
        mig_static: the device's pool has a static layout: only ``static``
            instances are ever granted, none is created (even when
            ``static`` is empty).
        batch: its pool's purpose is ``batch``: only requests that may use
            batch pools (jobs) are placed on it (:func:`in_pool`).
    """

    uuid: str
    node: str
    index: int
    drained: bool = False
    pool: str = "default"
    mode: str = PoolMode.exclusive.value
    model: str = ""
    memory_mib: int = 0
    reserve_mib: int = 0
    static: tuple[Instance, ...] = ()
    foreign: tuple[Instance, ...] = ()
    mig_static: bool = False
    batch: bool = field(default=False, repr=False)  # repr: as before (golden data)


#: the pool a request names to mean "any pool whose purpose is not batch"
#: (an interactive server, where batch pools exist: jobs only run there)
INTERACTIVE_POOLS = "@interactive"


def in_pool(slot: Slot, pool: str | None) -> bool:
    """Whether ``slot`` is in the pool a request asks for: any (``None``),
    the one named, or, for :data:`INTERACTIVE_POOLS`, any pool that is not
    a batch pool (a pool's purpose, DESIGN.md "pool")."""
    if pool is None:
        return True
    if pool == INTERACTIVE_POOLS:
        return not slot.batch
    return slot.pool == pool


@dataclass(frozen=True)
class Part:
    """One fractional slot held by a lease: a MIG instance or a share.

    Attributes:
        device: UUID of the physical device.
        kind: ``mig`` or ``share`` (:class:`SlotKind` value).
        weight: fraction of the device it counts for in quotas and usage:
            a MIG instance its compute slices / the device's, a share its
            memory / the device's memory.
        profile: MIG profile name (``mig`` only).
        start, size: MIG placement, memory slices (``mig`` only).
        memory_mib: memory of the share or the MIG instance, MiB.
        instance: the MIG instance's ``MIG-`` UUID, ``""`` until created.
    """

    device: str
    kind: str
    weight: float
    profile: str = ""
    start: int = 0
    size: int = 0
    memory_mib: int = 0
    instance: str = ""


@dataclass(frozen=True)
class Running:
    """A granted lease.

    Attributes:
        lease_id: the lease.
        user: its holder.
        group: the group (account) it is charged to, if any.
        devices: UUIDs it holds (all on one node).
        priority_class: its class name.
        started: when it was granted (aware UTC).
        ends: when its time limit runs out, ``None`` if it has none.
        preempt_deadline: set once it has been told it is preempted: when it
            will be evicted.
        parts: the MIG instances or shares it holds (then ``devices`` is
            empty: it holds no whole device).
        held_before: for a lease held across a broker restart, the decayed
            GPU-seconds the usage ledger holds it for before the restart
            (as of the end of that time); ``None``: none.
        held_since: when fair share's charge of it runs from (the start of
            its open ledger interval, after a restart); ``None``: ``started``.
        preempted_for: once told (``preempt_deadline`` set), the lease id of
            the request it is preempted for (``Preemption.for_lease``). The
            preemption is withdrawn once that request is no longer pending
            or its earmarked devices no longer include this lease's.
            ``None``: not told, or the request is not known; then the
            preemption stands while any pending request's earmarked devices
            include this lease's.
    """

    lease_id: int
    user: str
    devices: tuple[str, ...]
    started: dt.datetime
    group: str | None = None
    priority_class: str = "interactive"
    ends: dt.datetime | None = None
    preempt_deadline: dt.datetime | None = None
    parts: tuple[Part, ...] = ()
    held_before: UsageRecord | None = field(default=None, repr=False)
    held_since: dt.datetime | None = field(default=None, repr=False)
    preempted_for: int | None = field(default=None, repr=False)  # repr: golden data

    @property
    def gpus(self) -> float:
        """GPUs held, in device units: whole devices plus the parts' weights."""
        return float(len(self.devices)) + sum(p.weight for p in self.parts)


@dataclass(frozen=True)
class Request:
    """A pending lease as the scheduler sees it.

    Attributes:
        lease_id: id of the pending lease.
        user: JupyterHub user name.
        gpus: number of whole devices, >= 1, all on one node.
        created: when it was made (aware UTC).
        group: the group (account) it is charged to, if any.
        priority_class: its class name.
        time_limit: seconds it will run at most once granted; ``None``: no limit.
        earmarked: devices being reclaimed for it (set after a preemption).
        kind: :class:`SlotKind` value: ``gpus`` (``gpus`` whole devices),
            ``mig`` (one instance of ``mig_profile``) or ``share`` (``gpus``
            shares of ``memory_mib`` each, on distinct devices of one node).
        mig_profile: the MIG profile asked for (``mig`` only).
        memory_mib: memory of each share, MiB (``share`` only).
        pool: the pool asked for; ``None``: any pool of the right mode;
            :data:`INTERACTIVE_POOLS`: any of the right mode that is not a
            batch pool.
        weight: device units charged to quotas while it waits and when
            granted (whole devices: ``gpus``; else the broker's estimate from
            the pool's devices, see :func:`gpubroker.scheduler.sharing.mig_weight` and
            :func:`~gpubroker.scheduler.sharing.share_weight`).
        prefer: whole devices to take when all of them are usable now (a
            restarted server's previous devices); else placement as usual.
    """

    lease_id: int
    user: str
    gpus: int
    created: dt.datetime
    group: str | None = None
    priority_class: str = "interactive"
    time_limit: float | None = None
    earmarked: tuple[str, ...] = ()
    kind: str = SlotKind.gpus.value
    mig_profile: str = ""
    memory_mib: int = 0
    pool: str | None = None
    weight: float | None = None
    prefer: tuple[str, ...] = ()

    @property
    def amount(self) -> float:
        """Device units this request counts for in quotas (``weight`` or ``gpus``)."""
        return float(self.gpus) if self.weight is None else self.weight

    @property
    def whole(self) -> bool:
        """Whether it asks for whole devices."""
        return self.kind == "gpus"  # SlotKind.gpus.value (a literal: hot path)


@dataclass(frozen=True)
class UsageRecord:
    """Past usage of a user: ``gpu_seconds`` already decayed to ``as_of``."""

    gpu_seconds: float
    as_of: dt.datetime


#: a node's topology: square matrix of link levels (see gpubroker.devices.topology)
Topology = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class SchedulerState:
    """Everything one scheduling pass needs.

    Attributes:
        slots: every device of the inventory.
        running: granted leases.
        pending: pending requests, in any order (the policy sorts them).
        policy: classes, quotas and knobs.
        usage: past usage by user, for fair share.
        topology: link matrix per node, indexed by device index; a node
            without one counts every pair as equally far.
        sharing_strategy: MIG placement, ``least-fragmentation`` (the
            broker's) or ``first-fit`` (a baseline), see
            :mod:`gpubroker.scheduler.sharing`.
        explain: whether each wait gets its sentence for the user
            (``Wait.message``); the trace simulator, which reads only
            reasons, ETAs and earmarks, turns it off (``message`` is then
            ``""``). The decisions are the same either way.
        also_waiting: users with requests waiting that ``pending`` leaves
            out, for a pass over part of the queue (the trace simulator's
            prefix passes). They count among the active users whose shares
            normalise fair share, so every factor is the one the whole queue
            gives; their left-out requests get no decisions.
        share_placement: where shares go: a strategy of
            :mod:`gpubroker.scheduler.packing` other than ``random``
            (``packing``, the broker's; ``fgd``, ``best-fit``, ``first-fit``).
        share_sizes: share sizes (MiB) counted once each in the share mix
            besides those held and waiting (:func:`gpubroker.scheduler.sharing.share_mix`).
    """

    slots: tuple[Slot, ...]
    running: tuple[Running, ...]
    pending: tuple[Request, ...]
    policy: Policy = Policy()
    usage: Mapping[str, UsageRecord] = field(default_factory=dict)
    topology: Mapping[str, Topology] = field(default_factory=dict)
    sharing_strategy: str = "least-fragmentation"
    explain: bool = field(default=True, repr=False)  # repr: as before (golden data)
    also_waiting: frozenset[str] = field(default=frozenset(), repr=False)
    share_placement: str = field(default="packing", repr=False)
    share_sizes: tuple[int, ...] = field(default=(), repr=False)


@dataclass(frozen=True)
class Grant:
    """Decision: bind ``devices`` (UUIDs) to ``lease_id``, or, for a MIG or
    share request, ``parts`` (a MIG instance to create or take, shares)."""

    lease_id: int
    devices: tuple[str, ...]
    parts: tuple[Part, ...] = ()


@dataclass(frozen=True)
class Preemption:
    """Decision: tell ``lease_id`` it is preempted; evict it at ``deadline``.

    Attributes:
        lease_id: the victim.
        for_lease: the request its devices are earmarked for.
        devices: devices of the victim that go to ``for_lease``.
        reason: why, in a sentence.
        deadline: end of the grace period (aware UTC).
    """

    lease_id: int
    for_lease: int
    devices: tuple[str, ...]
    reason: str
    deadline: dt.datetime


@dataclass(frozen=True)
class Eviction:
    """Decision: the grace period of preempted ``lease_id`` is over: end it."""

    lease_id: int
    reason: str


@dataclass(frozen=True)
class Wait:
    """Decision: ``lease_id`` keeps waiting.

    Attributes:
        lease_id: the pending lease.
        position: 1-based place, in policy order, among the waiting requests
            that compete with it: the same kind of slot (whole devices, MIG
            instances or shares) and an overlapping pool (either asks for
            any pool, or both for the same one).
        reason: a :class:`WaitReason` code.
        message: one sentence for the user.
        eta: estimated start (aware UTC), ``None`` when unknown.
        earmarked: devices being reclaimed for it (from a preemption).
    """

    lease_id: int
    position: int
    reason: WaitReason
    message: str
    eta: dt.datetime | None = None
    earmarked: tuple[str, ...] = ()

    def __eq__(self, other: object) -> bool:
        # the fields compared at once (the broker compares thousands per
        # pass); the same result as the generated field-by-field comparison
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self.__dict__ == other.__dict__

    def __hash__(self) -> int:
        return hash(
            (self.lease_id, self.position, self.reason, self.message, self.eta, self.earmarked)
        )


@dataclass(frozen=True)
class Decisions:
    """The result of one pass.

    Attributes:
        grants: requests granted now, with their devices.
        preemptions: new victims, told now, evicted at their deadline.
        evictions: victims whose grace period is over.
        waits: every request left waiting, in queue order.
        reclaimable: ids of granted leases (old and new) that are borrowed,
            i.e. above their user's and group's guarantees.
        withdrawn: ids of leases told of a preemption whose request went
            away; they keep running.
    """

    grants: tuple[Grant, ...] = ()
    preemptions: tuple[Preemption, ...] = ()
    evictions: tuple[Eviction, ...] = ()
    waits: tuple[Wait, ...] = ()
    reclaimable: frozenset[int] = frozenset()
    withdrawn: tuple[int, ...] = ()
