"""A review of the culler: a kernel time out of range stopped every
judgement of its lease; a server left out of one hub listing lost its
warning; a read that waited its turn dropped fresh kernel activity as a
claim of the future."""

from __future__ import annotations

import datetime as dt

import pytest

from gpubroker.core import Broker
from gpubroker.culler import Culler
from gpubroker.hub import parse_time

from .test_culler_checks import MIN, idle_server, kinds
from .test_culler_leftovers import _kernels


@pytest.mark.parametrize("value", ["0001-01-01T00:00:00+01:00", "9999-12-31T23:59:59-01:00"])
def test_a_time_out_of_range_in_utc_is_no_time(value: str) -> None:
    assert parse_time(value) is None  # was OverflowError


async def test_a_kernel_time_out_of_range_does_not_stop_the_cull(broker: Broker) -> None:
    """Any user's server could answer its kernels' ``last_activity`` as
    ``0001-01-01T00:00:00+01:00``: every check then failed for the lease
    ("cannot judge"), so it was never warned, culled or held to
    ``max_age``. The time is now no evidence of activity."""
    hub, lease, start = idle_server(broker)
    culler = Culler(broker, hub)  # type: ignore[arg-type]
    odd = [{"execution_state": "idle", "last_activity": "0001-01-01T00:00:00+01:00"}]
    _kernels(culler, [odd, odd, odd])
    await culler.check_once(start)
    await culler.check_once(start + 61 * MIN)
    assert kinds(broker, lease["id"]) == ["cull-warning"]
    assert await culler.check_once(start + 72 * MIN) == [lease["id"]]


async def test_a_server_left_out_of_one_listing_keeps_its_warning(broker: Broker) -> None:
    """The hub's paged listing can skip a server as others stop between
    pages. Its lease's track was dropped: a second warning, and the cull
    a full timeout late. A granted lease now keeps its track."""
    hub, lease, start = idle_server(broker)
    culler = Culler(broker, hub)  # type: ignore[arg-type]
    await culler.check_once(start)
    await culler.check_once(start + 61 * MIN)  # warned: culled at 71 min
    server = hub.servers.pop(("ann", ""))
    assert await culler.check_once(start + 62 * MIN) == []
    hub.servers[("ann", "")] = server
    assert await culler.check_once(start + 72 * MIN) == [lease["id"]]
    assert kinds(broker, lease["id"]) == ["cull-warning", "culled"]


async def test_a_released_lease_loses_its_track(broker: Broker) -> None:
    hub, lease, start = idle_server(broker)
    culler = Culler(broker, hub)  # type: ignore[arg-type]
    await culler.check_once(start)
    assert lease["id"] in culler.tracks
    broker.release_lease(lease["id"], "stopped")
    await culler.check_once(start + MIN)
    assert lease["id"] not in culler.tracks


async def test_kernel_activity_is_judged_against_the_time_of_its_read(broker: Broker) -> None:
    """A check's reads wait their turn (``concurrency``); one read long
    after the check began dropped a kernel's fresh activity as more than
    ``CLOCK_SKEW`` in the future, so a lease in use could be warned."""
    hub, _, start = idle_server(broker)
    culler = Culler(broker, hub)  # type: ignore[arg-type]
    fresh = start - dt.timedelta(seconds=5)
    _kernels(culler, [[{"execution_state": "idle", "last_activity": fresh.isoformat()}]])
    (ref,) = broker.server_leases()
    began = start - 10 * MIN  # the check began ten minutes before this read
    signals = await culler._signals(ref, hub.servers[("ann", "")], began)
    assert signals.kernel_activity == fresh
