"""Spawn-form profiles (``GPUSpawnerMixin.gpu_profiles``): config checks,
``user_options`` from the form and the API, overrides, the form's HTML, and
the client calls against a stand-in broker (a real Tornado server on a free
loopback port)."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from jupyterhub.objects import Hub
from tornado import web
from tornado.httpserver import HTTPServer
from tornado.testing import bind_unused_port
from traitlets import TraitError
from traitlets.config import Config

from gpubroker.client import BrokerClient
from gpubroker_spawner import SimpleLocalGPUSpawner, form
from gpubroker_spawner.mixin import NO_GPU_ENV
from gpubroker_spawner.profiles import GUARANTEES

PROFILES = [
    {
        "display_name": "Full H100",
        "description": "One whole H100 80GB",
        "request": {"gpus": 1},
        "spawner_override": {"mem_limit": "32G", "environment": {"TIER": "full"}},
    },
    {"display_name": "Two H100", "slug": "two", "request": {"gpus": 2}},
    {
        "display_name": "MIG 1g.10gb",
        "slug": "mig",
        "request": {"mig_profile": "1g.10gb"},
        "default": True,
        "spawner_override": {"cmd": ["jupyterhub-singleuser", "--debug"]},
    },
    {"display_name": "Shared GPU 10 GiB", "slug": "shared", "request": {"memory_gib": 10}},
    {"display_name": "Big share", "slug": "big-share", "request": {"memory_gib": 40}},
    {"display_name": "No GPU", "slug": "none", "request": {}},
]

SLUGS = "full-h100, two, mig, shared, big-share, none"

POOLS: dict[str, Any] = {
    "pools": [
        {
            "name": "h100",
            "mode": "exclusive",
            "purpose": "interactive",
            "devices": 4,
            "models": ["NVIDIA H100 80GB HBM3"],
            "free": {"gpus": 3, "mig": {}, "share_gib": 0, "shares_total_gib": 0},
        },
        {
            "name": "h100-mig",
            "mode": "mig",
            "purpose": "interactive",
            "devices": 1,
            "models": ["NVIDIA H100 80GB HBM3"],
            "free": {"gpus": 0, "mig": {"1g.10gb": 5, "3g.40gb": 0}, "share_gib": 0},
        },
        {
            "name": "l40s",
            "mode": "timeslice",
            "purpose": "interactive",
            "devices": 2,
            "models": ["NVIDIA L40S"],
            "free": {"gpus": 0, "mig": {}, "share_gib": 24.5, "shares_total_gib": 40},
        },
    ],
    "quota": {
        "user": "ann",
        "limit": 2,
        "guaranteed": 1,
        "held": 0.5,
        "pending": 0,
        "remaining": 1.5,
    },
}

DEVICES: dict[str, Any] = {
    "backend": {"kind": "fake", "simulated": True},
    "summary": {"request_limit": 8, "free": 3, "total": 7},
    "devices": [
        {"name": "NVIDIA H100 80GB HBM3", "memory_total_mib": 81559, "present": True},
        {"name": "NVIDIA L40S", "memory_total_mib": 46068, "present": True},
    ],
}


def make_spawner(**kwargs: Any) -> SimpleLocalGPUSpawner:
    user = SimpleNamespace(name="ann", url="/user/ann/", escaped_name="ann")
    hub = Hub(ip="127.0.0.1", port=8081, base_url="/hub/")
    kwargs.setdefault("broker_url", "http://127.0.0.1:10101/services/gpubroker/")
    return SimpleLocalGPUSpawner(user=user, hub=hub, **kwargs)


# -- a stand-in broker ---------------------------------------------------------------


class StubBroker:
    """Answers GET /pools, GET /devices and POST /leases like the broker's API;
    records what it was asked."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.refuse: tuple[int, str] | None = None
        stub = self

        class Handler(web.RequestHandler):
            def record(self, body: Any = None) -> None:
                args = {k: self.get_argument(k) for k in self.request.arguments}
                stub.calls.append(
                    {
                        "method": self.request.method,
                        "path": self.request.path,
                        "args": args,
                        "body": body,
                        "auth": self.request.headers.get("Authorization"),
                    }
                )

            def answer(self, data: Any, status: int = 200) -> None:
                self.set_status(status)
                self.set_header("Content-Type", "application/json")
                self.finish(json.dumps(data))

        class Pools(Handler):
            def get(self) -> None:
                self.record()
                self.answer(POOLS)

        class Devices(Handler):
            def get(self) -> None:
                self.record()
                self.answer(DEVICES)

        class Leases(Handler):
            def post(self) -> None:
                body = json.loads(self.request.body)
                self.record(body)
                if stub.refuse:
                    status, message = stub.refuse
                    self.answer({"status": status, "message": message}, status)
                    return
                lease = {
                    "id": 7,
                    "state": "granted",
                    "version": 1,
                    "summary": "1 x MIG 1g.10gb",
                    "kind": "mig",
                    "devices": [{"name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-abc"}],
                    "env": {"CUDA_VISIBLE_DEVICES": "MIG-123", "GPUBROKER_LEASE_ID": "7"},
                    "queue": None,
                }
                self.answer(lease, 200 if self.get_argument("dry_run", "") else 201)

        app = web.Application(
            [
                (r"/services/gpubroker/api/v1/pools", Pools),
                (r"/services/gpubroker/api/v1/devices", Devices),
                (r"/services/gpubroker/api/v1/leases", Leases),
            ]
        )
        sock, self.port = bind_unused_port()
        self.server = HTTPServer(app)
        self.server.add_sockets([sock])
        self.url = f"http://127.0.0.1:{self.port}/services/gpubroker/"

    def posted(self) -> list[dict[str, Any]]:
        return [c for c in self.calls if c["method"] == "POST"]

    async def stop(self) -> None:
        self.server.stop()
        await self.server.close_all_connections()


