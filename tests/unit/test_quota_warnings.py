"""Quotas that cannot do what they say are told to the admin who sets them
(the admin trial: a quota for a user the hub does not have, or above every
GPU there is, was taken without a word). Nothing is refused for them."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator

import pytest
from jupyterhub.httpclient import JupyterHubHTTPClient

from gpubroker.api import auth
from gpubroker.core import Broker
from gpubroker.scheduler import Policy, Quota
from gpubroker.scheduler.quota_check import quota_warnings

from .test_api_scopes import ACCESS, MODELS, FakeHub, ServedAPI
from .test_panel_review import Panel, outcome, text


def test_each_kind_of_finding_in_a_stable_order() -> None:
    policy = Policy(
        user_quotas={"bob": Quota(1, 20), "ann": Quota(9), "cat": Quota(4, 8)},
        group_quotas={"vision": Quota(5), "nlp": Quota(4)},
        default_user_quota=Quota(0, 16),
    )
    assert quota_warnings(policy, 8.0) == [
        "user ann: its guarantee of 9 GPUs is above the 8 GPUs in service: it cannot be met",
        "user bob: its limit of 20 GPUs is above the 8 GPUs in service: it never holds anyone back",
        "the default user quota: its limit of 16 GPUs is above the 8 GPUs in service: "
        "it never holds anyone back",
        "the users' guarantees add up to 14 GPUs, above the 8 GPUs in service: "
        "they cannot all be met at once",
        "the groups' guarantees add up to 9 GPUs, above the 8 GPUs in service: "
        "they cannot all be met at once",
    ]


def test_quotas_that_fit_say_nothing() -> None:
    policy = Policy(user_quotas={"ann": Quota(4, 8), "bob": Quota(4)}, group_quotas={})
    assert quota_warnings(policy, 8.0) == []
    assert quota_warnings(Policy(), 0.0) == []  # no quotas, no devices


def test_drained_devices_are_not_capacity(broker: Broker) -> None:
    broker.set_quota("user", "ann", 8.0, None)
    assert broker.quotas()["warnings"] == []  # 8 H100s in service
    broker.set_drained(broker.device_rows()[0][0].uuid, True)
    assert broker.quotas()["warnings"] == [
        "user ann: its guarantee of 8 GPUs is above the 7 GPUs in service: it cannot be met",
        "the users' guarantees add up to 8 GPUs, above the 7 GPUs in service: "
        "they cannot all be met at once",
    ]


async def _no_such_user(user: str) -> bool | None:
    return user != "ghost"


@pytest.fixture
async def served(broker: Broker) -> AsyncIterator[ServedAPI]:
    with FakeHub() as hub:
        api = ServedAPI(broker, hub, has_user=_no_such_user)
        try:
            yield api
        finally:
            api.server.stop()
            await JupyterHubHTTPClient.loop_instance().close()


async def test_a_quota_for_a_user_the_hub_lacks_is_kept_with_a_warning(
    served: ServedAPI, broker: Broker
) -> None:
    answer = await served.call("PUT", "/quotas/user/ghost", "admin-token", {"limit": 100})
    assert answer.code == 200
    body = json.loads(answer.body)
    assert body["users"]["ghost"] == {"guaranteed": 0.0, "limit": 100.0}
    assert body["warnings"] == [
        "user ghost: the hub has no such user (yet); the quota applies once it has",
        "user ghost: its limit of 100 GPUs is above the 8 GPUs in service: "
        "it never holds anyone back",
    ]
    # a user the hub has: only the capacity finding, which GET shows too
    answer = await served.call("PUT", "/quotas/user/ann", "admin-token", {"guaranteed": 2})
    assert json.loads(answer.body)["warnings"] == body["warnings"][1:]
    got = json.loads((await served.call("GET", "/quotas", "admin-token")).body)
    assert got["warnings"] == body["warnings"][1:]


@pytest.fixture
async def panel(broker: Broker, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Panel]:
    monkeypatch.setitem(
        MODELS, "root-token", {"kind": "user", "name": "root", "scopes": [ACCESS, auth.ADMIN_SCOPE]}
    )
    with FakeHub() as hub:
        served = Panel(broker, hub, has_user=_no_such_user)
        try:
            yield served
        finally:
            served.server.stop()
            await JupyterHubHTTPClient.loop_instance().close()


async def test_the_panel_shows_the_warnings_and_an_unknown_user(panel: Panel) -> None:
    form = {"action": "set", "kind": "user", "name": "ghost", "guaranteed": "9"}
    posted = await panel.post("quotas", form)
    assert posted.code == 303
    assert await outcome(panel, posted) == (
        "Quota of user ghost set; it applies from the next pass. "
        "The hub has no such user (yet): it applies once it has."
    )
    page = text(await panel.get("quotas"))
    found = re.search(r'<ul class="warnings" id="quota-warnings" role="status">(.*?)</ul>', page)
    assert found is not None
    assert "user ghost: its guarantee of 9 GPUs is above the 8 GPUs in service" in found.group(1)
