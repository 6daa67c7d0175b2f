"""A broker whose engine cannot say its inventory at start (slurmctld or
NVML down) serves with the stored devices, grants none of them, and grants
again once the engine answers; it used to raise and not start."""

from __future__ import annotations

import asyncio
import logging

from gpubroker.core import Broker
from gpubroker.engines.base import EngineError, Node
from gpubroker.service import first_inventory, inventory_until_read

LOG = logging.getLogger("test")


async def test_an_engine_down_at_start_holds_every_device_until_it_answers(
    broker: Broker,
) -> None:
    nodes = broker.engine.nodes()  # what the engine says once it answers
    held = broker.request_lease("ann", "", gpus=1)  # granted before the restart
    answers: list[list[Node] | EngineError] = [
        EngineError("squeue: slurm_load_jobs error: Unable to contact slurm controller"),
        EngineError("still down"),
        nodes,
    ]
    reads = 0

    async def read() -> list[Node]:
        nonlocal reads
        reads += 1
        answer = answers.pop(0)
        if isinstance(answer, EngineError):
            raise answer
        return answer

    assert await first_inventory(broker, read, LOG) is False
    uuid = held["devices"][0]["uuid"]
    assert "has not answered: squeue" in (broker.outside_reason(uuid) or "")
    # nothing is ended on it: the held lease stays; nothing new is granted
    assert broker.get_lease(held["id"])["state"] == "granted"
    waiting = broker.request_lease("bob", "", gpus=1)
    assert waiting["state"] == "pending"
    await asyncio.wait_for(inventory_until_read(broker, read, LOG, first=0.01), 10)
    assert reads == 3 and broker.outside_reason(uuid) is None
    assert broker.get_lease(waiting["id"])["state"] == "granted"
