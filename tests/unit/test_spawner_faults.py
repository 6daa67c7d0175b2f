"""The spawner when things go wrong: a server that dies, a broker that
restarts, saved options that are no longer offered, and the spawn form's
quota room. Against a stand-in broker (a real Tornado server on a free
loopback port) that can answer 503 or be stopped (then: 599)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from jupyterhub.apihandlers.users import UserServerAPIHandler
from jupyterhub.objects import Hub
from jupyterhub.spawner import LocalProcessSpawner, SpawnException
from tornado import web
from tornado.httpserver import HTTPServer
from tornado.testing import bind_unused_port

from gpubroker.client import BrokerClient, BrokerClientError
from gpubroker_spawner import SimpleLocalGPUSpawner, form
from gpubroker_spawner.mixin import BROKER_RETRY_MESSAGE
from gpubroker_spawner.profiles import GUARANTEES

PROFILES = [
    {"display_name": "Full H100", "request": {"gpus": 1}},
    {"display_name": "MIG 1g.10gb", "slug": "mig", "request": {"mig_profile": "1g.10gb"}},
    {"display_name": "No GPU", "slug": "none", "request": {}, "default": True},
]


class Broker:
    """Answers GET /devices, GET /pools, POST /leases, GET and DELETE
    /leases/ID like the broker's API. ``unavailable`` makes the next that
    many calls answer 503; ``stop()`` makes it unreachable (client: 599)."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.unavailable = 0
        self.quota: dict[str, Any] = {"user": "ann", "limit": None, "remaining": None}
        self.released: dict[int, str] = {}
        stub = self

        class Handler(web.RequestHandler):
            def prepare(self) -> None:
                body = json.loads(self.request.body) if self.request.body else None
                ok = stub.unavailable <= 0
                stub.calls.append(
                    {
                        "method": self.request.method,
                        "path": self.request.path.split("/api/v1", 1)[1],
                        "args": {k: self.get_argument(k) for k in self.request.arguments},
                        "body": body,
                        "answered": ok,
                    }
                )
                if not ok:
                    stub.unavailable -= 1
                    self.answer({"status": 503, "message": "restarting"}, 503)

            def answer(self, data: Any, status: int = 200) -> None:
                self.set_status(status)
                self.set_header("Content-Type", "application/json")
                self.finish(json.dumps(data))

        class Devices(Handler):
            def get(self) -> None:
                self.answer({"summary": {"request_limit": 8, "free": 8, "total": 8}})

        class Pools(Handler):
            def get(self) -> None:
                self.answer({"pools": [], "quota": stub.quota})

        class Leases(Handler):
            def post(self) -> None:
                body = json.loads(self.request.body)
                lease = {
                    "id": 12,
                    "state": "granted",
                    "version": 1,
                    "restarts": 1 if "restart_of" in body else 0,
                    "devices": [{"name": "H100", "uuid": "GPU-a"}],
                    "env": {"CUDA_VISIBLE_DEVICES": "GPU-a"},
                }
                self.answer(lease, 200 if self.get_argument("dry_run", "") else 201)

        class Lease(Handler):
            def get(self, lease_id: str) -> None:
                self.answer({"id": int(lease_id), "state": "granted", "version": 2, "env": {}})

            def delete(self, lease_id: str) -> None:
                reason = json.loads(self.request.body or b"{}").get("reason", "")
                stub.released.setdefault(int(lease_id), reason)
                self.answer({"id": int(lease_id), "release_reason": reason})

        app = web.Application(
            [
                (r"/b/api/v1/devices", Devices),
                (r"/b/api/v1/pools", Pools),
                (r"/b/api/v1/leases", Leases),
                (r"/b/api/v1/leases/(\d+)", Lease),
            ]
        )
        sock, port = bind_unused_port()
        self.server = HTTPServer(app)
        self.server.add_sockets([sock])
        self.url = f"http://127.0.0.1:{port}/b/"

    def answered(self, method: str, path: str = "") -> list[dict[str, Any]]:
        return [
            c
            for c in self.calls
            if c["answered"] and c["method"] == method and c["path"].startswith(path)
        ]

    async def stop(self) -> None:
        self.server.stop()
        await self.server.close_all_connections()


@pytest.fixture
async def broker() -> AsyncIterator[Broker]:
    stub = Broker()
    yield stub
    await stub.stop()


def make_spawner(broker: Broker | str, **kwargs: Any) -> SimpleLocalGPUSpawner:
    user = SimpleNamespace(name="ann", url="/user/ann/", escaped_name="ann")
    hub = Hub(ip="127.0.0.1", port=8081, base_url="/hub/")
    url = broker if isinstance(broker, str) else broker.url
    kwargs.setdefault("broker_retry_interval", 0.1)
    return SimpleLocalGPUSpawner(user=user, hub=hub, broker_url=url, **kwargs)


