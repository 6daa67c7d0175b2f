"""The admin panel, the audit log and the usage report's outputs under
attack: the panel served by the broker's own application on 127.0.0.1, its
logins checked by a real ``HubOAuth`` against a small fake hub API (no
JupyterHub started); bad input, other users' data, markup in names, forms
sent twice or without their XSRF token."""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import pytest
from jupyterhub.httpclient import JupyterHubHTTPClient
from jupyterhub.services.auth import HubAuth, HubOAuth
from tornado.httpclient import AsyncHTTPClient, HTTPResponse
from tornado.httpserver import HTTPServer

from gpubroker.api import auth
from gpubroker.api.app import make_app
from gpubroker.core import Broker
from gpubroker.jobs.service import JobService
from gpubroker.observe import audit
from gpubroker.store import audit_repo
from gpubroker.usage.ledger import Ledger

from .test_api_scopes import ACCESS, MODELS, FakeHub, _bound

BASE = "/services/gpubroker/"
#: every page only a broker admin may open
ADMIN_PAGES = ("overview", "queue", "leases", "devices", "quotas", "usage", "usage.csv", "audit")
#: a name that is markup (no "/": a valid user, server, group and quota name)
MARKUP = "<img src=x onerror=alert(1)>"


class Panel:
    """The broker's application with its panel, served on 127.0.0.1."""

    def __init__(self, broker: Broker, hub: FakeHub, **settings: Any) -> None:
        hub_auth = HubAuth(api_url=hub.api_url, api_token="s", access_scopes={ACCESS})
        panel_auth = HubOAuth(
            api_url=hub.api_url,
            api_token="s",
            access_scopes={ACCESS},
            base_url=BASE,
            oauth_client_id="service-gpubroker",
            oauth_redirect_uri=BASE + "oauth_callback",
        )
        app = make_app(
            broker,
            base_url=BASE,
            hub_auth=hub_auth,
            panel_auth=panel_auth,
            cookie_secret=os.urandom(32),
            service_name="gpubroker",
            log=logging.getLogger("test-panel"),
            **settings,
        )
        self.server = HTTPServer(app)
        sock, self.port = _bound()
        self.server.add_sockets([sock])
        self.client = AsyncHTTPClient()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{BASE}{path}"

    async def get(self, path: str, token: str = "root-token") -> HTTPResponse:
        response: HTTPResponse = await self.client.fetch(
            self.url(path),
            headers={"Authorization": f"token {token}"},
            raise_error=False,
            follow_redirects=False,
            request_timeout=60,
        )
        return response

    async def post(
        self, path: str, form: dict[str, str], token: str = "root-token", xsrf: bool = True
    ) -> HTTPResponse:
        """Send a form as a browser does: with the XSRF cookie and token of
        a page loaded first (``xsrf`` False: without them)."""
        headers = {"Authorization": f"token {token}"}
        if xsrf:
            page = await self.get("me", token)
            headers["Cookie"] = "; ".join(
                c.split(";")[0] for c in page.headers.get_list("Set-Cookie")
            )
            found = re.search(r'name="xsrf-token" content="([^"]+)"', page.body.decode())
            assert found, page.body
            form = dict(form, _xsrf=found.group(1))
        response: HTTPResponse = await self.client.fetch(
            self.url(path),
            method="POST",
            body=urlencode(form),
            headers=headers,
            raise_error=False,
            follow_redirects=False,
            request_timeout=60,
        )
        return response


async def _running(user: str, server_name: str) -> bool:
    """The hub runs every server."""
    return True


@pytest.fixture
async def panel(broker: Broker, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Panel]:
    """The panel of ``broker`` (with a usage ledger); ``root-token`` is a
    broker admin's login, ``ann-token`` and ``bob-token`` researchers'."""
    monkeypatch.setitem(
        MODELS, "root-token", {"kind": "user", "name": "root", "scopes": [ACCESS, auth.ADMIN_SCOPE]}
    )
    ledger = Ledger(broker.session_factory, broker.backend)
    ledger.start()
    with FakeHub() as hub:
        served = Panel(broker, hub, ledger=ledger, server_running=_running)
        try:
            yield served
        finally:
            served.server.stop()
            await JupyterHubHTTPClient.loop_instance().close()


def text(response: HTTPResponse) -> str:
    return (response.body or b"").decode()


