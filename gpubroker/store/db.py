"""Engine, sessions and schema upgrades.

SQLite databases are opened in WAL mode (readers never block the one writer)
with ``synchronous=NORMAL`` (a commit survives a crash of the process; an OS
crash or power loss may lose the last ones) and foreign keys on. The
schema is owned by Alembic: :func:`upgrade` brings a database to the newest
revision and is what ``gpubroker upgrade-db`` and
broker start-up run.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util.exc import CommandError
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import NullPool

MIGRATIONS_DIR = Path(__file__).parent / "migrations"
#: the store where neither ``--db-url``, the config file nor ``$GPUBROKER_DB_URL`` names one
DEFAULT_DB_URL = "sqlite:///gpubroker.sqlite"


def shown_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for log lines)."""
    return make_url(url).render_as_string(hide_password=True)


def _sqlite_pragmas(dbapi_connection: Any, connection_record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.close()
    _sqlite_reader_pragmas(dbapi_connection, connection_record)


def _sqlite_reader_pragmas(dbapi_connection: Any, connection_record: Any) -> None:
    """The pragmas that change nothing in the file (the journal mode does:
    a read of another program's database must leave it as it was)."""
    cursor = dbapi_connection.cursor()
    # NORMAL in WAL mode: a commit survives any crash of the broker process;
    # only an OS crash or power loss can lose the last commits, and that also
    # ends every server and job those commits were about (a full fsync per
    # command would cost ~10 ms on a plain disk)
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=5000")
    cursor.close()


def sqlite_path(url: str) -> str | None:
    """The file of a SQLite ``url``, resolved (symlinks followed, relative
    to the working directory), also for URI filenames
    (``sqlite:///file:NAME?uri=true``); ``None`` for in-memory databases and
    other back ends."""
    parsed = make_url(url)
    name = parsed.database
    if parsed.get_backend_name() != "sqlite" or name in (None, "", ":memory:"):
        return None
    if name.startswith("file:"):
        name = name[5:].split("?", 1)[0]
        if name.startswith("//"):  # file://host/path: the path part
            name = "/" + name[2:].split("/", 1)[-1]
        if name in ("", ":memory:"):
            return None
    return os.path.realpath(name)


def create_private_sqlite(url: str) -> None:
    """Create the file of a SQLite ``url`` readable by its owner only (0600)
    if it does not exist yet; other URLs are left alone.

    SQLite gives its ``-wal`` and ``-shm`` files the database file's mode, so
    they are private too. A file that exists keeps its mode (an admin may
    have chosen one).
    """
    path = sqlite_path(url)
    if path is None:
        return
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))


def make_engine(url: str, wal: bool = True, **kwargs: Any) -> Engine:
    """Create an engine for ``url`` (any SQLAlchemy URL).

    For SQLite, the file is created 0600 (:func:`create_private_sqlite`);
    WAL journal mode (unless ``wal`` is false: the file's journal mode is
    left as it is), foreign keys and a 5 s busy timeout are set on every
    connection.
    """
    create_private_sqlite(url)
    engine = create_engine(url, **kwargs)
    if engine.dialect.name == "sqlite":
        event.listen(engine, "connect", _sqlite_pragmas if wal else _sqlite_reader_pragmas)
    return engine


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    """Return a session factory whose objects stay usable after commit."""
    return sessionmaker(engine, expire_on_commit=False)


