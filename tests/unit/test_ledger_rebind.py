"""A lease its engine bound to other devices than the ones granted (Slurm
picks GPU indices itself: ``Broker.rebind_lease``) is charged, from the
move on, to the devices it holds: its ledger intervals on the old devices
close at the move (cause ``rebound``) and new ones open on the new."""

from __future__ import annotations

import pytest

from ..conftest import make_broker
from . import test_usage_ledger
from .test_usage_ledger import HOUR, Clock, ledger_of, report

clock = test_usage_ledger.clock  # the fixture: a clock the broker and the ledger share


def test_a_rebound_lease_is_charged_to_its_new_devices_model(db_url: str, clock: Clock) -> None:
    broker = make_broker(db_url, inventory=["1 x H100", "1 x A100-80GB"])
    ledger = ledger_of(broker, clock)
    lease = broker.request_lease("ann", "", 1, holder_kind="external")
    (granted,) = lease["devices"]
    (other,) = [d for d, _ in broker.device_rows() if d.uuid != granted["uuid"]]
    ledger.flush()  # the grant is in the ledger before the move
    clock.advance(HOUR)
    broker.rebind_lease(lease["id"], [other.uuid])
    clock.advance(2 * HOUR)
    broker.release_lease(lease["id"], "done")
    ledger.flush()
    by_model = report(broker, clock, by="model")
    assert by_model[granted["name"]].gpu_hours_allocated == pytest.approx(1.0)
    assert by_model[other.name].gpu_hours_allocated == pytest.approx(2.0)
    assert report(broker, clock)["ann"].leases == 1  # one lease, moved once


def test_a_rebind_before_the_grant_is_folded_charges_the_new_devices_from_the_move(
    db_url: str, clock: Clock
) -> None:
    broker = make_broker(db_url, inventory=["1 x H100", "1 x A100-80GB"])
    ledger = ledger_of(broker, clock)
    lease = broker.request_lease("ann", "", 1, holder_kind="external")
    (granted,) = lease["devices"]
    (other,) = [d for d, _ in broker.device_rows() if d.uuid != granted["uuid"]]
    clock.advance(HOUR)
    broker.rebind_lease(lease["id"], [other.uuid])
    clock.advance(HOUR)
    broker.release_lease(lease["id"], "done")
    ledger.flush()  # grant, move and release in one batch
    total = sum(r.gpu_hours_allocated for r in report(broker, clock, by="model").values())
    assert total == pytest.approx(2.0)  # never two devices at once
    assert report(broker, clock, by="model")[other.name].gpu_hours_allocated >= 1.0 - 1e-6