async def unreachable_url() -> str:
    """The URL of a broker that is not there (the client answers 599)."""
    stub = Broker()
    await stub.stop()
    return stub.url


async def wait_for(predicate: Any, timeout: float = 10) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise TimeoutError(f"condition not met in {timeout} s")


def messages(spawner: SimpleLocalGPUSpawner) -> list[str]:
    return [e["message"] for e in spawner._gpu_feed.events]


# -- 3: a server that dies -----------------------------------------------------------------


async def test_a_dead_server_releases_its_lease_at_once_and_the_next_start_restarts_it(
    broker: Broker,
) -> None:
    spawner = make_spawner(broker)
    spawner.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    spawner.pid = spawner.proc.pid
    spawner.gpu_lease_id = 7
    spawner.proc.kill()
    spawner.proc.wait()

    status = await spawner.poll()  # the parent's poll() clears the state first

    assert status == -9
    assert broker.released == {7: "server exited (status -9)"}
    assert spawner.gpu_lease_id is None
    # the hub then clears and saves the state; a restart of the hub reloads it
    spawner.clear_state()
    state = spawner.get_state()
    assert state["gpu_restart_of"] == 7
    restarted = make_spawner(broker)
    restarted.load_state(state)
    assert restarted.gpu_restart_of == 7

    request = await restarted.check_user_options({"gpus": 1})
    lease = await restarted._acquire(request)
    dry_run, real = (c["body"] for c in broker.answered("POST", "/leases"))
    assert dry_run["restart_of"] == real["restart_of"] == 7
    assert lease["restarts"] == 1
    assert restarted.gpu_restart_of is None and "gpu_restart_of" not in restarted.get_state()


async def test_a_stop_is_not_a_restart(broker: Broker) -> None:
    spawner = make_spawner(broker)
    spawner.gpu_restart_of = 7
    spawner.gpu_lease_id = 8
    await spawner.stop()
    assert spawner.gpu_restart_of is None
    assert broker.released == {8: "server stopped"}
    assert "restart_of" not in spawner._lease_fields()


