"""A review of the usage reports, the metrics and the audit log: a lease
on two models counts once, unknown GPU use is no 0 % efficiency, periods
compare as instants, the zone is a place's, labelled counters start at 0,
the pool labels agree, and an admin's preemption of a server is the
admin's to its release."""

from __future__ import annotations

import datetime as dt

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpubroker.observe.metrics import BrokerMetrics
from gpubroker.usage.ledger import EngineTelemetry, Ledger
from gpubroker.usage.report import ReportError, parse_request

from ..conftest import make_broker
from . import test_usage_ledger
from .test_usage_ledger import HOUR, Clock, report

clock = test_usage_ledger.clock  # the fixture: a clock the broker and the ledger share


def test_dst_gap_period_with_end_before_start_is_refused() -> None:
    """report.py:136 compares two times of one ZoneInfo by wall clock: in the
    spring-forward gap, from=02:30 (01:30Z) is after to=03:00 (01:00Z), yet
    the request is accepted (200 over the API, an empty report)."""
    now = dt.datetime(2026, 12, 6, tzinfo=dt.timezone.utc)
    with pytest.raises(ReportError) as err:
        r = parse_request(
            "2026-03-29T02:30", "2026-03-29T03:00", "user", "Europe/Berlin", "json", now
        )
        print("accepted:", r.start, r.end)
    assert err.value.param == "from"


def test_the_first_day_of_1970_is_a_valid_date_in_any_zone() -> None:
    """docs/usage.md: 'between the years 1970 and 9000'; --from=1970-01-01
    --tz=Europe/Berlin is refused (report.py:183 checks the UTC year)."""
    now = dt.datetime(2026, 12, 6, tzinfo=dt.timezone.utc)
    parse_request("1970-01-01", "1970-02-01", "user", "Europe/Berlin", "json", now)


def test_non_iana_zone_names_are_refused() -> None:
    """docs: --tz is 'an IANA name'; 'localtime' (the server's own zone
    file) is accepted, so the period depends on the host's setting."""
    now = dt.datetime(2026, 12, 6, tzinfo=dt.timezone.utc)
    with pytest.raises(ReportError):
        parse_request("2026-11-01", "2026-12-01", "day", "localtime", "json", now)


class NoTelemetry:
    """An engine like Slurm's: no GPU use known (docs/slurm.md: 'the usage
    reports count GPU-hours allocated, not GPU use')."""

    def telemetry(self, uuids):
        return {}


def test_unknown_gpu_use_is_not_reported_as_zero_efficiency(db_url: str, clock: Clock) -> None:
    """With no utilization known (Slurm engine, A100 MIG, NVML read errors)
    the ledger records sampled_s == 0, but the report says used 0.0 and
    efficiency 0.0: a 0 % efficiency a finance lead reads as 'all idle'.
    Efficiency should be None (unknown) when nothing was sampled, and used
    over the sampled time only otherwise (report.py:266, ledger_repo.aggregate
    ignores sampled_s)."""
    broker = make_broker(db_url)
    ledger = Ledger(broker.session_factory, EngineTelemetry(NoTelemetry()), clock=clock.epoch)
    ledger.sample_interval = 600.0
    ledger.start()
    lease = broker.request_lease("sam", "", 2, holder_kind="external")
    ledger.flush()
    for _ in range(6):
        clock.advance(dt.timedelta(minutes=10))
        ledger.sample()
    broker.release_lease(lease["id"], "done")
    ledger.flush()
    sam = report(broker, clock)["sam"]
    assert sam.gpu_hours_allocated == pytest.approx(2.0)
    assert sam.efficiency is None, f"efficiency {sam.efficiency} though no use was ever known"


def test_lease_and_slot_gauges_agree_on_the_pool_label(db_url: str) -> None:
    """gpubroker_slots_held labels a slot with its device's pool
    ('default'); gpubroker_leases labels a lease with the pool it asked for
    ('' when none): 'sum by (pool)' of the two never joins (metrics.py:151
    vs metrics.py:130)."""
    broker = make_broker(db_url)
    broker.request_lease("ann", "", 1, holder_kind="external")
    text = BrokerMetrics(broker).exposition().decode()
    pools = {
        fam.name: {s.labels["pool"] for s in fam.samples}
        for fam in text_string_to_metric_families(text)
        if fam.name in ("gpubroker_leases", "gpubroker_slots_held")
    }
    assert pools["gpubroker_leases"] == pools["gpubroker_slots_held"], pools


