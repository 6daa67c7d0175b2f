"""An admin's release of a running server's lease through the API stops the
server first, as a user's own and the panel's do (the admin review: an
admin token released it at once and the GPU went to the next user while
the server ran on it); only a release that says ``holder_stopped`` (the
spawner's, after its stop) is immediate, and only a broker admin may say
so."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from jupyterhub.httpclient import JupyterHubHTTPClient

from gpubroker.api import auth
from gpubroker.broker.release_asked import Outcome
from gpubroker.core import Broker

from .test_api_scopes import ACCESS, MODELS, FakeHub, ServedAPI, error


async def _running(user: str, server_name: str) -> bool:
    """The hub runs every server."""
    return True


@pytest.fixture
async def served(broker: Broker, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[ServedAPI]:
    """The API, with ``root-token`` a (human) broker admin's."""
    root = {"kind": "user", "name": "root", "scopes": [ACCESS, auth.ADMIN_SCOPE]}
    monkeypatch.setitem(MODELS, "root-token", root)
    with FakeHub() as hub:
        api = ServedAPI(broker, hub, server_running=_running)
        try:
            yield api
        finally:
            api.server.stop()
            await JupyterHubHTTPClient.loop_instance().close()


def _server_lease(broker: Broker, user: str) -> dict[str, Any]:
    lease = broker.request_lease(user, "", gpus=1, holder_kind="server")
    assert lease["state"] == "granted"
    return lease


