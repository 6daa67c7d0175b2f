"""The overview's picture as data: nodes, each a row of device tiles, each
tile split into its slots (a whole device, MIG instances, shares) and the
room left free. Pure: it reads the device listing
(:func:`gpubroker.views.device_listing`) and lease views it is given, and
no clock (``now`` is an argument).

A slot's ``width`` is its part of the device: 1 for a whole device; for a
MIG instance the larger of its compute slices over 7 (the A100/H100 rule
of seven GPCs) and its memory over the device's (``3g.40gb`` on an 80 GB
device: 1/2, as it takes four of the eight memory slices; ``1g.20gb``:
1/4), so the free room drawn is room a profile could still use; memory
over the device's memory for a share, and the pool's ``reserve_gib`` is
drawn as reserved room.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: compute slices of a full MIG-capable device (A100, H100, H200: seven GPCs)
MIG_SLICES = 7


@dataclass(frozen=True)
class SlotTile:
    """One held slot of a device, or its free room (``lease_id`` ``None``).

    Attributes:
        label: what the slot is: ``whole device``, ``MIG 1g.10gb``,
            ``share 10 GiB``, ``reserved`` or ``free``.
        width: its part of the device, 0 to 1.
        lease_id: the holding lease; ``None`` for free room.
        user: the holder's user name (``None`` for free room).
        server_name: the holder's server name (``""``: the default server).
        holder_kind: ``server``, ``job`` or ``external``.
        priority_class: the lease's priority class.
        age_seconds: seconds since the grant (``None``: unknown).
        idle_seconds: seconds since its GPU was last seen busy, as the
            culler tracks it (``None``: not tracked).
    """

    label: str
    width: float
    lease_id: int | None = None
    user: str | None = None
    server_name: str = ""
    holder_kind: str = ""
    priority_class: str = ""
    age_seconds: float | None = None
    idle_seconds: float | None = None

    @property
    def free(self) -> bool:
        """Whether this is the device's free room (or its reserve)."""
        return self.lease_id is None


@dataclass(frozen=True)
class DeviceTile:
    """One device as the overview draws it.

    Attributes:
        uuid, index, name, node: the device's identity.
        pool, mode: its pool and the pool's sharing mode.
        state: ``free``, ``leased``, ``shared`` or ``drained``.
        drained, present, mig_enabled, simulated: flags drawn on the tile.
        utilization: GPU utilization, percent (``None``: not read).
        memory_used_gib, memory_total_gib: memory, GiB.
        slots: the held slots, then the free room (if any).
    """

    uuid: str
    index: int
    name: str
    node: str
    pool: str
    mode: str
    state: str
    drained: bool
    present: bool
    mig_enabled: bool
    simulated: bool
    utilization: int | None
    memory_used_gib: float | None
    memory_total_gib: float
    slots: tuple[SlotTile, ...]


@dataclass(frozen=True)
class NodeRow:
    """One node and its devices, in index order."""

    name: str
    tiles: tuple[DeviceTile, ...]


def mig_width(profile: str | None, total_gib: float = 0.0) -> float:
    """A MIG profile's part of its device: the larger of its compute slices
    over 7 and its memory over ``total_gib`` (``3g.40gb`` of 80 GiB: 1/2;
    1/7 when the profile names neither)."""
    head, _, tail = (profile or "").partition("g.")
    slices = int(head) if head.isdigit() else 1
    memory = tail.lower().removesuffix("gb")
    part = slices / MIG_SLICES
    if memory.isdigit() and total_gib > 0:
        part = max(part, int(memory) / total_gib)
    return min(1.0, part)


def _since(when: str | None, now: dt.datetime) -> float | None:
    """Seconds from an ISO 8601 UTC time (``…Z``) to ``now``."""
    if not when:
        return None
    at = dt.datetime.fromisoformat(when.replace("Z", "+00:00"))
    return max(0.0, (now - at).total_seconds())


def _slot(
    holder: Mapping[str, Any],
    total_gib: float,
    lease: Mapping[str, Any] | None,
    idle_since: Mapping[int, dt.datetime],
    now: dt.datetime,
) -> SlotTile:
    kind = holder.get("kind")
    if kind == "mig":
        profile = holder.get("profile")
        label, width = f"MIG {profile}", mig_width(profile, total_gib)
    elif kind == "share":
        gib = float(holder.get("memory_gib") or 0.0)
        label, width = f"share {gib:g} GiB", min(1.0, gib / total_gib) if total_gib else 0.0
    else:
        label, width = "whole device", 1.0
    lease_id = int(holder["lease_id"])
    idle = idle_since.get(lease_id)
    return SlotTile(
        label=label,
        width=width,
        lease_id=lease_id,
        user=str(holder.get("user")),
        server_name=str(holder.get("server_name") or ""),
        holder_kind=str(lease.get("holder_kind", "")) if lease else "",
        priority_class=str(lease.get("priority_class", "")) if lease else "",
        age_seconds=_since(lease.get("granted_at"), now) if lease else None,
        idle_seconds=max(0.0, (now - idle).total_seconds()) if idle else None,
    )


