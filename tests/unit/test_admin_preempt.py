"""An admin's preemption of a lease (the panel's Preempt): the holder's
notice, the release with cause ``preemption``, the audit entry, and what
is refused."""

from __future__ import annotations

import pytest

from gpubroker.core import Broker
from gpubroker.errors import Conflict, NotFound
from gpubroker.observe import audit


def test_a_preempted_lease_tells_its_holder_and_is_audited(broker: Broker) -> None:
    held = broker.request_lease("ann", "", gpus=2, holder_kind="external")
    assert held["state"] == "granted"
    view = broker.preempt_lease(held["id"], "maintenance at noon", actor="root")
    assert view["state"] == "released"
    assert view["release_reason"] == "preempted by root: maintenance at noon"
    notices = broker.notices("ann")
    assert notices[0]["kind"] == "preempted"
    assert notices[0]["message"] == "preempted by root: maintenance at noon"
    entries = audit.query(broker.session_factory, kind="lease-preempted")
    assert [(e["actor"], e["target"], e["detail"]) for e in entries] == [
        ("root", "user:ann", {"lease_id": held["id"], "reason": "maintenance at noon"})
    ]
    assert entries[0]["reason"] == "maintenance at noon"  # why, not only in the detail
    found = audit.query(broker.session_factory, user="ann", kind="lease-preempted")
    assert len(found) == 1  # the user filter finds it
    # "granted" is an event kind and a release cause: the grant is found
    grants = audit.query(broker.session_factory, kind="granted")
    assert [(e["action"], e["actor"]) for e in grants] == [("granted", "scheduler")]
    released = [e for e in broker.lease_events(held["id"]) if e["to"] == "released"]
    assert released and released[0]["actor"] == "root"
    assert audit.query(broker.session_factory, kind="preemption")  # the release's cause
    assert broker.list_leases() == []  # both devices free again


def test_only_a_granted_lease_is_preempted(broker: Broker) -> None:
    for _ in range(8):
        broker.request_lease("ann", "", gpus=1, holder_kind="external")
    waiting = broker.request_lease("bob", "", gpus=1, holder_kind="external")
    assert waiting["state"] == "pending"
    with pytest.raises(Conflict, match="only a granted lease is preempted"):
        broker.preempt_lease(waiting["id"], "no", actor="root")
    assert broker.get_lease(waiting["id"])["state"] == "pending"
    assert broker.notices("bob") == []
    with pytest.raises(NotFound):
        broker.preempt_lease(10**6, "no", actor="root")


def test_the_release_after_an_admins_stop_is_the_admins(broker: Broker) -> None:
    """An admin releases a running server's lease: the hub stops the server,
    the spawner reports it with the broker's own token; the release is the
    admin's (and so in the audit log), not the spawner's."""
    asked: list[int] = []
    broker.on_evict = lambda view: asked.append(view["id"])  # the service asks the hub
    lease = broker.request_lease("ann", "", gpus=1)
    broker.stop_lease(lease["id"], "released by root", actor="root")
    assert asked == [lease["id"]] and broker.get_lease(lease["id"])["state"] == "granted"
    broker.release_lease(lease["id"], "server stopped", actor="gpubroker")
    released = [e for e in broker.lease_events(lease["id"]) if e["to"] == "released"]
    assert [(e["actor"], e["reason"]) for e in released] == [
        ("root", "released by root (server stopped)")
    ]
    found = audit.query(broker.session_factory, kind="release", on_behalf=("gpubroker",))
    assert [(e["actor"], e["action"]) for e in found] == [("root", "released")]
