"""The culler's pure judgement: signals, time zones, daylight saving."""

from __future__ import annotations

import datetime as dt
from zoneinfo import ZoneInfo

import pytest
from traitlets import TraitError

from gpubroker.culler import Culler, Signals, Track, judge, parse_time, terminal_activity

UTC = dt.timezone.utc
T0 = dt.datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def signals(**kw) -> Signals:
    base = dict(
        hub_activity=None, kernel_activity=None, kernels=1, busy=False, gpu_util=0, gpu_memory_mib=0
    )
    base.update(kw)
    return Signals(**base)


def verdict(s: Signals, now: dt.datetime, track: Track | None = None, granted=T0, **kw):
    params = dict(
        timeout=3600, threshold=5, busy_gpu_idle_timeout=4 * 3600, cull_busy_gpu_idle=False
    )
    params.update(kw)
    return judge(s, track or Track(gpu_active=granted), granted, now, **params)


def test_idle_lease_with_memory_held_is_idle_after_timeout() -> None:
    now = T0 + dt.timedelta(minutes=62)
    v = verdict(signals(gpu_memory_mib=20 * 1024, hub_activity=T0), now)
    assert v.cull and v.reason == "idle 62 min, GPU 0%, 20.0 GiB held, no busy kernel"


def test_busy_kernel_with_busy_gpu_is_never_idle() -> None:
    now = T0 + dt.timedelta(hours=10)
    v = verdict(signals(busy=True, gpu_util=80), now)
    assert not v.cull and v.idle == 0


def test_gpu_use_counts_as_activity_between_checks() -> None:
    track = Track(gpu_active=T0)
    verdict(signals(gpu_util=90), T0 + dt.timedelta(minutes=50), track)
    later = verdict(signals(gpu_util=0), T0 + dt.timedelta(minutes=100), track)
    assert not later.cull and round(later.idle) == 50 * 60


def test_busy_kernel_with_idle_gpu_is_flagged_and_culled_only_if_configured() -> None:
    track = Track(gpu_active=T0)
    verdict(signals(busy=True), T0, track)
    late = T0 + dt.timedelta(hours=5)
    flagged = verdict(signals(busy=True), late, track)
    assert not flagged.cull and "kernel busy but GPU idle 300 min" in flagged.reason
    track2 = Track(gpu_active=T0)
    verdict(signals(busy=True), T0, track2)
    assert verdict(signals(busy=True), late, track2, cull_busy_gpu_idle=True).cull


def test_times_are_read_as_utc_whatever_their_zone() -> None:
    assert parse_time("2026-11-30T12:00:00Z") == T0
    assert parse_time("2026-11-30T12:00:00") == T0  # naive: UTC
    assert parse_time("2026-11-30T13:00:00+01:00") == T0
    assert parse_time("garbage") is None and parse_time(None) is None


def test_idle_time_across_a_daylight_saving_change() -> None:
    # New York springs forward at 02:00 local on 2026-03-08: 01:30 EST to
    # 03:30 EDT is one hour of real time, not two
    ny = ZoneInfo("America/New_York")
    before = dt.datetime(2026, 3, 8, 1, 30, tzinfo=ny)
    after = dt.datetime(2026, 3, 8, 3, 30, tzinfo=ny)
    hub_activity = parse_time(before.isoformat())
    v = verdict(signals(hub_activity=hub_activity), after.astimezone(UTC), granted=hub_activity)
    assert round(v.idle) == 3600 and v.cull
    # and falls back on 2026-11-01: 01:30 EDT to 01:30 EST is one hour too
    first = dt.datetime(2026, 11, 1, 1, 30, tzinfo=ny, fold=0)
    second = dt.datetime(2026, 11, 1, 1, 30, tzinfo=ny, fold=1)
    start = parse_time(first.isoformat())
    v = verdict(signals(hub_activity=start), second.astimezone(UTC), granted=start, timeout=7200)
    assert round(v.idle) == 3600 and not v.cull


def test_browser_traffic_does_not_count_when_kernels_are_known() -> None:
    now = T0 + dt.timedelta(minutes=62)
    # an open tab keeps refreshing the hub's activity; the kernel did nothing
    tab_open = signals(hub_activity=now, kernel_activity=T0, kernels=1)
    assert verdict(tab_open, now).cull
    # without kernel information, the hub's activity is all there is
    unknown = signals(hub_activity=now, kernel_activity=None, kernels=None)
    assert not verdict(unknown, now).cull


def test_a_busy_kernel_on_a_gpu_of_unknown_use_is_never_flagged() -> None:
    # a share or a MIG instance without GPM: the GPU's use cannot be read,
    # so "kernel busy but GPU idle" cannot be said, even when culling for it
    track = Track(gpu_active=T0)
    for hours in range(6):
        v = verdict(
            signals(busy=True, gpu_util=None),
            T0 + dt.timedelta(hours=hours),
            track,
            cull_busy_gpu_idle=True,
        )
        assert not v.cull and "GPU idle" not in v.reason
    assert track.busy_since_gpu_idle is None


def test_terminal_activity_counts_when_kernels_are_known() -> None:
    now = T0 + dt.timedelta(minutes=62)
    # training in a terminal: no kernel, output a minute ago
    terminal = signals(kernels=0, terminal_activity=now - dt.timedelta(minutes=1), gpu_util=None)
    v = verdict(terminal, now)
    assert not v.cull and round(v.idle) == 60
    # the hub's activity (an open tab) still does not count
    assert verdict(signals(kernels=0, hub_activity=now, gpu_util=None), now).cull


def test_terminal_answers_are_read_as_untrusted() -> None:
    answer = [
        {"name": "1", "last_activity": "2026-11-30T12:00:00Z"},
        {"name": "2", "last_activity": "2026-11-30T12:05:00+00:00"},
        {"name": "3", "last_activity": 12},
        "junk",
    ]
    assert terminal_activity(answer) == T0 + dt.timedelta(minutes=5)
    assert terminal_activity([]) is None
    assert terminal_activity({"message": "not found"}) is None


def test_a_bad_exempt_pattern_is_refused_at_start() -> None:
    with pytest.raises(TraitError, match=r"exempt_server_names: 'keep-\(' is not a regular"):
        Culler(None, None, exempt_server_names=["keep-("])  # type: ignore[arg-type]
    assert Culler(None, None, exempt_server_names=["keep-.*"]).exempt_server_names == ["keep-.*"]  # type: ignore[arg-type]


def test_a_dry_run_stores_no_warning() -> None:
    track = Track(gpu_active=T0, warned_until=T0 + dt.timedelta(minutes=10))
    dry = Culler(None, None, dry_run=True)  # type: ignore[arg-type]
    assert dry._stored_track(track)["warned_until"] is None
    real = Culler(None, None)  # type: ignore[arg-type]
    assert real._stored_track(track)["warned_until"] == track.warned_until
