"""The running side of the share memory watchdog: samples the processes on
devices holding time-sliced shares, lets
:class:`gpubroker.enforce.watchdog.ShareWatchdog` judge them, and acts:
notices to the holder, then the offending process ended, with the reason
recorded. Only processes that map to the over-cap lease are ever touched.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Callable
from typing import Any

from traitlets import Float, Instance, default
from traitlets.config import LoggingConfigurable

from .enforce.watchdog import (
    Overuse,
    ProcessSample,
    ShareCap,
    ShareWatchdog,
    Terminate,
    Withdrawn,
    end_process,
    lease_of_pid,
)
from .model.holdings import LeaseRef


def _mib(value: int) -> str:
    return f"{value / 1024:.1f} GiB"


class ShareGuard(LoggingConfigurable):
    """Every ``interval`` seconds, enforce the memory caps of shares.

    Args:
        broker: the broker core (leases, notices, device backend).
    """

    interval = Float(10, help="Seconds between two samples of the shared devices' processes.").tag(
        config=True
    )

    watchdog = Instance(ShareWatchdog, help="The judgement (configure ShareWatchdog).")

    @default("watchdog")
    def _default_watchdog(self) -> ShareWatchdog:
        return ShareWatchdog(parent=self)

    def __init__(
        self, broker: Any, pid_lease: Callable[[int], int | None] = lease_of_pid, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.broker = broker
        self.pid_lease = pid_lease

    @property
    def enabled(self) -> bool:
        """Whether the watchdog runs (``ShareWatchdog.enabled``)."""
        return bool(self.watchdog.enabled)

    async def run(self) -> None:
        """Check forever, every ``interval`` seconds; errors are logged."""
        while True:
            try:
                await self.check_once()
            except Exception:
                self.log.exception("Share watchdog pass failed")
            await asyncio.sleep(self.interval)

    def _samples(self, caps: list[ShareCap]) -> tuple[list[ProcessSample], dict[str, int]]:
        """The processes on the capped devices, and each device's memory in
        use (MiB), read from the device backend (NVML: blocking)."""
        samples, used = [], {}
        for device in sorted({cap.device_uuid for cap in caps}):
            try:
                usage = self.broker.backend.usage(device)
            except Exception as err:
                self.log.warning("Cannot read processes of %s: %s", device, err)
                continue
            used[device] = usage.memory_used_mib
            samples.extend(ProcessSample(device, p.pid, p.used_memory_mib) for p in usage.processes)
        return samples, used

    async def check_once(self, now: dt.datetime | None = None) -> list[Any]:
        """Sample, judge and act once; returns the actions taken."""
        leases: dict[int, LeaseRef] = {}
        caps: list[ShareCap] = []
        for lease, device, memory in self.broker.share_caps():
            leases[lease.id] = lease
            caps.append(
                ShareCap(lease.id, lease.user, device, memory, container=lease.container_id)
            )
        now = now or dt.datetime.now(dt.timezone.utc)
        # NVML off the event loop: a call can block for seconds (persistence
        # mode off) or longer (a GPU fallen off the bus)
        samples, used = await asyncio.to_thread(self._samples, caps)
        actions = self.watchdog.judge(samples, caps, self.pid_lease, now, used)
        for action in actions:
            try:
                await self._act(action, leases[action.lease_id])
            except Exception:
                self.log.exception("Share watchdog: cannot act on %s", action)
        return actions

    async def _act(self, action: Any, lease: LeaseRef) -> None:
        if isinstance(action, Overuse):
            message = (
                f"Your shared GPU uses {_mib(action.lease_used_mib or action.used_mib)} of its "
                f"{_mib(action.cap_mib)} cap (process {action.pid}: {_mib(action.used_mib)}). "
                f"Free memory, or process {action.pid} will be ended at "
                f"{action.deadline:%H:%M:%S} UTC."
            )
            self.broker.add_notice(
                lease, "share-overuse", message, action.deadline, actor="watchdog"
            )
        elif isinstance(action, Withdrawn):
            message = f"Process {action.pid} is back under your share's memory cap."
            self.broker.add_notice(lease, "share-overuse-withdrawn", message, actor="watchdog")
        elif isinstance(action, Terminate):
            self.log.warning(
                "Ending process %s of lease %s on %s: %s",
                action.pid,
                action.lease_id,
                action.device_uuid,
                action.reason,
            )
            await asyncio.to_thread(end_process, action.pid, self.watchdog.term_timeout)
            message = f"Process {action.pid} was ended: {action.reason}"
            self.broker.add_notice(lease, "share-process-ended", message, actor="watchdog")