def test_a_lease_on_two_device_models_counts_once_per_user_group_pool_and_day(
    db_url: str, clock: Clock
) -> None:
    """One 2-GPU lease on a node with an H100 and an A100, culled after an
    hour: by user, group, pool and day it is 1 lease and 1 cull, but the
    report says 2 and 2 (ledger_repo.aggregate groups by (key, model) and
    report.combine sums the per-model distinct counts; the 'holders' column
    aggregate's docstring promises for this is never selected)."""
    broker = make_broker(db_url, inventory=["1 x H100", "1 x A100-80GB"])
    from .test_usage_ledger import ledger_of

    ledger = ledger_of(broker, clock)
    lease = broker.request_lease("ann", "", 2)
    assert len({d["name"] for d in lease["devices"]}) == 2
    clock.advance(HOUR)
    broker.note_lease(lease["id"], "culled", "culled: idle", detail={"idle_seconds": 1800.0})
    broker.stop_lease(lease["id"], "culled: idle", cause="cull")
    ledger.flush()
    got = {}
    for by in ("user", "group", "pool", "day"):
        rows = report(broker, clock, by=by)
        row = next(r for r in rows.values() if r.gpu_hours_allocated > 0)
        got[by] = (row.leases, row.culls)
    assert got == {by: (1, 1) for by in got}, got


def test_labelled_counters_have_their_known_series_from_the_first_scrape(db_url: str) -> None:
    """gpubroker_releases_total{cause=...}, gpubroker_grants_total and
    gpubroker_job_outcomes_total{outcome=...} appear only after their first
    event, so increase()/rate() over the first cull, preemption or failed job
    reads 0 (metrics.py:52-66; the queue gauge already pre-fills its
    classes: 'a gap is not a 0')."""
    broker = make_broker(db_url)
    text = BrokerMetrics(broker).exposition().decode()
    causes = {
        s.labels.get("cause")
        for fam in text_string_to_metric_families(text)
        if fam.name == "gpubroker_releases"
        for s in fam.samples
        if s.name == "gpubroker_releases_total"
    }
    assert {"release", "cancel", "cull", "preemption", "time-limit", "reconcile"} <= causes, causes


def test_an_admins_preemption_of_a_server_names_the_admin_on_its_release(db_url: str) -> None:
    """docs/usage.md (audit log): an admin's preemption is an entry of its
    own 'beside the lease's transitions it causes (stopping or released,
    actor the admin)'. For a hub server the release is recorded with actor
    'scheduler' (broker/leases.py:318 CAUSE_ACTORS['preemption']; stops.py:104),
    so `gpubroker audit --kind=preemption` shows an admin's decision as the
    scheduler's; the same preemption of an external lease names the admin."""
    from gpubroker.observe import audit

    broker = make_broker(db_url)
    broker.on_evict = lambda view: None  # the service stops the hub server
    lease = broker.request_lease("ann", "", 1)
    broker.preempt_lease(lease["id"], "maintenance", actor="root")
    broker.release_lease(lease["id"], "server stopped", actor="gpubroker")
    entries = audit.query(broker.session_factory, kind="preemption", on_behalf=("gpubroker",))
    released = [e for e in entries if e["action"] == "released"]
    assert [e["actor"] for e in released] == ["root"], released


def test_a_server_stopped_for_an_admins_preemption_and_found_gone_names_the_admin(
    db_url: str,
) -> None:
    """The server of a lease an admin preempted is found gone by the
    reconciliation before the spawner reports it stopped: its release keeps
    the stop's reason, cause and the admin as actor."""
    import datetime as dt

    from gpubroker.core import utcnow
    from gpubroker.observe import audit

    broker = make_broker(db_url)
    broker.on_evict = lambda view: None  # the service stops the hub server
    lease = broker.request_lease("ann", "", 1)
    broker.preempt_lease(lease["id"], "maintenance", actor="root")
    assert broker.reconcile(set(), utcnow() + dt.timedelta(seconds=1)) == [lease["id"]]
    entries = audit.query(broker.session_factory, kind="preemption", on_behalf=("gpubroker",))
    released = [e for e in entries if e["action"] == "released"]
    assert [e["actor"] for e in released] == ["root"], released


def test_the_audit_command_takes_the_brokers_service_name_from_its_option(db_url: str) -> None:
    """A broker registered as ``gpu-svc``: the spawner's requests and
    releases, made through that service for the user, are no admin actions
    when the admin's shell names the service (before: only through
    ``$JUPYTERHUB_SERVICE_NAME``, which a shell does not have)."""
    import json

    from .test_usage_ledger import _cli

    broker = make_broker(db_url)
    lease = broker.request_lease("ann", "", 1, actor="gpu-svc")
    broker.release_lease(lease["id"], "server stopped", actor="gpu-svc")

    def actors(*args: str) -> set[str]:
        done = _cli("audit", f"--db-url={db_url}", "--json", *args)
        assert done.returncode == 0, done.stderr
        return {json.loads(line)["actor"] for line in done.stdout.splitlines()}

    assert "gpu-svc" in actors()  # taken for an admin acting on ann's lease
    assert "gpu-svc" not in actors("--service-name=gpu-svc")


def test_a_report_ending_before_the_default_start_names_to_and_the_default() -> None:
    """``--to`` before this month without ``--from``: the message named
    ``--from``, which the admin never typed."""
    now = dt.datetime(2026, 12, 5, tzinfo=dt.timezone.utc)
    with pytest.raises(ReportError) as err:
        parse_request(None, "2026-10-15", "user", "UTC", "table", now)
    assert err.value.param == "to"
    assert "from, which defaults to the 1st of this month (2026-12-01" in str(err.value)
