"""The usage ledger and its reports, on a real broker and SQLite store with
fake GPUs and a clock the test moves (hours pass in no time)."""

from __future__ import annotations

import datetime as dt
import functools
import json
import os
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from traitlets.config import Config

import gpubroker.core as core
from gpubroker.core import Broker
from gpubroker.devices.fake import FakeDeviceBackend
from gpubroker.store.db import make_engine, make_session_factory, upgrade
from gpubroker.usage.ledger import Ledger
from gpubroker.usage.query import build_report
from gpubroker.usage.report import ReportError, ReportRow, combine, parse_request

from ..conftest import make_broker
from .test_sharing_core import sharing_broker

T0 = dt.datetime(2026, 11, 2, 8, 0, tzinfo=dt.timezone.utc)
HOUR = dt.timedelta(hours=1)


class Clock:
    """The broker's and the ledger's clock (``core.utcnow``), moved by hand."""

    def __init__(self, now: dt.datetime) -> None:
        self.now = now

    def __call__(self) -> dt.datetime:
        return self.now

    def epoch(self) -> float:
        return self.now.timestamp()

    def advance(self, delta: dt.timedelta) -> None:
        self.now += delta


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[Clock]:
    c = Clock(T0)
    monkeypatch.setattr(core, "utcnow", c)
    yield c


def ledger_of(broker: Broker, clock: Clock, **options: float) -> Ledger:
    ledger = Ledger(
        broker.session_factory,
        broker.backend,
        pool_of=lambda uuid: broker.pool_spec(uuid).name,
        clock=clock.epoch,
    )
    for key, value in options.items():
        setattr(ledger, key, value)
    ledger.start()
    return ledger


def restart(db_url: str, clock: Clock, booted: float) -> Broker:
    """A broker started on ``db_url`` the service's way: the ledger catches
    up and reopens what was open first, then the inventory and adoption."""
    backend = FakeDeviceBackend(inventory=["8 x H100"], node_name="node-a")
    broker = Broker(session_factory=make_session_factory(make_engine(db_url)), backend=backend)
    Ledger(broker.session_factory, backend, clock=clock.epoch).start(booted)
    broker.load_held_usage()
    broker.sync_inventory()
    broker.adopt()
    return broker


def report(
    broker: Broker,
    clock: Clock,
    by: str = "user",
    start: str = "2026-11-01",
    end: str = "2026-12-01",
    tz: str = "UTC",
    user: str | None = None,
) -> dict[str, ReportRow]:
    request = parse_request(start, end, by, tz, "json", clock.now)
    rows = build_report(broker.session_factory, request, clock.now, {"*": 2.0}, user=user)
    return {r.key: r for r in rows}


def test_a_mig_instance_held_seven_hours_is_one_gpu_hour_and_its_wait_is_kept_apart(
    db_url: str, tmp_path: Path, clock: Clock
) -> None:
    broker = sharing_broker(db_url, tmp_path)
    ledger = ledger_of(broker, clock)
    held = [broker.request_lease(f"h{i}", "", mig_profile="1g.10gb", pool="mig") for i in range(14)]
    assert all(x["state"] == "granted" for x in held)
    mine = broker.request_lease("ann", "", mig_profile="1g.10gb", pool="mig")
    assert mine["state"] == "pending"
    clock.advance(dt.timedelta(minutes=20))
    broker.release_lease(held[0]["id"], "done")
    assert broker.get_lease(mine["id"])["state"] == "granted"
    ledger.flush()
    clock.advance(7 * HOUR)
    broker.release_lease(mine["id"], "done")
    ledger.flush()
    ann = report(broker, clock)["ann"]
    assert ann.gpu_hours_allocated == pytest.approx(1.0)
    assert ann.wait_hours == pytest.approx(20 / 60)
    assert ann.leases == 1
    assert ann.cost == pytest.approx(2.0)
    # by model, a wait (no device yet) is its own row; the device's rows are use only
    models = report(broker, clock, by="model")
    assert models["(none)"].wait_hours == pytest.approx(20 / 60)
    assert models["(none)"].gpu_hours_allocated == 0
    assert models["NVIDIA H100 80GB HBM3"].wait_hours == 0


def a100_share_broker(db_url: str, tmp_path: Path) -> Broker:
    """Two A100 80GB (81,920 MiB each) in a time-sliced pool."""
    config = Config()
    config.Pools.pools = [{"name": "shared", "mode": "timeslice", "devices": ["node-a:0-1"]}]
    backend = FakeDeviceBackend(
        inventory=["2 x A100-80GB"], node_name="node-a", state_file=str(tmp_path / "gpus.json")
    )
    broker = Broker(
        session_factory=make_session_factory(make_engine(db_url)), backend=backend, config=config
    )
    broker.sync_inventory()
    broker.adopt()
    return broker


