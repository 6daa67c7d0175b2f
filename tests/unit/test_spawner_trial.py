"""The spawner as a new user met it in a trial of the demo: what an empty
spawn body reuses (docs), how the next spawn tells a GPU release the user
made herself from a loss, and which UUID the grant's progress line names."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from gpubroker.client import BrokerClient
from gpubroker_spawner import SimpleLocalGPUSpawner

from .test_sharing_core import sharing_broker
from .test_spawner_hub_review import api_handler
from .test_spawner_hub_review import make_spawner as make_profile_spawner
from .test_spawner_profiles import StubBroker, broker  # noqa: F401
from .test_spawner_review import ACCESS, MODELS, broker_url, hub_api, make_spawner, start  # noqa: F401

DOCS = Path(__file__).parents[2] / "docs"

PROFILES = [
    {"display_name": "MIG", "slug": "mig-small", "request": {"mig_profile": "1g.10gb"}},
    {"display_name": "Share", "slug": "shared-gpu-10-gib", "request": {"memory_gib": 10}},
]


# -- 1: what `{}` reuses -------------------------------------------------------------


def hub_spawn_options(spawner: SimpleLocalGPUSpawner, body: bytes) -> dict[str, Any]:
    """The options JupyterHub's ``User.spawn`` gives the spawner for a
    ``POST /users/ann/server`` with ``body`` (jupyterhub/user.py: options
    ``None`` load the saved ones, any others are saved)."""
    spawner.handler = api_handler(body)
    options = spawner.handler.get_server_json_body()["user_options"]
    if options is None:
        options = spawner.orm_spawner.user_options or {}
    else:
        spawner.orm_spawner.user_options = options
    spawner.user_options = options
    return dict(options)


async def test_an_empty_body_after_user_options_of_nothing_starts_the_default(
    broker: StubBroker,  # noqa: F811
) -> None:
    """The trial's kim/s2: a share, then ``{"user_options": {}}``, then
    ``{}``: the default, as the docs now say (the hub saved ``{}``)."""
    spawner = make_profile_spawner(broker.url, gpu_profiles=PROFILES)
    spawner.orm_spawner = SimpleNamespace(user_options={}, server=None, name="s2")
    requests = []
    for body in (b'{"profile": "shared-gpu-10-gib"}', b'{"user_options": {}}', b"{}"):
        options = hub_spawn_options(spawner, body)
        requests.append(await spawner.check_user_options(options))
    assert requests == [{"memory_gib": 10}, {"mig_profile": "1g.10gb"}, {"mig_profile": "1g.10gb"}]


@pytest.mark.parametrize("page", ["user.md", "profiles.md"])
def test_the_docs_say_an_empty_body_reuses_what_the_hub_saved_even_nothing(page: str) -> None:
    text = (DOCS / page).read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `{}`, no body"))
    assert "named some" not in row  # read as "the last options that named a choice"
    assert "even `{}`" in row
    assert "named some" not in text


# -- 2: a release of the user's own is no loss ----------------------------------------


async def test_the_users_own_release_is_told_as_given_up_and_a_cull_as_lost(
    broker_url: str,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(MODELS, "ann-token", {"kind": "user", "name": "ann", "scopes": [ACCESS]})
    admin = BrokerClient(broker_url, "admin-token")
    spawner = make_spawner(broker_url)
    spawner.user_options = {"gpus": 1}
    await start(spawner)
    lease_id = spawner.gpu_lease_id
    assert lease_id is not None
    # %gpu_submit --release, with the server's (ann's) token
    ann = BrokerClient(broker_url, "ann-token")
    await ann.release_lease(lease_id, "released for job 2 (%gpu_submit)")
    await spawner._release("server stopped")  # what stop() does then
    assert spawner.gpu_last_end == "released for job 2 (%gpu_submit)"
    form = await spawner._gpu_options_form()
    note = "Your previous server gave up its GPUs at your request: released for job 2 (%gpu_submit)"
    assert f'<p class="alert alert-info">{note}</p>' in form
    assert "lost its GPUs" not in form
    # kept across a hub restart, and said once by the next start
    again = make_spawner(broker_url)
    again.load_state(spawner.get_state())
    assert again.gpu_last_end_given
    again.user_options = {"gpus": 1}
    await start(again)
    messages = [e["message"] for e in again._gpu_feed.events]
    assert messages[0] == note
    assert not again.gpu_last_end and not again.gpu_last_end_given
    # an admin's release of the same server is a loss
    await admin.release_lease(again.gpu_lease_id, "culled: idle 71 min")
    await again._release("server stopped")
    assert not again.gpu_last_end_given
    form = await again._gpu_options_form()
    assert (
        '<p class="alert alert-warning">Your previous server lost its GPUs: '
        "culled: idle 71 min</p>" in form
    )


# -- 3: the grant names what the server sees -------------------------------------------


def test_a_mig_grant_names_the_instance_the_server_sees_then_its_gpu(
    db_url: str, tmp_path: Path
) -> None:
    core = sharing_broker(db_url, tmp_path)
    mig = core.request_lease("kim", "s2", mig_profile="1g.10gb", pool="mig")
    whole = core.request_lease("kim", "s3", 1)
    share = core.request_lease("kim", "s4", memory_gib=10, pool="shared")
    spawner = make_spawner("http://127.0.0.1:1/b/")
    shown = []
    for lease in (mig, whole, share):
        assert lease["state"] == "granted"
        spawner._event(json.loads(json.dumps(lease)))  # as the API sends it
        shown.append(spawner._gpu_feed.events[-1]["message"])
    instance = mig["env"]["CUDA_VISIBLE_DEVICES"]
    assert instance.startswith("MIG-") and instance == mig["slots"][0]["uuid"]
    gpu = mig["devices"][0]["uuid"]
    assert shown[0] == (
        f"GPUs granted: 1 x MIG 1g.10gb on NVIDIA H100 80GB HBM3 ({instance}, instance of {gpu})"
    )
    for lease, message in zip((whole, share), shown[1:], strict=True):
        seen = lease["env"]["CUDA_VISIBLE_DEVICES"]
        assert re.fullmatch(rf"GPUs granted: .* on NVIDIA H100 80GB HBM3 \({seen}\)", message)


async def test_a_user_named_like_a_system_actor_gives_up_her_gpus_too(
    broker_url: str,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Her release is recorded as ``user/culler`` (caller_actor), which the
    spawner read as someone else's: she was told her server lost its GPUs."""
    monkeypatch.setitem(
        MODELS, "culler-token", {"kind": "user", "name": "culler", "scopes": [ACCESS]}
    )
    spawner = make_spawner(broker_url)
    spawner.user = SimpleNamespace(name="culler", url="/user/culler/", escaped_name="culler")
    spawner.user_options = {"gpus": 1}
    await start(spawner)
    lease_id = spawner.gpu_lease_id
    assert lease_id is not None
    own = BrokerClient(broker_url, "culler-token")
    await own.release_lease(lease_id, "released for job 2 (%gpu_submit)")
    await spawner._release("server stopped")
    assert spawner.gpu_last_end_given
