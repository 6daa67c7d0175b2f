"""The culler's pure judgement: signals, time zones, daylight saving."""

from __future__ import annotations

import datetime as dt
from zoneinfo import ZoneInfo

from gpubroker.culler import Signals, Track, judge, parse_time

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
