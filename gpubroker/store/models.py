"""The ORM: devices, leases and the allocations that bind them.

Exactly-once ownership (DESIGN principle 2) is backed by the database: an
:class:`Allocation` row is *active* while its lease holds the device, and a
partial unique index allows at most one active allocation per device. A second
partial unique index allows at most one active lease per (user, server name).
Both are partial indexes, which SQLite (3.8+) and PostgreSQL support.

All times are stored as naive UTC and returned as timezone-aware UTC.
"""

from __future__ import annotations

import datetime as dt
import enum

from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    TypeDecorator,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship


class UTCDateTime(TypeDecorator[dt.datetime]):
    """A DateTime stored as naive UTC and read back as aware UTC.

    Raises:
        ValueError: when given a naive datetime (ambiguous time zone).
    """

    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: dt.datetime | None, dialect: object) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given; use an aware UTC datetime")
        return value.astimezone(dt.timezone.utc).replace(tzinfo=None)

    def process_result_value(
        self, value: dt.datetime | None, dialect: object
    ) -> dt.datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=dt.timezone.utc)


class LeaseState(str, enum.Enum):
    """Life cycle of a lease: ``pending`` → ``granted`` → ``released``.

    A pending lease may go straight to ``released`` (cancelled in the queue).
    """

    pending = "pending"
    granted = "granted"
    released = "released"


#: states in which a lease counts against devices, quotas and uniqueness
ACTIVE_STATES = (LeaseState.pending.value, LeaseState.granted.value)
_ACTIVE_SQL = "state IN ('pending', 'granted')"


class HolderKind(str, enum.Enum):
    """What holds a lease.

    ``server``: a JupyterHub single-user server (reconciled against the hub);
    ``external``: something outside the hub (an admin script), never
    reconciled against hub servers; ``job``: a batch job's own lease (made
    by ``POST /jobs``, never by ``POST /leases``).
    """

    server = "server"
    external = "external"
    job = "job"


class Base(DeclarativeBase):
    """Declarative base of every gpubroker table."""


class Device(Base):
    """One physical GPU known to the broker (the inventory).

    ``present`` is false for a device that the backend no longer reports;
    such a device is never granted, but leases on it are kept.
    """

    __tablename__ = "devices"

    uuid: Mapped[str] = mapped_column(String(64), primary_key=True)
    node: Mapped[str] = mapped_column(String(255))
    index: Mapped[int] = mapped_column(Integer)
    name: Mapped[str] = mapped_column(String(255))
    memory_total_mib: Mapped[int] = mapped_column(Integer)
    pci_bus_id: Mapped[str] = mapped_column(String(32))
    mig_enabled: Mapped[bool] = mapped_column(Boolean, default=False)
    present: Mapped[bool] = mapped_column(Boolean, default=True)
    drained: Mapped[bool] = mapped_column(Boolean, default=False)
    #: MIG mode an admin asked for; set once the device is empty (a drain operation)
    mig_target: Mapped[bool | None] = mapped_column(Boolean, nullable=True)


