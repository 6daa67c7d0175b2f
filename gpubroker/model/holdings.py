"""Typed, immutable pictures of what a lease holds, handed out of the broker
core to the loops that act on holders (the culler, the share watchdog, the
reconciliations with Docker and Slurm) instead of the store's rows: a
picture is taken at one moment and never changes under its reader, however
many awaits it is kept across (pure values, no I/O)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HeldSlot:
    """One slot a lease holds.

    Attributes:
        kind: ``device`` (a whole device), ``mig`` or ``share``.
        device_uuid: the device (``GPU-…``).
        instance_uuid: the MIG instance (``MIG-…``), else ``None``.
        profile: the MIG profile (``1g.10gb``), else ``None``.
        memory_mib: a share's memory cap, MiB, else ``None``.
    """

    kind: str
    device_uuid: str
    instance_uuid: str | None = None
    profile: str | None = None
    memory_mib: int | None = None


@dataclass(frozen=True, slots=True)
class LeaseRef:
    """A granted lease as it stood when the picture was taken.

    Attributes:
        id: the lease.
        user, server_name: its holder's user and server name (``""``: the
            default server).
        holder_kind: ``server``, ``job`` or ``external``.
        priority_class: its class's name.
        created: when it was requested, aware UTC.
        granted_at: when it was granted, aware UTC (``None``: never).
        server_url: where its single-user server listens (``None``: not told).
        container_id, docker_engine: its server's Docker container and that
            engine's ID (``DockerGPUSpawner``), else ``None``.
        slurm_job: its server's Slurm job (``SlurmGPUSpawner``), else ``None``.
        slots: the slots it holds.
    """

    id: int
    user: str
    server_name: str
    holder_kind: str
    priority_class: str
    created: dt.datetime
    granted_at: dt.datetime | None
    server_url: str | None
    container_id: str | None
    docker_engine: str | None
    slurm_job: str | None
    slots: tuple[HeldSlot, ...]


@dataclass(frozen=True, slots=True)
class DeviceRef:
    """A device as it stood when the picture was taken (``Broker.device_rows``).

    Attributes:
        uuid: NVML UUID (``GPU-…``).
        node: the node it is on.
        index: its index on the node.
        name: the model's NVML name (``NVIDIA H100 80GB HBM3``).
        memory_total_mib: its memory, MiB.
        pci_bus_id: its PCI bus id.
        mig_enabled: whether MIG mode is on.
        present: whether its engine still reports it.
        drained: whether an admin drained it (no new grants).
        mig_target: the MIG mode an admin asked for and not yet set
            (``None``: none asked).
    """

    uuid: str
    node: str
    index: int
    name: str
    memory_total_mib: int
    pci_bus_id: str
    mig_enabled: bool
    present: bool
    drained: bool
    mig_target: bool | None
