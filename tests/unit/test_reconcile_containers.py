"""Broker.reconcile_containers and reconcile_slurm_servers: a server lease
whose Docker container (or Slurm job) has ended is released with the
engine's words; a lease whose container changed since the check, or that
is no longer granted, is left alone."""

from __future__ import annotations

import pytest

from gpubroker.core import Broker

CONTAINER = "ab" * 32


def served(broker: Broker, user: str) -> dict:
    lease = broker.request_lease(user, "", gpus=1)
    return broker.set_server_url(lease["id"], "http://127.0.0.1:9/user/x/", CONTAINER, "E1")


def test_an_ended_container_releases_its_lease_with_what_docker_said(broker: Broker) -> None:
    lease = served(broker, "ann")
    done = broker.reconcile_containers({lease["id"]: (CONTAINER, "exited with status 137")})
    assert done == [lease["id"]]
    view = broker.get_lease(lease["id"])
    assert view["state"] == "released"
    assert view["release_reason"] == (
        f"reconcile: the container {CONTAINER[:12]} of server ann/ exited with status 137"
    )


def test_a_lease_whose_container_changed_is_left_alone(broker: Broker) -> None:
    lease = served(broker, "bob")
    other = "cd" * 32
    assert broker.reconcile_containers({lease["id"]: (other, "is gone")}) == []
    assert broker.get_lease(lease["id"])["state"] == "granted"
    broker.release_lease(lease["id"], "done")
    assert broker.reconcile_containers({lease["id"]: (CONTAINER, "is gone")}) == []


def test_the_engine_id_is_kept_only_with_a_container(broker: Broker) -> None:
    lease = broker.request_lease("cy", "", gpus=1)
    broker.set_server_url(lease["id"], "http://127.0.0.1:9/", None, "E1")
    assert [x.docker_engine for x in broker.server_leases()] == [None]


def test_a_url_without_a_container_keeps_the_recorded_one(broker: Broker) -> None:
    lease = served(broker, "dee")
    broker.set_server_url(lease["id"], "http://127.0.0.1:10/user/dee/")
    (held,) = broker.server_leases()
    assert (held.server_url, held.container_id, held.docker_engine) == (
        "http://127.0.0.1:10/user/dee/",
        CONTAINER,
        "E1",
    )


def test_an_ended_slurm_job_releases_its_server_lease_with_what_slurm_said(
    broker: Broker,
) -> None:
    lease = broker.request_lease("eve", "", gpus=1)
    broker.set_server_url(lease["id"], "http://127.0.0.1:9/user/eve/", slurm_job="41")
    assert broker.reconcile_slurm_servers({lease["id"]: ("40", "is gone from Slurm")}) == []
    done = broker.reconcile_slurm_servers({lease["id"]: ("41", "was ended by signal 15")})
    assert done == [lease["id"]]
    assert broker.get_lease(lease["id"])["release_reason"] == (
        "reconcile: the Slurm job 41 of server eve/ was ended by signal 15"
    )


def test_a_refused_binding_is_told_once(broker: Broker, caplog) -> None:
    import logging

    from gpubroker.broker.rebind import Rebinder

    first = broker.request_lease("fay", "", gpus=1)
    second = broker.request_lease("gus", "", gpus=1)
    rebinder = Rebinder(broker, logging.getLogger("test.rebind"))
    held = [d["uuid"] for d in first["devices"]]
    assert not rebinder.apply(first["id"], held, held, "job 1")  # nothing to move
    broker.release_lease(first["id"], "done")
    taken = [d["uuid"] for d in second["devices"]]
    with caplog.at_level(logging.DEBUG, logger="test.rebind"):
        for _ in range(3):
            assert not rebinder.apply(first["id"], held, taken, "job 1")
    levels = [r.levelno for r in caplog.records if r.name == "test.rebind"]
    assert levels == [logging.WARNING, logging.DEBUG, logging.DEBUG]


def test_a_container_reconciliation_is_a_command_its_release_published_at_once(
    broker: Broker,
) -> None:
    """The release is published to the bus's subscribers (the ledger, the
    audit log, metrics) when the reconciliation ends, as the reconcile
    actor, not left staged for some later command to publish."""
    lease = served(broker, "fay")
    seen = []
    broker.bus.subscribe(seen.append)
    broker.reconcile_containers({lease["id"]: (CONTAINER, "is gone")})
    released = [e for e in seen if e.kind == "released" and e.lease_id == lease["id"]]
    assert len(released) == 1 and released[0].actor == "reconcile"


def test_pools_set_after_start_reach_every_part(broker: Broker) -> None:
    """An option object replaced after start (here the pools) is what the
    parts holding it use too."""
    from gpubroker.pools import Pools

    pools = Pools(parent=broker)
    broker.pools = pools
    assert broker.sharing.pools is pools
    assert broker.admission.pools is pools and broker.free.pools is pools


def test_server_leases_are_pictures_that_do_not_change_under_their_reader(
    broker: Broker,
) -> None:
    """The culler and the reconciliations keep what ``server_leases`` gives
    across awaits: a picture (``LeaseRef``), frozen at the time it was
    taken, never the store's row, which a release would change under them.
    A notice for the picture lands on the lease."""
    import dataclasses

    from gpubroker.model.holdings import LeaseRef

    lease = served(broker, "gus")
    (ref,) = broker.server_leases()
    assert isinstance(ref, LeaseRef) and [s.kind for s in ref.slots] == ["device"]
    broker.release_lease(lease["id"], "done")
    assert [s.device_uuid for s in ref.slots] == [lease["devices"][0]["uuid"]]
    broker.add_notice(ref, "cull-warning", "idle 60 min")
    assert broker.notices("gus")[0]["lease_id"] == lease["id"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        ref.user = "eve"  # type: ignore[misc]