@pytest.fixture
async def broker() -> AsyncIterator[StubBroker]:
    stub = StubBroker()
    yield stub
    await stub.stop()


# -- the configured list ---------------------------------------------------------------


def test_profiles_get_their_defaults() -> None:
    spawner = make_spawner(gpu_profiles=PROFILES)
    full, two, mig, shared, _, none = spawner.gpu_profiles
    assert full["slug"] == "full-h100" and full["default"] is False
    assert full["guarantee"] == GUARANTEES["gpus"] == "dedicated device: all memory and compute"
    assert mig["guarantee"] == "memory and compute isolated in hardware (MIG)"
    assert shared["guarantee"].startswith("memory cap enforced by the broker")
    assert none["request"] == {} and none["spawner_override"] == {}
    assert two["description"] == ""


@pytest.mark.parametrize(
    ("profiles", "message"),
    [
        (
            [{"display_name": "A", "colour": "red"}],
            "gpu_profiles[0] ('A'): colour: unknown key",
        ),
        ([{"slug": "x"}], "gpu_profiles[0]: display_name: must be a non-empty string"),
        (
            [{"display_name": "One"}, {"display_name": "one!"}],
            "gpu_profiles[1] ('one!'): slug: 'one' is already the slug of gpu_profiles[0]",
        ),
        (
            [{"display_name": "A", "slug": "a b"}],
            "gpu_profiles[0] ('A'): slug: must be letters, digits",
        ),
        (
            [{"display_name": "A", "request": {"gpus": 0}}],
            "gpu_profiles[0] ('A'): request.gpus: must be an integer >= 1, got 0",
        ),
        (
            [{"display_name": "A", "request": {"gpus": True}}],
            "request.gpus: must be an integer >= 1, got True",
        ),
        (
            [{"display_name": "A", "request": {"mig_profile": "big"}}],
            "request.mig_profile: must be a MIG profile name such as '1g.10gb', got 'big'",
        ),
        (
            [{"display_name": "A", "request": {"memory_gib": -1}}],
            "request.memory_gib: must be a number >= 0.25 (GiB), got -1",
        ),
        (
            [{"display_name": "A", "request": {"gpus": 1, "memory_gib": 10}}],
            "request: give one of gpus, mig_profile, memory_gib, not gpus and memory_gib",
        ),
        (
            [{"display_name": "A", "request": {"gpus": 1, "count": 2}}],
            "request.count: only goes with memory_gib",
        ),
        (
            [{"display_name": "A", "request": {"memory_gib": 10, "count": 0}}],
            "request.count: must be an integer >= 1, got 0",
        ),
        ([{"display_name": "A", "request": {"pool": "x"}}], "request.pool: needs gpus"),
        (
            [{"display_name": "A", "request": {"gpu": 1}}],
            "request.gpu: unknown field (allowed: count, gpus, memory_gib, mig_profile, pool)",
        ),
        ([{"display_name": "A", "request": 1}], "request: must be a dict"),
        (
            [{"display_name": "A", "default": True}, {"display_name": "B", "default": True}],
            "gpu_profiles[1] ('B'): default: only one profile may be the default "
            "(gpu_profiles[0] is)",
        ),
        (
            [{"display_name": "A", "spawner_override": {"mem_limt": "1G"}}],
            "gpu_profiles[0] ('A'): spawner_override.mem_limt: not a setting",
        ),
        (
            [{"display_name": "A", "spawner_override": {"user": None}}],
            "spawner_override.user: not a setting",
        ),
        (
            [{"display_name": "A", "spawner_override": {"gpu_profiles": []}}],
            "spawner_override.gpu_profiles: not a setting",
        ),
        ([{"display_name": "A", "guarantee": 3}], "guarantee: must be a string"),
    ],
)
def test_bad_profiles_are_refused_naming_item_and_field(profiles: list, message: str) -> None:
    with pytest.raises(TraitError, match=re.escape(message)):
        make_spawner(gpu_profiles=profiles)


