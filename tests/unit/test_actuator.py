"""MIG instances made and destroyed off the event loop (gpubroker.broker.actuator):
a grant waits as ``Preparing`` while its instance is made in a worker thread,
its slices are kept from other requests meanwhile, a failure is an event and
a retry succeeds, and a request cancelled meanwhile leaves nothing behind."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpubroker.broker.actuator import Actuator
from gpubroker.core import Broker

from .test_enforce_mps import StandIn
from .test_sharing_core import layout_of, sharing_broker


@pytest.fixture
def broker(db_url: str, tmp_path: Path) -> Broker:
    broker = sharing_broker(db_url, tmp_path)
    broker.actuator = Actuator(broker.log, backoff=0.01)
    return broker


def _kinds(broker: Broker, lease_id: int) -> list[str]:
    return [e["kind"] for e in broker.lease_events(lease_id)]


async def test_a_grant_waits_preparing_until_its_instance_is_made(broker: Broker) -> None:
    lease = broker.request_lease("ann", "", mig_profile="3g.40gb", pool="mig")
    assert lease["state"] == "pending" and lease["slots"] == []
    assert lease["queue"]["reason"] == "Preparing"
    assert "making MIG 3g.40gb on GPU-" in lease["queue"]["message"]
    assert broker.actuator is not None
    await broker.actuator.idle()
    done = broker.get_lease(lease["id"])
    assert done["state"] == "granted" and done["slots"][0]["profile"] == "3g.40gb"
    device = done["slots"][0]["device"]
    assert [m.uuid for m in broker.backend.mig_devices(device)] == [done["slots"][0]["uuid"]]
    assert done["env"]["CUDA_VISIBLE_DEVICES"] == done["slots"][0]["uuid"]
    assert _kinds(broker, lease["id"]) == ["requested", "preparing", "granted"]
    assert broker.validate_state([lease["id"]]) == []


async def test_slices_being_made_are_not_given_to_another_request(broker: Broker) -> None:
    # two MIG devices: two full-device instances in flight, the third request waits
    leases = [
        broker.request_lease(f"u{i}", "", mig_profile="7g.80gb", pool="mig") for i in range(3)
    ]
    reasons = [broker.get_lease(x["id"])["queue"]["reason"] for x in leases]
    assert reasons[:2] == ["Preparing", "Preparing"] and reasons[2] == "Resources"
    assert broker.actuator is not None
    await broker.actuator.idle()
    views = [broker.get_lease(x["id"]) for x in leases]
    assert [v["state"] for v in views] == ["granted", "granted", "pending"]
    assert len({v["slots"][0]["device"] for v in views[:2]}) == 2


async def test_a_failed_make_is_an_event_and_the_retry_succeeds(broker: Broker) -> None:
    broker.backend.fail_mig_creates = 1
    lease = broker.request_lease("ann", "", mig_profile="1g.10gb", pool="mig")
    assert broker.actuator is not None
    await broker.actuator.idle()
    failed = broker.get_lease(lease["id"])
    assert failed["state"] == "pending" and failed["slots"] == []
    assert "injected failure" in failed["queue"]["message"]
    assert "tried again in" in failed["queue"]["message"]
    assert _kinds(broker, lease["id"]) == ["requested", "preparing", "grant-failed"]
    assert all(layout_of(broker, d.uuid) == [] for d in broker.backend.devices()[:2])
    broker.grant_retry_backoff = 0.0
    broker.sharing.retry_after.clear()  # the backoff is over
    broker.schedule_now()
    await broker.actuator.idle()
    assert broker.get_lease(lease["id"])["state"] == "granted"
    assert _kinds(broker, lease["id"])[-2:] == ["preparing", "granted"]


async def test_a_request_cancelled_while_preparing_leaves_no_instance(broker: Broker) -> None:
    lease = broker.request_lease("ann", "", mig_profile="3g.40gb", pool="mig")
    broker.release_lease(lease["id"], "changed my mind")
    assert broker.actuator is not None
    await broker.actuator.idle()  # made, handed back, destroyed again
    await broker.actuator.idle()
    assert broker.get_lease(lease["id"])["state"] == "released"
    assert all(layout_of(broker, d.uuid) == [] for d in broker.backend.devices()[:2])
    assert broker.validate_state([lease["id"]]) == []


async def test_a_release_destroys_the_instance_off_the_loop(broker: Broker) -> None:
    lease = broker.request_lease("ann", "", mig_profile="3g.40gb", pool="mig")
    assert broker.actuator is not None
    await broker.actuator.idle()
    device = broker.get_lease(lease["id"])["slots"][0]["device"]
    broker.release_lease(lease["id"], "done")
    await broker.actuator.idle()
    assert layout_of(broker, device) == []


async def test_the_api_answer_waits_for_the_instance(broker: Broker) -> None:
    lease = broker.request_lease("ann", "", mig_profile="1g.10gb", pool="mig")
    assert lease["queue"]["reason"] == "Preparing"
    answered = await broker.after_pass(lease)  # what POST /leases answers
    assert answered["state"] == "granted" and answered["slots"][0]["uuid"].startswith("MIG-")


async def test_a_retry_at_once_after_a_failure_is_not_dropped(broker: Broker) -> None:
    broker.grant_retry_backoff = 0.0  # the outcome's own pass tries again
    broker.backend.fail_mig_creates = 1
    lease = broker.request_lease("ann", "", mig_profile="1g.10gb", pool="mig")
    assert broker.actuator is not None
    for _ in range(3):
        await broker.actuator.idle()
    assert broker.get_lease(lease["id"])["state"] == "granted"


# -- MPS daemons of shares, started off the event loop ----------------------------


@pytest.fixture
def mps_broker(broker: Broker, standin: StandIn) -> Broker:
    broker.mps = standin.control()
    return broker


async def test_a_share_waits_preparing_while_its_mps_daemon_starts(
    mps_broker: Broker, standin: StandIn
) -> None:
    broker = mps_broker
    lease = broker.request_lease("ann", "", memory_gib=10, pool="shared")
    assert lease["state"] == "pending" and lease["queue"]["reason"] == "Preparing"
    assert "starting the MPS daemon of GPU-" in lease["queue"]["message"]
    assert standin.calls() == []  # nothing ran on the event loop
    assert broker.actuator is not None
    await broker.actuator.idle()
    done = broker.get_lease(lease["id"])
    device = done["slots"][0]["device"]
    assert done["state"] == "granted"
    assert done["env"]["CUDA_MPS_PIPE_DIRECTORY"] == str(broker.mps.pipe_dir(device))
    assert [c["argv"] for c in standin.calls()] == [["-d"]]
    assert _kinds(broker, lease["id"]) == ["requested", "preparing", "granted"]
    # a second share of the same device: its daemon runs, granted at once
    second = broker.request_lease("bob", "", memory_gib=10, pool="shared")
    assert second["state"] == "granted", second["queue"]
    assert second["slots"][0]["device"] == device
    assert len(standin.calls()) == 1
    assert broker.validate_state([lease["id"], second["id"]]) == []


async def test_a_daemon_that_does_not_start_is_an_event_and_the_request_waits(
    mps_broker: Broker, standin: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    broker = mps_broker
    monkeypatch.setenv("STANDIN_FAIL", "1")
    lease = broker.request_lease("ann", "", memory_gib=10, pool="shared")
    assert broker.actuator is not None
    await broker.actuator.idle()
    failed = broker.get_lease(lease["id"])
    assert failed["state"] == "pending" and failed["slots"] == []
    assert "boom: cannot start" in failed["queue"]["message"]
    assert _kinds(broker, lease["id"]) == ["requested", "preparing", "grant-failed"]
    monkeypatch.delenv("STANDIN_FAIL")
    broker.grant_retry_backoff = 0.0
    broker.sharing.retry_after.clear()  # the backoff is over
    broker.schedule_now()
    await broker.actuator.idle()
    assert broker.get_lease(lease["id"])["state"] == "granted"


# -- MIG mode changes, carried out off the event loop ----------------------------


async def test_a_mig_mode_change_runs_off_the_loop_and_the_answer_waits_for_it(
    broker: Broker,
) -> None:
    gpu0 = broker.backend.devices()[0].uuid
    view = broker.request_mig_mode(gpu0, False)
    # the command only asked: NVML has not been called on the event loop
    assert view == {"uuid": gpu0, "mig_enabled": True, "mig_target": False}
    assert broker.backend.devices()[0].mig_enabled
    answered = await broker.after_mig_mode(view)  # what PATCH /devices answers
    assert answered == {"uuid": gpu0, "mig_enabled": False, "mig_target": None}
    assert not broker.backend.devices()[0].mig_enabled
    # the pass after it sees the change: MIG requests go to the other device only
    lease = broker.request_lease("ann", "", mig_profile="7g.80gb", pool="mig")
    assert broker.actuator is not None
    await broker.actuator.idle()
    assert broker.get_lease(lease["id"])["slots"][0]["device"] != gpu0
    assert broker.validate_state([lease["id"]]) == []


async def test_a_mig_mode_change_lists_instances_off_the_event_loop(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The instances of a device whose MIG mode changed are listed by the
    change's worker, and the outcome's pool recompute makes no device call
    on the event loop (NVML answers in milliseconds per device, and a
    broker has many)."""
    import threading

    backend = broker.backend
    listing = backend.mig_devices
    on_loop: list[str] = []

    def listed(uuid: str) -> Any:
        if threading.current_thread() is threading.main_thread():
            on_loop.append(uuid)
        return listing(uuid)

    monkeypatch.setattr(backend, "mig_devices", listed)
    gpu0, gpu1 = (d.uuid for d in backend.devices()[:2])
    known = list(broker.sharing.mig_inventory[gpu1])
    off = await broker.after_mig_mode(broker.request_mig_mode(gpu0, False))
    assert off["mig_enabled"] is False and on_loop == []
    assert gpu0 not in broker.sharing.mig_inventory
    assert broker.sharing.mig_inventory[gpu1] == known  # the others as known
    on = await broker.after_mig_mode(broker.request_mig_mode(gpu0, True))
    assert on == {"uuid": gpu0, "mig_enabled": True, "mig_target": None}
    assert on_loop == [] and broker.sharing.mig_inventory[gpu0] == []


