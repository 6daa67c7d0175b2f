"""The usage ledger: GPU-seconds allocated and used, per lease and slot.

The ledger is fed by the lifecycle events, read from the durable
transition log: every ``flush_interval`` seconds it folds the log's new
entries into intervals (:func:`gpubroker.usage.intervals.fold`), adds the
GPU use sampled since, and writes a *heartbeat* and the id of the last
entry folded, all in one transaction. So an entry is folded exactly once.
A usage report flushes it first (so it counts the last few seconds); lease
requests and releases never write it.

GPU use is sampled every ``sample_interval`` seconds, off the event loop
(a worker thread reads the device backend), for each open slot interval:

* a whole device: NVML's utilization of the device
  (``nvmlDeviceGetUtilizationRates().gpu``);
* a MIG instance: its graphics-engine activity from NVML's GPU Performance
  Monitoring (``NVML_GPM_METRIC_GRAPHICS_UTIL`` of its GPU instance: the
  figure DCGM exports as ``DCGM_FI_PROF_GR_ENGINE_ACTIVE``); not counted
  where the GPU has no GPM (before Hopper);
* a share: the whole device's utilization. NVML does not split time-sliced
  utilization by process here, so when several shares of one device are
  busy at once each is charged the device's figure (times its weight).

A sample adds ``weight * utilization * seconds`` to the interval's used
GPU-seconds.

At start-up (:meth:`Ledger.start`) the ledger folds what the log holds
beyond its mark, closes every interval still open at the broker's last
sign of life (the later of the heartbeat and the newest log entry: a
crash loses at most one ``flush_interval`` and never counts twice), and
opens new intervals, from now, for the leases that are still pending or
granted.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Callable
from typing import Any

from traitlets import Bool, Dict, Float, Integer, TraitError, validate
from traitlets.config import LoggingConfigurable

from ..devices.base import DeviceBackendError
from ..store import ledger_repo as repo
from .intervals import accrue, fold


class Ledger(LoggingConfigurable):
    """The usage ledger of one broker (see the module's documentation).

    Args:
        session_factory: the store's sessions.
        backend: the device backend (its ``usage(uuid)`` is sampled).
        pool_of: a device's pool name, by UUID.
        clock: UTC epoch seconds now (``time.time``).
        inventory: the devices to read telemetry of at each sample (for
            metrics): ``(uuid, index, model name, node, MIG mode on)``.
    """

    enabled = Bool(
        True,
        help="Keep the usage ledger (GPU-hours allocated and used per lease, for "
        "`gpubroker report` and GET /api/v1/usage). Off: nothing is recorded.",
    ).tag(config=True)

    flush_interval = Float(
        10.0,
        help="Seconds between the ledger's writes: it folds the new lifecycle events "
        "into intervals, adds the GPU use sampled and writes its heartbeat. A broker "
        "that crashes loses at most this much of the intervals open at the crash.",
    ).tag(config=True)

    sample_interval = Float(
        30.0,
        help="Seconds between samples of the GPU use of every held slot (read off "
        "the event loop). 0: GPU use is not sampled (used GPU-hours stay 0).",
    ).tag(config=True)

    batch_size = Integer(
        20000,
        help="Most transition-log entries folded in one transaction.",
    ).tag(config=True)

    price_per_gpu_hour = Dict(
        {},
        help="Price of one GPU-hour by device model (the NVML name, e.g. "
        '{"NVIDIA H100 80GB HBM3": 2.5}; "*" for every other model), for the '
        "cost column of usage reports: allocated GPU-hours * price. Empty: no cost.",
    ).tag(config=True)

    @validate("flush_interval")
    def _valid_flush(self, proposal: Any) -> float:
        value = float(proposal["value"])
        if not 0.05 <= value <= 3600:
            raise TraitError(f"Ledger.flush_interval: must be 0.05 to 3600 seconds, not {value}")
        return value

    @validate("sample_interval")
    def _valid_sample(self, proposal: Any) -> float:
        value = float(proposal["value"])
        if not 0 <= value <= 86400:
            raise TraitError(f"Ledger.sample_interval: must be 0 to 86400 seconds, not {value}")
        return value

    @validate("price_per_gpu_hour")
    def _valid_prices(self, proposal: Any) -> dict[str, float]:
        prices = {}
        for model, price in proposal["value"].items():
            number = not isinstance(price, bool) and isinstance(price, (int, float))
            if not number or not 0 <= price < math.inf:
                raise TraitError(
                    f"Ledger.price_per_gpu_hour[{model!r}]: must be a finite number >= 0,"
                    f" not {price!r}"
                )
            prices[str(model)] = float(price)
        return prices

    def __init__(
        self,
        session_factory: Any,
        backend: Any,
        pool_of: Callable[[str], str] = lambda uuid: "",
        clock: Callable[[], float] = time.time,
        inventory: Callable[[], list[tuple[str, int, str, str, bool]]] = lambda: [],
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.inventory = inventory
        self.session_factory = session_factory
        self.backend = backend
        self.pool_of = pool_of
        self.clock = clock
        self._open: list[tuple[int, str, str, str, float, float, float | None]] = []
        self._sampled_at: dict[int, float] = {}
        self._accrued: dict[int, tuple[float, float]] = {}
        #: the newest telemetry of every device and MIG device (for metrics):
        #: (DCGM-style labels, DeviceUsage)
        self.telemetry: list[tuple[dict[str, str], Any]] = []
        #: when the newest sample was taken (UTC epoch seconds; 0: never)
        self.sampled_at = 0.0
        self._born = clock()  # intervals closed before it are not sampled

    # --- writing --------------------------------------------------------------

    def start(self, booted: float | None = None) -> dict[str, int]:
        """Catch up with the log, close what a stop left open at the last
        sign of life, and reopen it from this start. Returns counts
        (folded, closed, reopened).

        The entries of the previous broker (stamped before ``booted``) are
        folded first, then the intervals still open are closed at the last
        sign of life (the later of the heartbeat and the newest of those
        entries) and reopened, with the same facts, from ``booted``; only
        then are this broker's own entries folded (its adoption of the
        leases may release or grant some at once), so the time the broker
        was down is never counted. The catch-up keeps the stored heartbeat
        (a start killed before its reopen leaves the last sign of life as it
        was), and the reopen writes the heartbeat ``now``.

        Args:
            booted: when this broker process started (UTC epoch seconds;
                default now).
        """
        now = self.clock()
        boot = now if booted is None else booted
        with self.session_factory() as session:
            _, heartbeat = repo.read_mark(session)  # before the catch-up writes a new one
        # the catch-up writes back the stored heartbeat, not now: a broker
        # killed before the reopen below leaves the last sign of life as it was
        folded = self._fold_all(heartbeat, before=boot)
        with self.session_factory.begin() as session:
            event_id, _ = repo.read_mark(session)
            last_alive = max(heartbeat, repo.last_event_s(session, boot))
            closed, reopened = repo.reopen(session, last_alive, boot)
            repo.write_mark(session, event_id, now)
        folded += self._fold_all(now)
        self.log.info(
            "Usage ledger: %s log entries folded, %s intervals closed at %s and reopened",
            folded,
            closed,
            time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(last_alive)) if last_alive else "-",
        )
        return {"folded": folded, "closed": closed, "reopened": reopened}

    def _fold_all(self, now: float, before: float | None = None) -> int:
        total = 0
        while True:
            n = self.flush(now, before)
            total += n
            if n < self.batch_size:
                return total

    def flush(self, now: float | None = None, before: float | None = None) -> int:
        """Fold the new log entries (only those stamped before ``before``,
        when given), add the sampled use, write the heartbeat (``now``, UTC
        epoch seconds; default the clock; the start-up catch-up passes the
        stored heartbeat), in one transaction. Returns how many entries were
        folded."""
        now = self.clock() if now is None else now
        accrued, self._accrued = self._accrued, {}
        try:
            with self.session_factory.begin() as session:
                event_id, _ = repo.read_mark(session)
                entries = repo.entries_after(session, event_id, self.batch_size)
                if before is not None:
                    entries = list(itertools.takewhile(lambda e: e.at_s < before, entries))
                if entries:
                    ids = {e.lease_id for e in entries}
                    holders, slots = repo.holders_and_slots(session, ids, self.pool_of)
                    repo.apply_changes(session, fold(entries, holders, slots))
                    event_id = entries[-1].id
                repo.add_used(session, accrued)
                repo.write_mark(session, event_id, now)
                self._open = repo.open_slots(session, max(self.sampled_at, self._born))
        except Exception:
            self._add(accrued)  # kept for the next try
            raise
        return len(entries)

    # --- sampling -------------------------------------------------------------

    def sample(self, now: float | None = None) -> int:
        """Read the use of every open slot interval and add it to what the
        next flush writes (blocking: NVML). Returns how many slots were read."""
        now = self.clock() if now is None else now
        self.flush(now)  # the intervals as they stand
        return self._merge(now, *self._measure(now, self.inventory(), list(self._open)))

    def _measure(
        self,
        now: float,
        inventory: list[tuple[str, int, str, str, bool]],
        intervals: list[tuple[int, str, str, str, float, float, float | None]],
    ) -> tuple[dict[int, tuple[float, float]], list[tuple[dict[str, str], Any]]]:
        """(used and sampled seconds per open slot interval since its last
        sample, telemetry of ``inventory``); every UUID is read once (a MIG
        device's engine activity is measured between two reads). Safe in a
        worker thread. ``intervals``: the open slot intervals as the flush
        just before this sample left them."""
        cap = 2 * max(self.sample_interval, self.flush_interval)
        reads: dict[str, Any] = {}
        accrued: dict[int, tuple[float, float]] = {}
        sampled: dict[int, float] = {}
        for interval_id, kind, device, slot, weight, start, end in intervals:
            uuid = slot if kind == "mig" and slot else device
            if uuid not in reads:
                reads[uuid] = self._read(uuid, instance=kind == "mig" and bool(slot))
            since = max(self._sampled_at.get(interval_id, start), start)
            upto = now if end is None else min(now, end)  # never past the interval's end
            seconds = min(max(upto - since, 0.0), cap)
            accrued[interval_id] = accrue(weight, _utilization(kind, reads[uuid]), seconds)
            sampled[interval_id] = max(upto, since)  # an interval is never charged twice
        self._sampled_at = sampled
        return accrued, self._telemetry(inventory, reads)

    def _telemetry(
        self, inventory: list[tuple[str, int, str, str, bool]], reads: dict[str, Any]
    ) -> list[tuple[dict[str, str], Any]]:
        found = []
        for uuid, index, model, node, mig_on in inventory:
            labels = {"gpu": str(index), "UUID": uuid, "modelName": model, "Hostname": node}
            if uuid not in reads:
                reads[uuid] = self._read(uuid)
            if reads[uuid] is not None:
                found.append((labels, reads[uuid]))
            for mig in self._mig_devices(uuid) if mig_on else []:
                if mig.uuid not in reads:
                    reads[mig.uuid] = self._read(mig.uuid, instance=True)
                if reads[mig.uuid] is not None:
                    extra = {"GPU_I_PROFILE": mig.profile, "GPU_I_ID": str(mig.gi_id)}
                    found.append((labels | extra, reads[mig.uuid]))
        return found

    def _mig_devices(self, uuid: str) -> list[Any]:
        try:
            return list(self.backend.mig_devices(uuid))
        except Exception as err:
            self.log.warning("Usage ledger: cannot list the MIG devices of %s: %s", uuid, err)
            return []

    def _merge(
        self,
        now: float,
        accrued: dict[int, tuple[float, float]],
        telemetry: list[tuple[dict[str, str], Any]],
    ) -> int:
        """Add one sample's figures to what the next flush writes (on the loop)."""
        self._add(accrued)
        self.telemetry, self.sampled_at = telemetry, now
        return len(accrued)

    def _add(self, accrued: dict[int, tuple[float, float]]) -> None:
        for key, (du, ds) in accrued.items():
            old = self._accrued.get(key, (0.0, 0.0))
            self._accrued[key] = (old[0] + du, old[1] + ds)

    def _read(self, uuid: str, instance: bool = False) -> Any:
        """The backend's usage read of ``uuid``; ``None`` when it cannot be
        read (the use is then unknown for this sample).

        A MIG instance (``instance``) the backend no longer knows (its
        ``KeyError``) was destroyed since the sample's intervals or listing
        were taken (its lease was released meanwhile): skipped with a debug
        line. Any other failure is a warning saying what failed.
        """
        try:
            return self.backend.usage(uuid)
        except KeyError:
            if instance:
                self.log.debug(
                    "Usage ledger: MIG instance %s is gone (released since the sample "
                    "began); its use is not read",
                    uuid,
                )
            else:
                self.log.warning(
                    "Usage ledger: cannot read the use of %s: the device backend has "
                    "no such device",
                    uuid,
                )
        except DeviceBackendError as err:  # its message says what failed
            self.log.warning("Usage ledger: cannot read the use of %s: %s", uuid, err)
        except Exception as err:
            self.log.warning(
                "Usage ledger: cannot read the use of %s: unexpected %s from the "
                "device backend: %s",
                uuid,
                type(err).__name__,
                err,
            )
        return None

    async def run(self) -> None:
        """Flush every ``flush_interval`` and sample every ``sample_interval``
        seconds (the samples in a worker thread), until cancelled."""
        loop = asyncio.get_running_loop()
        next_sample = time.monotonic() + self.sample_interval
        while True:
            await asyncio.sleep(self.flush_interval)
            if self.sample_interval > 0 and time.monotonic() >= next_sample:
                next_sample = time.monotonic() + self.sample_interval
                try:
                    now = self.clock()
                    self.flush(now)  # the intervals as they stand
                    snapshot = list(self._open)
                    measured = await loop.run_in_executor(
                        None, self._measure, now, self.inventory(), snapshot
                    )
                    self._merge(now, *measured)
                except Exception:
                    self.log.exception("Usage ledger: sampling failed")
            try:
                self.flush()
            except Exception:
                self.log.exception("Usage ledger: writing failed (tried again)")

    def stop(self) -> None:
        """The last flush and heartbeat, at a clean shutdown."""
        try:
            self.flush()
        except Exception:
            self.log.exception("Usage ledger: the last write failed")


def _utilization(kind: str, usage: Any) -> float | None:
    """The fraction 0..1 of time a slot computed, from its usage read."""
    if usage is None:
        return None
    if kind == "mig":
        activity: float | None = usage.engine_activity
        return activity
    if usage.utilization_gpu is None:
        return None
    return float(usage.utilization_gpu) / 100.0


class EngineTelemetry:
    """What the ledger samples, read from an engine rather than a device
    backend (the Slurm engine: its devices are on other hosts, and Slurm
    reports no GPU use, so every read is ``None``: allocated, use unknown).

    Args:
        engine: an :class:`~gpubroker.engines.base.Engine`.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def usage(self, uuid: str) -> Any:
        """The engine's telemetry of ``uuid``, ``None`` when it has none."""
        return self.engine.telemetry([uuid]).get(uuid)

    def mig_devices(self, uuid: str) -> list[Any]:
        """No MIG devices: engines other than the local one report none."""
        return []
