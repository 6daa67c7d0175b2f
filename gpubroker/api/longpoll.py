"""A bound on the long-polls each caller holds open.

``GET /api/v1/leases/{id}?wait=S`` keeps a connection open for up to ``S``
seconds. Each caller may hold at most ``limit`` such polls; when one more
arrives, the caller's *oldest* open poll is told to answer at once (with the
lease as it stands, 200), so a client that leaks polls keeps working and
the broker's connections stay bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from typing import Any


class LongPollRegistry:
    """Open long-polls per caller, oldest first.

    Args:
        limit: most open long-polls per caller (>= 1).
        log: where to say that a poll was ended early.
    """

    def __init__(self, limit: int, log: logging.Logger | None = None) -> None:
        if limit < 1:
            raise ValueError(f"limit: must be at least 1, got {limit}")
        self.limit = limit
        self.log = log or logging.getLogger("gpubroker")
        self._open: dict[str, OrderedDict[int, asyncio.Event]] = {}
        self._next = 0

    def open(self, caller: str) -> tuple[int, asyncio.Event]:
        """Register a new poll of ``caller``; end their oldest ones beyond the limit.

        Returns:
            ``(ticket, event)``: pass ``ticket`` to :meth:`close` when the poll
            ends; ``event`` is set when the poll must answer now.
        """
        polls = self._open.setdefault(caller, OrderedDict())
        while len(polls) >= self.limit:
            _, event = polls.popitem(last=False)
            event.set()
            self.log.info(
                "Long-poll limit of %s reached for %s: answering their oldest poll now",
                self.limit,
                caller,
            )
        self._next += 1
        event = asyncio.Event()
        polls[self._next] = event
        return self._next, event

    def close(self, caller: str, ticket: int) -> None:
        """Forget a finished poll (a no-op when it was already ended early)."""
        polls = self._open.get(caller)
        if polls is None:
            return
        polls.pop(ticket, None)
        if not polls:
            del self._open[caller]

    def count(self, caller: str) -> int:
        """How many long-polls ``caller`` holds open now."""
        return len(self._open.get(caller, ()))

    async def wait(self, caller: str, waiter: Any, cancel: asyncio.Event | None = None) -> Any:
        """Run ``waiter`` (an awaitable) as one poll of ``caller``.

        Args:
            caller: whose poll it is.
            waiter: the awaitable that waits for the change.
            cancel: set when the poll should end anyway (e.g. the client went away).

        Returns:
            what ``waiter`` returned, or ``None`` when the poll was ended early
            (the limit was reached or ``cancel`` was set) and ``waiter`` was
            cancelled.

        Raises:
            whatever ``waiter`` raised.
        """
        ticket, ended = self.open(caller)
        task = asyncio.ensure_future(waiter)
        stops = [asyncio.ensure_future(ended.wait())]
        if cancel is not None:
            stops.append(asyncio.ensure_future(cancel.wait()))
        try:
            await asyncio.wait([task, *stops], return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.close(caller, ticket)
            for stop in stops:
                stop.cancel()
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if task.cancelled():
            return None
        return task.result()
