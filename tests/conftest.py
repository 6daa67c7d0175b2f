"""Shared fixtures: a store on a temporary SQLite file, a broker on fake GPUs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gpubroker.core import Broker
from gpubroker.devices.fake import FakeDeviceBackend
from gpubroker.store.db import make_engine, make_session_factory, upgrade

# every broker in the tests checks its invariants after every command
# (Broker.check_state; the hub tests' brokers get --Broker.check_state=raise)
Broker.check_state.default_value = "raise"  # type: ignore[attr-defined]


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    """A migrated SQLite store in a temporary directory."""
    url = f"sqlite:///{tmp_path / 'broker.sqlite'}"
    upgrade(url)
    return url


def make_broker(db_url: str, inventory: list[str] | None = None) -> Broker:
    """A broker over ``db_url`` with fake devices, inventory synced and leases adopted."""
    backend = FakeDeviceBackend(inventory=inventory or ["8 x H100"], node_name="node-a")
    engine = make_engine(db_url)
    broker = Broker(session_factory=make_session_factory(engine), backend=backend)
    broker.sync_inventory()
    broker.adopt()
    return broker


@pytest.fixture
def broker(db_url: str) -> Iterator[Broker]:
    """A broker with 8 fake H100s on one node."""
    yield make_broker(db_url)