async def test_a_stop_that_fails_keeps_the_lease_for_the_reconciliation(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    spawner = make_spawner(broker)
    spawner.gpu_lease_id = 9

    async def refuse(self: Any, now: bool = False) -> None:
        raise RuntimeError("the engine does not answer")

    monkeypatch.setattr(LocalProcessSpawner, "stop", refuse)
    with pytest.raises(RuntimeError, match="does not answer"):
        await spawner.stop()
    assert broker.released == {}
    assert spawner.gpu_lease_id is None and not spawner._gpu_stopping


# -- 4: the broker restarts --------------------------------------------------------------------


async def test_options_are_checked_locally_while_the_broker_is_unreachable() -> None:
    spawner = make_spawner(await unreachable_url())
    assert await spawner.check_user_options({"gpus": 2}) == {"gpus": 2}
    assert spawner._gpu_checks_deferred
    assert await spawner.check_user_options({"gpus": 0}) == {}
    assert not spawner._gpu_checks_deferred
    for options, message in [
        ({"gpus": "two"}, 'gpus: must be an integer 0 or more, got "two"'),
        ({"gpus": -1}, "gpus: must be 0 or more, got -1"),
        ({"colour": "red"}, "colour: unknown option"),
    ]:
        with pytest.raises(web.HTTPError) as info:
            await spawner.check_user_options(options)
        assert info.value.status_code == 400
        assert message in info.value.log_message


async def test_options_are_checked_locally_while_the_broker_answers_503(broker: Broker) -> None:
    spawner = make_spawner(broker)
    broker.unavailable = 1  # GET /devices
    assert await spawner.check_user_options({"gpus": 2}) == {"gpus": 2}
    assert spawner._gpu_checks_deferred
    assert broker.answered("POST") == []  # no dry run while the broker is down
    profiled = make_spawner(broker, gpu_profiles=PROFILES)
    broker.unavailable = 1  # the dry run
    assert await profiled.check_user_options({"profile": "mig"}) == {"mig_profile": "1g.10gb"}
    assert profiled._gpu_checks_deferred


async def test_the_deferred_checks_wait_for_the_broker_and_say_so(broker: Broker) -> None:
    spawner = make_spawner(broker)
    broker.unavailable = 4
    await spawner._broker_checks({"gpus": 2})
    assert messages(spawner).count(BROKER_RETRY_MESSAGE) == 1
    assert broker.answered("GET", "/devices") and broker.answered("POST", "/leases")
    broker.unavailable = 2
    with pytest.raises(SpawnException, match=r"GPU request refused: gpus: must be between 0 and 8"):
        await spawner._broker_checks({"gpus": 9})


async def test_a_request_waits_for_the_broker_for_broker_wait_timeout_then_fails() -> None:
    spawner = make_spawner(await unreachable_url(), broker_wait_timeout=0.5)
    began = time.monotonic()
    with pytest.raises(SpawnException) as info:
        await spawner._acquire({"gpus": 1})
    assert time.monotonic() - began >= 0.5
    assert "The GPU broker is unavailable (503 Service Unavailable)" in str(info.value)
    assert "while requesting GPUs" in str(info.value)
    assert messages(spawner) == [BROKER_RETRY_MESSAGE]


async def test_a_request_rides_out_a_broker_restart(broker: Broker) -> None:
    spawner = make_spawner(broker)
    broker.unavailable = 3
    lease = await spawner._acquire({"gpus": 1})
    assert lease["id"] == spawner.gpu_lease_id == 12
    assert messages(spawner)[0] == BROKER_RETRY_MESSAGE
    assert messages(spawner)[-1].startswith("GPUs granted")


async def test_a_release_while_the_broker_is_down_is_retried_in_the_background(
    broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    spawner = make_spawner(broker)
    broker.unavailable = 3
    with caplog.at_level(logging.INFO):
        await spawner._release("server stopped", 5)  # returns at once
        assert broker.released == {}
        await wait_for(lambda: broker.released)
        # the broker records the release before the spawner has its answer:
        # the background task logs, then forgets the release
        await wait_for(lambda: not spawner._pending_releases)
    assert broker.released == {5: "server stopped"}
    assert "lease 5 released after 4 tries" in caplog.text


async def test_a_background_release_gives_up_after_release_retry_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    spawner = make_spawner(await unreachable_url(), release_retry_timeout=0.3)
    await spawner._release("server stopped", 5)
    task, _ = spawner._pending_releases[5]
    with caplog.at_level(logging.ERROR):
        await asyncio.wait_for(task, 5)
    assert re.search(r"gave up releasing lease 5 after \d+ tries", caplog.text)


async def test_a_start_makes_this_servers_pending_releases_first(broker: Broker) -> None:
    spawner = make_spawner(broker)
    broker.unavailable = 1
    await spawner._release("server stopped", 5)
    await spawner._flush_pending_releases()
    assert broker.released == {5: "server stopped"}
    assert spawner._pending_releases == {}


# -- 8: a new user's trial ------------------------------------------------------------------------


async def test_default_gpus_apply_to_empty_and_null_options(broker: Broker) -> None:
    spawner = make_spawner(broker, default_gpus=1)
    assert await spawner.check_user_options({}) == {"gpus": 1}
    assert await spawner.check_user_options(None) == {"gpus": 1}
    assert await spawner.check_user_options({"gpus": None}) == {"gpus": 1}
    assert await spawner.check_user_options({"gpus": 0}) == {}
    assert form.check_gpu_options({"gpus": None}, limit=8, default=2) == 2


def api_handler(body: bytes) -> UserServerAPIHandler:
    """JupyterHub's own handler of POST /hub/api/users/NAME/server, holding
    ``body`` as its request (only its body parsing is used)."""
    handler = UserServerAPIHandler.__new__(UserServerAPIHandler)
    handler.request = SimpleNamespace(body=body, method="POST", query_arguments={})
    return handler


@pytest.mark.parametrize(
    ("body", "saved"),
    [
        (b"", True),
        (b"{}", True),
        (b'{"user_options": null}', True),
        (b'{"display_name": "x"}', True),
        (b'{"profile": "gpu-legacy"}', False),
        (b'{"user_options": {}}', False),
        (b'{"user_options": {"profile": "gpu-legacy"}}', False),
    ],
)
def test_options_the_hub_reused_are_told_from_posted_ones(body: bytes, saved: bool) -> None:
    spawner = make_spawner("http://127.0.0.1:1/")
    spawner.handler = api_handler(body)
    assert spawner._options_are_saved() is saved


def test_spawn_pages_post_their_options() -> None:
    spawner = make_spawner("http://127.0.0.1:1/")
    spawner.handler = SimpleNamespace(request=SimpleNamespace(method="POST", query_arguments={}))
    assert not spawner._options_are_saved()
    spawner.handler = SimpleNamespace(
        request=SimpleNamespace(method="GET", query_arguments={"gpus": [b"1"]})
    )
    assert not spawner._options_are_saved()
    spawner.handler = SimpleNamespace(
        request=SimpleNamespace(method="GET", query_arguments={"next": [b"/x"]})
    )
    assert spawner._options_are_saved()
    spawner.handler = None
    assert not spawner._options_are_saved()


async def test_a_stale_saved_profile_falls_back_to_the_default_with_a_notice(
    broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    spawner = make_spawner(broker, gpu_profiles=PROFILES)
    spawner.orm_spawner = SimpleNamespace(
        user_options={"profile": "gpu-legacy"}, server=None, name=""
    )
    spawner.user_options = {"profile": "gpu-legacy"}
    spawner.handler = api_handler(b"{}")
    with caplog.at_level(logging.WARNING):
        assert await spawner.check_user_options(spawner.user_options) == {}
    assert spawner.gpu_profile == "none"
    (notice,) = messages(spawner)
    assert notice == (
        'Your saved spawn options {"profile": "gpu-legacy"} are not accepted now '
        "(profile: unknown profile 'gpu-legacy' (choices: full-h100, mig, none)); "
        "starting with the default profile 'none' instead."
    )
    assert "saved user_options" in caplog.text and "gpu-legacy" in caplog.text
    assert spawner.user_options == spawner.orm_spawner.user_options == {}

    posted = make_spawner(broker, gpu_profiles=PROFILES)
    posted.handler = api_handler(b'{"profile": "gpu-legacy"}')
    with pytest.raises(web.HTTPError) as info:
        await posted.check_user_options({"profile": "gpu-legacy"})
    assert info.value.status_code == 400
    assert "unknown profile 'gpu-legacy'" in info.value.log_message


async def test_saved_gpu_counts_out_of_range_fall_back_to_default_gpus(broker: Broker) -> None:
    spawner = make_spawner(broker, default_gpus=1)
    spawner.handler = api_handler(b"")
    assert await spawner.check_user_options({"gpus": 99}) == {"gpus": 1}
    assert "starting with the default (1 GPUs) instead" in messages(spawner)[0]


def test_count_form_shows_the_quota_room_and_greys_out_counts_over_it() -> None:
    devices = {"summary": {"free": 8, "total": 8}, "devices": []}
    quota = {"limit": 2, "held": 0.5, "pending": 0, "remaining": 1.5}
    page = form.render_form(4, devices, 0, quota)
    options = re.findall(r"<option[^>]*>[^<]*</option>", page)
    assert options == [
        '<option value="0" selected>No GPU</option>',
        '<option value="1">1 x GPU</option>',
        '<option value="2" disabled>2 x GPU (over your quota)</option>',
        '<option value="3" disabled>3 x GPU (over your quota)</option>',
        '<option value="4" disabled>4 x GPU (over your quota)</option>',
    ]
    assert "You may hold 1.5 more GPU-equivalents (you hold 0.5 of your limit of 2)." in page
    unlimited = form.render_form(2, devices, 0, {"limit": None, "held": 0, "remaining": None})
    assert "disabled" not in unlimited and "No GPU quota limit applies to you" in unlimited


def test_the_last_choice_stays_preselected() -> None:
    assert form.count_choices(4, 0, None, 3) == ([], 3)
    assert form.count_choices(4, 0, {"remaining": 1}, 3) == ([2, 3, 4], 1)  # nearest allowed
    assert form.count_choices(4, 2, {"remaining": 1}, None) == ([2, 3, 4], 0)
    assert form.count_choices(4, 2, None, "two") == ([], 2)
    profiles = make_spawner("http://127.0.0.1:1/", gpu_profiles=PROFILES).gpu_profiles
    pools = {"pools": [], "quota": {"remaining": None}}
    page = form.render_profiles(profiles, pools, None, selected="mig")
    assert re.search(r'value="mig" checked', page) and not re.search(r'value="none" checked', page)
    page = form.render_profiles(profiles, pools, None, selected="gpu-legacy")
    assert re.search(r'value="none" checked', page)


async def test_spawner_count_form_asks_for_the_quota_and_keeps_the_last_choice(
    broker: Broker,
) -> None:
    broker.quota = {"user": "ann", "limit": 3, "held": 0, "pending": 0, "remaining": 3}
    spawner = make_spawner(broker)
    spawner.user_options = {"gpus": 2}  # e.g. refused with 403, the hub renders the form again
    page = await spawner._gpu_options_form()
    assert broker.answered("GET", "/pools")[0]["args"] == {"user": "ann"}
    assert '<option value="2" selected>' in page
    assert '<option value="4" disabled>4 x GPU (over your quota)</option>' in page


async def test_count_form_without_the_quota_still_offers_counts(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def no_pools(self: BrokerClient, user: str | None = None) -> Any:
        raise BrokerClientError(404, "no such endpoint")  # e.g. an older broker

    monkeypatch.setattr(BrokerClient, "pools", no_pools)
    page = await make_spawner(broker)._gpu_options_form()
    assert page.count("<option") == 9 and "disabled" not in page and "quota" not in page


def test_the_share_guarantee_says_the_mps_cap_is_per_process() -> None:
    text = GUARANTEES["share"]
    assert "applies per CUDA process" in text
    assert "two processes of one server can each use the cap" in text
    assert "watchdog enforces the total per server" in text