class Lease(Base):
    """A request for GPUs and, once granted, the binding to devices.

    ``queue_*`` columns hold the latest scheduling verdict for a pending
    lease (position from 1, Slurm-style reason code, sentence for the user).
    ``version`` grows by one at every change a holder can see (state, queue
    position, reason), for long-polls (like Kubernetes' resourceVersion).
    """

    __tablename__ = "leases"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    user: Mapped[str] = mapped_column(String(255), index=True)
    server_name: Mapped[str] = mapped_column(String(255), default="")
    holder_kind: Mapped[str] = mapped_column(String(16), default=HolderKind.server.value)
    gpus: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16), default=LeaseState.pending.value, index=True)
    created: Mapped[dt.datetime] = mapped_column(UTCDateTime)
    granted_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)
    released_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)
    release_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    queue_position: Mapped[int | None] = mapped_column(Integer, nullable=True)
    queue_reason: Mapped[str | None] = mapped_column(String(32), nullable=True)
    queue_message: Mapped[str | None] = mapped_column(Text, nullable=True)
    version: Mapped[int] = mapped_column(Integer, default=1)
    priority_class: Mapped[str] = mapped_column(String(64), default="interactive")
    group_name: Mapped[str | None] = mapped_column(String(255), nullable=True)
    time_limit: Mapped[float | None] = mapped_column(Float, nullable=True)
    ends_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)
    queue_eta: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)
    earmarked: Mapped[list[str] | None] = mapped_column(JSON, nullable=True)
    reclaimable: Mapped[bool] = mapped_column(Boolean, default=False)
    preempted_for: Mapped[int | None] = mapped_column(Integer, nullable=True)
    preempt_deadline: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)
    preempt_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    server_url: Mapped[str | None] = mapped_column(String(1024), nullable=True)
    #: Docker container id of a DockerGPUSpawner server (64 hex digits)
    container_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    #: ID of the Docker engine that runs it (``docker info``), as the spawner saw it
    docker_engine: Mapped[str | None] = mapped_column(String(128), nullable=True)
    #: Slurm job id of a SlurmGPUSpawner server
    slurm_job: Mapped[str | None] = mapped_column(String(20), nullable=True)
    kind: Mapped[str] = mapped_column(String(8), default="gpus", server_default="gpus")
    mig_profile: Mapped[str | None] = mapped_column(String(32), nullable=True)
    memory_mib: Mapped[int | None] = mapped_column(Integer, nullable=True)
    pool: Mapped[str | None] = mapped_column(String(64), nullable=True)
    weight: Mapped[float | None] = mapped_column(Float, nullable=True)
    grant_env: Mapped[dict[str, str] | None] = mapped_column(JSON, nullable=True)
    #: restarts of the server this lease serves (previous lease's + 1)
    restarts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    #: the lease of the same server this one replaces after a restart
    restart_of: Mapped[int | None] = mapped_column(Integer, nullable=True)
    #: devices placement tries first (the previous lease's, after a restart)
    prefer_devices: Mapped[list[str] | None] = mapped_column(JSON, nullable=True)

    allocations: Mapped[list[Allocation]] = relationship(
        back_populates="lease", order_by="Allocation.id", lazy="selectin"
    )

    __table_args__ = (
        Index(
            "uq_leases_active_server",
            "user",
            "server_name",
            unique=True,
            sqlite_where=text(f"{_ACTIVE_SQL} AND holder_kind = 'server'"),
            postgresql_where=text(f"{_ACTIVE_SQL} AND holder_kind = 'server'"),
        ),
    )


class Allocation(Base):
    """One slot bound to one lease; ``active`` until the lease is released.

    ``kind`` ``device``: the whole device (at most one active per device,
    by a partial unique index). ``mig``: a MIG instance of ``profile`` at
    ``placement_start``/``placement_size`` whose ``MIG-`` UUID is
    ``instance_uuid`` (unique among active allocations). ``share``:
    ``memory_mib`` of the device. ``weight``: device units it counts for.
    Overlapping MIG placements and oversubscribed shares cannot be expressed
    as indexes; the scheduler prevents them (property-tested).
    """

    __tablename__ = "allocations"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    lease_id: Mapped[int] = mapped_column(ForeignKey("leases.id", ondelete="CASCADE"))
    device_uuid: Mapped[str] = mapped_column(ForeignKey("devices.uuid"))
    active: Mapped[bool] = mapped_column(Boolean, default=True)
    kind: Mapped[str] = mapped_column(String(8), default="device", server_default="device")
    instance_uuid: Mapped[str | None] = mapped_column(String(64), nullable=True)
    profile: Mapped[str | None] = mapped_column(String(32), nullable=True)
    placement_start: Mapped[int | None] = mapped_column(Integer, nullable=True)
    placement_size: Mapped[int | None] = mapped_column(Integer, nullable=True)
    memory_mib: Mapped[int | None] = mapped_column(Integer, nullable=True)
    weight: Mapped[float] = mapped_column(Float, default=1.0, server_default="1.0")

    lease: Mapped[Lease] = relationship(back_populates="allocations")
    device: Mapped[Device] = relationship(lazy="joined")

    __table_args__ = (
        Index(
            "uq_allocations_active_device",
            "device_uuid",
            unique=True,
            sqlite_where=text("active = 1 AND kind = 'device'"),
            postgresql_where=text("active AND kind = 'device'"),
        ),
        Index(
            "uq_allocations_active_instance",
            "instance_uuid",
            unique=True,
            sqlite_where=text("active = 1 AND instance_uuid IS NOT NULL"),
            postgresql_where=text("active AND instance_uuid IS NOT NULL"),
        ),
    )


class QuotaRow(Base):
    """A quota set through the admin API (overrides the config's).

    ``kind`` is ``user`` or ``group``; GPUs in whole-device units.
    """

    __tablename__ = "quotas"

    kind: Mapped[str] = mapped_column(String(8), primary_key=True)
    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    guaranteed: Mapped[float] = mapped_column(Float, default=0.0)
    limit: Mapped[float | None] = mapped_column(Float, nullable=True)


class UsageRow(Base):
    """A user's past GPU-seconds, decayed (fair-share half-life) to ``as_of``."""

    __tablename__ = "usage"

    user: Mapped[str] = mapped_column(String(255), primary_key=True)
    gpu_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    as_of: Mapped[dt.datetime] = mapped_column(UTCDateTime)