def test_bad_profiles_in_config_files_are_refused_too() -> None:
    config = Config()
    config.Spawner.gpu_profiles = [{"display_name": "A", "request": {"gpus": "1"}}]
    with pytest.raises(TraitError, match=re.escape("gpu_profiles[0] ('A'): request.gpus")):
        make_spawner(config=config)


# -- user_options ------------------------------------------------------------------------


def test_form_data_becomes_a_profile_option() -> None:
    spawner = make_spawner(gpu_profiles=PROFILES)
    assert spawner.options_from_form({"profile": ["mig"]}) == {"profile": "mig"}
    assert spawner.options_from_form({}) == {}
    plain = make_spawner()
    assert plain.options_from_form({"gpus": ["2"]}) == {"gpus": 2}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"profile": "huge"}, f"profile: unknown profile 'huge' (choices: {SLUGS})"),
        ({"profile": 3}, "profile: must be the slug of a profile"),
        ({"gpus": 1}, f"gpus: choose a profile (profile: {SLUGS})"),
        ({"profile": "mig", "gpus": 8}, "gpus: choose a profile"),
        ({"mig_profile": "7g.80gb"}, "mig_profile: choose a profile"),
        ({"memory_gib": 80}, "memory_gib: choose a profile"),
        ({"pool": "h100"}, "pool: choose a profile"),
        ({"profile": "mig", "colour": "red"}, "colour: unknown option (allowed: profile)"),
    ],
)
async def test_bad_options_are_refused_with_400(
    broker: StubBroker, options: dict, message: str
) -> None:
    spawner = make_spawner(gpu_profiles=PROFILES, broker_url=broker.url)
    with pytest.raises(web.HTTPError) as info:
        await spawner.check_user_options(options)
    assert info.value.status_code == 400
    assert message in str(info.value.log_message)
    assert broker.posted() == []


