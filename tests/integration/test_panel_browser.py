"""The web panel in a real headless Chromium against the shared hub: login
through the hub, the admin pages and their forms, and the researcher's page.
Screenshots go to ``$GPUBROKER_SCREENSHOT_DIR`` (the docs' images) or a
temporary folder."""

from __future__ import annotations

import datetime as dt
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from .. import browserutil
from ..hubutil import RunningHub
from ..nbutil import write_notebook
from .test_spawn import wait_until

pytestmark = pytest.mark.hub

PANEL = "/services/gpubroker/"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with browserutil.chromium() as running:
        yield running


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return browserutil.screenshot_dir(tmp_path_factory.mktemp("screenshots"))


def login(browser: Any, hub: RunningHub, name: str) -> Any:
    """A new browser context logged in to the hub as ``name`` (with the
    demo's password, ``admin`` with the admin password); fails on any
    ``alert()``."""
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    alerts: list[str] = []
    context.alerts = alerts

    def on_dialog(dialog: Any) -> None:
        if dialog.type == "alert":
            alerts.append(dialog.message)
        dialog.accept()  # confirm() of the panel's forms: yes

    context.on("dialog", on_dialog)
    page.goto(f"{hub.url}/hub/login")
    page.fill("#username_input", name)
    page.fill("#password_input", hub.admin_password if name == "admin" else hub.password)
    page.click("#login_submit")
    page.wait_for_url(lambda url: "/hub/login" not in url)
    page.close()
    return context


def lease(hub: RunningHub, user: str, gpus: int | None = 1, **extra: Any) -> dict[str, Any]:
    """An external lease (held by no server) for ``user``, made by the admin
    (``gpus`` None: a MIG instance or a share, named in ``extra``)."""
    body = {"user": user, "holder_kind": "external", **extra}
    if gpus is not None:
        body["gpus"] = gpus
    r = hub.broker_api("POST", "/leases", json=body)
    assert r.status_code == 201, r.text
    return dict(r.json())


def wait_state(hub: RunningHub, lease_id: int, state: str) -> dict[str, Any]:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        view = hub.broker_api("GET", f"/leases/{lease_id}").json()
        if view["state"] == state:
            return dict(view)
        time.sleep(0.2)
    raise AssertionError(f"lease {lease_id} is {view['state']}, not {state}")


def test_admin_reaches_the_overview_from_the_services_menu(
    clean_hub: RunningHub, browser: Any, shots: Path
) -> None:
    hub = clean_hub
    held = [lease(hub, "alice", 2), lease(hub, "bob", 1)]
    context = login(browser, hub, "admin")
    page = context.new_page()
    page.goto(f"{hub.url}/hub/home")
    page.get_by_role("button", name="Services").click()
    page.get_by_role("link", name="gpubroker").click()
    page.wait_for_url(f"{hub.url}{PANEL}overview")  # no second login on the way
    assert "/hub/login" not in page.url
    tiles = page.locator("article.tile")
    assert tiles.count() == 8  # every fake device of the demo
    assert page.locator(".banner").inner_text().startswith("SIMULATED GPUs")
    assert page.locator(".flag.fake").count() == 8
    for x in held:
        for slot in x["slots"]:
            tile = page.locator(f"article.tile[data-uuid='{slot['uuid']}']")
            assert x["user"] in tile.locator(".slot.held .holder").inner_text()
    assert page.locator(".slot.free").count() == 5
    page.screenshot(path=str(shots / "overview.png"), full_page=True)
    # live: a new lease shows up without a reload
    extra = lease(hub, "carol", 1)
    uuid = extra["slots"][0]["uuid"]
    page.locator(f"article.tile[data-uuid='{uuid}'] .slot.held").wait_for(timeout=15000)
    assert "carol" in page.locator(f"article.tile[data-uuid='{uuid}']").inner_text()
    assert context.alerts == []
    context.close()