def test_a_share_of_a_quarter_device_at_half_use_is_half_allocated_a_quarter_used(
    db_url: str, tmp_path: Path, clock: Clock
) -> None:
    broker = a100_share_broker(db_url, tmp_path)
    ledger = ledger_of(broker, clock, sample_interval=3600.0)
    lease = broker.request_lease("bea", "", memory_gib=20, pool="shared")
    assert lease["slots"][0]["weight"] == 0.25  # 20 GiB of 80 GiB
    assert lease["state"] == "granted"
    device = lease["devices"][0]["uuid"]
    broker.backend.set_usage(device, utilization_gpu=50)
    ledger.flush()  # the grant is folded: its interval is open
    for _ in range(2):
        clock.advance(HOUR)
        assert ledger.sample() == 1
    broker.release_lease(lease["id"], "done")
    ledger.flush()
    bea = report(broker, clock)["bea"]
    assert bea.gpu_hours_allocated == pytest.approx(0.5)
    assert bea.gpu_hours_used == pytest.approx(0.25)
    assert bea.efficiency == pytest.approx(0.5)
    assert report(broker, clock, by="pool")["shared"].gpu_hours_allocated == pytest.approx(0.5)


def test_mig_use_is_the_instance_engine_activity(db_url: str, tmp_path: Path, clock: Clock) -> None:
    broker = sharing_broker(db_url, tmp_path)
    ledger = ledger_of(broker, clock, sample_interval=3600.0)
    lease = broker.request_lease("cy", "", mig_profile="3g.40gb", pool="mig")
    instance = lease["slots"][0]["uuid"]
    assert instance.startswith("MIG-")
    broker.backend.set_usage(instance, utilization_gpu=None, engine_activity=0.25)
    ledger.flush()
    clock.advance(HOUR)
    ledger.sample()
    broker.release_lease(lease["id"], "done")
    ledger.flush()
    cy = report(broker, clock)["cy"]
    weight = broker.get_lease(lease["id"])["weight"]
    assert cy.gpu_hours_allocated == pytest.approx(weight, abs=1e-6)
    assert cy.gpu_hours_used == pytest.approx(weight * 0.25, abs=1e-6)


def test_a_crash_closes_at_the_heartbeat_and_the_lease_counts_once(
    db_url: str, clock: Clock
) -> None:
    broker = make_broker(db_url)
    ledger = ledger_of(broker, clock)
    lease = broker.request_lease("dan", "", 2, holder_kind="external")
    clock.advance(HOUR)
    ledger.flush()  # the last heartbeat: T0 + 1 h
    clock.advance(dt.timedelta(seconds=20))  # ... then SIGKILL: nothing more is written
    clock.advance(dt.timedelta(seconds=30))  # down for 30 s
    booted = clock.epoch()
    again = make_broker(db_url)  # its adoption writes to the log: not a sign of the old one
    counts = Ledger(again.session_factory, again.backend, clock=clock.epoch).start(booted)
    assert counts["closed"] == counts["reopened"] == 2  # two slots
    restarted = clock.now
    clock.advance(HOUR)
    again.release_lease(lease["id"], "done")
    Ledger(again.session_factory, again.backend, clock=clock.epoch).flush()
    dan = report(again, clock)["dan"]
    assert dan.leases == 1
    held = (HOUR + (clock.now - restarted)).total_seconds() / 3600
    assert dan.gpu_hours_allocated == pytest.approx(2 * held)
    # a second start-up (nothing open any more but what is active) counts nothing twice
    ledger_of(again, clock).start()
    assert report(again, clock)["dan"].gpu_hours_allocated == pytest.approx(2 * held)


def test_fair_share_charges_what_the_ledger_holds_across_a_crash(db_url: str, clock: Clock) -> None:
    from gpubroker.store.usage_repo import load_usage
    from gpubroker.usage.decayed import held_usage

    broker = make_broker(db_url)
    ledger = ledger_of(broker, clock)
    lease = broker.request_lease("eve", "", 2, holder_kind="external")
    granted = clock.epoch()
    clock.advance(HOUR)
    ledger.flush()  # the last heartbeat
    last_alive = clock.epoch()
    clock.advance(dt.timedelta(seconds=50))  # SIGKILL, then down
    booted = clock.epoch()
    again = restart(db_url, clock, booted)
    clock.advance(HOUR)
    again.release_lease(lease["id"], "done")
    released = clock.epoch()
    half_life = again.policy.fairshare_half_life
    held = [(2.0, granted, last_alive), (2.0, booted, released)]
    memory = again._world.usage["eve"]
    assert memory.gpu_seconds == pytest.approx(held_usage(held, released, half_life))
    # the 50 s the broker was down are not charged (a whole run would be)
    whole = held_usage([(2.0, granted, None)], released, half_life)
    assert whole - memory.gpu_seconds == pytest.approx(2 * 50, rel=1e-2)  # decayed 1 h
    # what a restart loads, before the ledger folds the release and after
    assert again.validate_state() == []
    Ledger(again.session_factory, again.backend, clock=clock.epoch).flush()
    with again.session_factory() as session:
        loaded, _, _ = load_usage(session, half_life)
    assert loaded["eve"].gpu_seconds == pytest.approx(memory.gpu_seconds, rel=1e-12)
    # undecayed, fair share's charge is the report's allocated GPU-hours
    allocated = report(again, clock)["eve"].gpu_hours_allocated * 3600
    assert held_usage(held, released, 0.0) == pytest.approx(allocated)


