"""One active broker per database: the writer lock.

A broker takes this lock before it migrates, adopts or schedules, and holds
it for its whole life (DESIGN.md, principle 7). A second broker on the same
database refuses to start and says which process holds the lock.

- **SQLite**: an exclusive ``flock`` on the database file itself, found by
  its real path (symlinks, hard links, relative and URI forms all meet the
  same lock). The kernel frees it the moment the holder exits, however it
  dies. ``<database file>.lock`` holds the holder's description (pid, host,
  start time), which a refused broker prints. ``flock`` is not reliable on network file
  systems: keep a SQLite store on a local disk.
- **PostgreSQL**: a session advisory lock (``pg_try_advisory_lock``) on a
  connection kept open for the broker's life, named by its
  ``application_name`` (pid, host), which a refused broker reads from
  ``pg_stat_activity``. When the holder dies the server frees the lock as
  soon as it sees the connection gone: at once for a process that exits on
  the same host, and within ``tcp_keepalives_idle + tcp_keepalives_interval
  x tcp_keepalives_count`` seconds (10 + 5 x 3 = 25 s, set on the lock's
  session) when the holder's host vanishes.
- An in-memory SQLite database (``sqlite://``) belongs to one process and
  needs no lock.

Other back ends are refused: a broker cannot promise one writer there.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import os
import socket
from typing import Any

from sqlalchemy import Connection, Engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from .db import create_private_sqlite, sqlite_path

#: key of the PostgreSQL advisory lock (``b"gpubrokr"`` read as a big-endian int64)
ADVISORY_KEY = int.from_bytes(b"gpubrokr", "big") & 0x7FFF_FFFF_FFFF_FFFF


class DatabaseUnavailable(RuntimeError):
    """The database could not be reached to take the lock (PostgreSQL down,
    a wrong host); the message names it, without its password."""


class DatabaseLocked(RuntimeError):
    """Another broker holds the database.

    Attributes:
        holder: what is known of the holder (pid, host, since), for the message.
    """

    def __init__(self, where: str, holder: str) -> None:
        super().__init__(
            f"another gpubroker is the active broker of {where} ({holder}); "
            "one broker per database: stop that one first, or point this one "
            "at another database"
        )
        self.holder = holder


def describe_self(url: str = "") -> dict[str, Any]:
    """This process as a lock holder: pid, host, start (UTC ISO 8601), URL."""
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "url": url,
    }


class WriterLock:
    """The writer lock of one database, held until :meth:`release` or exit.

    Args:
        engine: the store's engine (its URL picks the kind of lock).
        me: how this broker describes itself to a refused one
            (:func:`describe_self`).
    """

    def __init__(self, engine: Engine, me: dict[str, Any] | None = None) -> None:
        self.engine = engine
        self.me = me or describe_self()
        self._fd: int | None = None
        self._conn: Connection | None = None

    def acquire(self) -> None:
        """Take the lock now, without waiting.

        Raises:
            DatabaseLocked: another broker holds it (the message names it).
            ValueError: the database is of a kind this lock cannot guard.
            OSError: the lock file cannot be created (SQLite).
        """
        url = self.engine.url
        if url.get_backend_name() == "sqlite":
            path = sqlite_path(url.render_as_string(hide_password=False))
            if path is None:
                return
            self._acquire_file(path)
        elif url.get_backend_name() == "postgresql":
            self._acquire_advisory()
        else:
            raise ValueError(
                f"db_url: one-writer lock not available for {url.get_backend_name()!r} "
                "(use SQLite or PostgreSQL)"
            )

    def _acquire_file(self, database: str) -> None:
        """``flock`` the database file itself (its inode: every path to it,
        symlinks and hard links included, meets the same lock; SQLite's own
        locks are POSIX record locks, which ``flock`` leaves alone); the
        holder is described in ``<database>.lock``."""
        create_private_sqlite(f"sqlite:///{database}")
        fd = os.open(database, os.O_RDONLY)
        note = f"{database}.lock"
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DatabaseLocked(database, _holder_text(_read(note))) from None
        info = os.open(note, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(info, json.dumps(self.me).encode())
        finally:
            os.close(info)
        self._fd = fd

    def _acquire_advisory(self) -> None:
        try:
            conn = self.engine.connect()
        except OperationalError as err:
            where = make_url(str(self.engine.url)).render_as_string(hide_password=True)
            raise DatabaseUnavailable(f"cannot reach {where}: {err.orig}") from None
        name = f"gpubroker pid={self.me['pid']} host={self.me['host']} since={self.me['since']}"
        conn.execute(text("SELECT set_config('application_name', :n, false)"), {"n": name[:63]})
        for setting, value in (
            ("tcp_keepalives_idle", 10),
            ("tcp_keepalives_interval", 5),
            ("tcp_keepalives_count", 3),
        ):
            conn.execute(text(f"SET {setting} = {int(value)}"))
        got = conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": ADVISORY_KEY}).scalar()
        conn.commit()
        if not got:
            holder = conn.execute(
                text(
                    "SELECT a.application_name, a.client_addr, a.pid FROM pg_locks l "
                    "JOIN pg_stat_activity a ON a.pid = l.pid "
                    "WHERE l.locktype = 'advisory' AND l.granted "
                    "AND l.classid = :hi AND l.objid = :lo AND l.objsubid = 1 "
                    # advisory locks belong to one database: not another's broker
                    "AND l.database = (SELECT oid FROM pg_database "
                    "WHERE datname = current_database())"
                ),
                {"hi": ADVISORY_KEY >> 32, "lo": ADVISORY_KEY & 0xFFFF_FFFF},
            ).first()
            conn.invalidate()  # a session of its own, never back to the pool
            conn.close()
            where = make_url(str(self.engine.url)).render_as_string(hide_password=True)
            described = (
                f"{holder[0]} from {holder[1] or 'a local socket'}, server pid {holder[2]}"
                if holder
                else "holder unknown"
            )
            raise DatabaseLocked(where, described)
        self._conn = conn

    def check(self) -> bool:
        """Whether the lock is still held (for PostgreSQL: its session is alive).

        A broker that loses its lock's session must stop writing: another may
        already hold it.
        """
        if self._conn is None:
            return True
        try:
            self._conn.execute(text("SELECT 1"))
            self._conn.commit()
        except Exception:
            return False
        return True

    def release(self) -> None:
        """Give the lock up (at a clean shutdown; exiting frees it too)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._conn is not None:
            try:
                # close the session itself: back in the pool it would keep the lock
                self._conn.invalidate()
                self._conn.close()
            finally:
                self._conn = None


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(4096)
    except OSError:
        return ""


def _holder_text(raw: str) -> str:
    try:
        holder = json.loads(raw)
    except ValueError:
        return "holder unknown"
    return f"pid {holder.get('pid')} on {holder.get('host')}, since {holder.get('since')}" + (
        f", serving {holder['url']}" if holder.get("url") else ""
    )
