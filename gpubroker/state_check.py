"""``validate_state``: the invariants of the store, checked after commands.

- no whole device, and no MIG instance, held by two active allocations;
  a device never held both whole and in parts;
- the shares of a device never reserve more memory than it has;
- every granted lease holds its slots (whole: ``gpus`` devices; MIG: one
  instance; shares: ``count``); pending and released leases hold none;
- at most one active lease per hub server;
- the broker's memory holds exactly the active leases of the store, with
  their stored state, version and slots (what a restart would reload);
- the transition log of every lease a command touched replays to the
  lease's stored state (:func:`gpubroker.model.lifecycle.replay`), with no
  gap.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping

from .model.lifecycle import IllegalTransition, replay
from .scheduler import UsageRecord
from .store.models import Allocation, HolderKind, Lease
from .store.repository import Repository
from .transitions import as_events


class StateInvalid(AssertionError):
    """The broker's state breaks an invariant (a bug: never user input)."""


def problems(repo: Repository, touched: Iterable[int] = ()) -> list[str]:
    """Every invariant the store breaks now, in words (empty: all hold).

    Args:
        repo: a repository on the store.
        touched: ids of the leases whose transition logs to replay.
    """
    found: list[str] = []
    active = repo.active_allocations()
    found += _slots(repo, active)
    found += _leases(repo, active)
    found += _logs(repo, touched)
    return found


def _slots(repo: Repository, active: list[Allocation]) -> list[str]:
    found = []
    whole = Counter(a.device_uuid for a in active if a.kind == "device")
    found += [f"device {uuid} held whole {n} times" for uuid, n in whole.items() if n > 1]
    parts = [a for a in active if a.kind != "device"]
    instances = Counter(a.instance_uuid for a in parts if a.instance_uuid)
    found += [f"MIG instance {uuid} held {n} times" for uuid, n in instances.items() if n > 1]
    found += [
        f"device {a.device_uuid} held whole and in parts" for a in parts if a.device_uuid in whole
    ]
    shared: dict[str, int] = defaultdict(int)
    for a in parts:
        if a.kind == "share":
            shared[a.device_uuid] += a.memory_mib or 0
    for uuid, mib in shared.items():
        device = repo.device(uuid)
        if device is not None and mib > device.memory_total_mib:
            found.append(f"device {uuid}: shares reserve {mib} MiB of {device.memory_total_mib}")
    return found


def _leases(repo: Repository, active: list[Allocation]) -> list[str]:
    found = []
    held = Counter(a.lease_id for a in active)
    leases = repo.active_leases()
    for lease in leases:
        want = 1 if lease.kind == "mig" else lease.gpus
        have = held.pop(lease.id, 0)
        if lease.state == "granted" and have != want:
            found.append(f"granted lease {lease.id} holds {have} slots, not {want}")
        if lease.state == "pending" and have:
            found.append(f"pending lease {lease.id} holds {have} slots")
    found += [f"lease {lease_id} is not active but holds slots" for lease_id in held]
    servers = Counter(
        (x.user, x.server_name) for x in leases if x.holder_kind == HolderKind.server.value
    )
    found += [f"server {u}/{s} has {n} active leases" for (u, s), n in servers.items() if n > 1]
    return found


def _logs(repo: Repository, touched: Iterable[int]) -> list[str]:
    found = []
    for lease_id in sorted(set(touched)):
        lease = repo.lease(lease_id)
        rows = repo.events_of(lease_id)
        try:
            state = replay(as_events(rows))
        except IllegalTransition as err:
            found.append(str(err))
            continue
        if lease is not None and state != lease.state:
            found.append(f"lease {lease_id}: its log ends {state!r}, the lease is {lease.state!r}")
    return found


def memory_matches(repo: Repository, memory: Iterable[Lease]) -> list[str]:
    """How the broker's in-memory active leases differ from the store's.

    Args:
        repo: a fresh repository (not the broker's own).
        memory: the leases the broker keeps in memory as active.
    """
    found = []
    kept = {x.id: x for x in memory}
    stored = {x.id: x for x in repo.active_leases()}
    for lease_id in sorted(kept.keys() - stored.keys()):
        found.append(f"lease {lease_id} is active in memory but not in the store")
    for lease_id in sorted(stored.keys() - kept.keys()):
        found.append(f"lease {lease_id} is active in the store but not in memory")
    for lease_id in sorted(kept.keys() & stored.keys()):
        mine, truth = kept[lease_id], stored[lease_id]
        if mine.state != truth.state:
            found.append(f"lease {lease_id}: {mine.state!r} in memory, {truth.state!r} stored")
        if _slots_of(mine) != _slots_of(truth):
            found.append(f"lease {lease_id}: memory and store disagree on its slots")
    return found


def usage_matches(
    repo: Repository, memory: Mapping[str, UsageRecord], half_life: float
) -> list[str]:
    """How the broker's usage records differ from what a restart would load
    (:func:`gpubroker.store.usage_repo.load_usage`; equal to rounding)."""
    loaded, _stored, _behind = repo.usage(half_life)
    found = [
        f"usage of {u}: in memory, not loadable" for u in sorted(memory.keys() - loaded.keys())
    ]
    found += [
        f"usage of {u}: loadable, not in memory" for u in sorted(loaded.keys() - memory.keys())
    ]
    for user in sorted(memory.keys() & loaded.keys()):
        mine, truth = memory[user], loaded[user]
        if mine.as_of != truth.as_of or not math.isclose(
            mine.gpu_seconds, truth.gpu_seconds, rel_tol=1e-9, abs_tol=1e-9
        ):
            found.append(f"usage of {user}: {mine} in memory, {truth} loaded")
    return found


def _slots_of(lease: Lease) -> set[tuple[str, str | None]]:
    return {(a.device_uuid, a.instance_uuid) for a in lease.allocations if a.active}