def alembic_config(url: str) -> Config:
    """An Alembic :class:`Config` for the packaged migrations and ``url``."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


class UnknownSchema(RuntimeError):
    """The database's schema is not one this gpubroker can run on: a
    revision it does not ship (written by a newer gpubroker), or, where the
    broker does not migrate at start, an older one or none; the message
    says what to do."""


#: what :func:`check_schema` tells the broker's admin by default
UPGRADE_ADVICE = "upgrade_db is off, so run `gpubroker upgrade-db` first (see the admin guide)"


def check_schema(url: str, advice: str = UPGRADE_ADVICE) -> None:
    """Refuse a database this gpubroker cannot run on without migrating it
    (``GPUBrokerApp.upgrade_db`` off, or a command that only reads it): it
    must be at this release's newest revision. The schema is not changed (a
    SQLite file that did not exist is created, empty, as any open of it
    does). ``advice``: what the refusal of an older schema, or of none,
    tells the reader to do.

    Raises:
        UnknownSchema: at a revision this gpubroker does not know (a newer
            release migrated it), at an older one, or without a schema.
        sqlalchemy.exc.SQLAlchemyError: the database cannot be reached.
    """
    at = _revision_at(url)
    head = head_revision()
    if at == head:
        return
    if at is not None and not _known(alembic_config(url), at):
        raise UnknownSchema(_newer(url, at))
    found = "has no gpubroker schema" if at is None else f"is at schema revision {at!r}"
    raise UnknownSchema(
        f"the database {shown_url(url)} {found}, and this gpubroker needs {head!r}; {advice}"
    )


class StoreUnreachable(RuntimeError):
    """The database cannot be reached (its message: one line, the URL's
    password hidden)."""


def check_url(url: str) -> None:
    """Refuse a store URL SQLAlchemy cannot read (a command line's typo).

    Raises:
        StoreUnreachable: it is not such a URL; the message does not repeat
            the URL, which may hold a password.
    """
    try:
        make_url(url)
    except (ArgumentError, ValueError) as err:
        why = f" ({err})" if isinstance(err, ValueError) else ""
        raise StoreUnreachable(
            "Cannot read the store: its URL is not one SQLAlchemy can read, "
            f"dialect+driver://user:password@host:port/database{why}"
        ) from None


def check_readable(url: str, advice: str) -> None:
    """:func:`check_schema` for a command that only reads the store
    (``gpubroker report``, ``audit``).

    Raises:
        UnknownSchema: as :func:`check_schema`, with ``advice``.
        StoreUnreachable: the database cannot be reached.
    """
    try:
        check_schema(url, advice)
    except (SQLAlchemyError, ImportError, ValueError) as err:
        # ImportError: the URL's driver is not installed; ValueError: a bad URL
        first = (str(getattr(err, "orig", None) or err).splitlines() or [type(err).__name__])[0]
        raise StoreUnreachable(f"Cannot reach the store {shown_url(url)}: {first}") from None


def _revision_at(url: str) -> str | None:
    """The schema revision of the database at ``url`` (``None``: none), read
    on a connection of its own that changes nothing (not even a SQLite
    file's journal mode: the file may be another program's)."""
    engine = make_engine(url, wal=False, poolclass=NullPool)
    try:
        return current_revision(engine)
    finally:
        engine.dispose()


def _newer(url: str, at: str) -> str:
    """The refusal of a database at revision ``at``, which a newer gpubroker wrote."""
    return (
        f"the database {shown_url(url)} is at schema revision {at!r}, which this "
        f"gpubroker (newest revision {head_revision()!r}) does not know: a newer "
        "gpubroker migrated it. Run that release again, or take the schema down "
        "with it to this release's newest revision first (see the admin guide)"
    )


def upgrade(url: str, revision: str = "head") -> None:
    """Upgrade the database at ``url`` to ``revision`` (default: newest).

    Raises:
        UnknownSchema: the database is at a revision this gpubroker does not
            know (a newer release migrated it; nothing was changed).
        sqlalchemy.exc.SQLAlchemyError: the database cannot be reached or migrated.
    """
    create_private_sqlite(url)
    cfg = alembic_config(url)
    at = _revision_at(url)
    if at is not None and not _known(cfg, at):
        raise UnknownSchema(_newer(url, at))
    command.upgrade(cfg, revision)


def downgrade(url: str, revision: str) -> str | None:
    """Take the database at ``url`` down to ``revision`` (a packaged
    migration's number, e.g. ``"0014"``), for going back to the release whose
    newest migration that is. Every migration has a downgrade.

    Returns:
        the revision the database was at before.

    Raises:
        UnknownSchema: ``revision`` is not a packaged migration, or the
            database is at a revision this gpubroker does not know, or below
            ``revision`` already (nothing was changed).
        sqlalchemy.exc.SQLAlchemyError: the database cannot be reached or migrated.
    """
    cfg = alembic_config(url)
    if not (revision.isascii() and revision.isdigit() and len(revision) == 4):
        raise UnknownSchema(
            f"revision {revision!r} is not a migration's number (four digits, e.g. 0014)"
        )
    path = sqlite_path(url)
    if path is not None and not os.path.exists(path):
        raise UnknownSchema(f"the database {shown_url(url)} does not exist: nothing to take down")
    if not _known(cfg, revision):
        raise UnknownSchema(
            f"revision {revision!r} is not a migration of this gpubroker (its files in "
            "gpubroker/store/migrations/versions/ are numbered 0001 to "
            f"{head_revision()})"
        )
    at = _revision_at(url)
    if at is None or not _known(cfg, at):
        raise UnknownSchema(
            f"the database {shown_url(url)} is at schema revision {at!r}, which this "
            "gpubroker does not know: nothing to take down"
        )
    if int(at) < int(revision):
        raise UnknownSchema(
            f"the database {shown_url(url)} is at schema revision {at!r}, below "
            f"{revision!r} already: use upgrade-db to go up"
        )
    command.downgrade(cfg, revision)
    return at


def _known(cfg: Config, revision: str) -> bool:
    """Whether ``revision`` is one of the packaged migrations."""
    try:
        return ScriptDirectory.from_config(cfg).get_revision(revision) is not None
    except CommandError:
        return False


def current_revision(engine: Engine) -> str | None:
    """The Alembic revision the database is at, or ``None`` if unversioned."""
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def head_revision() -> str | None:
    """The newest revision shipped with this version of gpubroker."""
    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()
