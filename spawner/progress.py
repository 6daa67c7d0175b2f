"""ProgressFeed: spawn progress events that a spawner adds while it starts
and ``Spawner.progress()`` follows (JupyterHub streams them to the spawn
page as server-sent events)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

#: seconds between two looks for new events while none comes
IDLE_WAIT = 5.0


class ProgressFeed:
    """An append-only list of events (``{"progress": 0-100, "message": str}``)
    and whether more will come.

    Attributes:
        events: every event added so far, oldest first.
        over: no more events will come (the part of the start it follows is done).
        failed: that part of the start failed (set by :meth:`close`): the
            spawn goes no further, so nothing follows these events.
    """

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.over = False
        self.failed = False
        self._changed = asyncio.Event()

    def add(self, progress: int, message: str, once: bool = False) -> bool:
        """Add an event; with ``once``, not when it repeats the last one.

        Returns:
            whether it was added.
        """
        event = {"progress": progress, "message": message}
        if once and self.events and self.events[-1] == event:
            return False
        self.events.append(event)
        self._changed.set()
        return True

    def close(self, failed: bool = False) -> None:
        """No more events: followers stop after the ones added; ``failed``:
        the part of the start this feed follows failed."""
        self.over = True
        self.failed = self.failed or failed
        self._changed.set()

    async def follow(self) -> AsyncIterator[dict[str, Any]]:
        """Yield every event, old and new, until :meth:`close`."""
        sent = 0
        while True:
            self._changed.clear()
            while sent < len(self.events):  # also those added while a yield waited
                sent += 1
                yield self.events[sent - 1]
            if self.over:
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), IDLE_WAIT)
