"""Hub shutdown order for a hub-managed broker: servers first, then the broker."""

from __future__ import annotations

import asyncio
from typing import Any


def stop_servers_before_services(app: Any) -> None:
    """At hub shutdown, stop the single-user servers before the managed services.

    JupyterHub's ``cleanup()`` stops managed services first, then (with
    ``cleanup_servers``, JupyterHub's default) the servers: a broker run as
    a managed service is gone when the spawners release their leases, each
    release fails with a warning, and the leases stay open (and charged)
    until the broker's next start reconciles them. This wraps
    ``app.cleanup`` so that the servers stop first (concurrently, each
    releasing its lease at its stop), then JupyterHub's own cleanup runs.
    Without ``cleanup_servers`` nothing changes: servers keep running and
    keep their GPUs.

    Call it from ``jupyterhub_config.py`` when the hub itself loads the
    file::

        from jupyterhub.app import JupyterHub
        if JupyterHub.initialized():
            stop_servers_before_services(JupyterHub.instance())

    Args:
        app: the hub's ``JupyterHub`` application (its ``cleanup``,
            ``cleanup_servers``, ``users`` and ``log`` are used).
    """
    cleanup = app.cleanup

    async def cleanup_servers_first() -> None:
        if app.cleanup_servers:
            stops = [
                asyncio.ensure_future(user.stop(name))
                for user in list(app.users.values())
                for name, spawner in list(user.spawners.items())
                if spawner.active
            ]
            if stops:
                app.log.info(
                    "Stopping %i single-user servers before the GPU broker, so it releases"
                    " their GPUs...",
                    len(stops),
                )
            for result in await asyncio.gather(*stops, return_exceptions=True):
                if isinstance(result, BaseException):
                    app.log.error("Failed to stop user: %s", result)
        await cleanup()

    app.cleanup = cleanup_servers_first