def test_an_open_overview_keeps_updating_across_a_broker_restart(
    clean_hub: RunningHub, browser: Any
) -> None:
    """The login cookie's key is new at each broker start: the page's refresh
    is sent through the hub's login again (no prompt) and goes on."""
    hub = clean_hub
    context = login(browser, hub, "admin")
    page = context.new_page()
    page.goto(f"{hub.url}{PANEL}overview")
    old_pid = hub.broker_pid()
    assert old_pid
    os.kill(old_pid, signal.SIGKILL)
    wait_until(lambda: (pid := hub.broker_pid()) and pid != old_pid and pid, timeout=60)
    wait_until(lambda: hub.broker_api("GET", "/health").status_code == 200, timeout=30)
    uuid = lease(hub, "after-restart", 1)["slots"][0]["uuid"]
    page.locator(f"article.tile[data-uuid='{uuid}'] .slot.held").wait_for(timeout=30000)
    assert "after-restart" in page.locator(f"article.tile[data-uuid='{uuid}']").inner_text()
    assert page.url == f"{hub.url}{PANEL}overview"
    context.close()


def test_drain_changes_the_waiting_reason_and_is_audited(
    clean_hub: RunningHub, browser: Any, shots: Path
) -> None:
    hub = clean_hub
    lease(hub, "alice", 1)
    waiting = lease(hub, "bob", 8)  # 7 free devices: bob waits for alice's
    waiting = wait_state(hub, waiting["id"], "pending")
    before = (waiting["queue"]["reason"], waiting["queue"]["message"])
    free = [d for d in hub.broker_api("GET", "/devices").json()["devices"] if d["state"] == "free"]
    target = free[0]
    context = login(browser, hub, "admin")
    try:
        _drain(hub, context, target, waiting, before, shots)
    finally:
        hub.broker_api("PATCH", f"/devices/{target['uuid']}", json={"drained": False})
        context.close()


def _drain(
    hub: RunningHub,
    context: Any,
    target: dict[str, Any],
    waiting: dict[str, Any],
    before: tuple[str, str],
    shots: Path,
) -> None:
    page = context.new_page()
    page.goto(f"{hub.url}{PANEL}devices")
    row = page.locator(f"tr[data-uuid='{target['uuid']}']")
    row.get_by_role("button", name="Drain").click()
    page.wait_for_url(re.compile(r".*/devices\?done=.*"))
    assert "drained" in page.locator(".done").inner_text()
    assert page.locator(f"tr[data-uuid='{target['uuid']}'] td.state").inner_text() == "drained"
    page.screenshot(path=str(shots / "devices.png"), full_page=True)
    after = hub.broker_api("GET", f"/leases/{waiting['id']}").json()["queue"]
    assert before[0] == "Resources"
    assert after["reason"] == "PoolDrained"  # 7 GPUs in service now: 8 never fit
    page.goto(f"{hub.url}{PANEL}queue")
    row = page.locator(f"tr[data-lease='{waiting['id']}']")
    assert row.locator("td.message").inner_text() == after["message"]
    page.screenshot(path=str(shots / "queue.png"), full_page=True)
    page.goto(f"{hub.url}{PANEL}audit?kind=device-drained")
    first = page.locator("#audit tbody tr").first
    assert first.locator("td.actor").inner_text() == "admin"
    assert target["uuid"] in first.inner_text()
    page.screenshot(path=str(shots / "audit.png"), full_page=True)


