"""Review of the culler (second round): configuration that is refused,
warnings that survive a failed notice or a crash in the middle of a check,
and GPU or kernel reads that fail without being taken for idleness."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from traitlets import TraitError
from traitlets.config import Config

from gpubroker.core import Broker
from gpubroker.culler import Culler, Track

from .test_culler import T0, signals, verdict
from .test_culler_checks import MIN, fail_notice_once, idle_server, kinds

UTC = dt.timezone.utc


# -- configuration ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("timeout", 0),
        ("timeout", -60),
        ("timeout", float("nan")),
        ("cull_every", 0),
        ("cull_every", float("inf")),
        ("grace", -1),
        ("max_age", -1),
        ("gpu_idle_threshold", 0),
        ("gpu_idle_threshold", -5),
        ("gpu_idle_threshold", 101),
        ("busy_gpu_idle_timeout", 0),
        ("pre_stop_timeout", 0),
        ("pre_stop_timeout", float("inf")),
        ("request_timeout", -1),
    ],
)
def test_a_number_out_of_range_is_refused_at_start(name: str, value: float) -> None:
    # e.g. a negative timeout culled everyone at once, a threshold of 0 made
    # every GPU "used" (nothing culled), cull_every 0 spun against the hub,
    # an infinite pre_stop_timeout made every cull fail
    config = Config({"Culler": {name: value}})
    with pytest.raises(TraitError, match=rf"Culler\.{name}: "):
        Culler(None, None, config=config)  # type: ignore[arg-type]


def test_numbers_in_range_are_accepted() -> None:
    culler = Culler(
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        timeout=4,
        cull_every=1,
        grace=0,
        max_age=0,
        gpu_idle_threshold=100,
        busy_gpu_idle_timeout=60,
        pre_stop_timeout=0.5,
        request_timeout=2,
    )
    assert (culler.timeout, culler.grace, culler.gpu_idle_threshold) == (4, 0, 100)


def test_a_pre_stop_hook_that_is_not_an_absolute_path_is_refused() -> None:
    # the hook runs without PATH: a bare name would fail at every cull
    # (logged, and the cull goes on without it), found only then
    with pytest.raises(TraitError, match=r"Culler\.pre_stop_hook: .*absolute path"):
        Culler(None, None, pre_stop_hook=["notify-culled", "--all"])  # type: ignore[arg-type]
    hook = ["/usr/local/bin/notify-culled", "relative-args-are-fine"]
    assert Culler(None, None, pre_stop_hook=hook).pre_stop_hook == hook  # type: ignore[arg-type]
    assert Culler(None, None, pre_stop_hook=[]).pre_stop_hook == []  # type: ignore[arg-type]


# -- warnings -----------------------------------------------------------------------------


async def test_a_warning_whose_notice_failed_is_not_a_warning(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub, lease, start = idle_server(broker)
    culler = Culler(broker, hub)  # type: ignore[arg-type]
    fail_notice_once(broker, monkeypatch, "cull-warning")  # when the warning is recorded
    await culler.check_once(start)
    await culler.check_once(start + 61 * MIN)  # the warning's notice fails
    assert kinds(broker, lease["id"]) == []
    await culler.check_once(start + 62 * MIN)
    assert kinds(broker, lease["id"]) == ["cull-warning"]
    # never culled before a full grace after the warning the user got
    assert await culler.check_once(start + 71 * MIN) == []
    assert await culler.check_once(start + 72 * MIN) == [lease["id"]]


async def test_a_crash_in_the_middle_of_a_check_does_not_warn_twice(broker: Broker) -> None:
    hub, bob, start = idle_server(broker, "bob")
    _, ann, _ = idle_server(broker, "ann")
    hub.servers[("bob", "")] = {"last_activity": (start - 10 * MIN).isoformat()}
    hub.servers[("ann", "")] = {"last_activity": (start + 11 * MIN).isoformat()}
    culler = Culler(broker, hub, pre_stop_hook=["/bin/true"])  # type: ignore[arg-type]
    hook_started = asyncio.Event()

    async def slow_hook(ref: Any, token: str) -> None:
        hook_started.set()
        await asyncio.Event().wait()  # a hook that takes its time (up to pre_stop_timeout)

    culler._run_hook = slow_hook  # type: ignore[method-assign]
    await culler.check_once(start)
    await culler.check_once(start + 61 * MIN)  # bob warned
    check = asyncio.ensure_future(culler.check_once(start + 72 * MIN))  # bob culled, ann warned
    await asyncio.wait_for(hook_started.wait(), 5)
    assert kinds(broker, ann["id"]) == ["cull-warning"]
    check.cancel()  # the broker stops (a crash) while bob's hook runs
    with contextlib.suppress(asyncio.CancelledError):
        await check
    # the restarted broker keeps ann's warning and its deadline
    restarted = Culler(broker, hub)  # type: ignore[arg-type]
    culled = await restarted.check_once(start + 73 * MIN)
    assert culled == [bob["id"]]  # past his deadline: culled at once
    assert kinds(broker, ann["id"]) == ["cull-warning"]
    assert await restarted.check_once(start + 82 * MIN) == [ann["id"]]
    assert kinds(broker, ann["id"]) == ["cull-warning", "culled"]


# -- reads that fail ----------------------------------------------------------------------


async def test_a_gpu_whose_use_cannot_be_read_is_not_an_idle_gpu(broker: Broker) -> None:
    lease = broker.request_lease("ann", "", gpus=2)
    assert lease["state"] == "granted"
    (ref,) = [x for x in broker.server_leases() if x.id == lease["id"]]
    first, second = (slot.device_uuid for slot in ref.slots)
    culler = Culler(broker, None)  # type: ignore[arg-type]
    broker.backend.set_usage(first, utilization_gpu=0)
    broker.backend.set_usage(second, utilization_gpu=None)  # NVML could not say
    seen = await culler._signals(ref, {})
    # one device idle and one unknown is not "the GPUs are idle": a busy
    # kernel must not be flagged (or culled) for an idle GPU on it
    assert seen.gpu_util is None
    broker.backend.set_usage(first, utilization_gpu=80)
    assert (await culler._signals(ref, {})).gpu_util == 80  # any use seen is use


def test_a_failed_read_does_not_restart_the_busy_kernel_on_idle_gpu_clock() -> None:
    track = Track(gpu_active=T0)
    busy = signals(busy=True, gpu_util=0)
    verdict(busy, T0, track)
    # one check could not read the kernels (a slow server), another not the GPU
    verdict(signals(kernels=None, gpu_util=0), T0 + dt.timedelta(hours=2), track)
    verdict(signals(busy=True, gpu_util=None), T0 + dt.timedelta(hours=3), track)
    # a check that cannot read the GPU does not flag it idle, past the limit too
    unread = verdict(signals(busy=True, gpu_util=None), T0 + dt.timedelta(hours=4), track)
    assert "GPU idle" not in unread.reason
    late = verdict(busy, T0 + dt.timedelta(hours=4, minutes=1), track)
    assert "kernel busy but GPU idle 241 min" in late.reason
    # evidence does end it: the kernel seen idle, or the GPU seen in use
    verdict(signals(busy=False, gpu_util=0), T0 + dt.timedelta(hours=5), track)
    assert track.busy_since_gpu_idle is None


def test_a_claim_of_the_future_hides_no_other_activity() -> None:
    now = T0 + dt.timedelta(minutes=90)
    # a kernel stamped two hours ahead (the server's clock was wrong, then
    # corrected): left out, but the terminal's output a minute ago still counts
    s = signals(
        kernel_activity=now + dt.timedelta(hours=2),
        terminal_activity=now - dt.timedelta(minutes=1),
    )
    v = verdict(s, now)
    assert not v.cull and round(v.idle) == 60


# -- the pre-stop hook ----------------------------------------------------------------------


async def test_a_hook_past_its_timeout_is_killed_with_its_children(
    broker: Broker, tmp_path: Path
) -> None:
    # a shell script hook that waits on a program it started: past
    # pre_stop_timeout the whole hook is killed, not only the shell
    pid_file = tmp_path / "child.pid"
    script = f"/bin/sleep 60 & echo $! > {pid_file}; wait"
    hub, lease, start = idle_server(broker)
    culler = Culler(  # type: ignore[arg-type]
        broker, hub, pre_stop_hook=["/bin/sh", "-c", script], pre_stop_timeout=1
    )
    await culler.check_once(start)
    await culler.check_once(start + 61 * MIN)
    assert await culler.check_once(start + 72 * MIN) == [lease["id"]]
    child = int(pid_file.read_text())
    for _ in range(50):  # killed, then reaped by init
        if not Path(f"/proc/{child}").exists() or "Z" in _state(child):
            break
        await asyncio.sleep(0.1)
    else:
        os.kill(child, signal.SIGKILL)
        pytest.fail("the hook's child outlived the hook's timeout")


def _state(pid: int) -> str:
    """A process's state letter (``Z``: ended, not yet reaped); ``""`` if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