async def test_chosen_profile_is_the_lease_request_and_admitted_by_dry_run(
    broker: StubBroker,
) -> None:
    spawner = make_spawner(gpu_profiles=PROFILES, broker_url=broker.url, priority_class="batch")
    request = await spawner.check_user_options({"profile": "shared"})
    assert request == {"memory_gib": 10}
    (call,) = broker.posted()
    assert call["args"] == {"dry_run": "true"}
    assert call["body"] == {
        "user": "ann",
        "server_name": "",
        "memory_gib": 10,
        "priority_class": "batch",
    }
    assert spawner.gpu_profile == "shared"


async def test_no_profile_given_means_the_default_one(broker: StubBroker) -> None:
    spawner = make_spawner(gpu_profiles=PROFILES, broker_url=broker.url)
    assert await spawner.check_user_options({}) == {"mig_profile": "1g.10gb"}
    assert await spawner.check_user_options(None) == {"mig_profile": "1g.10gb"}
    first_is_default = make_spawner(gpu_profiles=PROFILES[:2], broker_url=broker.url)
    assert await first_is_default.check_user_options({}) == {"gpus": 1}


async def test_no_gpu_profile_asks_the_broker_nothing(broker: StubBroker) -> None:
    spawner = make_spawner(gpu_profiles=PROFILES, broker_url=broker.url)
    assert await spawner.check_user_options({"profile": "none"}) == {}
    assert broker.posted() == []
    assert {k: spawner.get_env()[k] for k in NO_GPU_ENV} == NO_GPU_ENV


async def test_broker_refusal_passes_through_and_undoes_the_override(broker: StubBroker) -> None:
    broker.refuse = (403, "quota: ann may hold 1.5 more GPUs, asked for 2")
    spawner = make_spawner(gpu_profiles=PROFILES, broker_url=broker.url)
    with pytest.raises(web.HTTPError) as info:
        await spawner.check_user_options({"profile": "full-h100"})
    assert info.value.status_code == 403
    assert info.value.log_message == "quota: ann may hold 1.5 more GPUs, asked for 2"
    assert spawner.mem_limit is None
    assert spawner.gpu_profile is None


async def test_without_profiles_options_stay_a_gpu_count(broker: StubBroker) -> None:
    spawner = make_spawner(broker_url=broker.url)
    assert await spawner.check_user_options({"gpus": 2}) == {"gpus": 2}
    assert broker.posted()[0]["body"] == {"user": "ann", "server_name": "", "gpus": 2}
    assert await spawner.check_user_options({"gpus": 0}) == {}
    with pytest.raises(web.HTTPError, match="profile: unknown option"):
        await spawner.check_user_options({"profile": "mig"})


# -- spawner_override ------------------------------------------------------------------------


async def test_override_is_applied_and_undone_by_the_next_choice(broker: StubBroker) -> None:
    spawner = make_spawner(
        gpu_profiles=PROFILES, broker_url=broker.url, environment={"KEEP": "1", "TIER": "none"}
    )
    await spawner.check_user_options({"profile": "full-h100"})
    assert spawner.mem_limit == 32 * 1024**3
    assert spawner.environment == {"KEEP": "1", "TIER": "full"}
    env = spawner.get_env()
    assert env["TIER"] == "full" and env["KEEP"] == "1"

    await spawner.check_user_options({"profile": "mig"})
    assert spawner.mem_limit is None
    assert spawner.environment == {"KEEP": "1", "TIER": "none"}
    assert spawner.cmd == ["jupyterhub-singleuser", "--debug"]

    await spawner.check_user_options({"profile": "none"})
    assert spawner.cmd == ["jupyterhub-singleuser"]


