"""Prometheus metrics of the broker, through ``prometheus_client``.

Counters and the wait histogram are fed by the lifecycle events (an
:class:`~gpubroker.transitions.EventBus` subscriber); gauges are read at
each scrape from the broker's state in memory and from the usage ledger's
newest telemetry sample (so a scrape never calls NVML).

No metric has a user name as a label (one series per user would grow
without bound): per-user figures are in the usage reports.

Device telemetry uses the label names of NVIDIA's DCGM exporter (``gpu``,
``UUID``, ``modelName``, ``Hostname``; ``GPU_I_PROFILE`` and ``GPU_I_ID``
for MIG devices), so dashboards built on DCGM's series can join them.

The metrics, their types and labels are listed in the admin guide
(``docs/usage.md``): ``gpubroker_devices``, ``gpubroker_slots_held``,
``gpubroker_leases``, ``gpubroker_queue_length`` (gauges);
``gpubroker_queue_wait_seconds`` (histogram); ``gpubroker_grants_total``,
``gpubroker_releases_total``, ``gpubroker_preemptions_total``,
``gpubroker_culls_total``, ``gpubroker_job_outcomes_total``,
``gpubroker_culler_checks_total``, ``gpubroker_reconciliations_total``
(counters); ``gpubroker_culler_last_check_timestamp_seconds`` and
``gpubroker_reconciliation_last_success_timestamp_seconds`` (gauges the
culler and the reconciliation with the hub set);
``gpubroker_gpu_utilization_percent``, ``gpubroker_gpu_memory_used_bytes``,
``gpubroker_mig_engine_active_ratio`` and
``gpubroker_telemetry_timestamp_seconds`` (device telemetry).
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ..model.jobs import FINAL
from ..model.lifecycle import Event
from ..usage.intervals import RELEASE_CAUSES, event_cause

#: the histogram's buckets, seconds (1 s to 1 day)
WAIT_BUCKETS = (1, 5, 15, 60, 300, 900, 1800, 3600, 7200, 14400, 43200, 86400)


class BrokerMetrics:
    """The broker's metrics registry.

    Args:
        broker: the broker (its ``device_rows()`` and ``list_leases()``,
            read at a scrape).
        ledger: the usage ledger (its ``telemetry``), or ``None``.
    """

    def __init__(self, broker: Any, ledger: Any = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.grants = Counter(
            "gpubroker_grants", "Leases granted.", ["priority_class"], registry=self.registry
        )
        self.releases = Counter(
            "gpubroker_releases", "Leases ended, by cause.", ["cause"], registry=self.registry
        )
        self.preemptions = Counter(
            "gpubroker_preemptions", "Leases preempted or reclaimed.", registry=self.registry
        )
        self.culls = Counter("gpubroker_culls", "Idle leases culled.", registry=self.registry)
        self.jobs = Counter(
            "gpubroker_job_outcomes",
            "Batch jobs ended, by outcome.",
            ["outcome"],
            registry=self.registry,
        )
        self.waits = Histogram(
            "gpubroker_queue_wait_seconds",
            "Seconds each granted request waited in the queue.",
            ["priority_class"],
            buckets=WAIT_BUCKETS,
            registry=self.registry,
        )
        self.culler_checks = Counter(
            "gpubroker_culler_checks",
            "The culler's checks of the granted leases, by outcome (ok, failed).",
            ["outcome"],
            registry=self.registry,
        )
        self.culler_last_check = Gauge(
            "gpubroker_culler_last_check_timestamp_seconds",
            "When the culler last completed a check, or started (Unix time); 0: it is off.",
            registry=self.registry,
        )
        self.reconciliations = Counter(
            "gpubroker_reconciliations",
            "Rounds of the reconciliation of leases with the hub's servers, by outcome "
            "(ok, failed).",
            ["outcome"],
            registry=self.registry,
        )
        self.reconciled = Gauge(
            "gpubroker_reconciliation_last_success_timestamp_seconds",
            "When the reconciliation with the hub last completed a round (Unix time); 0: none yet.",
            registry=self.registry,
        )
        for outcome in ("ok", "failed"):
            self.culler_checks.labels(outcome)
            self.reconciliations.labels(outcome)
        self.registry.register(_StateCollector(broker, ledger))
        # every known label value has its series from the first scrape, at 0:
        # increase() over a counter's first event needs the 0 before it
        for klass in broker.priority_classes():
            self.grants.labels(klass)
            self.waits.labels(klass)
        for cause in RELEASE_CAUSES:
            self.releases.labels(cause)
        for outcome in sorted(FINAL):
            self.jobs.labels(outcome)

    def on_event(self, event: Event) -> None:
        """Count one lifecycle event (an event-bus subscriber)."""
        if event.kind == "granted":
            klass = str(event.detail.get("priority_class", ""))
            self.grants.labels(klass).inc()
            waited = event.detail.get("waited_s")
            if isinstance(waited, (int, float)):
                self.waits.labels(klass).observe(float(waited))
        elif event.kind == "job-ended":
            self.jobs.labels(str(event.detail.get("state", ""))).inc()
        elif event.kind == "released":
            cause = event_cause(event.detail, event.reason, event.actor, event.from_state)
            self.releases.labels(cause).inc()
            if cause == "preemption":
                self.preemptions.inc()
            elif cause == "cull":
                self.culls.inc()

    def culler_started(self) -> None:
        """The culler starts: the time of its "last check" until its first,
        so that the staleness alert does not fire while it waits out its
        first ``cull_every``."""
        self.culler_last_check.set_to_current_time()

    def culler_checked(self, ok: bool) -> None:
        """Count one of the culler's checks (its ``on_check`` hook); a
        completed one also sets the time of the last (now): an alert on
        ``time() - gpubroker_culler_last_check_timestamp_seconds`` finds a
        culler that has stopped checking."""
        self.culler_checks.labels("ok" if ok else "failed").inc()
        if ok:
            self.culler_last_check.set_to_current_time()

    def reconciled_once(self, ok: bool) -> None:
        """Count one round of the reconciliation with the hub; a completed
        one also sets the time of the last success (now): while the hub
        does not answer, leases of servers that are gone stay granted, and
        an alert on ``time() - gpubroker_reconciliation_last_success_timestamp_seconds``
        finds it."""
        self.reconciliations.labels("ok" if ok else "failed").inc()
        if ok:
            self.reconciled.set_to_current_time()

    def exposition(self) -> bytes:
        """The registry in Prometheus text format."""
        return generate_latest(self.registry)


class _StateCollector(Collector):
    """Gauges read from the broker's state at each scrape."""

    def __init__(self, broker: Any, ledger: Any) -> None:
        self.broker = broker
        self.ledger = ledger

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield from self._devices()
        yield from self._leases()
        yield from self._telemetry()

    def _devices(self) -> Iterator[GaugeMetricFamily]:
        states: Tally[str] = Tally({"free": 0, "held": 0, "drained": 0, "outside": 0, "absent": 0})
        slots: Tally[tuple[str, str]] = Tally()
        for device, holders in self.broker.device_rows():
            if not device.present:
                states["absent"] += 1
            elif holders:
                states["held"] += 1
            elif device.drained or device.mig_target is not None:
                states["drained"] += 1
            elif self.broker.outside_reason(device.uuid):
                states["outside"] += 1  # its engine takes no new work on it (GET /devices too)
            else:
                states["free"] += 1
            pool = self.broker.pool_spec(device.uuid).name
            for holder in holders:
                slots[(holder["kind"], pool)] += 1
        family = GaugeMetricFamily("gpubroker_devices", "Devices by state.", labels=["state"])
        for state, n in sorted(states.items()):
            family.add_metric([state], n)
        yield family
        family = GaugeMetricFamily(
            "gpubroker_slots_held", "Slots held now.", labels=["kind", "pool"]
        )
        for (kind, pool), n in sorted(slots.items()):
            family.add_metric([kind, pool], n)
        yield family

    def _leases(self) -> Iterator[GaugeMetricFamily]:
        leases: Tally[tuple[str, str, str]] = Tally()
        # every class has a series, 0 when nothing waits (a gap is not a 0)
        queue: Tally[str] = Tally(dict.fromkeys(self.broker.priority_classes(), 0))
        for lease in self.broker.list_leases():
            leases[(lease["state"], lease["priority_class"], self._pool_of(lease))] += 1
            if lease["state"] == "pending":
                queue[lease["priority_class"]] += 1
        family = GaugeMetricFamily(
            "gpubroker_leases", "Active leases.", labels=["state", "priority_class", "pool"]
        )
        for key, n in sorted(leases.items()):
            family.add_metric(list(key), n)
        yield family
        family = GaugeMetricFamily(
            "gpubroker_queue_length", "Requests waiting.", labels=["priority_class"]
        )
        for klass, n in sorted(queue.items()):
            family.add_metric([klass], n)
        yield family

    def _pool_of(self, lease: dict[str, Any]) -> str:
        """The ``pool`` label of a lease: a granted lease's devices' pool,
        as ``gpubroker_slots_held`` labels its slots; else the pool it asked
        for (``""``: any)."""
        devices = lease.get("devices") or []
        if lease["state"] == "granted" and devices:
            return str(self.broker.pool_spec(devices[0]["uuid"]).name)
        return str(lease["pool"] or "")

    def _telemetry(self) -> Iterator[GaugeMetricFamily]:
        if self.ledger is None:
            return
        base = ["gpu", "UUID", "modelName", "Hostname"]
        mig = [*base, "GPU_I_PROFILE", "GPU_I_ID"]
        util = GaugeMetricFamily(
            "gpubroker_gpu_utilization_percent",
            "GPU utilization of whole devices, percent (DCGM_FI_DEV_GPU_UTIL).",
            labels=base,
        )
        memory = GaugeMetricFamily(
            "gpubroker_gpu_memory_used_bytes",
            "Device memory in use (DCGM_FI_DEV_FB_USED, in bytes).",
            labels=mig,
        )
        engine = GaugeMetricFamily(
            "gpubroker_mig_engine_active_ratio",
            "Graphics-engine activity of MIG devices, 0-1 (DCGM_FI_PROF_GR_ENGINE_ACTIVE).",
            labels=mig,
        )
        for labels, usage in self.ledger.telemetry:
            values = [labels.get(name, "") for name in mig]
            memory.add_metric(values, usage.memory_used_mib * 1024 * 1024)
            if "GPU_I_ID" in labels:
                if usage.engine_activity is not None:
                    engine.add_metric(values, usage.engine_activity)
            elif usage.utilization_gpu is not None:
                util.add_metric(values[:4], usage.utilization_gpu)
        yield util
        yield memory
        yield engine
        stamp = GaugeMetricFamily(
            "gpubroker_telemetry_timestamp_seconds",
            "When the device telemetry was sampled (UTC epoch seconds; 0: not yet).",
        )
        stamp.add_metric([], self.ledger.sampled_at)
        yield stamp