class Notice(Base):
    """A message for a lease's holder: a cull warning, its withdrawal, a cull.

    ``kind``: ``cull-warning`` (with ``deadline``), ``cull-withdrawn``,
    ``culled``, ``cull-dry-run``, ``busy-gpu-idle`` (for admins).
    """

    __tablename__ = "notices"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    lease_id: Mapped[int] = mapped_column(ForeignKey("leases.id", ondelete="CASCADE"), index=True)
    user: Mapped[str] = mapped_column(String(255), index=True)
    server_name: Mapped[str] = mapped_column(String(255), default="")
    kind: Mapped[str] = mapped_column(String(32))
    message: Mapped[str] = mapped_column(Text)
    created: Mapped[dt.datetime] = mapped_column(UTCDateTime)
    deadline: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)


class LeaseEvent(Base):
    """One entry of the durable transition log: a lease's change of state,
    or something that happened to it (see :mod:`gpubroker.model.lifecycle`).

    Appended in the same transaction as the change it records, so the log
    and the leases never disagree; never updated or deleted.
    """

    __tablename__ = "lease_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    lease_id: Mapped[int] = mapped_column(ForeignKey("leases.id", ondelete="CASCADE"), index=True)
    kind: Mapped[str] = mapped_column(String(32))
    from_state: Mapped[str | None] = mapped_column(String(16), nullable=True)
    to_state: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str] = mapped_column(Text, default="")
    actor: Mapped[str] = mapped_column(String(255))
    stimulus: Mapped[str] = mapped_column(String(64), index=True)
    at: Mapped[dt.datetime] = mapped_column(UTCDateTime)
    detail: Mapped[dict[str, object] | None] = mapped_column(JSON, nullable=True)


class Intent(Base):
    """A side effect on the outside world the broker has decided on and must
    see carried out, kept so a restart resumes it instead of forgetting it.

    ``kind``: ``stop-server`` (ask the hub to stop the server of ``lease_id``
    before its slots are released; ``reason`` is the lease's release
    reason). ``state``: ``open`` until it is carried out or given up
    (``done``, with ``done_at``).
    """

    __tablename__ = "intents"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    kind: Mapped[str] = mapped_column(String(32))
    lease_id: Mapped[int] = mapped_column(ForeignKey("leases.id", ondelete="CASCADE"), index=True)
    reason: Mapped[str] = mapped_column(Text, default="")
    created: Mapped[dt.datetime] = mapped_column(UTCDateTime)
    state: Mapped[str] = mapped_column(String(8), default="open", index=True)
    done_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    #: why the broker stops it (``cull``, ``preemption``, ``time-limit``,
    #: ``reconcile``, ``release``): recorded on the release
    cause: Mapped[str] = mapped_column(String(16), default="", server_default="")


class CullerTrack(Base):
    """What the culler remembers of a lease between checks, kept across
    broker restarts (see :class:`gpubroker.culler.Track`): when its GPUs
    were last used, since when its kernel is busy on an idle GPU, the
    deadline of a warning, whether admins were told, whether it is culled,
    whether a check read its kernels (revision 0016)."""

    __tablename__ = "culler_tracks"

    lease_id: Mapped[int] = mapped_column(
        ForeignKey("leases.id", ondelete="CASCADE"), primary_key=True
    )
    gpu_active: Mapped[dt.datetime] = mapped_column(UTCDateTime)
    busy_since_gpu_idle: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)
    warned_until: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)
    flagged: Mapped[bool] = mapped_column(Boolean, default=False)
    culled: Mapped[bool] = mapped_column(Boolean, default=False)
    kernels_seen: Mapped[bool] = mapped_column(Boolean, default=False)