@pytest.mark.parametrize(
    ("day", "hours"), [("2026-10-25", 25.0), ("2026-03-29", 23.0), ("2026-10-24", 24.0)]
)
def test_a_day_across_a_daylight_saving_change_has_its_local_hours(
    db_url: str, clock: Clock, day: str, hours: float
) -> None:
    start = dt.datetime.fromisoformat(day).replace(tzinfo=dt.timezone.utc) - 2 * 24 * HOUR
    clock.now = start
    broker = make_broker(db_url)
    ledger = ledger_of(broker, clock)
    lease = broker.request_lease("eve", "", 1, holder_kind="external")
    clock.advance(5 * 24 * HOUR)
    broker.release_lease(lease["id"], "done")
    ledger.flush()
    nxt = (dt.date.fromisoformat(day) + dt.timedelta(days=1)).isoformat()
    rows = report(broker, clock, by="day", start=day, end=nxt, tz="Europe/Berlin")
    assert list(rows) == [day]
    assert rows[day].gpu_hours_allocated == pytest.approx(hours)
    # in UTC every day has 24 hours: the ledger itself is in UTC
    utc = report(broker, clock, by="day", start=day, end=nxt, tz="UTC")
    assert utc[day].gpu_hours_allocated == pytest.approx(24.0)


def test_users_see_their_own_rows_only(db_url: str, clock: Clock) -> None:
    broker = make_broker(db_url)
    ledger = ledger_of(broker, clock)
    for user in ("fay", "gus"):
        broker.request_lease(user, "", 1, holder_kind="external")
    clock.advance(HOUR)
    ledger.flush()
    assert set(report(broker, clock)) == {"fay", "gus"}
    mine = report(broker, clock, user="fay")
    assert set(mine) == {"fay"}
    assert mine["fay"].gpu_hours_allocated == pytest.approx(1.0)  # open: counted up to now


@pytest.mark.parametrize(
    ("args", "param"),
    [
        (("2026-11-10", "2026-11-01", "user", "UTC", "table"), "from"),
        (("2026-11-01", "2026-11-01", "user", "UTC", "table"), "from"),
        (("2026-11-01", "2026-12-01", "team", "UTC", "table"), "by"),
        (("2026-11-01", "2026-12-01", "user", "Mars/Olympus", "table"), "tz"),
        (("2026-11-01", "2026-12-01", "user", "UTC", "pdf"), "format"),
        (("yesterday", "2026-12-01", "user", "UTC", "table"), "from"),
        (("2026-11-01", "2026-13-01", "user", "UTC", "table"), "to"),
        (("1990-01-01", "2026-12-01", "user", "UTC", "table"), "to"),
    ],
)
def test_bad_report_parameters_name_the_parameter(args: tuple[str, ...], param: str) -> None:
    with pytest.raises(ReportError) as err:
        parse_request(*args, now=T0)
    assert err.value.param == param
    assert str(err.value).startswith(f"{param}: ")


def test_the_default_period_is_this_month_so_far_in_the_time_zone() -> None:
    now = dt.datetime(2026, 11, 30, 23, 30, tzinfo=dt.timezone.utc)  # Dec 1 in Berlin
    request = parse_request(None, None, None, "Europe/Berlin", None, now)
    assert request.start == dt.datetime(2026, 11, 30, 23, 0, tzinfo=dt.timezone.utc)
    assert request.end == now and request.by == "user" and request.format == "table"