async def test_a_failed_mig_mode_change_keeps_the_target_and_is_tried_again(
    broker: Broker,
) -> None:
    gpu0 = broker.backend.devices()[0].uuid
    # a process on the GPU: NVML refuses the change (in use)
    broker.backend.set_usage(gpu0, processes=[{"pid": 4242, "used_memory_mib": 100}])
    view = await broker.after_mig_mode(broker.request_mig_mode(gpu0, False))
    assert view == {"uuid": gpu0, "mig_enabled": True, "mig_target": False}
    assert broker.backend.devices()[0].mig_enabled
    # no grant lands on it meanwhile
    lease = broker.request_lease("ann", "", mig_profile="7g.80gb", pool="mig")
    other = broker.request_lease("bob", "", mig_profile="7g.80gb", pool="mig")
    assert broker.actuator is not None
    await broker.actuator.idle()
    assert broker.get_lease(lease["id"])["slots"][0]["device"] != gpu0
    assert broker.get_lease(other["id"])["state"] == "pending"
    # the process ends; the scheduling loop's housekeeping tries again
    broker.backend.set_usage(gpu0, processes=[])
    broker.housekeep_mig()
    await broker.actuator.idle()
    assert broker.sharing.mig_mode_view(gpu0) == {
        "uuid": gpu0,
        "mig_enabled": False,
        "mig_target": None,
    }


async def test_an_instance_destroyed_by_hand_counts_as_destroyed(
    broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    """An instance gone before its release (destroyed by hand, a GPU reset,
    or a demo's state file overwritten) was an error logged on every retry
    for ever, its slices still counted as taken; it is now as good as
    destroyed."""
    lease = broker.request_lease("ann", "", mig_profile="7g.80gb", pool="mig")
    assert broker.actuator is not None
    await broker.actuator.idle()
    slot = broker.get_lease(lease["id"])["slots"][0]
    broker.backend.destroy_mig_device(slot["device"], slot["uuid"])  # by hand
    broker.release_lease(lease["id"], "done")
    await broker.actuator.idle()
    assert "Cannot destroy" not in caplog.text
    assert f"MIG instance {slot['uuid']} on {slot['device']} was already gone" in caplog.text
    assert slot["uuid"] not in {i.uuid for i in broker.sharing.mig_inventory[slot["device"]]}
    # its slices are free: two whole-device instances fit on the two devices
    again = [broker.request_lease(u, "", mig_profile="7g.80gb", pool="mig") for u in "ab"]
    await broker.actuator.idle()
    assert [broker.get_lease(x["id"])["state"] for x in again] == ["granted", "granted"]
