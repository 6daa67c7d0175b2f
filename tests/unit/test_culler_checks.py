"""The culler's checks against a broker (fake devices) and a stand-in for
the hub's server list: what is stored between checks and restarts, and
what a cull re-checks."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gpubroker.core import Broker
from gpubroker.culler import Culler

UTC = dt.timezone.utc
MIN = dt.timedelta(minutes=1)


class Hub:
    """The hub as the culler asks it: active servers, groups, tokens."""

    def __init__(self) -> None:
        self.servers: dict[tuple[str, str], dict[str, Any]] = {}

    async def active_server_models(self) -> tuple[dict[tuple[str, str], Any], dict[str, Any]]:
        return self.servers, {}

    @contextlib.asynccontextmanager
    async def server_token(self, *_: Any, **__: Any) -> AsyncIterator[str]:
        yield "server-token"


def idle_server(broker: Broker, user: str = "ann") -> tuple[Hub, dict[str, Any], dt.datetime]:
    """A granted server lease of ``user`` whose hub activity is old and GPU idle."""
    lease = broker.request_lease(user, "", gpus=1)
    assert lease["state"] == "granted"
    start = dt.datetime.now(UTC)
    hub = Hub()
    hub.servers[(user, "")] = {"last_activity": (start - 10 * MIN).isoformat()}
    return hub, lease, start


def fail_notice_once(broker: Broker, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """Make the store refuse, once, the first notice of ``kind`` the broker records."""
    real = broker.add_notice
    failures = [RuntimeError("database is locked")]

    def add_notice(*args: Any, **kwargs: Any) -> None:
        if args[1] == kind and failures:
            raise failures.pop()
        real(*args, **kwargs)

    monkeypatch.setattr(broker, "add_notice", add_notice)


def kinds(broker: Broker, lease_id: int) -> list[str]:
    return [n["kind"] for n in reversed(broker.notices(None)) if n["lease_id"] == lease_id]


async def test_a_dry_run_warning_is_not_a_warning_after_a_restart(broker: Broker) -> None:
    hub, lease, start = idle_server(broker)
    dry = Culler(broker, hub, dry_run=True)  # type: ignore[arg-type]
    await dry.check_once(start)
    assert await dry.check_once(start + 61 * MIN) == []  # warned, in the dry run's memory
    # restarted without the dry run: the user is warned first, then culled
    real = Culler(broker, hub)  # type: ignore[arg-type]
    assert await real.check_once(start + 72 * MIN) == []
    assert kinds(broker, lease["id"]) == ["cull-warning"]
    assert await real.check_once(start + 81 * MIN) == []
    assert await real.check_once(start + 83 * MIN) == [lease["id"]]


async def test_an_exempted_lease_forgets_its_warning(broker: Broker) -> None:
    hub, lease, start = idle_server(broker)
    culler = Culler(broker, hub)  # type: ignore[arg-type]
    await culler.check_once(start)
    await culler.check_once(start + 61 * MIN)
    assert kinds(broker, lease["id"]) == ["cull-warning"]
    culler.exempt_users = ["ann"]
    await culler.check_once(start + 62 * MIN)
    culler.exempt_users = []
    # judged afresh: not culled at the old deadline, nor without a warning
    assert await culler.check_once(start + 75 * MIN) == []
    assert broker.get_lease(lease["id"])["state"] == "granted"


async def test_a_lease_released_while_its_pre_stop_hook_ran_is_not_culled(
    broker: Broker,
) -> None:
    hub, lease, start = idle_server(broker)
    culler = Culler(broker, hub, pre_stop_hook=["/bin/true"])  # type: ignore[arg-type]

    async def user_stops_meanwhile(ref: Any, token: str) -> None:
        broker.release_lease(ref.id, "server stopped by user")

    culler._run_hook = user_stops_meanwhile  # type: ignore[method-assign]
    await culler.check_once(start)
    await culler.check_once(start + 61 * MIN)
    assert await culler.check_once(start + 72 * MIN) == []
    assert kinds(broker, lease["id"]) == ["cull-warning"]
    assert broker.get_lease(lease["id"])["release_reason"] == "server stopped by user"


async def test_the_pre_stop_hooks_of_one_check_run_at_the_same_time(broker: Broker) -> None:
    hub, first, start = idle_server(broker, "ann")
    _, second, _ = idle_server(broker, "bob")
    hub.servers[("bob", "")] = hub.servers[("ann", "")]
    culler = Culler(broker, hub, pre_stop_hook=["/bin/true"])  # type: ignore[arg-type]
    running: set[int] = set()
    seen_together: list[bool] = []
    both = asyncio.Event()

    async def hook(ref: Any, token: str) -> None:
        running.add(ref.id)
        if len(running) == 2:
            both.set()
        try:  # one after the other, the first would wait here in vain
            await asyncio.wait_for(both.wait(), 5)
            seen_together.append(True)
        except asyncio.TimeoutError:
            seen_together.append(False)

    culler._run_hook = hook  # type: ignore[method-assign]
    await culler.check_once(start)
    await culler.check_once(start + 61 * MIN)
    culled = await culler.check_once(start + 72 * MIN)
    assert sorted(culled) == sorted([first["id"], second["id"]])
    assert seen_together == [True, True]
