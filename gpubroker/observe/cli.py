"""``gpubroker audit``: the audit log from the store, on the shell (reads
only; see :mod:`gpubroker.observe.audit`)."""

from __future__ import annotations

import datetime as dt
import json
import os
import sys

from traitlets import Bool, Integer, Unicode, default

from ..oneline import one_line
from ..usage.cli import StoreCommand


class AuditCommand(StoreCommand):
    """``gpubroker audit [--user U] [--kind K] [--since T] [--until T] [--limit N] [--json]``."""

    description = "The audit log: admin and policy actions, newest first."
    aliases = {
        "user": "AuditCommand.user",
        "kind": "AuditCommand.kind",
        "since": "AuditCommand.since",
        "until": "AuditCommand.until",
        "limit": "AuditCommand.limit",
        "service-name": "AuditCommand.service_name",
        "db-url": "AuditCommand.db_url",
        "config": "AuditCommand.config_file",
        "log-level": "Application.log_level",
    }
    flags = {"json": ({"AuditCommand": {"as_json": True}}, "Print JSON (one object per line).")}

    user = Unicode("", help="Only entries about this user or by them.").tag(config=True)
    kind = Unicode("", help="Only entries of this action or cause (e.g. quota-set, cull).").tag(
        config=True
    )
    since = Unicode("", help="From this time (ISO 8601; UTC without an offset).").tag(config=True)
    until = Unicode("", help="Up to this time (exclusive).").tag(config=True)
    limit = Integer(100, help="Most entries to print (1-10000).").tag(config=True)
    as_json = Bool(False, help="Print JSON, one entry per line.").tag(config=True)
    service_name = Unicode(
        help="The broker's JupyterHub service name: the hub's spawner acts for users through "
        "it, so its requests and releases are not admin actions (default: "
        "$JUPYTERHUB_SERVICE_NAME, else 'gpubroker'; set it in the config file when the "
        "service has another name)."
    ).tag(config=True)

    @default("service_name")
    def _default_service_name(self) -> str:
        return os.environ.get("JUPYTERHUB_SERVICE_NAME") or "gpubroker"

    def start(self) -> None:
        """Print the entries."""
        from ..usage.report import ReportError, parse_time
        from . import audit

        try:
            since = parse_time("since", self.since, dt.timezone.utc) if self.since else None
            until = parse_time("until", self.until, dt.timezone.utc) if self.until else None
        except ReportError as err:
            self.log.critical("--%s", err)
            self.exit(2)
        try:
            audit.check_period(since, until)
        except ValueError as err:
            self.log.critical("--%s", err)
            self.exit(2)
        if not 1 <= self.limit <= audit.MAX_LIMIT:
            self.log.critical(
                "--limit: must be between 1 and %s, got %s", audit.MAX_LIMIT, self.limit
            )
            self.exit(2)
        entries = audit.query(
            self.sessions(),
            since,
            until,
            self.user or None,
            self.kind or None,
            self.limit,
            on_behalf=(self.service_name,),
        )
        for entry in entries:
            if self.as_json:
                print(json.dumps(entry))
                continue
            cause = f" ({entry['cause']})" if entry["cause"] else ""
            sys.stdout.write(
                f"{entry['at']}  {one_line(entry['actor']):<12} {entry['action']}{cause:<14} "
                f"{one_line(entry['target'])}: {one_line(entry['reason'])}\n"
            )
