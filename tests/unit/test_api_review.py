"""A review of the REST API's answers to hostile input: a caller's field
name or value never puts a line break or a long text into a message (or
the broker's log, which logs each 4xx's message), a lease records only a
server URL with a host, a path that is not UTF-8 is checked after the
token like any other bad name, and a service submits no job of its own."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from jupyterhub.httpclient import JupyterHubHTTPClient

from gpubroker.errors import BadRequest
from gpubroker.jobs.service import JobService

from .test_api_scopes import FakeHub, ServedAPI, error

#: a field name that would forge a log line, and long
FORGED = "x\nERROR Uncaught exception: forged line\u2028" + "y" * 300


@pytest.fixture
async def served(jobs: JobService, home: Path) -> AsyncIterator[ServedAPI]:
    """The API of the job service's broker (tokens of test_api_scopes)."""
    (home / "ann").mkdir(parents=True)
    with FakeHub() as hub:
        api = ServedAPI(jobs.broker, hub, jobs=jobs)
        try:
            yield api
        finally:
            api.server.stop()
            await JupyterHubHTTPClient.loop_instance().close()


def _plain(message: str) -> None:
    """A message with the caller's text escaped and cut."""
    assert "\n" not in message and "\u2028" not in message, message
    assert len(message) < 300, message


async def test_an_unknown_field_is_named_escaped_and_cut(served: ServedAPI) -> None:
    lease = json.loads(
        (await served.call("POST", "/leases", "ann-token", {"user": "ann", "gpus": 1})).body
    )
    calls: list[tuple[str, str, str, dict[str, Any]]] = [
        ("POST", "/leases", "ann-token", {"user": "ann", "gpus": 1}),
        ("POST", "/jobs", "ann-token", {"command": "true", "gpus": 1}),
        ("PUT", "/quotas/user/ann", "admin-token", {"limit": 2}),
        ("PATCH", f"/leases/{lease['id']}", "admin-token", {"priority_class": "batch"}),
        ("DELETE", f"/leases/{lease['id']}", "ann-token", {}),
    ]
    for method, path, token, body in calls:
        code, message = error(await served.call(method, path, token, {**body, FORGED: 1}))
        assert code == 400, (method, path)
        assert message.startswith('"x\\nERROR Uncaught exception: forged line\\u2028yyy')
        assert message.endswith(": unknown field (allowed: " + message.split("(allowed: ")[1])
        _plain(message)
    # a plain name is named as sent
    code, message = error(await served.call("PUT", "/quotas/user/ann", "admin-token", {"lmit": 2}))
    assert message == "lmit: unknown field (allowed: guaranteed, limit)"
    assert served.app.settings["broker"].get_lease(lease["id"])["state"] == "granted"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"notebook": "a/" * 2000 + "b.ipynb"}, "notebook"),
        ({"notebook": "x\n" * 2000}, "notebook"),
        ({"command": "true", "time": "x\n" * 2000}, "time"),
        ({"notebook": "nb.ipynb", "kernel": "k\n" * 2000}, "kernel"),
        ({"notebook": "nb.ipynb", "params": ["x\n" * 2000]}, "param"),
    ],
)
def test_a_job_fields_value_is_echoed_escaped_and_cut(
    jobs: JobService, home: Path, body: dict[str, Any], field: str
) -> None:
    (home / "ann").mkdir(parents=True)
    with pytest.raises(BadRequest) as err:
        jobs.submit("ann", {"gpus": 1, **body})
    assert err.value.message.startswith(f"{field}: "), err.value.message
    _plain(err.value.message)
    assert jobs.list(None) == [] and jobs.broker.list_leases() == []


async def test_a_service_names_whose_job_it_submits(served: ServedAPI) -> None:
    """A service owns no job (before: the job was a user's named like the
    service, and would run as the account of that name)."""
    answer = await served.call("POST", "/jobs", "admin-token", {"command": "true", "gpus": 1})
    assert error(answer) == (400, "user: required, and missing")
    # a user's own job needs no name
    answer = await served.call("POST", "/jobs", "ann-token", {"command": "true", "gpus": 1})
    assert answer.code == 201, answer.body
    assert json.loads(answer.body)["user"] == "ann"


@pytest.mark.parametrize(
    "url",
    [
        "http://x\r\nX-Injected: 1",
        "http://",
        "http:// a b/",
        "http://x\x7f\x85/",
        "http://host:99999/",
        "ftp://host/",
        "http:///path",
    ],
)
async def test_a_recorded_server_url_has_a_host_and_no_control_character(
    served: ServedAPI, url: str
) -> None:
    broker = served.app.settings["broker"]
    lease = broker.request_lease("ann", "", gpus=1)
    path = f"/leases/{lease['id']}"
    answer = await served.call("PATCH", path, "admin-token", {"server_url": url})
    code, message = error(answer)
    assert code == 400 and message.startswith("server_url: must be an http(s) URL with a host")
    _plain(message)
    assert broker.get_lease(lease["id"])["env"] == lease["env"]
    good = "http://[::1]:8888/user/ann/"
    answer = await served.call(
        "PATCH", f"/leases/{lease['id']}", "admin-token", {"server_url": good}
    )
    assert answer.code == 200, answer.body


@pytest.mark.parametrize(
    ("method", "path", "body", "field"),
    [
        ("PUT", "/quotas/user/%ff", {"guaranteed": 1}, "name"),
        ("DELETE", "/quotas/%ff/x", None, "kind"),
        ("PATCH", "/devices/%ff", {"drained": True}, "uuid"),
    ],
)
async def test_a_path_that_is_not_utf8_is_checked_after_the_token(
    served: ServedAPI, method: str, path: str, body: Any, field: str
) -> None:
    """Tornado refused it with 400 before any token was checked, naming no
    field; now 401 without a token, 403 for a user, and 400 naming the
    field for an admin."""
    assert (await served.call(method, path, None, body)).code == 401
    assert (await served.call(method, path, "ann-token", body)).code == 403
    code, message = error(await served.call(method, path, "admin-token", body))
    assert code == 400 and message.startswith(f"{field}: "), message
    assert message.endswith('got "\\udcff"') or "must be one of" in message, message


async def test_a_user_named_like_a_system_actor_is_recorded_as_a_user(
    served: ServedAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hub user named ``culler`` releasing her lease with a reason of the
    culler's words was recorded as the actor ``culler``: the release
    counted as a cull and read as the broker's own in the audit log. She
    is recorded as ``user/culler`` (no hub name has a ``/``)."""
    from gpubroker.observe import audit
    from gpubroker.usage.intervals import event_cause

    from .test_api_scopes import ACCESS, MODELS

    monkeypatch.setitem(
        MODELS, "culler-token", {"kind": "user", "name": "culler", "scopes": [ACCESS]}
    )
    broker = served.app.settings["broker"]
    answer = await served.call("POST", "/leases", "culler-token", {"user": "culler", "gpus": 1})
    lease = json.loads(answer.body)
    body = {"reason": "culled: idle for 2 h"}
    answer = await served.call("DELETE", f"/leases/{lease['id']}", "culler-token", body)
    assert answer.code == 200, answer.body
    (released,) = [e for e in broker.lease_events(lease["id"]) if e["kind"] == "released"]
    assert released["actor"] == "user/culler"
    cause = event_cause(released["detail"], released["reason"], released["actor"], "granted")
    assert cause == "release"
    # her own release is not in the audit log (others' actions on her lease are)
    for who in (None, "culler"):
        entries = audit.query(broker.session_factory, None, None, who, None, 100)
        assert [(e["action"], e["actor"]) for e in entries] == [("granted", "scheduler")]
