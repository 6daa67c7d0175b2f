"""Coalesced scheduling passes.

A command that changes what the scheduler sees asks for a pass. The gap
kept between two passes is as long as the last pass took, at most
``interval`` seconds, so passes never take more than about half of the
broker's time. When the last pass ended longer ago than that (the broker is
idle, or passes are cheap), the pass runs at once, inside the command, and a
request is answered granted. Otherwise the command only marks the state
dirty and answers; :meth:`PassLoop.run` runs one pass when the gap is over,
covering every change since: under load, however many commands arrive,
passes run at most once per gap.

A change whose pass cannot grant anything at once (the broker says which:
a request nothing is free for, some withdrawals) is *lazy*: its pass keeps
a gap ``lazy_factor`` times as long as the last pass took (still at most
``interval``), so that, below that cap, a stream of such changes spends at
most ``1 / (1 + lazy_factor)`` of the broker's time in passes over a long
queue. Any other change (and a rolled-back pass, :meth:`PassLoop.mark_dirty`)
cuts a lazy gap short to the plain one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any


class PassLoop:
    """When to run the next scheduling pass.

    Args:
        interval: the longest gap between two passes, seconds (>= 0).
        clock: monotonic seconds (``time.monotonic``; a test passes its own).
        lazy_factor: the gap after lazy changes, in multiples of the last
            pass's time (>= 1).
    """

    def __init__(
        self,
        interval: float,
        clock: Callable[[], float] = time.monotonic,
        lazy_factor: float = 3.0,
    ) -> None:
        self.interval = interval
        self.clock = clock
        self.lazy_factor = max(lazy_factor, 1.0)
        #: a change waiting for the loop's pass is not lazy (the plain gap holds)
        self._urgent = False
        self._woken = asyncio.Event()
        self._last_end = float("-inf")
        #: seconds the last pass took (the gap kept after it)
        self.last_took = 0.0
        self._started: float | None = None
        self._dirty = asyncio.Event()
        self._ended: asyncio.Future[None] | None = None
        #: passes run, and passes asked for (commands coalesced into them)
        self.passes = 0
        self.asked = 0
        #: loop passes that failed in a row (their retries back off)
        self._failures = 0

    def at_once(self, lazy: bool = False) -> bool:
        """Whether a pass asked for now runs at once (the last pass ended at
        least :meth:`gap` ago); when not, the state is marked dirty for
        :meth:`run`. ``lazy``: its pass cannot grant anything at once."""
        self.asked += 1
        if self.clock() - self._last_end >= self.gap(lazy and not self._urgent):
            self._started = self.clock()
            return True
        if not lazy and not self._urgent:
            self._urgent = True
            self._woken.set()  # the loop may be keeping a lazy gap: shorten it
        self._dirty.set()
        return False

    def mark_dirty(self) -> None:
        """Ask the loop for a pass (after a rollback undid one): not lazy."""
        self._urgent = True
        self._woken.set()
        self._dirty.set()

    def gap(self, lazy: bool = False) -> float:
        """Seconds to keep between two passes: as long as the last one
        took (``lazy``: ``lazy_factor`` times as long), at most ``interval``."""
        return min(self.interval, self.last_took * (self.lazy_factor if lazy else 1.0))

    def starting(self) -> None:
        """Record that the loop starts a pass now."""
        self._started = self.clock()

    def ran(self) -> None:
        """Record that a pass (at once or from the loop) just ended."""
        self.passes += 1
        self._last_end = self.clock()
        if self._started is not None:
            self.last_took = self._last_end - self._started
        self._started = None
        self._dirty.clear()
        self._urgent = False
        self._woken.clear()
        if self._ended is not None and not self._ended.done():
            self._ended.set_result(None)
        self._ended = None

    async def settled(self, timeout: float) -> None:
        """Return once no change waits for a pass (at most ``timeout``
        seconds): a request answered after it carries the pass's verdict."""
        if not self._dirty.is_set():
            return
        if self._ended is None:
            self._ended = asyncio.get_running_loop().create_future()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._ended), timeout)

    async def run(self, run_pass: Callable[[], Any], log: Any) -> None:
        """Forever: wait for a dirty mark, then until the gap since the last
        pass is over (the lazy one while only lazy changes wait; worked out
        again whenever a change that is not lazy arrives), then
        ``run_pass()`` (which calls :meth:`ran`). A pass that raises after
        its rollback asked for another (:meth:`mark_dirty`) is run again,
        after ``interval`` seconds doubled per failure in a row (at most
        5 s)."""
        while True:
            await self._dirty.wait()
            wait = self._last_end + self.gap(not self._urgent) - self.clock()
            if wait > 0:
                self._woken.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    # woken early by a change that is not lazy
                    await asyncio.wait_for(self._woken.wait(), wait)
                continue  # again: a pass may have run at once meanwhile, the gap changed
            try:
                self.starting()
                # what asks from now on (the rollback of this very pass,
                # :meth:`mark_dirty`) needs a pass after this one
                self._dirty.clear()
                run_pass()
            except Exception:
                log.exception("Scheduling pass failed")
                again = self._dirty.is_set()
                self.ran()
                if again:
                    # the changes it covered are waiting still: run it again,
                    # after a pause that doubles while passes keep failing
                    self._failures += 1
                    await asyncio.sleep(min(self.interval * 2.0**self._failures, 5.0))
                    self.mark_dirty()
            else:
                self._failures = 0
