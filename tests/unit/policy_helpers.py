"""Builders shared by the policy's unit tests: a fixed pass time, nodes of
devices, running leases and pending requests (pure values, no broker)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from gpubroker.scheduler import Request, Running, Slot

#: the pass time of every test (aware UTC)
NOW = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.timezone.utc)
HOUR = dt.timedelta(hours=1)


def node(name: str = "a", n: int = 8, **kw: Any) -> tuple[Slot, ...]:
    """``n`` devices ``{name}0`` .. on node ``name`` (``kw``: more Slot fields)."""
    return tuple(Slot(f"{name}{i}", name, i, **kw) for i in range(n))


def running(lease_id: int, user: str, devices: tuple[str, ...], **kw: Any) -> Running:
    """A lease of ``user`` on ``devices``, granted an hour before :data:`NOW`
    unless ``started`` is given."""
    kw.setdefault("started", NOW - HOUR)
    return Running(lease_id, user, devices, **kw)


def req(lease_id: int, user: str, gpus: int = 1, minute: int = 0, **kw: Any) -> Request:
    """A request of ``user`` for ``gpus`` whole devices, made ``minute``
    minutes after :data:`NOW`."""
    return Request(lease_id, user, gpus, NOW + dt.timedelta(minutes=minute), **kw)
