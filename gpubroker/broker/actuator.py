"""Device side effects, carried out off the event loop.

Creating a MIG instance through NVML takes from a few hundred milliseconds
to seconds, and destroying one about as long; run inside a scheduling pass
they would stall every request the broker serves. With an
:class:`Actuator`, a pass only records what is to be made; the actuator runs
the device call in a worker thread (``asyncio.to_thread``) and hands the
outcome back to the event loop, where the broker commits it as the next
transition (the grant, or the failure and the wait).

The actuator knows nothing of leases or the store: it runs calls and calls
back. Destroys are retried with exponential backoff; a grant is not retried
here (its failure is an event and the request waits on: the next pass asks
again, after a backoff the broker keeps).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

#: what a finished call hands back: its result, or the error it raised
Done = Callable[[Any, BaseException | None], None]


class Actuator:
    """Runs device calls in worker threads, one task per call.

    Args:
        log: a logger (``%s`` formatting).
        retries: further tries of a call submitted with ``retry=True``.
        backoff: seconds before the first retry; doubled for each next one.
    """

    def __init__(self, log: Any, retries: int = 3, backoff: float = 0.5) -> None:
        self.log = log
        self.retries = retries
        self.backoff = backoff
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def busy(self, key: str) -> bool:
        """Whether a call submitted under ``key`` is still running."""
        task = self._tasks.get(key)
        return task is not None and not task.done()

    def submit(self, key: str, call: Callable[[], T], done: Done, retry: bool = False) -> None:
        """Run ``call()`` in a worker thread, then ``done(result, None)`` or
        ``done(None, error)`` on the event loop. ``key`` names the call (one
        at a time per key; a second submit while it runs is ignored).
        With ``retry``, a call that raises is tried again up to
        ``retries`` times, ``backoff`` seconds apart and doubling."""
        if self.busy(key):
            return
        self._tasks[key] = asyncio.ensure_future(self._run(key, call, done, retry))

    async def _run(self, key: str, call: Callable[[], Any], done: Done, retry: bool) -> None:
        delay = self.backoff
        tries = 1 + (self.retries if retry else 0)
        error: BaseException | None = None
        for attempt in range(tries):
            try:
                result = await asyncio.to_thread(call)
            except Exception as err:
                error = err
                if attempt + 1 < tries:
                    self.log.warning("%s failed (%s); trying again in %s s", key, err, delay)
                    await asyncio.sleep(delay)
                    delay *= 2
                continue
            self._finish(key, done, result, None)
            return
        self._finish(key, done, None, error)

    def _finish(self, key: str, done: Done, result: Any, error: BaseException | None) -> None:
        self._tasks.pop(key, None)  # done may submit under the same key again
        try:
            done(result, error)
        except Exception:
            self.log.exception("Committing the outcome of %s failed", key)

    async def settled(self, key: str, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for the call submitted under
        ``key`` (if one runs) to finish and be handed back. Returns whether
        none runs any more."""
        task = self._tasks.get(key)
        if task is None or task.done():
            return True
        done, _ = await asyncio.wait({task}, timeout=timeout)
        return bool(done)

    async def idle(self) -> None:
        """Wait until every submitted call has finished and been handed back."""
        while pending := [t for t in self._tasks.values() if not t.done()]:
            await asyncio.gather(*pending, return_exceptions=True)

    def cancel(self) -> None:
        """Stop waiting for every call (at shutdown; running threads end on
        their own, their outcomes are dropped: the next start reconciles)."""
        for task in self._tasks.values():
            task.cancel()
