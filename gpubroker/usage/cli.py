"""``gpubroker report``: the usage report from the store, on the shell.

It reads the store (``--db-url``, else ``GPUBrokerApp.db_url`` of the
``--config`` file, else ``$GPUBROKER_DB_URL``, as ``gpubroker serve``
finds it) and writes nothing, so it may run beside a live broker:
the ledger in the store is as new as its last write
(``Ledger.flush_interval``); ``GET /api/v1/usage`` writes first. An
interval still open counts up to the broker's last sign of life, never past
now, so a report read while the broker is down does not count the down
time (:func:`gpubroker.store.ledger_repo.counted_until`). Prices
come from ``Ledger.price_per_gpu_hour`` in the config file.
"""

from __future__ import annotations

import datetime as dt
import os
import sys
from pathlib import Path
from typing import Any

from traitlets import Unicode
from traitlets.config import Application

from ..logfmt import OneLineFormatter
from ..store.db import DEFAULT_DB_URL


class StoreCommand(Application):
    """A subcommand that reads the store: ``--db-url`` and ``--config``."""

    _log_formatter_cls = OneLineFormatter  # messages on one line (gpubroker.logfmt)

    config_file = Unicode(
        "gpubroker_config.py",
        help="The broker's config file (its GPUBrokerApp.db_url and Ledger options "
        "apply); a missing file is ignored.",
    ).tag(config=True)

    db_url = Unicode(
        "",
        help="SQLAlchemy URL of the store (default: GPUBrokerApp.db_url of the config "
        "file, else $GPUBROKER_DB_URL, else sqlite:///gpubroker.sqlite, as the broker "
        "finds it).",
    ).tag(config=True)

    def initialize(self, argv: list[str] | None = None) -> None:
        """Parse the command line, then load the config file (the command line wins)."""
        super().initialize(argv)
        if os.path.isfile(self.config_file):
            # as the broker loads it (GPUBrokerApp.load_config_file): the
            # file's name with .py and with .json
            self.load_config_file(self.config_file)
            self.update_config(self.cli_config)

    def store_url(self) -> str:
        """The store to read: ``--db-url``, else the config file's
        ``GPUBrokerApp.db_url``, else ``$GPUBROKER_DB_URL``, else
        ``sqlite:///gpubroker.sqlite`` (the broker's own order,
        :class:`gpubroker.app.GPUBrokerApp`)."""
        if self.db_url:
            return self.db_url
        app = self.config.get("GPUBrokerApp", {})
        if "db_url" in app:
            return str(app["db_url"])
        return os.environ.get("GPUBROKER_DB_URL") or DEFAULT_DB_URL

    def sessions(self) -> Any:
        """A session factory of the store; exits with status 2 and one line
        where there is no store there, it cannot be reached, or its schema
        is not this release's newest (none: not a broker's database, or no
        broker has run on it; older: not migrated yet; newer: written by a
        newer release), since the report's and the audit's queries read
        this release's tables."""
        from ..store.db import (
            StoreUnreachable,
            UnknownSchema,
            check_readable,
            check_url,
            make_engine,
            make_session_factory,
            sqlite_path,
        )

        url = self.store_url()
        try:
            check_url(url)
        except StoreUnreachable as err:
            self.log.critical("%s", err)
            self.exit(2)
        path = sqlite_path(url)
        if path is not None and not Path(path).exists():
            self.log.critical(
                "No store at %s (from --db-url, else the config file's "
                "GPUBrokerApp.db_url, else $GPUBROKER_DB_URL)",
                url,
            )
            self.exit(2)
        try:
            check_readable(url, READ_ADVICE)
        except UnknownSchema as err:
            self.log.critical("Cannot read the store: %s", err)
            self.exit(2)
        except StoreUnreachable as err:
            self.log.critical("%s", err)
            self.exit(2)
        return make_session_factory(make_engine(url))


#: what a report or audit on a database without this release's schema advises
READ_ADVICE = (
    "is it the broker's database (--db-url, else the config file's GPUBrokerApp.db_url, "
    "else $GPUBROKER_DB_URL)? A broker migrates its database when it starts "
    "(or run `gpubroker upgrade-db`, see the admin guide)"
)


class ReportCommand(StoreCommand):
    """``gpubroker report``: GPU-hours allocated and used, per user, group,
    pool, model or day (see the admin guide for every column)."""

    description = (
        "Usage report from the ledger: GPU-hours allocated and used, efficiency, "
        "queue-wait hours, leases, jobs, culls, preemptions, idle GPU-hours culled, cost."
    )
    aliases = {
        "from": "ReportCommand.period_start",
        "to": "ReportCommand.period_end",
        "by": "ReportCommand.by",
        "tz": "ReportCommand.tz",
        "format": "ReportCommand.format",
        "output": "ReportCommand.output",
        "user": "ReportCommand.user",
        "db-url": "ReportCommand.db_url",
        "config": "ReportCommand.config_file",
        "log-level": "Application.log_level",
    }
    period_start = Unicode(
        "", help="Start: YYYY-MM-DD (midnight in --tz) or ISO 8601; default: the 1st of this month."
    ).tag(config=True)
    period_end = Unicode("", help="End (exclusive): YYYY-MM-DD or ISO 8601; default: now.").tag(
        config=True
    )
    by = Unicode("user", help="Group by user, group, pool, model or day.").tag(config=True)
    tz = Unicode("UTC", help="IANA time zone of dates and of days (--by day).").tag(config=True)
    format = Unicode("table", help="table, csv, json or html.").tag(config=True)
    output = Unicode("", help="Write to this file (default: standard output).").tag(config=True)
    user = Unicode("", help="Only this user's usage.").tag(config=True)

    def start_report(self) -> str:
        """The report as text (exits 2 on a bad parameter)."""
        from ..usage.ledger import Ledger
        from . import query, render
        from .report import ReportError, parse_request

        now = dt.datetime.now(dt.timezone.utc)
        try:
            request = parse_request(
                self.period_start, self.period_end, self.by, self.tz, self.format, now
            )
        except ReportError as err:
            self.log.critical("--%s", err)
            self.exit(2)
        problem = render.html_problem(request.format)
        if problem:
            self.log.critical("--%s", problem)
            self.exit(2)
        factory = self.sessions()
        prices = Ledger(None, None, parent=self).price_per_gpu_hour
        user = self.user or None
        rows = query.build_report(factory, request, now, prices, user=user)
        plots = query.series(factory, request, now, user) if request.format == "html" else None
        return render.render(request, rows, plots)

    def start(self) -> None:
        """Print (or write) the report."""
        text = self.start_report()
        if self.output:
            Path(self.output).write_text(text, encoding="utf-8")
            print(f"wrote {self.output}", file=sys.stderr)
        else:
            sys.stdout.write(text)