async def test_override_callables_and_key_removal(broker: StubBroker) -> None:
    profiles = [
        {
            "display_name": "A",
            "spawner_override": {
                "default_url": lambda spawner: f"/lab/tree/{spawner.user.name}",
                "environment": {"DROP": None, "ADD": "yes"},
            },
        }
    ]
    spawner = make_spawner(
        gpu_profiles=profiles, broker_url=broker.url, environment={"DROP": "x", "KEEP": "1"}
    )
    await spawner.check_user_options({"profile": "a"})
    assert spawner.default_url == "/lab/tree/ann"
    assert spawner.environment == {"KEEP": "1", "ADD": "yes"}


async def test_refused_override_is_a_400_naming_the_setting(broker: StubBroker) -> None:
    spawner = make_spawner(
        gpu_profiles=[{"display_name": "A", "spawner_override": {"mem_limit": "lots"}}],
        broker_url=broker.url,
    )
    with pytest.raises(web.HTTPError) as info:
        await spawner.check_user_options({})
    assert info.value.status_code == 400
    assert "profile 'a': spawner_override.mem_limit:" in str(info.value.log_message)
    assert spawner.mem_limit is None
    # a profile list changed behind the check (e.g. by a subclass) is checked again
    spawner.gpu_profiles[0]["spawner_override"] = {"not_a_trait": 1}
    with pytest.raises(
        web.HTTPError, match=re.escape("spawner_override.not_a_trait: not a setting")
    ):
        await spawner.check_user_options({})


# -- the lease and progress --------------------------------------------------------------


async def test_acquire_requests_the_profile_and_reports_the_summary(broker: StubBroker) -> None:
    spawner = make_spawner(gpu_profiles=PROFILES, broker_url=broker.url, time_limit=3600)
    request = await spawner.check_user_options({"profile": "mig"})
    lease = await spawner._acquire(request)
    assert lease["env"]["CUDA_VISIBLE_DEVICES"] == "MIG-123"
    dry_run, real = broker.posted()
    assert dry_run["args"] == {"dry_run": "true"} and real["args"] == {}
    assert real["body"] == {
        "user": "ann",
        "server_name": "",
        "mig_profile": "1g.10gb",
        "time_limit": 3600,
    }
    assert spawner._gpu_feed.events[-1]["message"] == (
        "GPUs granted: 1 x MIG 1g.10gb on NVIDIA H100 80GB HBM3 (GPU-abc)"
    )


def test_queued_message_uses_the_summary_or_the_count() -> None:
    spawner = make_spawner()
    queue = {"position": 2, "reason": "Resources", "message": "waiting"}
    spawner._event({"state": "pending", "summary": "2 x shared GPU (10 GiB each)", "queue": queue})
    spawner._event({"state": "pending", "gpus": 4, "queue": queue})
    assert [e["message"] for e in spawner._gpu_feed.events] == [
        "Queued for 2 x shared GPU (10 GiB each): position 2 (Resources) - waiting",
        "Queued for 4 GPU(s): position 2 (Resources) - waiting",
    ]


# -- the form ----------------------------------------------------------------------------------


def choice_html(page: str, slug: str) -> str:
    match = re.search(
        rf'<div class="form-check[^"]*">\s*<input[^>]*value="{re.escape(slug)}".*?</div>',
        page,
        re.S,
    )
    assert match, f"no choice {slug} in {page}"
    return match.group(0)


def test_form_shows_availability_quota_and_greys_out_what_the_quota_forbids() -> None:
    profiles = make_spawner(gpu_profiles=PROFILES).gpu_profiles
    page = form.render_profiles(profiles, POOLS, DEVICES)
    assert "You may hold 1.5 more GPU-equivalents" in page
    assert page.count('type="radio" name="profile"') == len(PROFILES)

    full = choice_html(page, "full-h100")
    assert "(3 free now)" in full and "disabled" not in full
    assert "1 x GPU; counts as 1 GPU-equivalent against your quota" in full
    assert "One whole H100 80GB" in full
    assert "Guarantee: dedicated device: all memory and compute" in full

    two = choice_html(page, "two")
    assert re.search(r"<input[^>]*\bdisabled\b", two)
    assert "Not available: needs 2 GPU-equivalents; you may hold 1.5 more" in two

    mig = choice_html(page, "mig")
    assert "(5 free now)" in mig and "checked" in mig
    assert "counts as 0.14 GPU-equivalents" in mig  # 1 of 7 compute slices

    shared = choice_html(page, "shared")
    assert "(free now: up to 24.5 GiB on one GPU)" in shared
    assert (
        "counts as 0.22 GPU-equivalents against your quota" in shared
    )  # 10 GiB of an L40S's 45 GiB
    assert "(will queue)" in choice_html(page, "big-share")
    assert "Simulated GPUs" in page


