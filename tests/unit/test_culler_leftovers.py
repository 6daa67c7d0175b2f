"""Culler leftovers of earlier reviews: a cull whose notice failed keeps its
reason and is carried out at a later check; an unreadable check withdraws no
warning given on the kernels' word; NVML is read off the event loop (the
culler and the share guard)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from gpubroker.core import Broker
from gpubroker.culler import Culler

from .test_culler_checks import MIN, fail_notice_once, idle_server, kinds


async def test_a_cull_whose_notice_failed_is_done_again_with_its_reason(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub, lease, start = idle_server(broker)
    culler = Culler(broker, hub)  # type: ignore[arg-type]
    fail_notice_once(broker, monkeypatch, "culled")  # when the cull is recorded
    await culler.check_once(start)
    await culler.check_once(start + 61 * MIN)  # warned
    assert await culler.check_once(start + 72 * MIN) == []  # the cull's notice fails
    assert broker.get_lease(lease["id"])["state"] == "granted"
    assert kinds(broker, lease["id"]) == ["cull-warning"]
    # the next check culls it, and the user is told why (not a bare "culled")
    assert await culler.check_once(start + 73 * MIN) == [lease["id"]]
    assert kinds(broker, lease["id"]) == ["cull-warning", "culled"]
    (culled,) = [n for n in broker.notices(None) if n["kind"] == "culled"]
    assert culled["message"].startswith("culled: idle ")
    stop = [e for e in broker.lease_events(lease["id"]) if e["to"] in ("stopping", "released")]
    assert stop and all(e["reason"].startswith("culled: idle ") for e in stop)


def _kernels(culler: Culler, answers: list[Any]) -> None:
    """The server's kernels as ``culler`` reads them: the next of
    ``answers`` at each check (``None``: the server could not be read)."""

    async def read(lease: Any, until: Any = None) -> tuple[Any, None]:
        return answers.pop(0), None

    culler._kernels = read  # type: ignore[method-assign]


async def test_an_unreadable_check_does_not_withdraw_a_warning_given_on_the_kernels_word(
    broker: Broker,
) -> None:
    hub, lease, start = idle_server(broker)
    culler = Culler(broker, hub)  # type: ignore[arg-type]
    idle = [{"execution_state": "idle", "last_activity": (start - 10 * MIN).isoformat()}]
    _kernels(culler, [idle, idle, None, idle])
    await culler.check_once(start)
    await culler.check_once(start + 61 * MIN)
    assert kinds(broker, lease["id"]) == ["cull-warning"]
    # the server cannot be read once; an open idle tab keeps the hub's activity fresh
    hub.servers[("ann", "")] = {"last_activity": (start + 65 * MIN).isoformat()}
    assert await culler.check_once(start + 66 * MIN) == []
    assert kinds(broker, lease["id"]) == ["cull-warning"]  # not withdrawn
    # read again and still idle: culled at the warning's own deadline
    assert await culler.check_once(start + 71 * MIN + 1 * MIN // 60) == [lease["id"]]


async def test_a_restarted_broker_remembers_that_the_kernels_were_read(broker: Broker) -> None:
    """Whether the kernels were read is stored with the track: a restarted
    broker whose first check cannot read them keeps the warning given on
    their word, and culls at its deadline (before: it withdrew the warning
    on an open tab's activity and gave a new grace)."""
    hub, lease, start = idle_server(broker)
    culler = Culler(broker, hub)  # type: ignore[arg-type]
    idle = [{"execution_state": "idle", "last_activity": (start - 10 * MIN).isoformat()}]
    _kernels(culler, [idle, idle])
    await culler.check_once(start)
    await culler.check_once(start + 61 * MIN)
    assert kinds(broker, lease["id"]) == ["cull-warning"]
    restarted = Culler(broker, hub)  # type: ignore[arg-type]
    _kernels(restarted, [None, idle])
    hub.servers[("ann", "")] = {"last_activity": (start + 62 * MIN).isoformat()}
    assert await restarted.check_once(start + 63 * MIN) == []
    assert kinds(broker, lease["id"]) == ["cull-warning"]  # not withdrawn
    assert await restarted.check_once(start + 71 * MIN + 1 * MIN // 60) == [lease["id"]]


async def test_hub_activity_withdraws_a_warning_where_kernels_were_never_read(
    broker: Broker,
) -> None:
    # a server whose kernels the culler cannot read at all (no Jupyter
    # server API): the hub's activity is its only evidence, both ways
    hub, lease, start = idle_server(broker)
    culler = Culler(broker, hub)  # type: ignore[arg-type]
    _kernels(culler, [None, None, None])
    await culler.check_once(start)
    await culler.check_once(start + 61 * MIN)
    hub.servers[("ann", "")] = {"last_activity": (start + 65 * MIN).isoformat()}
    assert await culler.check_once(start + 66 * MIN) == []
    assert kinds(broker, lease["id"]) == ["cull-warning", "cull-withdrawn"]


def _blocking_usage(broker: Broker, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Make the backend's ``usage`` block until the returned event is set."""
    release = threading.Event()
    real = broker.backend.usage

    def blocking(uuid: str) -> Any:
        assert release.wait(10), "the read blocked the event loop"
        return real(uuid)

    monkeypatch.setattr(broker.backend, "usage", blocking)
    return release


async def _loop_runs_while(call: Any, release: Any) -> int:
    """Await ``call`` while a ticker runs; ``release`` the blocked read once
    the ticker has ticked a few times (it can only if the read is off the
    loop). Returns the ticks."""
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            if ticks == 5:
                release.set()
            await asyncio.sleep(0.01)

    task = asyncio.create_task(ticker())
    try:
        await asyncio.wait_for(call, 20)
    finally:
        task.cancel()
        release.set()
    return ticks


async def test_the_culler_reads_nvml_off_the_event_loop(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    # an NVML call can block for seconds (persistence mode off) or longer (a
    # GPU fallen off the bus): on the loop it would stop the whole broker
    lease = broker.request_lease("ann", "", gpus=1)
    (ref,) = [x for x in broker.server_leases() if x.id == lease["id"]]
    release = _blocking_usage(broker, monkeypatch)
    culler = Culler(broker, None)  # type: ignore[arg-type]
    assert await _loop_runs_while(culler._signals(ref, {}), release) >= 5


async def test_the_share_guard_reads_nvml_off_the_event_loop(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpubroker.share_guard import ShareGuard

    from .test_sharing_core import sharing_broker

    broker = sharing_broker(db_url, tmp_path)
    broker.request_lease("ann", "", memory_gib=10, pool="shared")
    release = _blocking_usage(broker, monkeypatch)
    guard = ShareGuard(broker)
    assert await _loop_runs_while(guard.check_once(), release) >= 5