def test_quota_editor_refuses_a_limit_below_the_guarantee(
    clean_hub: RunningHub, browser: Any, shots: Path
) -> None:
    hub = clean_hub
    context = login(browser, hub, "admin")
    page = context.new_page()
    page.goto(f"{hub.url}{PANEL}quotas")
    form = page.locator("#quota-form")
    form.locator("select[name=kind]").select_option("group")
    form.locator("input[name=name]").fill("physics")
    form.locator("input[name=guaranteed]").fill("4")
    form.locator("input[name=limit]").fill("2")
    form.get_by_role("button", name="Set").click()
    error = page.locator("#quota-form .error")
    assert "limit: must be at least guaranteed" in error.inner_text()
    assert form.locator("input[name=limit]").input_value() == "2"  # what was typed stays
    page.screenshot(path=str(shots / "quota-error.png"), full_page=True)
    assert "physics" not in hub.broker_api("GET", "/quotas").json()["groups"]
    form = page.locator("#quota-form")
    form.locator("input[name=limit]").fill("6")
    form.get_by_role("button", name="Set").click()
    page.wait_for_url(re.compile(r".*/quotas\?done=.*"))
    assert hub.broker_api("GET", "/quotas").json()["groups"]["physics"] == {
        "guaranteed": 4.0,
        "limit": 6.0,
    }
    assert page.locator("tr[data-quota='group:physics']").count() == 1
    # a quota for someone who has not logged in yet, above every GPU there
    # is: kept, and the admin is told both
    form = page.locator("#quota-form")
    form.locator("select[name=kind]").select_option("user")
    form.locator("input[name=name]").fill("newcomer")
    form.locator("input[name=guaranteed]").fill("0")
    form.locator("input[name=limit]").fill("100")
    form.get_by_role("button", name="Set").click()
    page.wait_for_url(re.compile(r".*/quotas\?done=.*"))
    assert "The hub has no such user (yet)" in page.locator(".done").inner_text()
    warnings = page.locator("#quota-warnings").inner_text()
    assert "user newcomer: its limit of 100 GPUs is above the" in warnings
    page.screenshot(path=str(shots / "quotas.png"), full_page=True)
    audit = hub.broker_api("GET", "/audit", params={"kind": "quota-set"}).json()["entries"]
    assert [(e["actor"], e["target"]) for e in audit[:2]] == [
        ("admin", "user:newcomer"),
        ("admin", "group:physics"),
    ]
    context.close()


def test_usage_csv_matches_the_report_command(
    clean_hub: RunningHub, browser: Any, shots: Path
) -> None:
    hub = clean_hub
    held = lease(hub, "alice", 2)
    time.sleep(1.5)  # the ledger (0.5 s here) records some GPU-time
    hub.broker_api("DELETE", f"/leases/{held['id']}", json={"reason": "done"})
    time.sleep(1.0)
    today = dt.datetime.now(dt.timezone.utc).date()
    start, end = today.isoformat(), (today + dt.timedelta(days=1)).isoformat()
    context = login(browser, hub, "admin")
    page = context.new_page()
    page.goto(f"{hub.url}{PANEL}usage?from={start}&to={end}&by=user")
    assert page.locator("table.report tbody tr").count() >= 1
    assert page.locator("figure svg").count() == 3
    page.screenshot(path=str(shots / "usage.png"), full_page=True)
    with page.expect_download() as info:
        page.locator("#csv").click()
    download = info.value
    from_panel = Path(download.path()).read_text("utf-8")
    report = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpubroker",
            "report",
            f"--db-url={hub.db_url}",
            f"--from={start}",
            f"--to={end}",
            "--by=user",
            "--format=csv",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert from_panel == report
    assert "alice" in from_panel
    context.close()


def test_non_admins_xsrf_and_names_that_are_markup(
    clean_hub: RunningHub, browser: Any, shots: Path
) -> None:
    hub = clean_hub
    hub.create_user("mallory")
    context = login(browser, hub, "mallory")
    page = context.new_page()
    for path in ("overview", "queue", "leases", "devices", "quotas", "usage", "audit"):
        response = page.goto(f"{hub.url}{PANEL}{path}")
        assert response.status == 403, path
        assert "custom:gpubroker:admin" in page.inner_text("body")
    response = page.goto(f"{hub.url}{PANEL}usage.csv")
    assert response.status == 403
    context.close()
    # a form post without the XSRF token, from a logged-in admin's browser
    marked = "<img src=x onerror=alert(1)>"
    lease(hub, "filler", 1)
    waiting = lease(hub, marked, 8)  # one device is held: it waits, with a reason
    admin = login(browser, hub, "admin")
    page = admin.new_page()
    page.goto(f"{hub.url}{PANEL}queue")
    refused = page.request.post(
        f"{hub.url}{PANEL}queue", form={"lease_id": str(waiting["id"]), "action": "cancel"}
    )
    assert refused.status == 403
    assert "_xsrf" in refused.text()
    assert hub.broker_api("GET", f"/leases/{waiting['id']}").json()["state"] == "pending"
    # names from users are text: in the queue, the leases page and an error
    row = page.locator(f"tr[data-lease='{waiting['id']}']")
    assert marked in row.inner_text()
    assert page.locator("tr[data-lease] img").count() == 0
    script = "<script>alert(1)</script>"
    response = page.goto(f"{hub.url}{PANEL}leases?user={requests.utils.quote(script)}")
    assert response.status == 400
    assert script in page.inner_text("body")
    page.goto(f"{hub.url}{PANEL}leases?user={requests.utils.quote(marked)}")
    assert marked in page.locator("table.list").first.inner_text()
    # a bad filter is an error naming it, never a silently empty or unfiltered page
    response = page.goto(f"{hub.url}{PANEL}leases?kind=bogus")
    assert response.status == 400
    assert "kind: must be one of server, job, external" in page.inner_text("body")
    response = page.goto(f"{hub.url}{PANEL}audit?since=garbage")
    assert response.status == 400
    assert "since: not a date" in page.inner_text("body")
    assert page.locator("#audit td.actor").count() == 0
    page.screenshot(path=str(shots / "leases.png"), full_page=True)
    assert admin.alerts == []
    admin.close()