def test_restarts_without_a_ledger_write_fold_the_whole_log(db_url: str, clock: Clock) -> None:
    """A store whose leases predate the ledger (or whose ledger never wrote)
    is folded from the transition log at the first start."""
    broker = make_broker(db_url)
    lease = broker.request_lease("hal", "", 1, holder_kind="external")
    clock.advance(HOUR)
    broker.release_lease(lease["id"], "done")
    clock.advance(dt.timedelta(seconds=1))  # a broker starts after the last one wrote
    engine = make_engine(db_url)
    ledger = Ledger(make_session_factory(engine), broker.backend, clock=clock.epoch)
    assert ledger.start()["folded"] >= 3
    assert report(broker, clock)["hal"].gpu_hours_allocated == pytest.approx(1.0)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpubroker", *args], capture_output=True, text=True, timeout=120
    )


def test_report_and_audit_commands_read_the_store(db_url: str, tmp_path: Path) -> None:
    broker = make_broker(db_url)
    Ledger(broker.session_factory, broker.backend).start()
    lease = broker.request_lease("<b>ivy</b>", "", 1, holder_kind="external")
    broker.set_quota("group", "physics", 2.0, 4.0, actor="root")
    broker.release_lease(lease["id"], "done", actor="root")
    Ledger(broker.session_factory, broker.backend).flush()
    config = tmp_path / "gpubroker_config.py"
    config.write_text(
        f"c.GPUBrokerApp.db_url = {db_url!r}\nc.Ledger.price_per_gpu_hour = {{'*': 3}}\n"
    )
    done = _cli("report", f"--config={config}", "--format=json", "--by=user")
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(done.stdout)["rows"]
    assert row["key"] == "<b>ivy</b>" and row["leases"] == 1 and row["cost"] is not None
    page = tmp_path / "report.html"
    done = _cli("report", f"--db-url={db_url}", "--format=html", f"--output={page}")
    assert done.returncode == 0, done.stderr
    text = page.read_text()
    assert "&lt;b&gt;ivy&lt;/b&gt;" in text and "<b>ivy" not in text  # escaped
    assert text.count("<svg") == 3
    bad = _cli("report", f"--db-url={db_url}", "--from=2026-12-01", "--to=2026-11-01")
    assert bad.returncode == 2 and "--from: must be before to" in bad.stderr
    done = _cli("audit", f"--db-url={db_url}", "--json")
    assert done.returncode == 0, done.stderr
    entries = [json.loads(line) for line in done.stdout.splitlines()]
    actions = {(e["action"], e["actor"]) for e in entries}
    assert ("quota-set", "root") in actions and ("released", "root") in actions
    assert ("granted", "scheduler") in actions
    done = _cli("audit", f"--db-url={db_url}", "--kind=quota-set")
    assert done.returncode == 0 and "group:physics" in done.stdout
    # a reversed period is refused, as the report's is (before: no output, status 0)
    bad = _cli("audit", f"--db-url={db_url}", "--since=2026-12-01", "--until=2026-11-01")
    assert bad.returncode == 2 and "--since: must be before until" in bad.stderr


def test_report_and_audit_find_the_store_as_the_broker_does(db_url: str, tmp_path: Path) -> None:
    """``$GPUBROKER_DB_URL`` (the Docker stack's only setting of the store)
    was ignored: the commands read ``sqlite:///gpubroker.sqlite`` and exited
    "No store" (or read a stray file). The order is the broker's: the
    command line, the config file, the variable."""
    broker = make_broker(db_url)
    broker.set_quota("group", "optics", 1.0, 2.0, actor="root")
    env = {**os.environ, "GPUBROKER_DB_URL": db_url}
    run = functools.partial(
        subprocess.run, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env
    )
    done = run([sys.executable, "-m", "gpubroker", "audit", "--kind=quota-set"])
    assert done.returncode == 0, done.stderr
    assert "group:optics" in done.stdout
    done = run([sys.executable, "-m", "gpubroker", "report", "--format=json"])
    assert done.returncode == 0, done.stderr
    # the config file's db_url wins over the variable, as for `gpubroker serve`,
    # a .json beside the .py too, as the broker loads them
    none = f"sqlite:///{tmp_path / 'none.sqlite'}"
    (tmp_path / "gpubroker_config.py").write_text("c.Ledger.price_per_gpu_hour = {'*': 1}\n")
    (tmp_path / "gpubroker_config.json").write_text(json.dumps({"GPUBrokerApp": {"db_url": none}}))
    done = run([sys.executable, "-m", "gpubroker", "audit"])
    assert done.returncode == 2 and f"No store at {none} (from --db-url" in done.stderr
    # an empty variable is no setting, for the broker's commands too
    (tmp_path / "gpubroker_config.json").unlink()
    env["GPUBROKER_DB_URL"] = ""
    done = run([sys.executable, "-m", "gpubroker", "audit"])
    assert done.returncode == 2 and "No store at sqlite:///gpubroker.sqlite" in done.stderr