@pytest.fixture
def stops(broker: Broker, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Ids of the leases released stopping their holder first
    (``Broker.stop_lease``; with no hub here, its stop is done at once)."""
    asked: list[int] = []
    real = broker.stop_lease

    def stop_lease(lease_id: int, *args: Any, **kwargs: Any) -> Any:
        asked.append(lease_id)
        return real(lease_id, *args, **kwargs)

    monkeypatch.setattr(broker, "stop_lease", stop_lease)
    return asked


async def test_an_admins_release_of_a_running_server_stops_it_first_and_tells_its_user(
    served: ServedAPI, broker: Broker, stops: list[int]
) -> None:
    lease = _server_lease(broker, "ann")
    answer = await served.call("DELETE", f"/leases/{lease['id']}", "root-token", {})
    assert answer.code == 200
    assert stops == [lease["id"]]
    notices = broker.notices("ann")
    assert [(n["kind"], n["message"]) for n in notices] == [("admin-release", "released by root")]
    # a service's release (the broker's own token, a tool's) is stopped first
    # too, and tells no one
    other = _server_lease(broker, "bob")
    answer = await served.call("DELETE", f"/leases/{other['id']}", "admin-token", {})
    assert answer.code == 200 and stops == [lease["id"], other["id"]]
    assert broker.notices("bob") == []


async def test_the_spawners_release_after_its_stop_is_at_once_and_tells_nobody(
    served: ServedAPI, broker: Broker, stops: list[int]
) -> None:
    lease = _server_lease(broker, "ann")
    body = {"reason": "server stopped", "holder_stopped": True}
    answer = await served.call("DELETE", f"/leases/{lease['id']}", "admin-token", body)
    assert answer.code == 200 and json.loads(answer.body)["state"] == "released"
    assert stops == []
    assert broker.notices("ann") == []


async def test_only_an_admin_may_say_the_holder_stopped(
    served: ServedAPI, broker: Broker, stops: list[int]
) -> None:
    lease = _server_lease(broker, "ann")
    answer = await served.call(
        "DELETE", f"/leases/{lease['id']}", "ann-token", {"holder_stopped": True}
    )
    code, message = error(answer)
    assert code == 403 and message.startswith("holder_stopped: only a broker admin")
    answer = await served.call(
        "DELETE", f"/leases/{lease['id']}", "admin-token", {"holder_stopped": "yes"}
    )
    assert error(answer) == (400, 'holder_stopped: must be true or false, got "yes"')
    # a misspelt field was dropped, and the server stopped first; a reason of
    # another type was taken for none: both are now 400s naming the field
    answer = await served.call(
        "DELETE", f"/leases/{lease['id']}", "admin-token", {"holder_stoped": True}
    )
    assert error(answer) == (
        400,
        "holder_stoped: unknown field (allowed: holder_stopped, reason)",
    )
    answer = await served.call("DELETE", f"/leases/{lease['id']}", "admin-token", {"reason": 0})
    assert error(answer) == (400, "reason: must be a string of at most 1000 characters, got 0")
    answer = await served.call(
        "DELETE", f"/leases/{lease['id']}", "admin-token", {"reason": None, "x\nINFO y": 1}
    )
    assert error(answer)[1].startswith('"x\\nINFO y": unknown field')  # escaped
    answer = await served.call("DELETE", f"/leases/{lease['id']}", "admin-token", {"reason": None})
    assert error(answer) == (
        400,
        "reason: must be a string of at most 1000 characters, got null",
    )
    assert broker.get_lease(lease["id"])["state"] == "granted"  # nothing lost
    assert stops == []
    # her own release of her running server stops it first, with no notice
    answer = await served.call("DELETE", f"/leases/{lease['id']}", "ann-token", {})
    assert answer.code == 200 and stops == [lease["id"]]
    assert broker.notices("ann") == []


async def test_an_admins_release_repeated_while_its_stop_is_under_way_tells_once(
    served: ServedAPI, broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    lease = _server_lease(broker, "ann")
    # the hub takes its time to stop the server: the stop stays open
    monkeypatch.setattr(broker, "stop_lease", lambda *a, **k: broker.get_lease(lease["id"]))
    monkeypatch.setattr(broker.stops, "open_stop", lambda lease_id: None)
    await served.call("DELETE", f"/leases/{lease['id']}", "root-token", {"reason": "first"})
    monkeypatch.setattr(broker.stops, "open_stop", lambda lease_id: object())
    await served.call("DELETE", f"/leases/{lease['id']}", "root-token", {"reason": "again"})
    assert [(n["kind"], n["message"]) for n in broker.notices("ann")] == [
        ("admin-release", "first")
    ]


# --- one rule for the API and the panel (gpubroker.broker.release_asked) --------


async def _gone(user: str, server_name: str) -> bool:
    """The hub runs no server (it ended on its own)."""
    return False


async def test_a_server_the_hub_no_longer_runs_is_released_at_once_and_its_user_told(
    broker: Broker, stops: list[int]
) -> None:
    """Before, the panel stopped first whatever the hub said: a lease whose
    server had ended waited for a stop the hub could not do."""
    lease = _server_lease(broker, "ann")
    done = await broker.release_asked(
        lease["id"], "maintenance", "root", server_running=_gone, tell=True
    )
    assert done.outcome is Outcome.released and done.lease["state"] == "released"
    assert stops == []
    assert [(n["kind"], n["message"]) for n in broker.notices("ann")] == [
        ("admin-release", "maintenance")
    ]


async def test_a_lease_that_ends_while_the_hub_is_asked_is_not_told_of(
    broker: Broker, stops: list[int]
) -> None:
    lease = _server_lease(broker, "ann")

    async def released_meanwhile(user: str, server_name: str) -> bool:
        broker.release_lease(lease["id"], "server stopped", actor="ann")
        return True

    done = await broker.release_asked(
        lease["id"], "maintenance", "root", server_running=released_meanwhile, tell=True
    )
    assert done.outcome is Outcome.ended_already and stops == []
    assert broker.notices("ann") == []
    assert [e["reason"] for e in broker.lease_events(lease["id"]) if e["to"] == "released"] == [
        "server stopped"
    ]


async def test_a_job_lease_is_stopped_first_whatever_the_caller_says(
    broker: Broker, stops: list[int]
) -> None:
    lease = broker.request_lease("ann", "", gpus=1, holder_kind="job")
    done = await broker.release_asked(
        lease["id"], "maintenance", "root", server_running=_gone, holder_stopped=True
    )
    assert done.outcome is Outcome.stopping and done.holder == "job"
    assert stops == [lease["id"]]


# --- where a server runs, recorded by hand, is audited (the usage review) -------


async def test_an_admins_record_of_where_a_server_runs_is_audited_the_spawners_not(
    served: ServedAPI, broker: Broker
) -> None:
    """Reconciliation ends a lease by its recorded container or Slurm job;
    before, an admin's ``PATCH`` of another user's lease left no trace."""
    lease = _server_lease(broker, "ann")
    spawner = {"server_url": "http://127.0.0.1:9/user/ann/"}
    answer = await served.call("PATCH", f"/leases/{lease['id']}", "admin-token", spawner)
    assert answer.code == 200
    by_hand = {"server_url": "http://127.0.0.1:9/", "container_id": "a" * 12}
    answer = await served.call("PATCH", f"/leases/{lease['id']}", "root-token", by_hand)
    assert answer.code == 200
    notes = [e for e in broker.lease_events(lease["id"]) if e["kind"] == "server-recorded"]
    assert [(e["actor"], e["detail"].get("container_id")) for e in notes] == [
        ("gpubroker", None),
        ("root", "a" * 12),
    ]
    audit = json.loads((await served.call("GET", "/audit", "root-token")).body)["entries"]
    recorded = [e for e in audit if e["action"] == "server-recorded"]
    assert [(e["actor"], e["target"]) for e in recorded] == [
        ("root", f"lease {lease['id']} of ann")
    ]


# --- a review of the shared rule --------------------------------------------------


async def test_a_server_whose_container_still_runs_is_stopped_first_whatever_the_hub_says(
    broker: Broker, stops: list[int]
) -> None:
    """After a failed stop the hub forgets a server whose container runs on;
    released at once, its GPU went to the next user beside that container."""
    lease = _server_lease(broker, "ann")
    broker.set_server_url(lease["id"], "http://127.0.0.1:9/", "c0ffee123456", "engine-1")
    done = await broker.release_asked(lease["id"], "maintenance", "root", server_running=_gone)
    assert done.outcome is Outcome.stopping and stops == [lease["id"]]


async def test_a_release_asked_while_a_stop_is_under_way_asks_and_tells_nothing_more(
    broker: Broker,
) -> None:
    asked: list[int] = []
    broker.on_evict = lambda view: asked.append(view["id"])  # the hub stops it, slowly
    lease = _server_lease(broker, "ann")

    async def running(user: str, server_name: str) -> bool:
        return True

    first = await broker.release_asked(
        lease["id"], "maintenance", "root", server_running=running, tell=True
    )
    assert first.outcome is Outcome.stopping and asked == [lease["id"]]
    # the hub forgot the server meanwhile: still no release, no second notice
    again = await broker.release_asked(
        lease["id"], "maintenance again", "root", server_running=_gone, tell=True
    )
    assert again.outcome is Outcome.stopping_already and again.lease["state"] == "granted"
    assert [n["message"] for n in broker.notices("ann")] == ["maintenance"]
    # the spawner's release after its stop goes through, with the stop's reason
    done = await broker.release_asked(
        lease["id"], "server stopped", "gpubroker", server_running=_gone, holder_stopped=True
    )
    assert done.outcome is Outcome.released
    assert done.lease["release_reason"] == "maintenance (server stopped)"


async def test_only_an_admin_may_replace_an_active_lease_by_a_restart(
    served: ServedAPI, broker: Broker, stops: list[int]
) -> None:
    """``restart_of`` naming an active lease releases it at once, with no
    stop of its server: that says the server has stopped, as
    ``holder_stopped`` does. A user could so hand her running server's GPUs
    to the next in line (found by a review of the API); only the spawner
    (an admin) may, and a user is told to release the lease first."""
    old = _server_lease(broker, "ann")
    bobs = broker.request_lease("bob", "", gpus=8, holder_kind="server")
    assert bobs["state"] == "pending"
    body = {"user": "ann", "gpus": 1, "restart_of": old["id"]}
    for path in ("/leases", "/leases?dry_run=true"):
        code, message = error(await served.call("POST", path, "ann-token", body))
        assert code == 403, path
        assert message == (
            f"restart_of: lease {old['id']} is still granted; only a broker admin "
            "(the spawner) may replace an active lease: release it first "
            f"(DELETE /api/v1/leases/{old['id']} stops its server)"
        )
    assert broker.get_lease(old["id"])["state"] == "granted"
    assert broker.get_lease(bobs["id"])["state"] == "pending"
    assert len(broker.list_leases(user="ann")) == 1 and stops == []
    # the spawner, which saw the server exit, may
    answer = await served.call("POST", "/leases", "admin-token", body)
    assert answer.code == 201, answer.body
    assert broker.get_lease(old["id"])["release_reason"] == "server restarted"
    # a user's restart that names a lease already released is hers to ask
    again = json.loads(answer.body)
    broker.release_lease(again["id"], "server exited (status 1)", actor="gpubroker")
    answer = await served.call(
        "POST", "/leases", "ann-token", {"user": "ann", "gpus": 1, "restart_of": again["id"]}
    )
    assert answer.code == 201, answer.body
    assert json.loads(answer.body)["restarts"] == 2
