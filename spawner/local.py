"""Local-process spawners with GPU leases."""

from __future__ import annotations

from jupyterhub.spawner import LocalProcessSpawner, SimpleLocalProcessSpawner

from .mixin import GPUSpawnerMixin


class LocalGPUSpawner(GPUSpawnerMixin, LocalProcessSpawner):  # type: ignore[misc]
    """:class:`~jupyterhub.spawner.LocalProcessSpawner` (one system user per
    hub user) whose servers get the GPUs the broker leases to them."""


class SimpleLocalGPUSpawner(GPUSpawnerMixin, SimpleLocalProcessSpawner):  # type: ignore[misc]
    """:class:`~jupyterhub.spawner.SimpleLocalProcessSpawner` (no user
    switching; for demos and tests, e.g. when the hub runs as root without
    system users) whose servers get the GPUs the broker leases to them."""
