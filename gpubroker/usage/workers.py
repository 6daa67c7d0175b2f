"""Where usage reports are built: a small pool of threads of their own,
and a bound on the reports one caller has in flight.

A report reads up to a year of intervals and may draw charts (matplotlib,
one drawing at a time); on the event loop's default executor, a user's
dozen reports held every worker thread the broker needs promptly (the MIG
actuator, the culler's reads, the share guard, the ledger), for as long as
they took. Here they queue behind one another instead, and one caller
asking for more than :attr:`ReportWorkers.per_caller` at once gets a 429.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import BrokerError

T = TypeVar("T")

#: threads that build reports, for the whole broker (``GPUBrokerApp.report_threads``)
WORKERS = 2
#: reports one caller may have in flight, building or queued
#: (``GPUBrokerApp.reports_per_caller``)
PER_CALLER = 2


class TooManyReports(BrokerError):
    """The caller has :attr:`ReportWorkers.per_caller` reports in flight (HTTP 429)."""

    status = 429


class ReportWorkers:
    """Builds reports off the event loop, in threads of their own.

    Args:
        workers: threads (reports built at once, broker-wide).
        per_caller: reports one caller may have in flight; one more is
            refused with :class:`TooManyReports`.
    """

    def __init__(self, workers: int = WORKERS, per_caller: int = PER_CALLER) -> None:
        self.per_caller = per_caller
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="gpubroker-report"
        )
        self._in_flight: collections.Counter[str] = collections.Counter()

    async def run(
        self, caller: str, build: Callable[[], T], first: Callable[[], None] | None = None
    ) -> T:
        """``build()`` in a report thread, for ``caller`` (a user or
        service name); returns what it returns. ``first``: run on the event
        loop once the report is admitted, before ``build`` (the ledger's
        flush), so a refused report costs nothing.

        Raises:
            TooManyReports: ``caller`` already has :attr:`per_caller`
                reports in flight.
            Exception: what ``first`` or ``build`` raised.
        """
        if self._in_flight[caller] >= self.per_caller:
            raise TooManyReports(
                f"usage: at most {self.per_caller} reports at once per caller; "
                "try again when one has finished"
            )
        self._in_flight[caller] += 1
        try:
            if first is not None:
                first()
            return await asyncio.get_running_loop().run_in_executor(self._pool, build)
        finally:
            self._in_flight[caller] -= 1
            if not self._in_flight[caller]:
                del self._in_flight[caller]

    def close(self) -> None:
        """Stop taking reports; those under way finish in their threads."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def flush_before_report(ledger: Any, log: Any) -> None:
    """Write the usage ledger (:class:`~gpubroker.usage.ledger.Ledger`,
    when it runs) so a report counts the newest events; a failure is logged
    to ``log`` and the report reads what is stored."""
    if ledger is not None and ledger.enabled:
        try:
            ledger.flush()
        except Exception:
            log.exception("Usage ledger: writing before a report failed")