def test_report_and_audit_refuse_a_database_without_this_releases_schema(tmp_path: Path) -> None:
    """An empty SQLite file (what a refused broker start leaves) and a
    database no broker has migrated yet gave a SQLAlchemy traceback ("no
    such table: ledger_mark") and status 1; now one line naming the
    database and what to check, status 2."""
    empty = tmp_path / "empty.sqlite"
    empty.touch()
    older = f"sqlite:///{tmp_path / 'older.sqlite'}"
    upgrade(older, "0001")
    for url, found in (
        (f"sqlite:///{empty}", "has no gpubroker schema"),
        (older, "is at schema revision '0001'"),
    ):
        for command in ("report", "audit"):
            done = _cli(command, f"--db-url={url}")
            assert done.returncode == 2, done.stderr
            assert "Traceback" not in done.stderr
            (line,) = done.stderr.strip().splitlines()
            assert f"Cannot read the store: the database {url} {found}" in line
            assert "is it the broker's database (--db-url" in line


def test_report_on_a_database_it_cannot_reach_says_so_in_one_line() -> None:
    done = _cli("report", "--db-url=postgresql+psycopg://ann:S3cret@127.0.0.1:1/gpubroker")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert "Cannot reach the store postgresql+psycopg://ann:***@127.0.0.1:1/gpubroker" in line
    assert "S3cret" not in line


def test_a_store_url_sqlalchemy_cannot_read_is_one_line_without_its_password() -> None:
    done = _cli("report", "--db-url=postgresql://ann:S3cret@db:notaport/gpubroker")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert "its URL is not one SQLAlchemy can read" in line and "S3cret" not in line


def test_report_leaves_another_programs_database_as_it_was(tmp_path: Path) -> None:
    """Refused, but only after its connection had set the file's journal
    mode to WAL: reading must change nothing."""
    other = tmp_path / "other.sqlite"
    with sqlite3.connect(other) as db:
        db.execute("CREATE TABLE notes (text TEXT)")
    done = _cli("report", f"--db-url=sqlite:///{other}")
    assert done.returncode == 2 and "has no gpubroker schema" in done.stderr
    with sqlite3.connect(other) as db:
        assert db.execute("PRAGMA journal_mode").fetchone() == ("delete",)
    assert not (tmp_path / "other.sqlite-wal").exists()


def test_the_audit_command_prints_one_line_per_entry_whatever_the_reason(
    db_url: str,
) -> None:
    """A reason with a newline printed as two lines, the second free text
    that could pass for another entry; with a terminal escape it could move
    the cursor. Control characters are now printed escaped."""
    broker = make_broker(db_url)
    lease = broker.request_lease("kim", "", 1, holder_kind="external")
    forged = "maintenance\n2026-12-01T00:00:00  root  quota-set  user:kim: \x1b[2Kok"
    broker.release_lease(lease["id"], forged, actor="root")
    done = _cli("audit", f"--db-url={db_url}", "--user=kim")
    assert done.returncode == 0, done.stderr
    (line,) = [x for x in done.stdout.splitlines() if "maintenance" in x]
    assert "maintenance\\n2026-12-01" in line and "\\x1b[2Kok" in line
    assert "\x1b" not in done.stdout and done.stdout.count("quota-set") == 1
    as_json = _cli("audit", f"--db-url={db_url}", "--user=kim", "--json")
    reasons = [json.loads(x)["reason"] for x in as_json.stdout.splitlines()]
    assert forged in reasons  # JSON keeps the text as it was


def test_a_sample_after_a_release_charges_up_to_the_release_only(
    db_url: str, tmp_path: Path, clock: Clock
) -> None:
    broker = make_broker(db_url)
    ledger = ledger_of(broker, clock, sample_interval=7200.0)
    lease = broker.request_lease("jon", "", 1, holder_kind="external")
    broker.backend.set_usage(lease["devices"][0]["uuid"], utilization_gpu=100)
    clock.advance(HOUR)
    ledger.sample()
    clock.advance(HOUR / 2)
    broker.release_lease(lease["id"], "done")
    clock.advance(HOUR)
    ledger.sample()  # the interval ended half an hour after the last sample
    clock.advance(HOUR)
    ledger.sample()  # and is not sampled again
    jon = report(broker, clock)["jon"]
    assert jon.gpu_hours_allocated == pytest.approx(1.5)
    assert jon.gpu_hours_used == pytest.approx(1.5)