def _job(hub: RunningHub, user: str, token: str) -> dict[str, Any]:
    """A notebook job of ``user`` run to its end (a notebook in her home)."""
    home = hub.workdir / "home" / user
    home.mkdir(parents=True, exist_ok=True)
    write_notebook(home / "train.ipynb", ["print('trained')"])
    body = {"notebook": "train.ipynb", "gpus": 1, "time": "10m"}
    r = hub.broker_api("POST", "/jobs", json=body, token=token)
    assert r.status_code == 201, r.text
    return hub.wait_for_job(r.json()["id"], token=token)


def test_researcher_sees_only_their_own(clean_hub: RunningHub, browser: Any, shots: Path) -> None:
    hub = clean_hub
    alice, bob = hub.create_user("alice"), hub.create_user("bob")
    r = hub.api("POST", "/users/alice/server", json={"gpus": 1})
    assert r.status_code in (201, 202), r.text
    hub.wait_for_server("alice")
    (server,) = [x for x in hub.leases(user="alice") if x["holder_kind"] == "server"]
    mine, theirs = _job(hub, "alice", alice), _job(hub, "bob", bob)
    assert mine["state"] == theirs["state"] == "succeeded"
    timed = lease(hub, "alice", 1, time_limit=3600)
    held = lease(hub, "bob", 1)
    waiting = lease(hub, "alice", 8)
    wait_state(hub, waiting["id"], "pending")
    context = login(browser, hub, "alice")
    page = context.new_page()
    page.goto(f"{hub.url}{PANEL}")
    page.wait_for_url(f"{hub.url}{PANEL}me")
    text = page.inner_text("main")
    for x in (server, timed, waiting):
        assert page.locator(f"tr[data-lease='{x['id']}']").count() == 1
    assert page.locator(f"tr[data-lease='{held['id']}']").count() == 0
    assert "bob" not in text
    assert (
        server["slots"][0]["uuid"] in page.locator(f"tr[data-lease='{server['id']}']").inner_text()
    )
    assert "59 min" in page.locator(f"tr[data-lease='{timed['id']}']").inner_text()
    row = page.locator(f"tr[data-lease='{waiting['id']}']").inner_text()
    view = hub.broker_api("GET", f"/leases/{waiting['id']}").json()
    assert view["queue"]["message"] in row and view["queue"]["reason"] in row
    job_row = page.locator(f"#my-jobs tr[data-job='{mine['id']}']")
    assert "succeeded" in job_row.inner_text()
    link = job_row.get_by_role("link")
    assert link.get_attribute("href") == f"/hub/user-redirect/lab/tree/train.{mine['id']}.ipynb"
    assert page.locator(f"#my-jobs tr[data-job='{theirs['id']}']").count() == 0
    assert "This month" in text and "GPU-hours allocated" in text and "Quota" in text
    assert page.locator("#my-notices li").count() >= 1  # the finished job
    page.screenshot(path=str(shots / "me.png"), full_page=True)
    # and no admin page
    assert page.goto(f"{hub.url}{PANEL}overview").status == 403
    context.close()


