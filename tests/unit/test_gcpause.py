"""Passes run with the cyclic garbage collector paused (gpubroker.gcpause):
the collector is back on after a pass, also after an error, and left off
where it was off."""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Iterator

import pytest

from gpubroker import scheduler
from gpubroker.core import Broker
from gpubroker.gcpause import paused_gc
from gpubroker.scheduler import Policy
from gpubroker.simulate.cluster import parse_spec
from gpubroker.simulate.compare import make_scheduler
from gpubroker.simulate.engine import Engine

from .test_simulate_engine import HAND, workload


@pytest.fixture(autouse=True)
def _collector_on() -> Iterator[None]:
    assert gc.isenabled()
    yield
    gc.enable()


def test_the_collector_is_paused_in_the_block_and_back_on_after_it() -> None:
    with paused_gc():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_the_collector_is_back_on_after_an_error() -> None:
    with pytest.raises(RuntimeError, match="boom"), paused_gc():
        raise RuntimeError("boom")
    assert gc.isenabled()


def test_a_collector_that_was_off_stays_off_and_nested_blocks_keep_it_off() -> None:
    gc.disable()
    with paused_gc():
        assert not gc.isenabled()
    assert not gc.isenabled()
    gc.enable()
    with paused_gc():
        with paused_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer block's pause holds
    assert gc.isenabled()


def test_the_broker_decides_with_the_collector_paused(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[bool] = []
    real = scheduler.schedule

    def recording(state: scheduler.SchedulerState, now: object) -> scheduler.Decisions:
        seen.append(gc.isenabled())
        return real(state, now)  # type: ignore[arg-type]

    monkeypatch.setattr(scheduler, "schedule", recording)
    lease = broker.request_lease("ann", "", 1)
    assert lease["state"] == "granted"
    broker.release_lease(lease["id"], "done")
    assert seen and not any(seen)
    assert gc.isenabled()


def test_the_simulator_decides_with_the_collector_paused() -> None:
    seen: list[bool] = []
    broker = make_scheduler("broker")

    def recording(state: scheduler.SchedulerState, now: object) -> scheduler.Decisions:
        seen.append(gc.isenabled())
        return broker.schedule(state, now)  # type: ignore[arg-type]

    cluster = parse_spec("1x4xA100-80GB")
    chosen = dataclasses.replace(broker, schedule=recording)
    Engine(workload(HAND, "1x4"), cluster, chosen, Policy()).run()
    assert seen and not any(seen)
    assert gc.isenabled()