def test_gpus_free_on_different_nodes_do_not_make_a_request_free_now() -> None:
    """Three free H100s, but no two on one node: a 2-GPU profile said
    "3 free now" and then queued (a request's GPUs are all on one node)."""
    profiles = make_spawner(
        gpu_profiles=[
            {"display_name": "Two", "request": {"gpus": 2}},
            {"display_name": "One", "request": {"gpus": 1}},
        ]
    ).gpu_profiles
    quota = {**POOLS["quota"], "limit": None, "remaining": None}
    spread = {**POOLS["pools"][0], "free": {"gpus": 3, "gpus_one_node": 1}}
    page = form.render_profiles(profiles, {"pools": [spread], "quota": quota}, DEVICES)
    assert "(will queue)" in choice_html(page, "two")
    assert "(3 free now)" in choice_html(page, "one")
    together = {**POOLS["pools"][0], "free": {"gpus": 3, "gpus_one_node": 2}}
    page = form.render_profiles(profiles, {"pools": [together], "quota": quota}, DEVICES)
    assert "(3 free now)" in choice_html(page, "two")


def test_the_gpu_count_menu_counts_free_gpus_on_one_node() -> None:
    def device(node: str, state: str, mode: str = "exclusive") -> dict[str, Any]:
        return {"name": "H100", "node": node, "state": state, "pool_mode": mode, "present": True}

    devices = {
        "summary": {"free": 4, "total": 6},
        "backend": {"simulated": False},
        "devices": [
            device("a", "free"),
            device("a", "leased"),
            device("b", "free"),
            device("b", "free"),
            device("c", "free", "timeslice"),  # not a whole GPU to lease
            device("c", "free"),
        ],
    }
    html = form.render_form(3, devices)
    options = re.findall(r"<option[^>]*>([^<]*)</option>", html)
    assert options == ["No GPU", "1 x GPU", "2 x GPU", "3 x GPU (will queue)"]


def test_a_disabled_default_is_not_preselected() -> None:
    profiles = make_spawner(
        gpu_profiles=[
            {"display_name": "Two", "request": {"gpus": 2}, "default": True},
            {"display_name": "One", "request": {"gpus": 1}},
        ]
    ).gpu_profiles
    page = form.render_profiles(profiles, POOLS, DEVICES)
    assert "checked" not in choice_html(page, "two")
    assert "checked" in choice_html(page, "one")


def test_form_without_quota_limit_and_unknown_pool() -> None:
    profiles = make_spawner(
        gpu_profiles=[{"display_name": "Pooled", "request": {"gpus": 1, "pool": "nowhere"}}]
    ).gpu_profiles
    pools = {**POOLS, "quota": {**POOLS["quota"], "limit": None, "remaining": None}}
    page = form.render_profiles(profiles, pools, {})
    assert "No GPU quota limit applies to you" in page
    assert "Not available: the broker has no pool &#x27;nowhere&#x27;" in page
    assert "Simulated GPUs" not in page


def test_form_escapes_every_text() -> None:
    profiles = make_spawner(
        gpu_profiles=[
            {
                "display_name": "<script>alert(1)</script>",
                "slug": "x",
                "description": 'a "quoted" <b>bold</b> & more',
                "guarantee": "<i>none</i>",
            }
        ]
    ).gpu_profiles
    page = form.render_profiles(profiles, POOLS, DEVICES)
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "a &quot;quoted&quot; &lt;b&gt;bold&lt;/b&gt; &amp; more" in page
    assert "&lt;i&gt;none&lt;/i&gt;" in page