async def test_an_exempt_class_that_is_no_class_is_reported_at_start(
    broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    """A typo in ``exempt_priority_classes`` (``bach``) exempted nothing, and
    nothing said so: the batch leases it meant were culled."""
    default = Culler(broker, None)  # type: ignore[arg-type]
    assert default.unknown_exempt_classes() == []
    typo = Culler(broker, None, exempt_priority_classes=["bach", "batch"])  # type: ignore[arg-type]
    assert typo.unknown_exempt_classes() == ["bach"]
    typo.cull_every = 3600
    with caplog.at_level("WARNING"):
        task = asyncio.ensure_future(typo.run())
        for _ in range(200):  # until its start has been logged
            await asyncio.sleep(0.05)
            if "exempt_priority_classes" in caplog.text:
                break
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert "exempt_priority_classes: no priority class is named bach" in caplog.text


async def test_an_unreadable_gpu_does_not_withdraw_a_busy_kernels_gpu_idle_warning(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel busy for an hour on an idle GPU is warned; an NVML error at
    the next check withdrew the warning (a busy kernel counts as use when
    the GPU is unknown), and the check after warned again with a new
    grace: every hiccup put the cull off."""
    hub, lease, start = idle_server(broker)
    culler = Culler(  # type: ignore[arg-type]
        broker, hub, cull_busy_gpu_idle=True, busy_gpu_idle_timeout=3600, grace=600
    )
    culler.pid_lease = lambda pid: None  # type: ignore[method-assign]

    async def busy(*_: Any, **__: Any) -> tuple[list[dict[str, Any]], None]:
        return [{"execution_state": "busy", "last_activity": None}], None

    monkeypatch.setattr(culler, "_kernels", busy)
    real = broker.backend.usage
    failing = [False]

    def usage(uuid: str) -> Any:
        if failing[0]:
            raise RuntimeError("NVML_ERROR_UNKNOWN")
        return real(uuid)

    monkeypatch.setattr(broker.backend, "usage", usage)
    for minute in (0, 30, 61):
        await culler.check_once(start + minute * MIN)
    assert kinds(broker, lease["id"]) == ["cull-warning"]
    deadline = culler.tracks[lease["id"]].warned_until
    failing[0] = True
    await culler.check_once(start + 62 * MIN)
    failing[0] = False
    await culler.check_once(start + 63 * MIN)
    assert kinds(broker, lease["id"]) == ["cull-warning"]
    assert culler.tracks[lease["id"]].warned_until == deadline
    assert await culler.check_once(start + 71 * MIN) == [lease["id"]]
