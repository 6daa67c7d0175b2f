"""gpubroker benchmarks; run with ``make bench`` (``python -m benchmarks``)."""

from __future__ import annotations

from typing import Any


def figure(
    value: float, unit: str, baseline: float, name: str, digits: int | None = 3
) -> dict[str, Any]:
    """One ``bench-results.json`` entry: value, unit, baseline (named) and
    value / baseline (``None`` when the baseline is 0: no ratio, rather than
    a 0 that reads as "none of the baseline's time"), rounded to ``digits``
    (``None``: not rounded)."""
    ratio = value / baseline if baseline else None
    if digits is not None:
        value, baseline = round(value, digits), round(baseline, digits)
        ratio = None if ratio is None else round(ratio, digits)
    return {
        "value": value,
        "unit": unit,
        "baseline": baseline,
        "baseline_name": name,
        "ratio": ratio,
    }


def fake_broker(tmp: str) -> tuple[Any, Any]:
    """A broker in this process on a fresh SQLite store in ``tmp``, with 8
    fake H100s, its state checks off; returns (broker, SQLAlchemy engine)."""
    from gpubroker.core import Broker
    from gpubroker.devices.fake import FakeDeviceBackend
    from gpubroker.store.db import make_engine, make_session_factory, upgrade

    url = f"sqlite:///{tmp}/broker.sqlite"
    upgrade(url)
    engine = make_engine(url)
    backend = FakeDeviceBackend(inventory=["8 x H100"], node_name="bench")
    broker = Broker(session_factory=make_session_factory(engine), backend=backend)
    broker.check_state = "off"
    broker.sync_inventory()
    broker.adopt()
    return broker, engine
