"""A private PostgreSQL server for tests: ``initdb`` in a temporary
directory, ``pg_ctl start`` on a free loopback port, stopped by the test.

Needs the PostgreSQL server binaries (Debian package ``postgresql``; the
Makefile installs it where it is missing and apt-get is there). As root the
server runs as the ``postgres`` system user, as PostgreSQL requires.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

from .hubutil import free_port


def pg_bin() -> Path | None:
    """The directory of ``initdb`` and ``pg_ctl`` (newest version), or ``None``."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).resolve().parent if initdb else None


class RunningPostgres:
    """A PostgreSQL server in a new temporary directory with a database
    ``gpubroker`` (outside pytest's 0700 temporary tree, which the
    ``postgres`` user could not enter); :meth:`stop` removes it.

    Attributes:
        url: SQLAlchemy URL of the database (psycopg 3, trust auth, loopback).
    """

    def __init__(self) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="gpubroker-pg-"))
        self.port = free_port()
        self.data = self.workdir / "data"
        binaries = pg_bin()
        if binaries is None:
            raise RuntimeError("PostgreSQL server binaries not found: run `make setup`")
        self.bin = binaries
        self.url = f"postgresql+psycopg://gpubroker@127.0.0.1:{self.port}/gpubroker"

    def _run(self, *args: str) -> None:
        cmd = [str(self.bin / args[0]), *args[1:]]
        if os.getuid() == 0:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        subprocess.run(cmd, check=True, capture_output=True, timeout=60)

    def start(self) -> RunningPostgres:
        """initdb, start, create the database; return self."""
        if os.getuid() == 0:
            owner = pwd.getpwnam("postgres")
            os.chown(self.workdir, owner.pw_uid, owner.pw_gid)
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "gpubroker")
        options = f"-p {self.port} -k {self.workdir} -c listen_addresses=127.0.0.1"
        log = str(self.workdir / "postgres.log")
        self._run("pg_ctl", "-D", str(self.data), "-l", log, "-w", "-o", options, "start")
        self._run(
            "createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "gpubroker", "gpubroker"
        )
        return self

    def stop(self) -> None:
        """Stop the server (fast shutdown), wait for it, remove its files."""
        try:
            self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")
        finally:
            shutil.rmtree(self.workdir, ignore_errors=True)
