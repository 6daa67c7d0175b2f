"""``gpubroker_devices`` by state (gpubroker.observe.metrics): a device the
engine takes no new work on counts as ``outside``, as ``GET /devices`` says,
not as drained by an admin."""

from __future__ import annotations

import dataclasses

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpubroker.core import Broker
from gpubroker.engines import OutsideHold
from gpubroker.observe.metrics import BrokerMetrics
from gpubroker.views import device_listing


def _devices(broker: Broker) -> dict[str, float]:
    text = generate_latest(BrokerMetrics(broker).registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return {s.labels["state"]: s.value for s in families["gpubroker_devices"].samples}


def test_the_queue_length_of_every_class_is_a_series_zero_included(broker: Broker) -> None:
    def queue() -> dict[str, float]:
        text = generate_latest(BrokerMetrics(broker).registry).decode()
        families = {f.name: f for f in text_string_to_metric_families(text)}
        samples = families["gpubroker_queue_length"].samples
        return {s.labels["priority_class"]: s.value for s in samples}

    assert set(queue()) == set(broker.priority_classes()) and not any(queue().values())
    broker.request_lease("ann", "", gpus=8, holder_kind="external")
    broker.request_lease("bob", "", gpus=1, holder_kind="external", priority_class="batch")
    assert queue()["batch"] == 1 and sum(queue().values()) == 1


def test_devices_by_state_count_outside_apart_from_drained(broker: Broker) -> None:
    nodes = broker.engine.nodes()
    (node,) = nodes
    held_outside = node.devices[0].uuid
    broker.sync_inventory(
        [dataclasses.replace(node, outside={held_outside: OutsideHold("Slurm job 41", "bob")})]
    )
    broker.set_drained(node.devices[1].uuid, True)
    broker.request_lease("ann", "", gpus=2, holder_kind="external")
    assert _devices(broker) == {"free": 4, "held": 2, "drained": 1, "outside": 1, "absent": 0}
    # the same word as the device listing
    listed = {d["uuid"]: d for d in device_listing(broker, True, "admin", broker.log)["devices"]}
    assert listed[held_outside]["state"] == "outside"
    assert listed[held_outside]["outside"] == "held by Slurm job 41 of bob"
    # a node the engine says is down: all its devices are outside
    down = dataclasses.replace(node, state="down", reason="not responding", outside={})
    broker.sync_inventory([down])
    # the 2 held stay held, the one an admin drained stays drained
    assert _devices(broker) == {"free": 0, "held": 2, "drained": 1, "outside": 5, "absent": 0}


def test_only_admins_see_who_runs_a_slurm_job_from_outside(broker: Broker) -> None:
    """The private queue hides who waits; GET /devices named the Slurm user
    of a job from outside the broker to everyone (Slurm's PrivateData=jobs
    hides it from other users too)."""
    (node,) = broker.engine.nodes()
    held_outside = node.devices[0].uuid
    broker.sync_inventory(
        [dataclasses.replace(node, outside={held_outside: OutsideHold("Slurm job 41", "bob")})]
    )

    def seen(admin: bool, me: str) -> str:
        listing = device_listing(broker, admin, me, broker.log)["devices"]
        return str({d["uuid"]: d for d in listing}[held_outside]["outside"])

    assert seen(True, "admin") == "held by Slurm job 41 of bob"
    assert seen(False, "ann") == "held by Slurm job 41"


def test_whose_outside_job_it_is_is_a_field_not_parsed_from_the_sentence(broker: Broker) -> None:
    """What an engine says of a user is never cut out of a sentence: a
    name with spaces or " of " stays hidden from users whole, an unknown
    owner reads ``?`` to admins, and a node that is down names nobody."""
    (node,) = broker.engine.nodes()
    odd, unknown = node.devices[0].uuid, node.devices[1].uuid
    holds = {odd: OutsideHold("Slurm job 7", "eve of ops x"), unknown: OutsideHold("Slurm job 8")}
    broker.sync_inventory([dataclasses.replace(node, outside=holds)])

    def seen(admin: bool) -> dict[str, str]:
        listing = device_listing(broker, admin, "ann", broker.log)["devices"]
        return {d["uuid"]: d["outside"] for d in listing if d["outside"]}

    assert seen(True) == {
        odd: "held by Slurm job 7 of eve of ops x",
        unknown: "held by Slurm job 8 of ?",
    }
    assert seen(False) == {odd: "held by Slurm job 7", unknown: "held by Slurm job 8"}
    broker.sync_inventory([dataclasses.replace(node, state="down", reason="bob's test")])
    assert (
        set(seen(True).values())
        == set(seen(False).values())
        == {f"node {node.name} is down: bob's test"}
    )