def test_preempt_and_release_reach_the_holder_and_the_audit_log(
    clean_hub: RunningHub, browser: Any
) -> None:
    hub = clean_hub
    hub.create_user("dana")
    first, second = lease(hub, "dana", 1), lease(hub, "dana", 1)
    admin = login(browser, hub, "admin")
    page = admin.new_page()
    page.goto(f"{hub.url}{PANEL}leases?user=dana")
    row = page.locator(f"tr[data-lease='{first['id']}']")
    row.locator("input[name=reason]").fill("node reboot at noon")
    row.get_by_role("button", name="Preempt").click()
    page.wait_for_url(re.compile(r".*/leases\?done=.*"))
    assert "preempted" in page.locator(".done").inner_text()
    row = page.locator(f"tr[data-lease='{second['id']}']")
    row.locator("input[name=reason]").fill("tidying up")
    row.get_by_role("button", name="Release").click()
    page.wait_for_url(re.compile(r".*/leases\?done=.*"))
    admin.close()
    for x in (first, second):
        assert hub.broker_api("GET", f"/leases/{x['id']}").json()["state"] == "released"
    audit = hub.broker_api("GET", "/audit", params={"user": "dana"}).json()["entries"]
    ended = {e["lease_id"]: e for e in audit if e["action"] == "released"}
    assert ended[first["id"]]["actor"] == "admin" and ended[first["id"]]["cause"] == "preemption"
    assert ended[second["id"]]["actor"] == "admin"
    assert ended[second["id"]]["reason"] == "tidying up"
    (preempted,) = [e for e in audit if e["action"] == "lease-preempted"]
    assert preempted["actor"] == "admin"
    assert preempted["detail"] == {"lease_id": first["id"], "reason": "node reboot at noon"}
    dana = login(browser, hub, "dana")
    page = dana.new_page()
    page.goto(f"{hub.url}{PANEL}me")
    notices = page.locator("#my-notices").inner_text()
    assert "preempted by admin: node reboot at noon" in notices
    assert "tidying up" in notices
    dana.close()


@pytest.fixture(scope="module")
def sharing_hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningHub]:
    """A hub of the demo's sharing layout: GPUs 0-3 whole, 4-5 MIG, 6-7 shares."""
    running = RunningHub(tmp_path_factory.mktemp("sharing-hub"), GPUBROKER_DEMO_SHARING="1").start()
    yield running
    running.stop()


def test_the_overview_splits_mig_devices_and_shared_devices(
    sharing_hub: RunningHub, browser: Any, shots: Path
) -> None:
    hub = sharing_hub
    lease(hub, "alice", 1)
    migs = [
        lease(hub, "bob", None, mig_profile="3g.40gb", pool="mig"),
        lease(hub, "carol", None, mig_profile="1g.10gb", pool="mig"),
    ]
    shares = [lease(hub, name, None, memory_gib=20, pool="shared") for name in ("dave", "erin")]
    for x in migs + shares:
        wait_state(hub, x["id"], "granted")
    context = login(browser, hub, "admin")
    page = context.new_page()
    page.goto(f"{hub.url}{PANEL}overview")
    for x, label in ((migs[0], "MIG 3g.40gb"), (migs[1], "MIG 1g.10gb")):
        slot = x["slots"][0]
        tile = page.locator(f"article.tile[data-uuid='{slot['device']}']")
        held = tile.locator(".slot.held", has_text=x["user"])
        assert label in held.inner_text()
        assert "MIG" in tile.locator("header").inner_text()
    devices = {x["slots"][0]["device"] for x in shares}
    for uuid in devices:
        tile = page.locator(f"article.tile[data-uuid='{uuid}']")
        assert tile.locator(".slot.free").count() == 1  # room left beside the share(s)
        assert "share 20 GiB" in tile.locator(".slot.held").first.inner_text()
    page.screenshot(path=str(shots / "overview-sharing.png"), full_page=True)
    context.close()
