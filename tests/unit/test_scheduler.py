"""The FIFO baseline scheduler: order, gang placement, reasons."""

from __future__ import annotations

import datetime as dt

from gpubroker.scheduler import (
    Request,
    Running,
    SchedulerState,
    Slot,
    WaitReason,
    fifo_schedule,
)

T0 = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.timezone.utc)


def slots(node: str, n: int, drained: tuple[int, ...] = ()) -> tuple[Slot, ...]:
    return tuple(Slot(f"GPU-{node}-{i}", node, i, i in drained) for i in range(n))


def held(*uuids: str) -> tuple[Running, ...]:
    return tuple(Running(100 + i, "x", (u,), T0) for i, u in enumerate(uuids))


def req(lease_id: int, gpus: int, minute: int = 0, user: str = "u") -> Request:
    return Request(lease_id, user, gpus, T0 + dt.timedelta(minutes=minute))


def test_grants_in_arrival_order_lowest_indices_first() -> None:
    state = SchedulerState(slots("a", 4), held("GPU-a-0"), (req(2, 1, 1), req(1, 2, 0)))
    decisions = fifo_schedule(state, T0)
    assert [(g.lease_id, g.devices) for g in decisions.grants] == [
        (1, ("GPU-a-1", "GPU-a-2")),
        (2, ("GPU-a-3",)),
    ]
    assert decisions.waits == ()


def test_head_of_line_blocks_smaller_requests_behind_it() -> None:
    state = SchedulerState(slots("a", 4), held("GPU-a-0"), (req(1, 4, 0), req(2, 1, 1)))
    decisions = fifo_schedule(state, T0)
    assert decisions.grants == ()
    head, second = decisions.waits
    assert (head.lease_id, head.position, head.reason) == (1, 1, WaitReason.resources)
    assert (second.lease_id, second.position, second.reason) == (2, 2, WaitReason.priority)
    assert "1st in the queue" in head.message and "2nd" in second.message


def test_gang_placement_stays_on_one_node_and_prefers_best_fit() -> None:
    inventory = slots("a", 4) + slots("b", 4)
    busy = held("GPU-a-0", "GPU-a-1", "GPU-a-2")  # a has 1 free, b has 4
    decisions = fifo_schedule(SchedulerState(inventory, busy, (req(1, 1), req(2, 2, 1))), T0)
    assert decisions.grants[0].devices == ("GPU-a-3",)  # best fit: the fuller node
    assert decisions.grants[1].devices == ("GPU-b-0", "GPU-b-1")


def test_request_spanning_nodes_waits_even_if_total_free_suffices() -> None:
    inventory = slots("a", 2) + slots("b", 2)
    decisions = fifo_schedule(
        SchedulerState(inventory, held("GPU-a-0", "GPU-b-0"), (req(1, 2),)), T0
    )
    assert decisions.grants == ()
    assert decisions.waits[0].reason is WaitReason.resources


def test_drained_devices_are_not_granted_and_oversized_requests_say_pool_drained() -> None:
    inventory = slots("a", 4, drained=(0, 1))
    decisions = fifo_schedule(SchedulerState(inventory, (), (req(1, 3), req(2, 2, 1))), T0)
    assert decisions.grants == ()
    assert decisions.waits[0].reason is WaitReason.pool_drained
    only_two = fifo_schedule(SchedulerState(inventory, (), (req(2, 2),)), T0)
    assert only_two.grants[0].devices == ("GPU-a-2", "GPU-a-3")


def test_ties_in_time_are_broken_by_lease_id() -> None:
    decisions = fifo_schedule(SchedulerState(slots("a", 1), (), (req(7, 1), req(3, 1))), T0)
    assert decisions.grants[0].lease_id == 3
    assert decisions.waits[0].lease_id == 7


def test_same_input_same_decisions() -> None:
    state = SchedulerState(
        slots("a", 8), held("GPU-a-3"), tuple(req(i, 1 + i % 3, i) for i in range(1, 12))
    )
    assert fifo_schedule(state, T0) == fifo_schedule(state, T0)