async def test_spawner_form_asks_the_broker_for_the_users_pools(broker: StubBroker) -> None:
    spawner = make_spawner(gpu_profiles=PROFILES, broker_url=broker.url)
    page = await spawner._gpu_options_form()
    pools_call = next(c for c in broker.calls if c["path"].endswith("/pools"))
    assert pools_call["args"] == {"user": "ann"}
    assert "You may hold 1.5 more GPU-equivalents" in page
    assert "(5 free now)" in page


async def test_spawner_form_when_the_broker_is_unreachable(broker: StubBroker) -> None:
    url = broker.url
    await broker.stop()
    spawner = make_spawner(gpu_profiles=PROFILES, broker_url=url)
    page = await spawner._gpu_options_form()
    assert "The GPU broker is unavailable" in page


# -- the client ----------------------------------------------------------------------------------


async def test_client_request_lease_bodies(broker: StubBroker) -> None:
    client = BrokerClient(broker.url, "secret")
    await client.request_lease("ann", "nb", 2)  # the old positional call
    await client.request_lease("ann", "", mig_profile="3g.40gb", pool="h100-mig")
    await client.request_lease("ann", "", memory_gib=10, count=2, dry_run=True)
    bodies = [c["body"] for c in broker.posted()]
    assert bodies == [
        {"user": "ann", "server_name": "nb", "gpus": 2},
        {"user": "ann", "server_name": "", "mig_profile": "3g.40gb", "pool": "h100-mig"},
        {"user": "ann", "server_name": "", "memory_gib": 10, "count": 2},
    ]
    assert [c["args"] for c in broker.posted()] == [{}, {}, {"dry_run": "true"}]
    assert broker.calls[0]["auth"] == "token secret"


async def test_client_pools(broker: StubBroker) -> None:
    client = BrokerClient(broker.url, "secret")
    assert await client.pools("ann") == POOLS
    assert await client.pools() == POOLS
    assert [c["args"] for c in broker.calls] == [{"user": "ann"}, {}]


def test_form_uses_the_brokers_mig_weight_where_it_gives_one() -> None:
    profiles = make_spawner(
        gpu_profiles=[{"display_name": "A30 slice", "request": {"mig_profile": "1g.6gb"}}]
    ).gpu_profiles
    a30 = {
        "name": "a30",
        "mode": "mig",
        "purpose": "interactive",
        "devices": 1,
        "models": ["NVIDIA A30"],
        "mig_weights": {"1g.6gb": 0.25},
        "free": {"gpus": 0, "mig": {"1g.6gb": 4}, "share_gib": 0},
    }
    quota = {**POOLS["quota"], "limit": 1.0, "remaining": 0.2}
    page = form.render_profiles(profiles, {"pools": [a30], "quota": quota}, {})
    assert "counts as 0.25 GPU-equivalents" in page  # 1 of the A30's 4 slices, not 1/7
    assert "Not available: needs 0.25 GPU-equivalents" in page


def test_form_greys_out_profiles_the_pools_cannot_serve() -> None:
    profiles = make_spawner(
        gpu_profiles=[
            {"display_name": "Wrong mode", "request": {"gpus": 1, "pool": "h100-mig"}},
            {"display_name": "Not offered", "request": {"mig_profile": "1g.6gb"}},
        ]
    ).gpu_profiles
    page = form.render_profiles(profiles, POOLS, DEVICES)
    wrong = choice_html(page, "wrong-mode")
    assert "pool &#x27;h100-mig&#x27; is a mig pool, not an exclusive one" in wrong
    assert "no GPU here offers MIG 1g.6gb" in choice_html(page, "not-offered")