class UsageInterval(Base):
    """One interval of the usage ledger (see :mod:`gpubroker.usage.ledger`):
    one slot of one lease held from ``start_s`` to ``end_s``, or one wait
    in the queue (``slot_kind`` ``wait``, weight 0).

    Times are UTC seconds since the epoch (floats), so that reports sum
    durations in portable SQL. ``end_s`` is ``NULL`` while the interval is
    open. ``weight``: device units the slot counts for (1 for a whole
    device; a MIG instance its compute slices over the device's; a share
    its memory over the device's). ``used_gpu_seconds``: sampled
    utilization * seconds * weight; ``sampled_s``: the seconds the samples
    cover. ``end_cause``: ``release``, ``cancel``, ``cull``, ``preemption``,
    ``time-limit``, ``reconcile``, ``granted`` (a wait that ended in a
    grant), ``broker-down`` (open when the broker stopped: closed at its
    last sign of life). ``idle_s``: for a culled lease, how long it had
    been idle when it was culled.
    """

    __tablename__ = "usage_intervals"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    lease_id: Mapped[int] = mapped_column(Integer, index=True)
    user: Mapped[str] = mapped_column(String(255))
    group_name: Mapped[str] = mapped_column(String(255), default="")
    holder_kind: Mapped[str] = mapped_column(String(16))
    holder: Mapped[str] = mapped_column(String(255), default="")
    priority_class: Mapped[str] = mapped_column(String(64))
    pool: Mapped[str] = mapped_column(String(64), default="")
    slot_kind: Mapped[str] = mapped_column(String(8))
    device_uuid: Mapped[str] = mapped_column(String(64), default="")
    slot_uuid: Mapped[str] = mapped_column(String(64), default="")
    profile: Mapped[str] = mapped_column(String(32), default="")
    model: Mapped[str] = mapped_column(String(255), default="")
    node: Mapped[str] = mapped_column(String(255), default="")
    weight: Mapped[float] = mapped_column(Float)
    start_s: Mapped[float] = mapped_column(Float, index=True)
    end_s: Mapped[float | None] = mapped_column(Float, nullable=True, index=True)
    end_cause: Mapped[str] = mapped_column(String(16), default="")
    used_gpu_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    sampled_s: Mapped[float] = mapped_column(Float, default=0.0)
    idle_s: Mapped[float] = mapped_column(Float, default=0.0)


class LedgerMark(Base):
    """Where the usage ledger stands (one row, ``id`` 1): the last
    transition-log entry folded in (``event_id``) and the broker's last
    sign of life (``heartbeat_s``, UTC seconds since the epoch)."""

    __tablename__ = "ledger_mark"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    event_id: Mapped[int] = mapped_column(Integer, default=0)
    heartbeat_s: Mapped[float] = mapped_column(Float, default=0.0)


class AuditEntry(Base):
    """An admin action for the audit log: on something other than a lease
    (a quota, a device), or an admin's decision about a lease (its
    preemption) whose transitions are in ``lease_events``.

    ``action``: ``quota-set``, ``quota-deleted``, ``device-drained``,
    ``device-undrained``, ``device-mig``, ``lease-preempted``. ``target``:
    ``user:NAME``, ``group:NAME`` or a device UUID, of any length (a name
    has up to 255 characters, its prefix comes on top; revision 0015).
    ``detail``: the values set. ``reason``: the admin's words, where the
    action takes them.
    """

    __tablename__ = "audit_entries"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[dt.datetime] = mapped_column(UTCDateTime, index=True)
    actor: Mapped[str] = mapped_column(String(255))
    action: Mapped[str] = mapped_column(String(32))
    target: Mapped[str] = mapped_column(Text)
    reason: Mapped[str] = mapped_column(Text, default="")
    stimulus: Mapped[str] = mapped_column(String(64), default="")
    detail: Mapped[dict[str, object] | None] = mapped_column(JSON, nullable=True)


class Job(Base):
    """A batch job: a notebook (run with papermill) or a command, on a lease
    of its own (see :mod:`gpubroker.jobs`).

    ``state``: ``queued`` (its lease waits), ``running``, ``succeeded``,
    ``failed``, ``cancelled``, ``timed-out`` (:mod:`gpubroker.model.jobs`).
    ``spec``: what to run (:class:`gpubroker.model.jobs.JobSpec` as JSON).
    ``handle_*``: the engine's handle of the running process. ``exit_code``
    and ``signal`` are recorded apart.
    """

    __tablename__ = "jobs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    user: Mapped[str] = mapped_column(String(255), index=True)
    lease_id: Mapped[int | None] = mapped_column(Integer, nullable=True, index=True)
    kind: Mapped[str] = mapped_column(String(16))
    spec: Mapped[dict[str, object]] = mapped_column(JSON)
    state: Mapped[str] = mapped_column(String(16), index=True)
    reason: Mapped[str] = mapped_column(Text, default="")
    created: Mapped[dt.datetime] = mapped_column(UTCDateTime)
    started_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)
    ended_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)
    exit_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    signal: Mapped[int | None] = mapped_column(Integer, nullable=True)
    output_path: Mapped[str] = mapped_column(Text, default="")
    log_path: Mapped[str] = mapped_column(Text, default="")
    handle_engine: Mapped[str] = mapped_column(String(32), default="")
    handle_id: Mapped[str] = mapped_column(String(255), default="")
    handle_node: Mapped[str] = mapped_column(String(255), default="")
    #: times it was requeued (preempted, or retried after a failure)
    restarts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    #: of those, times it was retried after a failure (``retries`` limits them)
    retried: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    #: when its process got the warning signal (a stop is near)
    warned_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)
