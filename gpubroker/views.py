"""JSON shapes of leases and devices, as the REST API returns them.

Times are ISO 8601 strings in UTC (``2026-11-30T14:20:00Z``); memory in MiB.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from .model.holdings import DeviceRef
from .store.models import Allocation, Device, Lease, LeaseState


def isoformat(when: dt.datetime | None) -> str | None:
    """Format an aware UTC datetime as ``YYYY-MM-DDTHH:MM:SS.ffffffZ`` (or
    ``None``); the microseconds are always written, also on a whole second,
    so the times of one field sort as text."""
    if when is None:
        return None
    return (
        when.astimezone(dt.timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")
    )


def device_view(device: Device | DeviceRef) -> dict[str, Any]:
    """A device's identity: ``uuid``, ``index``, ``name``, ``node``, ``pci_bus_id``,
    ``memory_total_mib``."""
    return {
        "uuid": device.uuid,
        "index": device.index,
        "name": device.name,
        "node": device.node,
        "pci_bus_id": device.pci_bus_id,
        "memory_total_mib": device.memory_total_mib,
    }


def lease_env(lease: Lease) -> dict[str, str]:
    """The environment a granted lease's notebook must get.

    ``CUDA_VISIBLE_DEVICES`` and ``NVIDIA_VISIBLE_DEVICES`` list the device
    UUIDs (CUDA accepts UUIDs there: CUDA C Programming Guide, "CUDA
    Environment Variables"); ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` makes CUDA's
    ordinals match NVML's. A lease that is not granted gets ``{}``.
    """
    if lease.state != LeaseState.granted.value:
        return {}
    if lease.grant_env:
        return dict(lease.grant_env)
    uuids = ",".join(a.device_uuid for a in lease.allocations if a.active)
    return {
        "CUDA_VISIBLE_DEVICES": uuids,
        "NVIDIA_VISIBLE_DEVICES": uuids,
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "GPUBROKER_LEASE_ID": str(lease.id),
    }


#: what each kind of slot guarantees, said in the lease and the spawn form
GUARANTEES = {
    "gpus": "whole device: all its memory and compute, for this lease alone",
    "mig": (
        "MIG instance: memory and compute isolated in hardware; "
        "compute: {slices} of the device's SMs, hard"
    ),
    "share": (
        "time-sliced share: memory cap of {memory} enforced by the broker "
        "(framework caps, watchdog; hard only where MPS runs, and there per CUDA "
        "process that keeps the variables that set it: two processes of the "
        "server can each use the cap, while the watchdog enforces the total "
        "per server); compute shared with the "
        "device's other users, no guaranteed part"
    ),
}


def summary(lease: Lease) -> str:
    """One line saying what the lease asks for, e.g. ``1 x MIG 1g.10gb``."""
    if lease.kind == "mig":
        return f"1 x MIG {lease.mig_profile}"
    if lease.kind == "share":
        gib = (lease.memory_mib or 0) / 1024
        each = " each" if lease.gpus > 1 else ""
        return f"{lease.gpus} x shared GPU ({gib:g} GiB{each})"
    return f"{lease.gpus} x GPU"


def guarantee(lease: Lease) -> str:
    """What the lease's slots guarantee (memory hard or soft, compute share)."""
    text = GUARANTEES.get(lease.kind, GUARANTEES["gpus"])
    if lease.kind == "mig":
        slices = int((lease.mig_profile or "1g").split("g.")[0])
        total = round(slices / lease.weight) if lease.weight else 7
        return text.format(slices=f"{slices}/{total}")
    if lease.kind == "share":
        return text.format(memory=f"{(lease.memory_mib or 0) / 1024:g} GiB")
    return text


def slot_view(allocation: Allocation) -> dict[str, Any]:
    """One slot a lease holds: ``kind`` (``device``, ``mig``, ``share``),
    ``device`` (GPU UUID), ``uuid`` (what CUDA sees: the GPU or ``MIG-``
    UUID), ``profile``, ``placement`` (``start:size``), ``memory_mib``,
    ``weight`` (device units)."""
    placement = None
    if allocation.placement_start is not None:
        placement = f"{allocation.placement_start}:{allocation.placement_size}"
    return {
        "kind": allocation.kind,
        "device": allocation.device_uuid,
        "uuid": allocation.instance_uuid or allocation.device_uuid,
        "profile": allocation.profile,
        "placement": placement,
        "memory_mib": allocation.memory_mib,
        "weight": allocation.weight,
    }


#: what another user's waiting request shows of itself in a private queue
QUEUED_REQUEST_KEYS = (
    "summary",
    "kind",
    "gpus",
    "mig_profile",
    "memory_gib",
    "count",
    "pool",
    "weight",
    "priority_class",
    "time_limit",
    "state",
    "created",
)


def queued_request(view: Mapping[str, Any]) -> dict[str, Any]:
    """Another user's waiting request (a :func:`lease_view`) as a caller who
    is not a broker admin sees it in a private queue (``QueuedRequest`` in
    the OpenAPI document): what it asks for, its class and its place (queue
    position, reason code, estimated start), not who asked or why in words
    (no id, user, server, group, queue message or devices earmarked)."""
    queue = view.get("queue") or {}
    shown = {key: view.get(key) for key in QUEUED_REQUEST_KEYS}
    shown["queue"] = {
        "position": queue.get("position"),
        "reason": queue.get("reason"),
        "eta": queue.get("eta"),
    }
    return shown


def lease_view(lease: Lease) -> dict[str, Any]:
    """The full JSON shape of a lease (see ``Lease`` in the OpenAPI document)."""
    granted = lease.state == LeaseState.granted.value
    queue = None
    if lease.state == LeaseState.pending.value:
        queue = {
            "position": lease.queue_position,
            "reason": lease.queue_reason,
            "message": lease.queue_message,
            "eta": isoformat(lease.queue_eta),
            "earmarked": list(lease.earmarked or ()),
        }
    preemption = None
    if lease.preempt_deadline is not None:
        preemption = {
            "reason": lease.preempt_reason,
            "deadline": isoformat(lease.preempt_deadline),
            "for_lease": lease.preempted_for,
        }
    return {
        "id": lease.id,
        "user": lease.user,
        "server_name": lease.server_name,
        "holder_kind": lease.holder_kind,
        "gpus": lease.gpus,
        "kind": lease.kind,
        "mig_profile": lease.mig_profile,
        "memory_gib": None if lease.memory_mib is None else lease.memory_mib / 1024,
        "count": lease.gpus,
        "pool": lease.pool,
        "weight": lease.weight if lease.weight is not None else float(lease.gpus),
        "summary": summary(lease),
        "guarantee": guarantee(lease),
        "priority_class": lease.priority_class,
        "group": lease.group_name,
        "time_limit": lease.time_limit,
        "state": lease.state,
        "version": lease.version,
        "created": isoformat(lease.created),
        "granted_at": isoformat(lease.granted_at),
        "released_at": isoformat(lease.released_at),
        "ends_at": isoformat(lease.ends_at),
        "release_reason": lease.release_reason,
        "restarts": lease.restarts or 0,
        "restart_of": lease.restart_of,
        "slurm_job": lease.slurm_job,
        "container_id": lease.container_id,
        "reclaimable": lease.reclaimable,
        "preemption": preemption,
        "devices": [device_view(a.device) for a in lease.allocations if a.active or not granted],
        "slots": [slot_view(a) for a in lease.allocations if a.active or not granted],
        "env": lease_env(lease),
        "queue": queue,
    }


#: the ``state`` of a device in ``GET /devices``, each counted in its ``summary``
DEVICE_STATES = ("free", "leased", "shared", "drained", "outside")


def device_listing(broker: Any, admin: bool, me: str, log: Any) -> dict[str, Any]:
    """The inventory as ``GET /api/v1/devices`` and the panel show it.

    Args:
        broker: the :class:`~gpubroker.core.Broker`.
        admin: whether the caller is a broker admin (sees every holder).
        me: the caller's name (a user sees her own holders only).
        log: where a device that cannot be read is reported.

    Returns:
        ``{"backend", "devices", "summary"}`` (``DeviceList`` in the OpenAPI
        document); memory in MiB, utilization in percent. ``summary``
        counts the present devices by their ``state`` (``free``,
        ``leased``, ``shared``, ``drained``, ``outside``; these add up to
        ``total``), ``free_whole`` (free devices of ``exclusive`` pools:
        what a request of whole GPUs can get), ``absent`` (devices not
        present, in no other count) and ``request_limit``.
    """
    devices = [
        _device(broker, device, holders, admin, me, log) for device, holders in broker.device_rows()
    ]
    present = [d for d in devices if d["present"]]
    summary: dict[str, int] = {"total": len(present)}
    summary.update(dict.fromkeys(DEVICE_STATES, 0))
    for device in present:
        summary[device["state"]] += 1
    summary["free_whole"] = sum(
        1 for d in present if d["state"] == "free" and d["pool_mode"] == "exclusive"
    )
    summary["absent"] = len(devices) - len(present)
    summary["request_limit"] = broker.request_limit()
    return {"backend": broker.inventory_source(), "devices": devices, "summary": summary}


def _device(
    broker: Any, device: DeviceRef, holders: list[dict[str, Any]], admin: bool, me: str, log: Any
) -> dict[str, Any]:
    """One device's view; admins see every holder, users their own."""
    view = device_view(device)
    held = bool(holders)
    outside = broker.outside_reason(device.uuid, admin)
    state = "leased" if held else "drained" if device.drained else "outside" if outside else "free"
    pool = broker.pool_spec(device.uuid)
    if held and (pool.mode != "exclusive" or holders[0]["kind"] != "device"):
        state = "shared"
    lease_id = holders[0]["lease_id"] if holders else None
    view.update(
        pool=pool.name,
        pool_mode=pool.mode,
        mig_target=device.mig_target,
        present=device.present,
        drained=device.drained,
        mig_enabled=device.mig_enabled,
        state=state,
        outside=outside,
        lease_id=lease_id if admin else None,
        holders=[h for h in holders if admin or h["user"] == me],
        slots_held=len(holders),
        usage=device_usage(broker, device.uuid, log) if device.present else None,
    )
    return view


def device_usage(broker: Any, uuid: str, log: Any) -> dict[str, Any] | None:
    """What the device backend reads of device ``uuid`` now: utilization
    (percent), memory used (MiB) and its process count; ``None`` (logged
    as a warning on ``log``) when the device cannot be read; ``None`` where
    its engine reads no usage of it (Slurm's)."""
    try:
        usage = broker.engine.telemetry([uuid]).get(uuid)
    except Exception as err:  # a device that cannot be read must not fail the listing
        log.warning("Cannot read usage of %s: %s", uuid, err)
        return None
    if usage is None:
        return None
    return {
        "utilization_gpu": usage.utilization_gpu,
        "memory_used_mib": usage.memory_used_mib,
        "processes": len(usage.processes),
    }
