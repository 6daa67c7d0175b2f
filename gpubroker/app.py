"""The ``gpubroker`` command: a traitlets Application with subcommands.

``gpubroker serve`` runs the broker service (normally as a hub-managed
JupyterHub service at ``/services/gpubroker/``); ``gpubroker upgrade-db``
migrates the store. Options come from ``gpubroker_config.py`` and the command
line (``--GPUBrokerApp.db_url=…``); ``gpubroker --help-all`` lists them all.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlparse

from traitlets import Bool, Enum, Float, Integer, Unicode, default
from traitlets.config import Application, catch_config_error

from . import __version__
from .core import Broker
from .culler import Culler
from .devices.fake import FakeDeviceBackend
from .devices.nvml import NVMLDeviceBackend
from .enforce.mps import MPSControl
from .enforce.watchdog import ShareWatchdog
from .engines.docker import DockerEngine
from .engines.slurm import SlurmEngine
from .hub import HubClient
from .jobs.service import JobService
from .logfmt import OneLineFormatter
from .policy_config import SchedulingPolicy
from .pools import Pools
from .share_guard import ShareGuard
from .store.db import DEFAULT_DB_URL
from .usage.ledger import Ledger


class GPUBrokerApp(Application):
    """The broker: configuration, wiring and subcommands."""

    #: each record's message on one line (:mod:`gpubroker.logfmt`)
    _log_formatter_cls = OneLineFormatter

    def get_default_logging_config(self) -> dict[str, Any]:
        """traitlets' logging setup, with the modules' own loggers
        (``gpubroker.*``, e.g. the local engine's) on the same handler and
        format as the broker's log (before: their INFO lines were dropped and
        their warnings written unformatted by Python's last resort)."""
        config: dict[str, Any] = super().get_default_logging_config()
        config["loggers"]["gpubroker"] = {
            "level": "DEBUG",
            "handlers": ["console"],
            "propagate": False,
        }
        return config

    name = "gpubroker"
    version = __version__
    description = "A GPU broker for JupyterHub: leases, queue and sharing of GPUs."
    examples = """
    gpubroker serve                     # run the service (as a hub-managed service)
    gpubroker serve --port=10101 --ip=127.0.0.1
    gpubroker upgrade-db --db-url=sqlite:///gpubroker.sqlite
    gpubroker --help-all                # every option
    """

    classes = [
        Broker,
        SchedulingPolicy,
        Pools,
        Culler,
        Ledger,
        JobService,
        DockerEngine,
        SlurmEngine,
        ShareGuard,
        ShareWatchdog,
        MPSControl,
        HubClient,
        FakeDeviceBackend,
        NVMLDeviceBackend,
    ]

    aliases = {
        "config": "GPUBrokerApp.config_file",
        "db-url": "GPUBrokerApp.db_url",
        "ip": "GPUBrokerApp.ip",
        "port": "GPUBrokerApp.port",
        "device-backend": "GPUBrokerApp.device_backend",
        "log-level": "Application.log_level",
    }
    flags = {
        "debug": ({"Application": {"log_level": 10}}, "Log at DEBUG level."),
    }

    subcommands = {
        "serve": ("gpubroker.app.ServeCommand", "Run the broker service."),
        "upgrade-db": ("gpubroker.app.UpgradeDBCommand", "Migrate the store to the newest schema."),
        "downgrade-db": (
            "gpubroker.app.DowngradeDBCommand",
            "Take the store's schema down to an older release's (broker stopped).",
        ),
        "report": (
            "gpubroker.usage.cli.ReportCommand",
            "Usage report: GPU-hours allocated and used per user, group, pool, model or day.",
        ),
        "jobs": (
            "gpubroker.jobs.cli.JobsCommand",
            "Batch jobs through the broker's API: submit, list, show, logs, cancel.",
        ),
        "audit": (
            "gpubroker.observe.cli.AuditCommand",
            "The audit log of admin and policy actions.",
        ),
        "simulate": (
            "gpubroker.simulate.cli.SimulateCommand",
            "Replay a trace through the scheduler.",
        ),
    }

    config_file = Unicode(
        "gpubroker_config.py",
        help="Config file to load (Python, traitlets style); a missing file is ignored.",
    ).tag(config=True)

    db_url = Unicode(
        help="SQLAlchemy URL of the store (default: $GPUBROKER_DB_URL, else "
        "sqlite:///gpubroker.sqlite). SQLite (WAL mode) by default; PostgreSQL "
        "with postgresql+psycopg://user:password@host/db (give a password "
        "through $GPUBROKER_DB_URL or the config file, not the command line, "
        "which every local user can read).",
    ).tag(config=True)

    @default("db_url")
    def _default_db_url(self) -> str:
        return os.environ.get("GPUBROKER_DB_URL") or DEFAULT_DB_URL  # empty: unset

    upgrade_db = Bool(
        True,
        help="Upgrade the store's schema at start (as `gpubroker upgrade-db` does). "
        "Off: the broker starts only on a store at this release's newest schema "
        "(run `gpubroker upgrade-db` first); it refuses any other with status 2.",
    ).tag(config=True)

    device_backend = Enum(
        ["auto", "nvml", "fake"],
        "auto",
        help="Where devices come from: 'nvml' (real GPUs through nvidia-ml-py), "
        "'fake' (simulated GPUs, see FakeDeviceBackend.inventory), or 'auto' "
        "(NVML when it initialises, else the fake, with a loud warning).",
    ).tag(config=True)

    ip = Unicode(
        help="Address to listen on (default: host of $JUPYTERHUB_SERVICE_URL, else 127.0.0.1)."
    ).tag(config=True)

    port = Integer(
        help="Port to listen on (default: port of $JUPYTERHUB_SERVICE_URL, else 10101)."
    ).tag(config=True)

    base_url = Unicode(
        help="URL prefix of the API (default: $JUPYTERHUB_SERVICE_PREFIX, else '/')."
    ).tag(config=True)

    reconcile_interval = Float(
        30,
        help="Seconds between reconciliations with the hub: leases of servers "
        "the hub no longer lists are released, and so are those of "
        "DockerGPUSpawner servers whose container has exited or is gone "
        "(asked of the Docker engine at DockerEngine.docker_url). 0 disables it.",
    ).tag(config=True)

    schedule_interval = Float(
        5,
        help="Seconds between scheduling passes run by the timer (besides each change); "
        "preemption grace periods end on this tick.",
    ).tag(config=True)

    hub_gone_timeout = Float(
        60,
        help="Seconds after which a broker whose hub API does not answer exits "
        "(status 3); 0: never. A hub-managed broker whose hub process died "
        "exits within a second anyway (a restarted hub starts a broker of its own).",
    ).tag(config=True)

    standby = Bool(
        False,
        help="Wait for the database lock as long as it takes, as a standby "
        "broker: while another broker is active, this one only waits (trying "
        "the lock every second, logging who holds it every minute) and takes "
        "over once that broker is gone; on PostgreSQL that is within a second "
        "of the holder's process dying on a live host and within 25 s of its "
        "host vanishing (the lock session's TCP keepalives). It opens its "
        "port only once it holds the lock, so it may be given the active "
        "broker's address.",
    ).tag(config=True)

    lock_wait_timeout = Float(
        120,
        help="Seconds a hub-managed broker waits for the database lock held by "
        "another broker (e.g. the broker of a hub that was killed, which exits "
        "within a second of its hub) before it gives up; a broker not started "
        "by a hub refuses at once.",
    ).tag(config=True)

    groups_ttl = Float(
        60, help="Seconds a user's JupyterHub groups (read from the hub API) are cached."
    ).tag(config=True)

    metrics_scope = Unicode(
        "custom:gpubroker:metrics",
        help="The JupyterHub scope a token needs to read {base_url}metrics (Prometheus "
        "text format); holders of custom:gpubroker:admin may read them too. Define a "
        "custom scope in the hub's c.JupyterHub.custom_scopes and give it to the role "
        "of the token Prometheus scrapes with (with access to this service).",
    ).tag(config=True)

    max_body_bytes = Integer(
        64 * 1024,
        min=1024,
        help="Largest request body the API accepts, bytes. A request whose "
        "Content-Length is larger is answered 413 from its headers, before its body "
        "is read; a chunked body that grows past it is answered 400 (its rest discarded).",
    ).tag(config=True)

    max_long_polls_per_user = Integer(
        8,
        min=1,
        help="Most long-polls (GET /api/v1/leases/{id}?wait=S) one caller (user or "
        "service) may hold open at once. One more answers the caller's oldest open "
        "poll at once with the lease as it stands (200), so clients keep working.",
    ).tag(config=True)

    report_threads = Integer(
        2,
        min=1,
        help="Threads that build usage reports (GET /api/v1/usage and the panel's usage "
        "page), broker-wide: reports queue for them and never hold the threads the MIG "
        "actuator, the culler and the ledger use.",
    ).tag(config=True)

    reports_per_caller = Integer(
        2,
        min=1,
        help="Usage reports one caller (user or service) may have under way at once; "
        "one more is answered 429.",
    ).tag(config=True)

    panel = Bool(
        True,
        help="Serve the web panel (admin pages and each researcher's page) at the "
        "service's URL, logged in through the hub's OAuth. Register the service "
        'with url, display=True and oauth_client_allowed_scopes=["custom:gpubroker:admin"] '
        "so admins' panel logins carry the admin scope (docs/admin.md).",
    ).tag(config=True)

    panel_refresh = Float(
        5.0,
        min=1.0,
        help="Seconds between the panel's live updates of its overview, queue and "
        "researcher pages (the page asks the broker again; no reload).",
    ).tag(config=True)

    private_queue = Bool(
        True,
        help="What GET /api/v1/queue shows a caller who is not a broker admin of other "
        "users' waiting requests: True, what each asks for and where it stands (position, "
        "reason, estimated start), not who asked (user, server, group, lease id), as the "
        "panel and GET /api/v1/devices show others' holdings (Slurm's PrivateData=jobs); "
        "False, every request in full, as squeue does by default. The caller's own "
        "requests and an admin's view are always in full.",
    ).tag(config=True)

    token_cache_max_age = Integer(
        5,
        min=1,
        help="Seconds the broker caches the hub's answer about a caller's token "
        "(HubAuth.cache_max_age). A revoked token, or one of a deleted user, "
        "loses access to the broker at most this long after. At least 1: "
        "HubAuth would cache forever with 0.",
    ).tag(config=True)

    @default("log_level")
    def _default_log_level(self) -> int:
        # INFO, as JupyterHub's: grants, stops, culls and admin changes are
        # logged there (successful API requests at DEBUG, docs/admin.md)
        return logging.INFO

    @default("log_format")
    def _default_log_format(self) -> str:
        return "[%(levelname)1.1s %(asctime)s.%(msecs).03d %(name)s] %(message)s"

    @default("log_datefmt")
    def _default_log_datefmt(self) -> str:
        return "%Y-%m-%d %H:%M:%S"

    @default("ip")
    def _default_ip(self) -> str:
        url = os.environ.get("JUPYTERHUB_SERVICE_URL")
        return (urlparse(url).hostname if url else None) or "127.0.0.1"

    @default("port")
    def _default_port(self) -> int:
        url = os.environ.get("JUPYTERHUB_SERVICE_URL")
        return (urlparse(url).port if url else None) or 10101

    @default("base_url")
    def _default_base_url(self) -> str:
        return os.environ.get("JUPYTERHUB_SERVICE_PREFIX", "/")

    @catch_config_error
    def initialize(self, argv: list[str] | None = None) -> None:
        """Parse the command line, then load the config file."""
        super().initialize(argv)
        if self.subapp is not None:
            return
        self.load_config_file(self.config_file)

    def load_config_file(self, path: str, **kwargs: Any) -> None:  # type: ignore[override]
        """Load ``path`` if it exists; command-line options still win."""
        if os.path.exists(path):
            super().load_config_file(path, **kwargs)
            self.update_config(self.cli_config)

    def start(self) -> None:
        """Run the subcommand, or print help when none was given."""
        if self.subapp is not None:
            self.subapp.start()
            return
        self.print_help()
        self.exit(2)


class _Command(Application):
    """A subcommand; reads options from its parent :class:`GPUBrokerApp`."""

    _log_formatter_cls = OneLineFormatter

    @property
    def broker_app(self) -> GPUBrokerApp:
        parent = self.parent
        assert isinstance(parent, GPUBrokerApp)
        return parent

    def initialize(self, argv: list[str] | None = None) -> None:
        """Let the parent parse options and load its config file."""
        app = self.broker_app
        app.parse_command_line(argv)
        app.load_config_file(app.config_file)


class UpgradeDBCommand(_Command):
    """``gpubroker upgrade-db``: migrate the store to the newest schema."""

    description = "Migrate the store (GPUBrokerApp.db_url) to the newest schema."

    def start(self) -> None:
        from .store.db import upgrade

        _migrate(self, "upgrading", upgrade)
        self.log.info("Store %s is at the newest schema", _shown(self.broker_app.db_url))


class DowngradeDBCommand(_Command):
    """``gpubroker downgrade-db REVISION``: take the store's schema down to
    ``REVISION`` (a migration's number, e.g. ``0014``), before going back to
    the release whose newest migration it is. Refused while a broker holds
    the database (a broker running on a schema taken from under it fails
    every command), as ``upgrade-db`` is."""

    description = (
        "Take the store (GPUBrokerApp.db_url) down to schema REVISION (e.g. 0014), the "
        "newest migration of the release to go back to; the broker must be stopped."
    )

    def start(self) -> None:
        from .store.db import downgrade, sqlite_path

        args = self.broker_app.extra_args
        if len(args) != 1:
            self.log.critical(
                "Not downgrading: give one REVISION, e.g. gpubroker downgrade-db 0014"
            )
            self.exit(2)
        revision = args[0]
        url = self.broker_app.db_url
        path = sqlite_path(url)
        if path is not None and not os.path.exists(path):  # make_engine would create it
            self.log.critical("Not downgrading: the database %s does not exist", _shown(url))
            self.exit(2)
        before = _migrate(self, "downgrading", lambda url: downgrade(url, revision))
        self.log.info("Store %s taken from schema %s down to %s", _shown(url), before, revision)


_T = TypeVar("_T")


def _migrate(command: _Command, verb: str, change: Callable[[str], _T]) -> _T:
    """Run ``change(db_url)`` holding the database's writer lock: never
    under a live broker. A held lock or an :class:`UnknownSchema` is logged
    as ``Not <verb>: …`` and ends the command with status 2."""
    from .store.db import UnknownSchema, make_engine
    from .store.lock import DatabaseLocked, WriterLock

    url = command.broker_app.db_url
    engine = make_engine(url)
    lock = WriterLock(engine)
    try:
        lock.acquire()
    except DatabaseLocked as err:
        engine.dispose()
        command.log.critical("Not %s: %s", verb, err)
        command.exit(2)
    try:
        return change(url)
    except UnknownSchema as err:
        command.log.critical("Not %s: %s", verb, err)
        command.exit(2)
        raise  # not reached: exit raises SystemExit
    finally:
        lock.release()
        engine.dispose()


def _shown(url: str) -> str:
    """``url`` for a log line: any password replaced by ``***``."""
    from .store.db import shown_url

    return shown_url(url)


class ServeCommand(_Command):
    """``gpubroker serve``: run the broker service."""

    description = "Run the broker service."

    def start(self) -> None:
        from .hub_tls import TLSConfigError
        from .service import BrokerService, SettingError
        from .store.db import UnknownSchema
        from .store.lock import DatabaseLocked, DatabaseUnavailable

        try:
            service = BrokerService(app=self.broker_app, log=self.broker_app.log)
            asyncio.run(service.run())
        except (DatabaseLocked, DatabaseUnavailable, UnknownSchema, TLSConfigError) as err:
            self.broker_app.log.critical("Not starting: %s", err)
            self.exit(2)
        except SettingError as err:  # a setting the configuration file got wrong
            self.broker_app.log.critical("Not starting: a setting is wrong: %s", err)
            self.exit(2)
        if service.exit_code:
            self.exit(service.exit_code)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``gpubroker`` console script."""
    app = GPUBrokerApp.instance()
    try:
        app.initialize(argv)  # --help and --help-all print here
        app.start()
    except BrokenPipeError:
        # output piped into a reader that stopped (`gpubroker jobs list | head`):
        # no traceback; stdout to /dev/null so that the exit's flush does not fail
        # again (Python's documentation, "Note on SIGPIPE")
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
