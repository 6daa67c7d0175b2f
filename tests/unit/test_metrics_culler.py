"""The culler's checks in the metrics: a culler that stopped checking (its
task died, a check hangs) culled nothing and nothing said so; an alert on
``time() - gpubroker_culler_last_check_timestamp_seconds`` now finds it."""

from __future__ import annotations

import asyncio
import contextlib
import time

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpubroker.core import Broker
from gpubroker.culler import Culler
from gpubroker.observe.metrics import BrokerMetrics


def _samples(
    metrics: BrokerMetrics, prefix: str = "gpubroker_culler"
) -> dict[tuple[str, str], float]:
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, s.labels.get("outcome", "")): s.value
        for family in text_string_to_metric_families(text)
        if family.name.startswith(prefix)
        for s in family.samples
        if not s.name.endswith("_created")
    }


async def test_each_check_of_the_culler_is_counted_and_the_last_one_timed(
    broker: Broker,
) -> None:
    metrics = BrokerMetrics(broker)
    assert _samples(metrics) == {
        ("gpubroker_culler_checks_total", "ok"): 0,
        ("gpubroker_culler_checks_total", "failed"): 0,
        ("gpubroker_culler_last_check_timestamp_seconds", ""): 0,
    }
    culler = Culler(broker, None, cull_every=0.01)  # type: ignore[arg-type]
    culler.on_check = metrics.culler_checked
    outcomes = iter([None, RuntimeError("the hub is down"), None])

    async def check_once() -> list[int]:
        failure = next(outcomes, None)
        if failure is not None:
            raise failure
        return []

    culler.check_once = check_once  # type: ignore[method-assign]
    began = time.time()
    task = asyncio.ensure_future(culler.run())
    try:
        for _ in range(500):
            await asyncio.sleep(0.01)
            if _samples(metrics)[("gpubroker_culler_checks_total", "failed")] >= 1:
                break
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    samples = _samples(metrics)
    assert samples[("gpubroker_culler_checks_total", "failed")] == 1
    assert samples[("gpubroker_culler_checks_total", "ok")] >= 1
    assert samples[("gpubroker_culler_last_check_timestamp_seconds", "")] >= began


def test_a_started_culler_is_not_stale_before_its_first_check(broker: Broker) -> None:
    """The documented alert (now - last check > 3 x cull_every) fired for
    the whole first interval after every start: the gauge was 0."""
    metrics = BrokerMetrics(broker)
    began = time.time()
    metrics.culler_started()
    assert _samples(metrics)[("gpubroker_culler_last_check_timestamp_seconds", "")] >= began


def test_rounds_of_the_reconciliation_are_counted_and_the_last_success_timed(
    broker: Broker,
) -> None:
    """While the hub does not answer the reconciliation, leases of servers
    that are gone stay granted: the rounds and the last success are
    metrics, so an alert can find it."""
    metrics = BrokerMetrics(broker)

    def samples() -> dict[tuple[str, str], float]:
        return _samples(metrics, "gpubroker_reconciliation")

    assert samples() == {
        ("gpubroker_reconciliations_total", "ok"): 0,
        ("gpubroker_reconciliations_total", "failed"): 0,
        ("gpubroker_reconciliation_last_success_timestamp_seconds", ""): 0,
    }
    metrics.reconciled_once(False)
    assert samples()[("gpubroker_reconciliation_last_success_timestamp_seconds", "")] == 0
    began = time.time()
    metrics.reconciled_once(True)
    assert samples()[("gpubroker_reconciliations_total", "failed")] == 1
    assert samples()[("gpubroker_reconciliations_total", "ok")] == 1
    assert samples()[("gpubroker_reconciliation_last_success_timestamp_seconds", "")] >= began