# --- defects found -----------------------------------------------------------


def test_audit_entries_are_newest_first_whatever_their_microseconds(broker: Broker) -> None:
    """An entry at a whole second sorts after one later in that second (the
    text ``…:00Z`` sorted after ``…:00.500000Z``), and every time has the
    same form."""
    utc = dt.timezone.utc
    with broker.session_factory.begin() as session:
        for at, target in [
            (dt.datetime(2026, 1, 1, 0, 0, 0, tzinfo=utc), "user:first"),
            (dt.datetime(2026, 1, 1, 0, 0, 0, 500000, tzinfo=utc), "user:second"),
            (dt.datetime(2026, 1, 1, 0, 0, 1, tzinfo=utc), "user:third"),
        ]:
            audit_repo.record(session, at, "root", "quota-set", target, {})
    entries = audit.query(broker.session_factory)
    assert [e["target"] for e in entries] == ["user:third", "user:second", "user:first"]
    assert [e["at"] for e in entries] == [
        "2026-01-01T00:00:01.000000Z",
        "2026-01-01T00:00:00.500000Z",
        "2026-01-01T00:00:00.000000Z",
    ]
    assert audit.query(broker.session_factory, limit=1)[0]["target"] == "user:third"


def test_audit_kind_of_a_release_cause_looks_past_releases_of_other_causes(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``kind=preemption`` finds the preemption even when more releases of
    other causes than one query reads came after it."""
    preempted = broker.request_lease("ann", "", gpus=1, holder_kind="external")
    broker.preempt_lease(preempted["id"], "maintenance", actor="root")
    monkeypatch.setattr(audit, "MAX_LIMIT", 3)  # what one query reads, made small
    for _ in range(4):  # newer releases, by an admin: audited, cause "release"
        lease = broker.request_lease("bob", "", gpus=1, holder_kind="external")
        broker.release_lease(lease["id"], "done", actor="root")
    found = audit.query(broker.session_factory, kind="preemption", limit=10)
    assert [(e["lease_id"], e["cause"]) for e in found] == [(preempted["id"], "preemption")]
    releases = audit.query(broker.session_factory, kind="release", limit=10)
    assert len(releases) == 3 and {e["cause"] for e in releases} == {"release"}


async def test_releasing_an_ended_lease_again_is_a_conflict_that_tells_no_one(
    panel: Panel, broker: Broker
) -> None:
    """A release sent again (a second admin, a stale page, a double click)
    answered "released" and gave the holder a second notice of a release
    that did not happen."""
    lease = broker.request_lease("ann", "", gpus=1, holder_kind="external")
    form = {"action": "release", "lease_id": str(lease["id"]), "reason": "maintenance"}
    first = await panel.post("leases", form)
    assert first.code == 303 and "released" in await outcome(panel, first)
    assert len(broker.notices("ann")) == 1
    again = await panel.post("leases", dict(form, reason="again"))
    assert again.code == 409, text(again)
    assert f"lease {lease['id']}: is released already" in text(again)
    assert [n["message"] for n in broker.notices("ann")] == ["maintenance"]
    notes = [e for e in broker.lease_events(lease["id"]) if e["kind"] == "admin-release"]
    assert len(notes) == 1


async def test_releasing_a_server_whose_stop_is_under_way_is_a_conflict(
    panel: Panel, broker: Broker
) -> None:
    asked: list[int] = []
    broker.on_evict = lambda view: asked.append(view["id"])  # the service asks the hub
    lease = broker.request_lease("ann", "", gpus=1)
    form = {"action": "release", "lease_id": str(lease["id"]), "reason": "maintenance"}
    first = await panel.post("leases", form)
    assert first.code == 303 and "stopping" in await outcome(panel, first)
    again = await panel.post("leases", form)
    assert again.code == 409 and "being stopped already" in text(again)
    assert asked == [lease["id"]] and len(broker.notices("ann")) == 1


# --- what held up, kept -------------------------------------------------------


async def outcome(panel: Panel, posted: HTTPResponse) -> str:
    """The line a form's redirect (303) shows on the page it leads to."""
    page = await panel.get(posted.headers["Location"].split(BASE, 1)[1])
    found = re.search(r'<p class="done" role="status">([^<]*)</p>', text(page))
    assert found, text(page)
    return found.group(1)


def alert(response: HTTPResponse) -> str:
    """The error line of a panel page (an error page or an inline error)."""
    found = re.search(r'<p class="error[^"]*" role="alert">([^<]*)</p>', text(response))
    assert found, text(response)
    return found.group(1)


async def test_researchers_get_403_on_every_admin_page_and_form(
    panel: Panel, broker: Broker
) -> None:
    theirs = broker.request_lease("bob", "", gpus=1, holder_kind="external")
    mine = broker.request_lease("ann", "", gpus=1, holder_kind="external")
    for page in ADMIN_PAGES:
        refused = await panel.get(page, "ann-token")
        assert refused.code == 403, page
        assert alert(refused) == f"this page needs the scope {auth.ADMIN_SCOPE}"
        assert "bob" not in text(refused)
    for page, form in [
        ("leases", {"action": "release", "lease_id": str(theirs["id"])}),
        ("queue", {"action": "cancel", "lease_id": str(theirs["id"])}),
        ("quotas", {"action": "set", "kind": "user", "name": "ann", "guaranteed": "8"}),
        ("devices", {"action": "drain", "uuid": theirs["slots"][0]["uuid"]}),
    ]:
        assert (await panel.post(page, form, "ann-token")).code == 403, page
    assert broker.get_lease(theirs["id"])["state"] == "granted"
    assert broker.quotas()["users"] == {}
    assert not any(device.drained for device, _holders in broker.device_rows())
    # her own page: her lease, nobody else's
    page = await panel.get("me", "ann-token")
    assert page.code == 200
    assert f'data-lease="{mine["id"]}"' in text(page)
    assert f'data-lease="{theirs["id"]}"' not in text(page) and "bob" not in text(page)


async def test_a_form_without_its_xsrf_token_changes_nothing(panel: Panel, broker: Broker) -> None:
    lease = broker.request_lease("ann", "", gpus=1, holder_kind="external")
    form = {"action": "release", "lease_id": str(lease["id"])}
    missing = await panel.post("leases", form, xsrf=False)
    assert missing.code == 403 and alert(missing) == "&#39;_xsrf&#39; argument missing from POST"
    forged = await panel.post("leases", dict(form, _xsrf="forged"), xsrf=False)
    assert forged.code == 403
    assert broker.get_lease(lease["id"])["state"] == "granted"


@pytest.mark.parametrize(
    ("page", "field", "value"),
    [
        ("leases", "user", "a/b"),
        ("leases", "user", "x" * 300),
        ("leases", "state", "everything"),
        ("leases", "kind", "robot"),
        ("audit", "user", "a\x7fb"),
        ("audit", "kind", "x" * 300),
        ("audit", "since", "soon"),
        ("audit", "until", "0001-01-01"),
        ("audit", "until", "9999-12-31"),
        ("usage", "from", "NaN"),
        ("usage", "to", "1e400"),
        ("usage", "by", "team"),
        ("usage", "tz", "Mars/Olympus"),
        ("usage", "tz", "../../etc/passwd"),
        ("usage.csv", "tz", "x" * 5000),
        ("usage.csv", "by", "-1"),
    ],
)
async def test_a_bad_query_argument_is_a_400_naming_it(
    panel: Panel, page: str, field: str, value: str
) -> None:
    refused = await panel.get(f"{page}?{field}={quote(value, safe='')}")
    assert refused.code == 400, text(refused)
    assert alert(refused).startswith(f"{field}: ")


async def test_too_long_a_period_names_the_limit(panel: Panel) -> None:
    refused = await panel.get("usage.csv?from=2000-01-01&to=2020-01-01")
    assert refused.code == 400 and alert(refused) == "to: the period may be at most 3660 days"
    refused = await panel.get("usage?by=day&from=2025-01-01&to=2026-06-01")
    assert refused.code == 400
    assert alert(refused) == "to: a report by day or in HTML may cover at most 400 days"


async def test_names_that_are_markup_are_text_on_every_admin_page(
    panel: Panel, broker: Broker
) -> None:
    held = broker.request_lease(
        MARKUP, MARKUP, gpus=1, holder_kind="external", group=MARKUP, groups=[MARKUP]
    )
    broker.request_lease(MARKUP, "", gpus=1, holder_kind="external", time_limit=60)
    for _ in range(7):  # the rest of the node, so the next one waits
        broker.request_lease("=cmd|' /C calc'!A0", "", gpus=1, holder_kind="external")
    broker.request_lease(MARKUP, MARKUP + "2", gpus=1, holder_kind="external")
    broker.set_quota("group", MARKUP, 1, 2, actor="root")
    broker.preempt_lease(held["id"], MARKUP, actor="root")
    pages = ["overview", "queue", "leases", "leases?state=all", "devices", "quotas", "audit"]
    pages += [f"usage?by={by}" for by in ("user", "group", "day")]
    for page in pages:
        shown = await panel.get(page)
        assert shown.code == 200, page
        assert "<img" not in text(shown), page
        assert "&lt;img src=x onerror=alert(1)&gt;" in text(shown), page
    csv = await panel.get("usage.csv")
    assert csv.headers["Content-Type"] == "text/csv; charset=utf-8"
    assert csv.headers["Content-Disposition"].startswith("attachment;")
    keys = [line.split(",")[0] for line in text(csv).splitlines()[1:]]
    assert "'=cmd|' /C calc'!A0" in keys  # a formula is text in a spreadsheet


async def test_the_usage_api_gives_a_user_her_own_rows_in_every_format(
    panel: Panel, broker: Broker
) -> None:
    for user in ("ann", "bob"):
        lease = broker.request_lease(user, "", gpus=1, holder_kind="external", time_limit=60)
        broker.release_lease(lease["id"], "done", actor=user)

    async def usage(query: str, token: str) -> HTTPResponse:
        return await panel.get(f"api/v1/usage?{query}", token)

    year = dt.datetime.now(dt.timezone.utc).year
    mine = await usage(f"from={year - 1}-01-01&to={year + 1}-01-01", "ann-token")
    report = json.loads(text(mine))
    assert [row["key"] for row in report["rows"]] == ["ann"]
    # times as the API writes every time: UTC with microseconds
    assert (report["from"], report["to"]) == (
        f"{year - 1}-01-01T00:00:00.000000Z",
        f"{year + 1}-01-01T00:00:00.000000Z",
    )
    for query in ("format=csv", "format=table", "format=html&by=day", "by=group", "by=day"):
        answer = await usage(query, "ann-token")
        assert answer.code == 200, query
        assert "bob" not in text(answer), query
    refused = await usage("user=bob", "ann-token")
    assert refused.code == 403
    everyone = json.loads(text(await usage("", "root-token")))
    assert {row["key"] for row in everyone["rows"]} == {"ann", "bob"}


async def test_a_forms_outcome_shows_only_when_the_panel_signed_it(
    panel: Panel, broker: Broker
) -> None:
    """The line saying what a form did came from the URL as plain text, so
    a link made anywhere (``leases?done=Your+account+is+locked...``) put
    its words on an admin's panel page. Now only the panel's own signed
    outcome shows; anything else is ignored."""
    lease = broker.request_lease("ann", "", gpus=1, holder_kind="external")
    form = {"action": "release", "lease_id": str(lease["id"]), "reason": "maintenance"}
    posted = await panel.post("leases", form)
    assert posted.code == 303
    location = posted.headers["Location"]
    assert f"Lease {lease['id']} of ann released" not in location  # not readable as text
    shown = await panel.get(location.split(BASE, 1)[1])
    assert shown.code == 200
    assert f"Lease {lease['id']} of ann released." in text(shown)
    forged = "Your GPUs were revoked: log in again at evil.example"
    for value in (forged, location.split("done=", 1)[1][:-3] + "abc"):
        page = await panel.get(f"leases?{urlencode({'done': value})}")
        assert page.code == 200
        assert 'class="done"' not in text(page) and "evil.example" not in text(page)


@pytest.mark.parametrize(
    ("page", "field"),
    [
        ("leases", "state"),
        ("leases", "user"),
        ("audit", "kind"),
        ("usage", "by"),
        ("queue", "done"),
    ],
)
async def test_a_query_argument_given_twice_is_a_400_naming_it(
    panel: Panel, page: str, field: str
) -> None:
    """The panel took the last of repeated arguments where the API refuses
    them: the same rule now."""
    refused = await panel.get(f"{page}?{field}=a&{field}=b")
    assert refused.code == 400, text(refused)
    assert alert(refused) == f"{field}: given 2 times; give it once"


async def test_a_filter_with_a_control_character_is_refused_not_dropped(
    panel: Panel, broker: Broker
) -> None:
    """Tornado's reading turned ``?user=%00`` into no filter (every user's
    entries) and ``?user=%01zed`` into ``zed`` (a review of the panel)."""
    broker.set_quota("user", "zed", 1, 2, actor="root")
    for path in ("audit?user=%00", "audit?user=%01zed", "audit?kind=%00", "usage?tz=%00"):
        shown = await panel.get(path)
        assert shown.code == 400, (path, shown.code)
    reversed_period = await panel.get("audit?since=2026-12-02&until=2026-12-01")
    assert reversed_period.code == 400 and "since: must be before until" in text(reversed_period)
    assert (await panel.get("audit?user=zed")).code == 200


async def test_cancelling_a_job_that_ended_is_a_conflict(
    jobs: JobService, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The panel said "Job 1 of ann cancelled." of a job that had
    succeeded, and changed nothing (a stale page, a form sent twice)."""
    import asyncio

    monkeypatch.setitem(
        MODELS, "root-token", {"kind": "user", "name": "root", "scopes": [ACCESS, auth.ADMIN_SCOPE]}
    )
    (home / "ann").mkdir(parents=True)
    job = jobs.submit("ann", {"command": "true", "gpus": 1})
    for _ in range(600):
        await jobs.tick()
        if jobs.get(job["id"])["state"] == "succeeded":
            break
        await asyncio.sleep(0.1)
    assert jobs.get(job["id"])["state"] == "succeeded"
    with FakeHub() as hub:
        served = Panel(jobs.broker, hub, jobs=jobs, server_running=_running)
        try:
            form = {"action": "cancel-job", "job_id": str(job["id"])}
            answer = await served.post("leases", form)
            assert answer.code == 409, answer.headers.get("Location")
            assert f"job {job['id']}: is succeeded already, nothing to cancel" in text(answer)
        finally:
            served.server.stop()
            await JupyterHubHTTPClient.loop_instance().close()
    assert jobs.get(job["id"])["state"] == "succeeded"


async def test_cancelling_a_request_twice_is_a_conflict(panel: Panel, broker: Broker) -> None:
    """The second cancel of a waiting request (a form sent twice) was a 400,
    where a second release is a 409 (a review of the panel)."""
    broker.request_lease("ann", "", gpus=8, holder_kind="external")
    waiting = broker.request_lease("bob", "", gpus=1, holder_kind="external")
    assert waiting["state"] == "pending"
    form = {"action": "cancel", "lease_id": str(waiting["id"])}
    assert (await panel.post("queue", form)).code == 303
    again = await panel.post("queue", form)
    assert again.code == 409 and f"lease {waiting['id']}: is released, not waiting" in text(again)


async def test_a_job_in_a_preemptions_grace_is_cancelled_from_the_panel(
    jobs: JobService, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job being stopped by a preemption is cancelled, as ``DELETE
    /jobs/{id}`` does; refused, it would be queued again after the grace
    (a review of this stop's fixes)."""
    import asyncio

    monkeypatch.setitem(
        MODELS, "root-token", {"kind": "user", "name": "root", "scopes": [ACCESS, auth.ADMIN_SCOPE]}
    )
    jobs.stop_grace = 2.0
    (home / "kim").mkdir(parents=True)
    job = jobs.submit("kim", {"command": "trap '' TERM; sleep 600", "gpus": 1})
    await jobs.tick()
    view = jobs.get(job["id"])
    assert view["state"] == "running"
    jobs.broker.preempt_lease(view["lease_id"], "maintenance")
    tick = asyncio.create_task(jobs.tick())
    for _ in range(200):  # until the tick has begun the stop
        await asyncio.sleep(0.05)
        if jobs.get(job["id"])["stopping"]:
            break
    assert jobs.get(job["id"])["stopping"]
    with FakeHub() as hub:
        served = Panel(jobs.broker, hub, jobs=jobs, server_running=_running)
        try:
            form = {"action": "cancel-job", "job_id": str(job["id"])}
            answer = await served.post("leases", form)
            assert answer.code == 303, text(answer)
        finally:
            served.server.stop()
            await JupyterHubHTTPClient.loop_instance().close()
    await tick
    assert jobs.get(job["id"])["state"] == "cancelled"