def test_a_restart_counts_no_downtime_for_leases_its_adoption_changes(
    db_url: str, clock: Clock
) -> None:
    """A lease whose time limit passed while the broker was down is released
    by the restarted broker's adoption; neither it nor the request that gets
    its GPUs is charged for the downtime (found by a review)."""
    broker = make_broker(db_url)
    ledger = ledger_of(broker, clock)
    amy = broker.request_lease("amy", "", 8, holder_kind="external", time_limit=2 * 3600)
    bob = broker.request_lease("bob", "", 8, holder_kind="external")
    clock.advance(HOUR)
    ledger.flush()  # the last heartbeat, then SIGKILL
    clock.advance(5 * HOUR)  # down for 5 h
    booted = clock.epoch()
    again = restart(db_url, clock, booted)  # adopt(): amy's time limit has passed
    assert again.get_lease(amy["id"])["state"] == "released"
    assert again.get_lease(bob["id"])["state"] == "granted"
    clock.advance(HOUR)
    again.release_lease(bob["id"], "done")
    Ledger(again.session_factory, again.backend, clock=clock.epoch).flush()
    rows = report(again, clock)
    assert rows["amy"].gpu_hours_allocated == pytest.approx(8.0)  # 1 h x 8 before the crash
    # fair share charges amy the same hour, not the 5 h the broker was down
    from gpubroker.usage.decayed import held_usage

    half_life = again.policy.fairshare_half_life
    charged = held_usage([(8.0, T0.timestamp(), (T0 + HOUR).timestamp())], booted, half_life)
    amy_record = again._world.usage["amy"]
    assert amy_record.as_of.timestamp() == booted
    assert amy_record.gpu_seconds == pytest.approx(charged)
    assert rows["bob"].wait_hours == pytest.approx(1.0)
    assert rows["bob"].gpu_hours_allocated == pytest.approx(8.0)


def test_a_release_between_a_samples_flush_and_its_reads_is_charged_once(
    db_url: str, clock: Clock
) -> None:
    """The sample works on the intervals its own flush left, even when
    another flush (a usage report) runs while it reads (found by a review)."""
    broker = make_broker(db_url)
    ledger = ledger_of(broker, clock, sample_interval=3600.0)
    lease = broker.request_lease("jon", "", 1, holder_kind="external")
    broker.backend.set_usage(lease["devices"][0]["uuid"], utilization_gpu=100)
    clock.advance(HOUR)
    ledger.sample()
    clock.advance(HOUR)
    now = clock.epoch()
    ledger.flush(now)  # what run() does before it reads in a worker thread
    snapshot = list(ledger._open)
    clock.advance(dt.timedelta(minutes=1))
    broker.release_lease(lease["id"], "done")
    ledger.flush()  # a report meanwhile
    ledger._merge(now, *ledger._measure(now, [], snapshot))
    for _ in range(2):
        clock.advance(HOUR)
        ledger.sample()
    jon = report(broker, clock)["jon"]
    assert jon.gpu_hours_used <= jon.gpu_hours_allocated + 1e-6
    assert jon.gpu_hours_used == pytest.approx(2 + 1 / 60, abs=1e-6)


def test_a_users_reason_cannot_forge_a_cause_and_policy_stops_name_their_actor(
    db_url: str, clock: Clock
) -> None:
    """Causes come from the broker's decision, never from a reason's words;
    an eviction by the pass is the scheduler's, whatever command ran the
    pass (found by a review)."""
    from gpubroker.observe import audit

    broker = make_broker(db_url)
    ledger = ledger_of(broker, clock)
    bob = broker.request_lease("bob", "", 1, holder_kind="external")
    broker.release_lease(bob["id"], "preempted: I say so", actor="bob")
    zed = broker.request_lease("zed", "", 1, holder_kind="external", time_limit=60)
    clock.advance(dt.timedelta(seconds=61))
    broker.request_lease("root-made", "", 1, holder_kind="external", actor="root")  # runs a pass
    assert broker.get_lease(zed["id"])["state"] == "released"
    ledger.flush()
    rows = report(broker, clock)
    assert rows["bob"].preemptions == 0 and rows["bob"].culls == 0
    entries = audit.query(broker.session_factory, kind="time-limit")
    assert [(e["user"], e["actor"], e["cause"]) for e in entries] == [
        ("zed", "scheduler", "time-limit")
    ]
    assert audit.query(broker.session_factory, kind="preemption") == []
    made = audit.query(broker.session_factory, user="root-made", kind="requested")
    assert made and made[0]["actor"] == "root"  # an admin's request for another user


@pytest.mark.parametrize(
    ("args", "param"),
    [
        ((None, None, "user", "Europe", "json"), "tz"),
        ((None, None, "user", "x" * 300, "json"), "tz"),
        (("0001-01-01", "0001-01-02", "user", "Europe/Berlin", "json"), "from"),
        (("9999-12-30", "9999-12-31T12:00", "day", "UTC", "json"), "from"),
        (("2016-01-01", "2026-01-01", "day", "UTC", "json"), "to"),
        (("2016-01-01", "2026-01-01", "user", "UTC", "html"), "to"),
    ],
)
def test_report_parameters_found_by_a_review_are_errors_not_crashes(
    args: tuple[str | None, ...], param: str
) -> None:
    with pytest.raises(ReportError) as err:
        parse_request(*args, now=T0)
    assert err.value.param == param


