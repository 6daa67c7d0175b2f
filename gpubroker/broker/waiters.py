"""Long-poll waiters, kept per lease.

A ``GET /leases/{id}?wait=…`` waits here for its lease's ``version`` to
move past the one its caller knows. After every command the broker asks
:meth:`Waiters.wake` to look at the leases that have waiters, and only the
waiters whose lease changed are woken (one read each, from memory); nobody
else is disturbed, however many requests wait in the queue.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class Waiters:
    """Futures of long-polls by lease id, each with the version it knows."""

    def __init__(self) -> None:
        self._waiting: dict[int, list[tuple[int, asyncio.Future[None]]]] = {}

    def __len__(self) -> int:
        return sum(len(v) for v in self._waiting.values())

    async def wait(self, lease_id: int, known: int, timeout: float) -> bool:
        """Wait until lease ``lease_id`` is woken past version ``known``, at
        most ``timeout`` seconds. Returns whether it was woken."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (known, future)
        self._waiting.setdefault(lease_id, []).append(entry)
        try:
            await asyncio.wait_for(asyncio.shield(future), timeout)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            entries = self._waiting.get(lease_id, [])
            if entry in entries:
                entries.remove(entry)
            if not entries:
                self._waiting.pop(lease_id, None)

    def wake(self, version_of: Callable[[int], int | None]) -> int:
        """Wake the waiters whose lease's version (``version_of(lease_id)``;
        ``None``: the lease is gone) differs from the one they know.
        Returns how many were woken."""
        woken = 0
        for lease_id, entries in list(self._waiting.items()):
            version = version_of(lease_id)
            for known, future in entries:
                if version != known and not future.done():
                    future.set_result(None)
                    woken += 1
        return woken
