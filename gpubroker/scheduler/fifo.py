"""First-in, first-out scheduling of whole devices, without backfill.

Requests are served strictly in arrival order: when the head of the queue does
not fit, everything behind it waits too (as Slurm's ``sched/builtin`` without
backfill does), so a large request is never starved by a stream of small ones.
A request's devices all come from one node (gang placement); among nodes with
room, the one with the fewest free devices is used (best fit), and on it the
lowest indices.
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict

from .types import Decisions, Grant, Request, SchedulerState, Slot, Wait, WaitReason


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _free_by_node(state: SchedulerState) -> dict[str, list[Slot]]:
    free: dict[str, list[Slot]] = defaultdict(list)
    for slot in state.slots:
        if not slot.drained and slot.uuid not in state.busy:
            free[slot.node].append(slot)
    for slots in free.values():
        slots.sort(key=lambda s: s.index)
    return free


def _largest_node(state: SchedulerState) -> int:
    per_node: dict[str, int] = defaultdict(int)
    for slot in state.slots:
        if not slot.drained:
            per_node[slot.node] += 1
    return max(per_node.values(), default=0)


def _place(free: dict[str, list[Slot]], gpus: int) -> tuple[str, ...] | None:
    fits = [node for node, slots in free.items() if len(slots) >= gpus]
    if not fits:
        return None
    node = min(fits, key=lambda n: (len(free[n]), n))
    chosen = free[node][:gpus]
    del free[node][:gpus]
    return tuple(s.uuid for s in chosen)


def _wait(request: Request, position: int, blocked: bool, largest: int) -> Wait:
    place = _ordinal(position)
    if request.gpus > largest:
        return Wait(
            request.lease_id,
            position,
            WaitReason.pool_drained,
            f"waiting: {request.gpus} GPUs were asked for but no node has that many "
            f"in service (largest: {largest}); you are {place} in the queue",
        )
    if blocked:
        return Wait(
            request.lease_id,
            position,
            WaitReason.priority,
            f"waiting: requests ahead of yours go first; you are {place} in the queue",
        )
    return Wait(
        request.lease_id,
        position,
        WaitReason.resources,
        f"waiting: not enough free GPUs for {request.gpus}; you are {place} in the queue",
    )


def schedule(state: SchedulerState, now: dt.datetime) -> Decisions:
    """One FIFO pass over ``state`` at time ``now`` (aware UTC; unused by FIFO).

    Returns:
        :class:`Decisions` with a grant for every request served in order
        until the first that does not fit, and a :class:`Wait` (position from
        1, reason, message) for each of the rest, in queue order.
    """
    queue = sorted(state.pending, key=lambda r: (r.created, r.lease_id))
    free = _free_by_node(state)
    largest = _largest_node(state)
    grants: list[Grant] = []
    waits: list[Wait] = []
    for request in queue:
        devices = None if waits else _place(free, request.gpus)
        if devices is not None:
            grants.append(Grant(request.lease_id, devices))
            continue
        waits.append(_wait(request, len(waits) + 1, blocked=bool(waits), largest=largest))
    return Decisions(tuple(grants), tuple(waits))