def test_html_reports_take_any_user_name(db_url: str, clock: Clock) -> None:
    from gpubroker.usage import query, render

    broker = make_broker(db_url)
    ledger = ledger_of(broker, clock)
    for name in ("$\\foo$", "_hidden", "=cmd|' /C calc'!A0"):
        broker.request_lease(name, "", 1, holder_kind="external")
    clock.advance(HOUR)
    ledger.flush()
    request = parse_request("2026-11-01", "2026-11-03", "user", "UTC", "html", clock.now)
    rows = query.build_report(broker.session_factory, request, clock.now, {})
    page = render.render(request, rows, query.series(broker.session_factory, request, clock.now))
    assert page.count("<svg") == 3 and "$\\foo$" in page
    csv_text = render.as_csv(request, rows)
    assert "\n'=cmd" in csv_text  # not a formula in a spreadsheet


def test_a_running_lease_held_across_a_restart_is_charged_as_the_ledger_counts_it(
    db_url: str, clock: Clock
) -> None:
    """While it runs, fair share charges an adopted lease without the time
    the broker was down, so its usage does not drop at its release (found
    by a review)."""
    from gpubroker.scheduler import fairshare

    broker = make_broker(db_url)
    ledger = ledger_of(broker, clock)
    lease = broker.request_lease("eve", "", 8, holder_kind="external")
    clock.advance(HOUR)
    ledger.flush()  # the last heartbeat
    clock.advance(5 * HOUR)  # down
    again = restart(db_url, clock, clock.epoch())
    clock.advance(HOUR)
    half_life = again.policy.fairshare_half_life
    state, _ = again._scheduler_state()
    running = fairshare.decayed_usage(state.usage, state.running, clock.now, half_life)["eve"]
    again.release_lease(lease["id"], "done")
    released = again._world.usage["eve"].gpu_seconds
    assert running == pytest.approx(released, rel=1e-9)
    assert released == pytest.approx(8 * 2 * 3600, rel=0.03)  # 2 h held (decayed), not 7


def test_a_report_read_while_the_broker_is_down_counts_no_down_time(
    db_url: str, clock: Clock
) -> None:
    """``gpubroker report`` beside a stopped broker counts an open interval
    up to the broker's last sign of life, as its restart will (found by a
    review)."""
    broker = make_broker(db_url)
    ledger = ledger_of(broker, clock)
    broker.request_lease("dan", "", 1, holder_kind="external")
    clock.advance(HOUR)
    ledger.stop()  # a clean stop: the last heartbeat
    clock.advance(5 * HOUR)  # down for 5 h, then a report
    assert report(broker, clock)["dan"].gpu_hours_allocated == pytest.approx(1.0)
    again = restart(db_url, clock, clock.epoch())
    assert report(again, clock)["dan"].gpu_hours_allocated == pytest.approx(1.0)
    clock.advance(HOUR)
    Ledger(again.session_factory, again.backend, clock=clock.epoch).flush()  # alive again
    assert report(again, clock)["dan"].gpu_hours_allocated == pytest.approx(2.0)


