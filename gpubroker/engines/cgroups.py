"""One control group (cgroup v2) per launch of the local engine.

A process cannot leave a cgroup by forking, by starting a session of its
own or by dropping the launch's tag from its environment: every process a
launch starts stays in its cgroup (Linux, ``Documentation/admin-guide/
cgroup-v2.rst``: "all processes belong to ... exactly one cgroup"; a child
is created in its parent's). So the local engine can tell when all of a
launch's processes have ended (``cgroup.events``: ``populated 0``) and end
them all at once (``cgroup.kill``, Linux 5.14+: SIGKILL to every member,
including one being forked), which a look through ``/proc`` cannot do for
a process that forks continuously. This is what Slurm's
``proctrack/cgroup`` does for a job's steps.

The launches' cgroups live under one directory (:func:`find_root`): by
default ``<cgroup2 mount><the broker's own cgroup>/gpubroker-launches``,
which the broker may create where it runs as root, or where its cgroup is
delegated to it (systemd ``Delegate=yes``). Where no cgroup2 hierarchy is
mounted or writable, there are none, and the engine looks through
``/proc`` alone.

Moving a process between cgroups needs write access to ``cgroup.procs`` of
the common ancestor of the two; a user's process cannot, so a launch is
moved by the broker before its program starts (the local engine's helper
waits for it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import signal
from pathlib import Path

log = logging.getLogger(__name__)

#: the subdirectory of the broker's cgroup that holds the launches' cgroups
LAUNCHES = "gpubroker-launches"


def cgroup2_mount(mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """The mount point of the cgroup v2 hierarchy (``/sys/fs/cgroup`` on a
    cgroup v2 host, ``/sys/fs/cgroup/unified`` on a hybrid one), from
    ``mountinfo`` (proc(5): the fifth field is the mount point, the
    filesystem type follows the `` - `` separator); ``None`` when none is
    mounted or the file cannot be read."""
    try:
        with open(mountinfo, encoding="utf-8", errors="surrogateescape") as lines:
            for line in lines:
                fields, _, rest = line.partition(" - ")
                if rest.split(" ", 1)[0] == "cgroup2":
                    return fields.split(" ")[4].replace("\\040", " ")
    except OSError:
        return None
    return None


def own_cgroup(cgroup: str = "/proc/self/cgroup") -> str | None:
    """This process's cgroup v2 path (the ``0::PATH`` line of ``cgroup``),
    or ``None``."""
    try:
        with open(cgroup, encoding="utf-8", errors="surrogateescape") as lines:
            for line in lines:
                if line.startswith("0::"):
                    return line[3:].rstrip("\n")
    except OSError:
        return None
    return None


def cgroup_of(pid: int) -> str | None:
    """``pid``'s cgroup v2 path (as :func:`own_cgroup` reads it), or ``None``."""
    return own_cgroup(f"/proc/{pid}/cgroup")


def find_root(setting: str) -> LaunchCgroups | None:
    """The launches' cgroups for ``setting``: ``""`` none; ``"auto"`` the
    :data:`LAUNCHES` directory under the broker's own cgroup in the cgroup
    v2 mount; else that directory (which must be in a cgroup v2
    hierarchy). It is created if missing. ``None`` (logged) where it
    cannot be: no cgroup v2, or no right to create it."""
    if not setting:
        return None
    if setting == "auto":
        mount, own = cgroup2_mount(), own_cgroup()
        if mount is None or own is None:
            log.info("no cgroup v2 hierarchy: launches are tracked through /proc alone")
            return None
        setting = os.path.join(mount, own.lstrip("/"), LAUNCHES)
    else:
        mount = cgroup2_mount()
    root = Path(setting)
    if mount is None or not is_cgroup2(root.parent, Path(mount)):  # nothing is made elsewhere
        log.warning("%s is not in a cgroup v2 hierarchy: launches are tracked through /proc", root)
        return None
    try:
        root.mkdir(exist_ok=True)
    except OSError as err:
        log.info("cannot create %s (%s): launches are tracked through /proc alone", root, err)
        return None
    return LaunchCgroups(root, Path(mount))


def is_cgroup2(path: Path, mount: Path) -> bool:
    """Whether ``path`` is a cgroup of the cgroup v2 hierarchy mounted at
    ``mount``: inside it, with a ``cgroup.procs`` (a cgroup v1 cgroup
    elsewhere has one too)."""
    try:
        inside = path.resolve().is_relative_to(mount.resolve())
    except OSError:
        return False
    return inside and (path / "cgroup.procs").is_file()


class LaunchCgroups:
    """The cgroups of launches, one per launch tag, under ``root``.

    Every call takes a launch's cgroup path (:meth:`path`); reads of a
    cgroup that is gone answer as for an empty one, and signals to
    processes that are gone are ignored.
    """

    def __init__(self, root: Path, mount: Path) -> None:
        self.root = root
        #: the cgroup v2 mount point (a cgroup path read in /proc is under it)
        self.mount = mount

    def absolute(self, path: str) -> str:
        """A cgroup path as ``/proc/PID/cgroup`` gives it, in the file system."""
        return str(self.mount / path.lstrip("/"))

    def path(self, tag: str) -> Path:
        """The cgroup of the launch tagged ``tag`` (characters other than
        letters, digits, ``.``, ``_`` and ``-`` become ``_``)."""
        return self.root / (re.sub(r"[^A-Za-z0-9._-]", "_", tag)[:200] or "_")

    def owns(self, path: str) -> bool:
        """Whether ``path`` (:meth:`absolute`) is one of this root's launch
        cgroups."""
        return Path(path).parent == self.root

    def create(self, tag: str) -> Path:
        """Make the cgroup of ``tag``. An empty one of that name is used
        again (the launch's intent survived a crash); where one is in use
        (another launch had the same tag), a new name is drawn: two
        launches never share a cgroup. Raises ``OSError``."""
        path = self.path(tag)
        try:
            path.mkdir()
        except FileExistsError:
            if self.populated(path):
                path = self.path(f"{tag}-{secrets.token_hex(4)}")
                path.mkdir()
        return path

    @staticmethod
    def add(path: Path, pid: int) -> None:
        """Move ``pid`` into ``path``. Raises ``OSError``."""
        (path / "cgroup.procs").write_text(str(pid))

    @staticmethod
    def pids(path: Path) -> list[int]:
        """The processes in ``path`` now (``[]`` when it is gone)."""
        try:
            return [int(p) for p in (path / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            return []

    @staticmethod
    def populated(path: Path) -> bool:
        """Whether a process is left in ``path`` (``cgroup.events``;
        zombies are not members)."""
        try:
            events = (path / "cgroup.events").read_text()
        except OSError:
            return False
        return "populated 1" in events.splitlines()

    @classmethod
    def signal(cls, path: Path, signum: int) -> None:
        """Send ``signum`` to every process in ``path``: SIGKILL through
        ``cgroup.kill`` where the kernel has it (a child being forked is
        killed too), else, and for other signals, to each member."""
        if signum == signal.SIGKILL:
            try:
                (path / "cgroup.kill").write_text("1")
                return
            except OSError:
                pass  # before Linux 5.14, or gone
        for pid in cls.pids(path):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signum)

    @staticmethod
    def remove(path: Path) -> None:
        """Remove ``path`` once empty (left in place while it is not)."""
        with contextlib.suppress(OSError):
            path.rmdir()