def device_tile(
    device: Mapping[str, Any],
    leases: Mapping[int, Mapping[str, Any]],
    simulated: bool,
    idle_since: Mapping[int, dt.datetime],
    now: dt.datetime,
) -> DeviceTile:
    """One device of the listing as a tile.

    Args:
        device: one entry of ``device_listing()["devices"]``; with
            ``reserve_gib`` (a time-sliced pool's reserve, GiB), drawn.
        leases: lease views by id (the holders' leases).
        simulated: whether the backend is the fake one.
        idle_since: lease id → when its GPU was last busy (aware UTC).
        now: aware UTC.
    """
    total_gib = float(device.get("memory_total_mib") or 0) / 1024
    slots = [
        _slot(h, total_gib, leases.get(int(h["lease_id"])), idle_since, now)
        for h in device.get("holders") or ()
    ]
    reserve = float(device.get("reserve_gib") or 0.0)
    if reserve > 0 and total_gib > 0:
        slots.append(SlotTile(label="reserved", width=min(1.0, reserve / total_gib)))
    used = sum(s.width for s in slots)
    if used < 0.999:
        slots.append(SlotTile(label="free", width=round(1.0 - used, 6)))
    usage = device.get("usage") or {}
    mem = usage.get("memory_used_mib")
    return DeviceTile(
        uuid=str(device["uuid"]),
        index=int(device["index"]),
        name=str(device.get("name") or ""),
        node=str(device.get("node") or ""),
        pool=str(device.get("pool") or ""),
        mode=str(device.get("pool_mode") or ""),
        state=str(device.get("state") or ""),
        drained=bool(device.get("drained")),
        present=bool(device.get("present", True)),
        mig_enabled=bool(device.get("mig_enabled")),
        simulated=simulated,
        utilization=usage.get("utilization_gpu"),
        memory_used_gib=None if mem is None else mem / 1024,
        memory_total_gib=total_gib,
        slots=tuple(slots),
    )


def overview(
    listing: Mapping[str, Any],
    leases: Sequence[Mapping[str, Any]],
    idle_since: Mapping[int, dt.datetime],
    now: dt.datetime,
) -> list[NodeRow]:
    """The whole picture: one row per node (in name order), tiles in index order.

    Args:
        listing: :func:`gpubroker.views.device_listing` of an admin.
        leases: the active lease views (``Broker.list_leases()``).
        idle_since: lease id → when its GPU was last busy (aware UTC).
        now: aware UTC.
    """
    by_id = {int(x["id"]): x for x in leases}
    simulated = bool((listing.get("backend") or {}).get("simulated"))
    rows: dict[str, list[DeviceTile]] = {}
    for device in listing.get("devices") or ():
        tile = device_tile(device, by_id, simulated, idle_since, now)
        rows.setdefault(tile.node, []).append(tile)
    return [
        NodeRow(name, tuple(sorted(tiles, key=lambda t: t.index)))
        for name, tiles in sorted(rows.items())
    ]


def headline(listing: Mapping[str, Any]) -> str:
    """The overview's first sentence: how many devices are present, each
    counted once, in the first of these that fits it: ``drained`` (as the
    devices page shows it, held or not), ``outside the broker`` (Slurm's
    node down or drained, or a job from outside on it; said only when
    some), ``MIG`` or ``shared`` (a device of a ``mig`` or ``timeslice``
    pool, with how many hold a lease's slot), else ``leased whole`` or
    ``free whole`` (an ``exclusive`` pool's device, held or not). Absent
    devices (tiles marked ``absent``) are not among them and are said
    after, when some, e.g. ``8 devices: 3 leased whole, 1 free whole,
    2 MIG (1 in use), 2 shared (2 in use), 0 drained``.

    Args:
        listing: :func:`gpubroker.views.device_listing` of an admin.
    """
    counts = dict.fromkeys(("leased", "free", "mig", "mig_used", "shared", "shared_used"), 0)
    counts.update(drained=0, outside=0, absent=0)
    for device in listing.get("devices") or ():
        held = device.get("state") in ("leased", "shared")
        mode = device.get("pool_mode")
        if not device.get("present", True):
            key = "absent"
        elif device.get("drained"):
            key = "drained"
        elif device.get("state") == "outside":
            key = "outside"
        elif mode in ("mig", "timeslice"):
            key = "mig" if mode == "mig" else "shared"
            counts[f"{key}_used"] += 1 if held else 0
        else:
            key = "leased" if held else "free"
        counts[key] += 1
    total = sum(counts[k] for k in ("leased", "free", "mig", "shared", "drained", "outside"))
    parts = [
        f"{counts['leased']} leased whole",
        f"{counts['free']} free whole",
        f"{counts['mig']} MIG ({counts['mig_used']} in use)",
        f"{counts['shared']} shared ({counts['shared_used']} in use)",
        f"{counts['drained']} drained",
    ]
    if counts["outside"]:
        parts.append(f"{counts['outside']} outside the broker")
    text = f"{total} device{'' if total == 1 else 's'}: " + ", ".join(parts)
    if counts["absent"]:
        text += f"; {counts['absent']} more absent"
    return text


def duration(seconds: float | None) -> str:
    """A short human duration: ``45 s``, ``12 min``, ``3 h 5 min``, ``2 d 4 h``;
    ``-`` for ``None``."""
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min"
    if s < 86400:
        return f"{s // 3600} h {s % 3600 // 60} min"
    return f"{s // 86400} d {s % 86400 // 3600} h"