def test_a_start_killed_during_its_catch_up_counts_no_down_time(
    db_url: str, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The catch-up keeps the stored heartbeat, so a broker killed before
    its reopen does not make the next start count the time the first
    broker was down (found by a review)."""
    from gpubroker.store import ledger_repo

    broker = make_broker(db_url)
    ledger = ledger_of(broker, clock)
    broker.request_lease("dan", "", 1, holder_kind="external")
    clock.advance(HOUR)
    ledger.flush()  # the last heartbeat, then SIGKILL
    clock.advance(10 * HOUR)  # down for 10 h

    def killed(*args: object, **kwargs: object) -> None:
        raise SystemExit("SIGKILL during the start-up")

    with monkeypatch.context() as patch:
        patch.setattr(ledger_repo, "reopen", killed)
        with pytest.raises(SystemExit):
            Ledger(broker.session_factory, broker.backend, clock=clock.epoch).start()
    clock.advance(dt.timedelta(seconds=30))
    again = restart(db_url, clock, clock.epoch())
    assert report(again, clock)["dan"].gpu_hours_allocated == pytest.approx(1.0)


def test_a_cull_counts_its_idle_hours_when_the_broker_restarts_before_the_release(
    db_url: str, clock: Clock
) -> None:
    """The idle seconds of a cull noted before a restart are carried into
    the reopened interval that the release ends (found by a review)."""
    broker = make_broker(db_url)
    broker.on_evict = lambda view: None  # the service stops the hub server
    ledger = ledger_of(broker, clock)
    lease = broker.request_lease("ann", "", 2)
    clock.advance(2 * HOUR)
    broker.note_lease(lease["id"], "culled", "culled: idle", detail={"idle_seconds": 3600.0})
    broker.stop_lease(lease["id"], "culled: idle", cause="cull")
    ledger.flush()
    clock.advance(dt.timedelta(seconds=5))  # SIGKILL, then a restart
    again = restart(db_url, clock, clock.epoch())
    again.on_evict = lambda view: None
    clock.advance(dt.timedelta(seconds=30))
    again.release_lease(lease["id"], "server stopped")
    Ledger(again.session_factory, again.backend, clock=clock.epoch).flush()
    ann = report(again, clock)["ann"]
    assert ann.culls == 1
    assert ann.idle_gpu_hours_culled == pytest.approx(2.0)  # 2 GPUs x 1 h, once


def test_a_cull_ending_on_a_days_boundary_counts_on_the_day_it_ends(
    db_url: str, clock: Clock
) -> None:
    """An interval that ends exactly at a period's start counts its cull
    there, and adds no time (found by a review)."""
    clock.now = dt.datetime(2026, 11, 2, 20, 0, tzinfo=dt.timezone.utc)
    broker = make_broker(db_url)  # no hub: a cull releases at once
    ledger = ledger_of(broker, clock)
    lease = broker.request_lease("ann", "", 1)
    clock.now = dt.datetime(2026, 11, 3, 0, 0, tzinfo=dt.timezone.utc)  # midnight exactly
    broker.note_lease(lease["id"], "culled", "culled: idle", detail={"idle_seconds": 3600.0})
    broker.stop_lease(lease["id"], "culled: idle", cause="cull")
    assert broker.get_lease(lease["id"])["state"] == "released"
    ledger.flush()
    clock.advance(HOUR)
    days = report(broker, clock, by="day", start="2026-11-02", end="2026-11-04")
    assert (days["2026-11-02"].gpu_hours_allocated, days["2026-11-02"].culls) == (
        pytest.approx(4.0),
        0,
    )
    assert days["2026-11-03"].gpu_hours_allocated == 0
    assert days["2026-11-03"].culls == 1
    assert days["2026-11-03"].idle_gpu_hours_culled == pytest.approx(1.0)
    assert report(broker, clock, start="2026-11-03", end="2026-11-04")["ann"].culls == 1


# --- a review of the usage reports ------------------------------------------------


def test_a_group_named_like_no_group_is_one_row_with_every_lease_counted(
    db_url: str, clock: Clock
) -> None:
    broker = make_broker(db_url)
    ledger = ledger_of(broker, clock)
    broker.request_lease("ann", "", 1, holder_kind="external")  # no group
    for user, gpus in (("bob", 2), ("cat", 1)):
        broker.request_lease(
            user, "", gpus, holder_kind="external", group="(none)", groups=["(none)"]
        )
    clock.advance(HOUR)
    ledger.flush()
    row = report(broker, clock, by="group")["(none)"]
    # before, the GPU-hours of both were added up, and the lease count of one was lost
    assert (row.gpu_hours_allocated, row.leases) == (pytest.approx(4.0), 3)


def test_a_period_after_the_last_sign_of_life_lists_nobody(db_url: str, clock: Clock) -> None:
    broker = make_broker(db_url)
    ledger = ledger_of(broker, clock)
    broker.request_lease("bob", "", 1, holder_kind="external")
    clock.advance(HOUR)
    ledger.flush()
    assert report(broker, clock, start="2026-12-01", end="2027-01-01") == {}
    assert report(broker, clock)["bob"].gpu_hours_allocated == pytest.approx(1.0)


def test_a_cost_never_covers_only_part_of_a_row() -> None:
    def hours(model: str) -> dict[str, object]:
        return {
            "model": model,
            "allocated": 3600.0,
            "used": 0,
            "sampled": 0,
            "wait": 0,
            "idle_culled": 0,
        }

    sums = [("ann", hours("H100")), ("ann", hours("A100")), ("bob", hours("H100"))]
    rows = {r.key: r for r in combine(sums, {"H100": 2.5}, {})}
    assert rows["ann"].gpu_hours_allocated == 2.0 and rows["ann"].cost is None
    assert rows["bob"].cost == 2.5
    rows = {r.key: r for r in combine(sums, {"H100": 2.5, "*": 1.0}, {})}
    assert rows["ann"].cost == 3.5
