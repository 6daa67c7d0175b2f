"""The local engine: holders' processes as plain processes on this host.

One node, this host, whose devices are those of the device backend passed in
(the engine never talks to NVML itself). Each launch is a
:class:`subprocess.Popen` in a new session (so a new process group whose id
is the pid: signals and :meth:`LocalEngine.stop` reach the process and its
children alike). The :class:`~gpubroker.engines.base.Handle` id is the pid.

Trust rule: anything the broker starts for a user carries only that user's
rights. So the process gets exactly ``spec.env`` as its environment, never
the broker's own (only ``PATH`` is added, set to
:data:`DEFAULT_PATH`, when ``spec.env`` has none), standard input from
``/dev/null``, and runs as ``spec.user``: directly when that is the broker's
own user, else (the broker must be root) with the user's uid, primary gid and
supplementary groups, and then the working directory is entered and the
output files opened *as that user*, by a small helper run with the user's
rights just before the program (so the broker's rights never open a path a
user named).

After a broker restart the new engine does not know the processes the old
one started: it polls such a handle by pid (``os.kill(pid, 0)``): alive is
``running``, gone is ``lost`` (how it ended is not known; the exit status
went to the old broker). It still signals and stops such a process, but only
while the pid leads its own process group (as every process this engine
starts does) and its environment has :data:`TAG_VARIABLE` (which every
launch has): a pid reused by an unrelated process (after a reboot, say) is
``lost`` and never signalled.

Every launch gets a tag in its environment (:data:`TAG_VARIABLE`), from
its first instruction on: the
:attr:`~gpubroker.engines.base.LaunchSpec.tag`, or one of its own;
:meth:`LocalEngine.find` looks for it in ``/proc`` among the process-group
leaders of the spec's user, so a broker that crashed between a launch and
recording its pid finds the process instead of starting a second one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pwd
import secrets
import select
import signal as signal_module
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from gpubroker.devices.base import DeviceBackend, DeviceBackendError, DeviceInfo, DeviceUsage

from . import cgroups
from .base import EngineError, Handle, LaunchSpec, Node, Status

log = logging.getLogger(__name__)

#: ``PATH`` given to a process whose ``spec.env`` has none (Debian's default
#: for users); never the broker's own ``PATH``
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"

#: the environment variable that carries a launch's tag (:meth:`LocalEngine.find`)
TAG_VARIABLE = "GPUBROKER_LAUNCH_TAG"

#: seconds :meth:`LocalEngine.stop` waits for the process after SIGKILL
KILL_WAIT = 5.0

#: seconds :meth:`LocalEngine.launch` waits for the as-user helper to exec
EXEC_WAIT = 30.0

#: how often a wait for a process group to empty looks again, seconds
_POLL_INTERVAL = 0.05

#: run as the target user (``python -I -S -c``) just before the program: wait
#: until the broker has put it in the launch's cgroup (where there is one),
#: enter the working directory and open the output files with the user's
#: rights, then exec. Its argv: status fd, go fd ("-1": none; one byte is
#: read from it first), cwd, stdout path or "", stderr path or "", the
#: original LC_CTYPE ("-" when unset, else "=" + value; Python's locale
#: coercion (PEP 538) may have changed it), then the program's argv. Any
#: failure is written to the status fd (close-on-exec: EOF means exec worked).
_AS_USER_HELPER = """\
import os, sys
fd, go = int(sys.argv[1]), int(sys.argv[2])
cwd, out, err, lc_ctype = sys.argv[3:7]
argv = sys.argv[7:]
os.set_inheritable(fd, False)
try:
    if go >= 0:
        if os.read(go, 1) != b"1":  # the broker went before it opened the gate
            raise RuntimeError("the broker did not let this launch start")
        os.close(go)
    os.chdir(cwd)
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
    if out:
        o = os.open(out, flags, 0o600)
        os.dup2(o, 1)
        os.close(o)
    if err and err == out:
        os.dup2(1, 2)
    elif err:
        e = os.open(err, flags, 0o600)
        os.dup2(e, 2)
        os.close(e)
    env = dict(os.environ)
    if lc_ctype == "-":
        env.pop("LC_CTYPE", None)
    else:
        env["LC_CTYPE"] = lc_ctype[1:]
    os.execvpe(argv[0], argv, env)
except BaseException as exc:
    os.write(fd, (type(exc).__name__ + ": " + str(exc)).encode())
    os._exit(127)
"""


@dataclass(frozen=True)
class _Mark:
    """What every process of one launch carries: its :data:`TAG_VARIABLE`
    value, and the real uid it runs as; and the cgroup they are all in
    (``""``: none, :mod:`.cgroups`)."""

    tag: str
    uid: int
    cgroup: str = ""


@dataclass
class _Proc:
    """A process this engine started and still remembers."""

    popen: subprocess.Popen[bytes]
    spec: LaunchSpec
    started: datetime
    mark: _Mark
    ended: datetime | None = None
    timed_out: bool = False
    timers: list[threading.Timer] = field(default_factory=list)
    #: when the launch's other processes were told to end, its leader having
    #: exited (:func:`time.monotonic`; ``None``: not yet)
    reaping: float | None = None
    #: process groups tagged processes of the launch were seen in, besides
    #: its own (:meth:`LocalEngine._kill_launch`)
    groups: set[int] = field(default_factory=set)


@dataclass
class _Adopted:
    """A launch an earlier broker's engine started, seen running by this
    one: what :meth:`LocalEngine.poll` needs to end the processes its
    leader leaves, read from the leader's ``/proc`` entry while it ran."""

    mark: _Mark
    #: as :attr:`_Proc.reaping`
    reaping: float | None = None
    #: as :attr:`_Proc.groups`
    groups: set[int] = field(default_factory=set)


def _utcnow() -> datetime:
    return datetime.now(timezone.utc)


def _exit_status(code: int) -> tuple[int | None, int | None]:
    """``Popen.returncode`` -> ``(exit_code, signal)``: negative means a signal."""
    return (None, -code) if code < 0 else (code, None)


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (``os.kill(pid, 0)``)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, another user's
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            # "pid (comm) S ...": the state follows the last ")"
            return stat.read().rpartition(b")")[2].split()[0] != b"Z"
    except (OSError, IndexError):
        return True  # no /proc (not Linux) or it just went: trust os.kill


def _group_alive(pgid: int) -> bool:
    """Whether the process group ``pgid`` has any member left that is not a zombie.

    ``os.killpg(pgid, 0)`` first; on Linux the members are then looked up in
    ``/proc``, so zombies do not count (in a container whose pid 1 does not
    reap orphans, ended children stay zombies for ever).
    """
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        entries = os.listdir("/proc")
    except OSError:
        return True  # not Linux: trust os.killpg
    wanted = str(pgid).encode()
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                # "pid (comm) state ppid pgrp ...": fields after the last ")"
                fields = stat.read().rpartition(b")")[2].split()
        except OSError:
            continue  # it just went
        if len(fields) > 2 and fields[2] == wanted and fields[0] != b"Z":
            return True
    return False


def _tag_of(pid: int) -> bytes | None:
    """The value of :data:`TAG_VARIABLE` in ``pid``'s environment (``b""``
    when it has none); ``None`` when the environment cannot be read (gone,
    or the broker may not read it)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as environ:
            variables = environ.read().split(b"\0")
    except OSError:
        return None
    prefix = f"{TAG_VARIABLE}=".encode()
    return next((v[len(prefix) :] for v in variables if v.startswith(prefix)), b"")


def _launched_here(pid: int) -> bool | None:
    """Whether ``pid``'s environment holds :data:`TAG_VARIABLE` (which every
    launch of this engine sets); ``None`` when it cannot be read (gone, or
    the broker may not read it: then nothing is concluded)."""
    tag = _tag_of(pid)
    return None if tag is None else bool(tag)


def _uid_and_stat(pid: int) -> tuple[int, list[bytes]] | None:
    """``pid``'s real uid and the fields of ``/proc/PID/stat`` after its
    ``comm`` (state, ppid, pgrp, ...); ``None`` when it is gone or they
    cannot be read."""
    try:
        with open(f"/proc/{pid}/status", "rb") as status:
            uids = next((ln for ln in status if ln.startswith(b"Uid:")), b"").split()
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rpartition(b")")[2].split()
    except OSError:
        return None
    if len(uids) < 2 or not fields:
        return None
    return int(uids[1]), fields


def _mark_of(pid: int) -> _Mark | None:
    """The :class:`_Mark` of the launch ``pid`` belongs to, from its
    ``/proc`` entry; ``None`` when it is gone, has no :data:`TAG_VARIABLE`
    or cannot be read."""
    found = _uid_and_stat(pid)
    tag = _tag_of(pid)
    if found is None or not tag:
        return None
    return _Mark(tag=tag.decode(errors="surrogateescape"), uid=found[0])


def _marked(mark: _Mark) -> list[int]:
    """The pids of every live process (zombies excluded) whose real uid is
    ``mark.uid`` and whose environment has :data:`TAG_VARIABLE` ``=
    mark.tag``, whatever its session or process group; never this
    process. Processes whose environment cannot be read are skipped; an
    unreadable ``/proc`` (not Linux) gives ``[]``."""
    return [pid for pid, _ in _marked_groups(mark)]


def _marked_groups(mark: _Mark) -> list[tuple[int, int]]:
    """``(pid, process group)`` of each process :func:`_marked` finds, the
    group read with it (a process that forks and exits at once is gone by
    the time one asks; its group lives on in its child)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    entry = f"{TAG_VARIABLE}={mark.tag}".encode()
    found_: list[tuple[int, int]] = []
    for name in entries:
        if not name.isdigit() or int(name) == os.getpid():
            continue
        found = _uid_and_stat(int(name))
        if found is None or found[0] != mark.uid or found[1][0] == b"Z":
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as environ:
                if entry in environ.read().split(b"\0"):
                    found_.append((int(name), int(found[1][2])))
        except (OSError, IndexError, ValueError):
            continue  # it just went, or may not be read
    return found_


def _tagged(entry: bytes, uid: int) -> int | None:
    """The pid of the oldest live process-group leader whose real uid is
    ``uid`` and whose environment has ``entry`` (``NAME=value``); ``None``
    when none has.

    Raises:
        EngineError: a candidate's environment cannot be read and none
            readable has ``entry`` (not known), or ``/proc`` cannot be read.
    """
    try:
        entries = os.listdir("/proc")
    except OSError as exc:
        raise EngineError(f"cannot look for a launch in /proc: {exc}") from exc
    found: list[tuple[int, int]] = []  # (start time in clock ticks, pid)
    unreadable: list[int] = []
    for name in entries:
        if not name.isdigit():
            continue
        pid = int(name)
        read = _uid_and_stat(pid)  # fields: "state ppid pgrp ... starttime (field 22)"
        if read is None:
            continue  # it just went
        real_uid, fields = read
        if real_uid != uid or len(fields) < 20:
            continue
        if fields[0] == b"Z" or int(fields[2]) != pid:  # a zombie, or not a group leader
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as environ:
                variables = environ.read().split(b"\0")
        except PermissionError:
            unreadable.append(pid)
            continue
        except OSError:
            continue
        if entry in variables:
            found.append((int(fields[19]), pid))
    if found:
        return min(found)[1]
    if unreadable:
        raise EngineError(
            f"cannot tell whether a launch runs: the environment of pids "
            f"{', '.join(map(str, unreadable[:5]))} of uid {uid} cannot be read "
            "(the broker needs CAP_SYS_PTRACE to read /proc/PID/environ)"
        )
    return None


class LocalEngine:
    """Runs processes on this host; one node with the backend's devices.

    Args:
        backend: the device backend of this host (inventory and telemetry).
        node_name: name of the node; ``None``: the ``node`` of the backend's
            devices (this host's name when it has none).
        default_path: ``PATH`` for a process whose ``spec.env`` has none.
        time_limit_grace: seconds between SIGTERM and SIGKILL when a
            process's ``time_limit`` passes.
        helper_python: Python interpreter that runs the as-user helper for
            launches as another user (any Python 3; it must be executable by
            every user, e.g. ``/usr/bin/python3``); ``None``: the broker's own
            (``os.path.realpath(sys.executable)``).

    Thread-safe. Only :meth:`stop` waits (at most ``grace`` +
    :data:`KILL_WAIT` seconds); :meth:`launch` waits for the fork and exec
    only. All calls block, so callers on an event loop run them with
    ``asyncio.to_thread``.
    """

    name = "local"

    def __init__(
        self,
        backend: DeviceBackend,
        node_name: str | None = None,
        *,
        default_path: str = DEFAULT_PATH,
        time_limit_grace: float = 10.0,
        helper_python: str | None = None,
        cgroup_root: str = "auto",
    ) -> None:
        self.backend = backend
        #: one cgroup per launch where the host allows (``None``: /proc alone)
        self.cgroups = cgroups.find_root(cgroup_root)
        self._node_name = node_name
        self.default_path = default_path
        self.time_limit_grace = time_limit_grace
        self.helper_python = helper_python or os.path.realpath(sys.executable)
        self._lock = threading.RLock()
        self._procs: dict[int, _Proc] = {}
        #: launches of an earlier engine seen running, by the leader's pid
        self._adopted: dict[int, _Adopted] = {}

    # --- inventory and telemetry ---------------------------------------------------

    @property
    def node_name(self) -> str:
        """The name of this engine's one node.

        Raises:
            EngineError: it comes from the inventory, which cannot be read.
        """
        if self._node_name is None:
            devices = self._devices()
            self._node_name = devices[0].node if devices else socket.gethostname()
        return self._node_name

    def nodes(self) -> list[Node]:
        """Return this host as the one node, ``"up"``, with the backend's devices.

        Devices are ordered by index; when ``node_name`` was given, their
        ``node`` is set to it.

        Raises:
            EngineError: the backend cannot read the inventory (the
                :class:`~gpubroker.devices.base.DeviceBackendError` is chained).
        """
        devices = self._devices()
        if self._node_name is None:
            self._node_name = devices[0].node if devices else socket.gethostname()
        name = self._node_name
        devices = [d if d.node == name else dataclasses.replace(d, node=name) for d in devices]
        return [Node(name=name, state="up", devices=tuple(devices))]

    def telemetry(self, uuids: Iterable[str]) -> dict[str, DeviceUsage]:
        """Return the backend's ``usage(uuid)`` of each known UUID (GPU or MIG).

        UUIDs the backend does not know (``KeyError``) are left out.

        Raises:
            EngineError: the backend cannot read a device's usage.
        """
        result: dict[str, DeviceUsage] = {}
        for uuid in uuids:
            try:
                result[uuid] = self.backend.usage(uuid)
            except KeyError:
                continue
            except DeviceBackendError as exc:
                raise EngineError(f"cannot read the usage of {uuid}: {exc}") from exc
        return result

    def _devices(self) -> list[DeviceInfo]:
        try:
            return sorted(self.backend.devices(), key=lambda d: d.index)
        except DeviceBackendError as exc:
            raise EngineError(
                f"cannot read the inventory of the {self.backend.kind} device backend: {exc}"
            ) from exc

    def _check_devices(self, uuids: tuple[str, ...]) -> None:
        """Raise EngineError unless every UUID is a GPU, or a MIG device, of this node."""
        if not uuids:
            return
        devices = self._devices()
        known = {d.uuid for d in devices}
        if any(u not in known for u in uuids):
            try:
                for device in devices:
                    if device.mig_enabled:
                        known.update(m.uuid for m in self.backend.mig_devices(device.uuid))
            except DeviceBackendError as exc:
                raise EngineError(f"cannot read the MIG devices of this node: {exc}") from exc
        missing = [u for u in uuids if u not in known]
        if missing:
            raise EngineError(f"devices not on node {self.node_name}: {', '.join(missing)}")

    # --- launch ---------------------------------------------------------------------

    def launch(self, spec: LaunchSpec) -> Handle:
        """Start ``spec`` as a new process (new session) and return its handle.

        The environment is exactly ``spec.env`` (plus ``PATH`` =
        :attr:`default_path` if it has none); standard input is
        ``/dev/null``; standard output and error are appended to
        ``spec.stdout``/``spec.stderr`` (created mode 0600) or discarded. A
        ``spec.time_limit`` is enforced by a timer: SIGTERM to the group when
        it passes, SIGKILL :attr:`time_limit_grace` seconds later.
        ``spec.devices`` must be devices of this node; the engine does not
        hide the others, ``spec.env`` says which to use
        (``CUDA_VISIBLE_DEVICES``). A ``spec.tag`` is added to the
        environment as :data:`TAG_VARIABLE` (:meth:`find`).

        Raises:
            EngineError: a device is not on this node; ``spec.user`` does not
                exist, or is another user and the broker is not root; the
                program, working directory or an output file cannot be
                found, opened or executed (the message names the cause).
        """
        self._check_devices(spec.devices)
        try:
            account = pwd.getpwnam(spec.user)
        except KeyError:
            raise EngineError(
                f"cannot launch lease {spec.lease_id}: no user {spec.user!r}"
            ) from None
        env = dict(spec.env)
        env.setdefault("PATH", self.default_path)
        # every launch carries a tag (one of its own when the caller gave
        # none): a restarted engine adopts only processes that carry one
        # (:func:`_launched_here`), never another process given a reused pid
        env[TAG_VARIABLE] = spec.tag or f"untagged-{secrets.token_hex(8)}"
        if account.pw_uid != os.geteuid() and os.geteuid() != 0:
            me = pwd.getpwuid(os.geteuid()).pw_name
            raise EngineError(
                f"cannot launch lease {spec.lease_id} as {spec.user!r}: the broker runs as"
                f" {me!r}, which may only start processes as itself (run it as root)"
            )
        group: Path | None = None
        if account.pw_uid == os.geteuid() and self.cgroups is None:
            popen = self._popen_as_self(spec, env)
        else:
            if account.pw_uid == os.geteuid():  # the same errors as without a cgroup
                self._check_outputs(spec)
            popen, group = self._popen_as_user(spec, env, account)
        mark = _Mark(tag=env[TAG_VARIABLE], uid=account.pw_uid, cgroup=str(group or ""))
        proc = _Proc(popen=popen, spec=spec, started=_utcnow(), mark=mark)
        with self._lock:
            self._procs[popen.pid] = proc
            if spec.time_limit is not None:
                self._start_timer(proc, spec.time_limit, self._on_time_limit, popen.pid)
        log.info(
            "launched lease %d as %s on %s: pid %d (%s)",
            spec.lease_id,
            spec.user,
            self.node_name,
            popen.pid,
            spec.argv[0],
        )
        return Handle(engine=self.name, id=str(popen.pid), node=self.node_name)

    def _cgroup_for(self, pid: int, tag: str) -> Path | None:
        """A new cgroup for the launch tagged ``tag`` whose first process
        is ``pid`` (named ``pid-<pid>-<tag>``: a restarted engine finds it
        by the pid it is given, :meth:`_orphans`), or ``None`` (no cgroups
        here, or it cannot be made: logged)."""
        if self.cgroups is None:
            return None
        try:
            return self.cgroups.create(f"pid-{pid}-{tag}")
        except OSError as err:
            log.warning("launch %s: no cgroup (%s): tracked through /proc alone", tag, err)
            return None

    def _popen_as_self(self, spec: LaunchSpec, env: dict[str, str]) -> subprocess.Popen[bytes]:
        files: list[int] = []
        try:
            stdout = self._open_output(spec, spec.stdout, files)
            if spec.stderr is not None and spec.stderr == spec.stdout:
                stderr = stdout
            else:
                stderr = self._open_output(spec, spec.stderr, files)
            return subprocess.Popen(
                list(spec.argv),
                env=env,
                cwd=spec.cwd,
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                start_new_session=True,
                close_fds=True,
            )
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            raise EngineError(self._launch_failed(spec, exc)) from exc
        finally:
            for fd in files:
                os.close(fd)

    def _check_outputs(self, spec: LaunchSpec) -> None:
        """Open (and close) ``spec``'s output files as the broker, for a
        launch as itself: :meth:`launch`'s error where one cannot be."""
        files: list[int] = []
        try:
            self._open_output(spec, spec.stdout, files)
            self._open_output(spec, spec.stderr, files)
        finally:
            for fd in files:
                os.close(fd)

    @staticmethod
    def _open_output(spec: LaunchSpec, path: str | None, files: list[int]) -> int:
        if path is None:
            return subprocess.DEVNULL
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise EngineError(
                f"cannot launch lease {spec.lease_id}: cannot open output file {path}: {exc}"
            ) from exc
        files.append(fd)
        return fd

    def _popen_as_user(
        self,
        spec: LaunchSpec,
        env: dict[str, str],
        account: pwd.struct_passwd,
    ) -> tuple[subprocess.Popen[bytes], Path | None]:
        """Start the helper as ``account`` (as the broker itself, without a
        change of user, where that is the broker's account), put it in a
        cgroup of its own (where the engine has them) before it goes on,
        and wait for its exec. Returns the process and its cgroup (``None``:
        none)."""
        lc_ctype = env.get("LC_CTYPE")
        read_end, write_end = os.pipe()
        go_read, go_write = os.pipe() if self.cgroups is not None else (-1, -1)
        group: Path | None = None
        switch: dict[str, Any] = {}
        if account.pw_uid != os.geteuid():
            switch = {
                "user": account.pw_uid,
                "group": account.pw_gid,
                "extra_groups": os.getgrouplist(account.pw_name, account.pw_gid),
            }
        try:
            argv = [
                self.helper_python,
                "-I",
                "-S",
                "-c",
                _AS_USER_HELPER,
                str(write_end),
                str(go_read),
                spec.cwd,
                spec.stdout or "",
                spec.stderr or "",
                "-" if lc_ctype is None else "=" + lc_ctype,
                *spec.argv,
            ]
            try:
                popen = subprocess.Popen(
                    argv,
                    env=env,
                    cwd="/",
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                    close_fds=True,
                    pass_fds=(write_end,) if go_read < 0 else (write_end, go_read),
                    **switch,
                )
            except (OSError, ValueError, subprocess.SubprocessError) as exc:
                cause = f"{exc} (starting the as-user helper {self.helper_python})"
                raise EngineError(self._launch_failed(spec, cause)) from exc
            os.close(write_end)
            write_end = -1
            try:
                if go_write >= 0:
                    group = self._cgroup_for(popen.pid, env[TAG_VARIABLE])
                    if group is not None and not self._move_into(group, popen.pid):
                        group = None
                    os.write(go_write, b"1")  # the helper goes on
            except BaseException:  # the helper, still at its gate, never starts it
                popen.kill()
                popen.wait()
                if group is not None:
                    cgroups.LaunchCgroups.remove(group)
                raise
            failure = self._read_exec_status(read_end)
        finally:
            for fd in (read_end, write_end, go_read, go_write):
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)
        if failure is not None:
            try:
                popen.wait(timeout=KILL_WAIT)
            except subprocess.TimeoutExpired:
                os.killpg(popen.pid, signal_module.SIGKILL)
                popen.wait()
            if group is not None:
                cgroups.LaunchCgroups.remove(group)
            raise EngineError(self._launch_failed(spec, failure))
        return popen, group

    def _move_into(self, group: Path, pid: int) -> bool:
        """Put the helper ``pid`` (waiting, before the program) in ``group``;
        ``False`` on a failure, logged (the launch is then tracked through
        /proc alone)."""
        assert self.cgroups is not None
        try:
            self.cgroups.add(group, pid)
        except OSError as err:
            log.warning(
                "pid %d: cannot move it into %s (%s): tracked through /proc", pid, group, err
            )
            cgroups.LaunchCgroups.remove(group)
            return False
        return True

    @staticmethod
    def _read_exec_status(fd: int) -> str | None:
        """Read the helper's status pipe to EOF: ``None`` if it exec'ed, else the error."""
        data = b""
        deadline = time.monotonic() + EXEC_WAIT
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return f"the program did not start within {EXEC_WAIT:g} seconds"
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready:
                continue
            chunk = os.read(fd, 4096)
            if not chunk:
                return data.decode(errors="replace") or None
            data += chunk

    @staticmethod
    def _launch_failed(spec: LaunchSpec, cause: object) -> str:
        return (
            f"cannot launch lease {spec.lease_id} ({spec.argv[0]!r} in {spec.cwd!r}"
            f" as {spec.user!r}): {cause}"
        )

    # --- finding a launch again -----------------------------------------------------

    def find(self, tag: str, user: str) -> Handle | None:
        """The process launched with ``spec.tag == tag`` as ``user``, by this
        engine or by an earlier broker's: one this engine remembers (running
        or ended), else a live process-group leader of ``user``'s uid whose
        environment holds :data:`TAG_VARIABLE` ``= tag`` (the oldest, if the
        user made more); ``None`` when there is none (it never started, or
        it has ended and was not this engine's).

        Raises:
            EngineError: ``tag`` or ``user`` is not valid, or a candidate's
                environment cannot be read (the broker lacks the rights to
                read ``/proc/PID/environ``): whether the launch happened is
                then not known.
        """
        if not tag:
            raise EngineError("find: no tag")
        try:
            uid = pwd.getpwnam(user).pw_uid
        except KeyError:
            raise EngineError(f"find: no user {user!r}") from None
        with self._lock:
            for pid, proc in self._procs.items():
                if proc.spec.tag == tag and proc.spec.user == user:
                    return Handle(engine=self.name, id=str(pid), node=self.node_name)
        found = _tagged(f"{TAG_VARIABLE}={tag}".encode(), uid)
        if found is None:
            return None
        log.info("found the process of launch %s as %s: pid %d", tag, user, found)
        return Handle(engine=self.name, id=str(found), node=self.node_name)

    # --- time limits ----------------------------------------------------------------

    def _start_timer(
        self, proc: _Proc, delay: float, action: Callable[[int], None], pid: int
    ) -> None:
        timer = threading.Timer(delay, action, args=(pid,))
        timer.daemon = True
        proc.timers.append(timer)
        timer.start()

    def _on_time_limit(self, pid: int) -> None:
        with self._lock:
            proc = self._procs.get(pid)
            if proc is None or proc.popen.poll() is not None:
                return
            proc.timed_out = True
            log.info("lease %d (pid %d): time limit passed, SIGTERM", proc.spec.lease_id, pid)
            self._kill_launch(pid, proc.mark, signal_module.SIGTERM, proc.groups)
            self._start_timer(proc, self.time_limit_grace, self._on_time_limit_kill, pid)

    def _on_time_limit_kill(self, pid: int) -> None:
        with self._lock:
            proc = self._procs.get(pid)
            if proc is None or (
                proc.popen.poll() is not None
                and not self._launch_alive(pid, proc.mark, proc.groups)
            ):
                return
            log.info(
                "lease %d (pid %d): still running after SIGTERM, SIGKILL", proc.spec.lease_id, pid
            )
            self._kill_launch(pid, proc.mark, signal_module.SIGKILL, proc.groups)

    # --- poll, signal, stop -------------------------------------------------------------

    def poll(self, handle: Handle) -> Status:
        """Return the status of ``handle``'s process, without waiting.

        A process this engine started: ``running``, or ``exited`` with its
        exit code (it exited by itself) or the signal that ended it (and no
        exit code). ``ended`` is when a poll first saw the end. A pid this
        engine does not know (e.g. after a broker restart): ``running`` while
        the pid exists (``os.kill(pid, 0)``; a zombie counts as gone) and
        carries the launch tag, and, once it has exited, while processes
        of its launch are left (they are ended, as for a launch of this
        engine); else ``lost``; ``started``/``ended`` are then unknown
        (``None``). A launch whose leader exited while no broker ran is
        ``lost`` at once, unless what it left is in its cgroup
        (:meth:`_orphan`): then it runs until that is empty.

        Raises:
            EngineError: the handle is of another engine or node, or its id is
                not a pid.
        """
        pid = self._pid(handle)
        with self._lock:
            proc = self._procs.get(pid)
            if proc is None:
                return Status(state=self._poll_adopted(pid))
            code = proc.popen.poll()
            if code is None or self._reap(pid, proc):
                return Status(state="running", started=proc.started, timed_out=proc.timed_out)
            if proc.ended is None:
                proc.ended = _utcnow()
                for timer in proc.timers:
                    timer.cancel()
                if proc.mark.cgroup:  # empty now: every process of it has ended
                    cgroups.LaunchCgroups.remove(Path(proc.mark.cgroup))
            exit_code, signum = _exit_status(code)
            return Status(
                state="exited",
                exit_code=exit_code,
                signal=signum,
                started=proc.started,
                ended=proc.ended,
                timed_out=proc.timed_out,
            )

    def _poll_adopted(self, pid: int) -> Literal["running", "lost"]:
        """:meth:`poll` of a pid this engine did not start: ``running`` while
        it is a launch (it carries :data:`TAG_VARIABLE`; its mark is then
        remembered), and after it has exited while processes it left run
        on (they are ended as :meth:`_reap` ends them; where it exited
        while no broker ran, they are found in its cgroup, :meth:`_orphan`);
        else ``lost``. A pid given to another process meanwhile is
        ``lost``, and nothing is signalled."""
        adopted = self._adopted.get(pid)
        alive = _pid_alive(pid)
        if alive and _launched_here(pid) is not False:
            if adopted is None:
                mark = self._adopted_mark(pid)
                if mark is not None:
                    self._adopted[pid] = _Adopted(mark)
            return "running"
        if alive:  # another process has its pid (and may lead a group of that number)
            self._adopted.pop(pid, None)
            return "lost"
        if adopted is None:
            adopted = self._orphan(pid)
            if adopted is not None:
                self._adopted[pid] = adopted
        if adopted is not None and self._reap(pid, adopted, "an earlier broker's launch"):
            return "running"
        self._adopted.pop(pid, None)
        if adopted is not None and adopted.mark.cgroup:
            cgroups.LaunchCgroups.remove(Path(adopted.mark.cgroup))
        return "lost"

    def _orphan(self, pid: int) -> _Adopted | None:
        """The launch whose first process ``pid`` exited while no broker ran,
        where processes it left are still in its cgroup (named by that pid,
        :meth:`_cgroup_for`): adopted with the uid of one of them. Empty
        cgroups of that pid are removed."""
        if self.cgroups is None:
            return None
        for path in sorted(self.cgroups.root.glob(f"pid-{pid}-*")):
            members = self.cgroups.pids(path)
            found = _uid_and_stat(members[0]) if members else None
            if found is None:
                self.cgroups.remove(path)
                continue
            tag = path.name.split("-", 2)[2]
            return _Adopted(_Mark(tag=tag, uid=found[0], cgroup=str(path)))
        return None

    def _adopted_mark(self, pid: int) -> _Mark | None:
        """:func:`_mark_of` ``pid``, with the launch's cgroup where it is in
        one of this engine's (a launch of an earlier broker)."""
        mark = _mark_of(pid)
        if mark is None or self.cgroups is None:
            return mark
        path = cgroups.cgroup_of(pid)
        if path is None:
            return mark
        absolute = self.cgroups.absolute(path)
        if not self.cgroups.owns(absolute):
            return mark
        return _Mark(tag=mark.tag, uid=mark.uid, cgroup=absolute)

    def _reap(self, pid: int, proc: _Proc | _Adopted, what: str = "") -> bool:
        """After the leader ``pid`` of a launch has exited: whether other
        processes of the launch are left (a command's ``cmd &``, a
        notebook's ``Popen(..., start_new_session=True)``), which still
        use its devices, so the launch still runs. The first time, they get
        SIGTERM, and SIGKILL :attr:`time_limit_grace` seconds later; from
        then on each poll sends SIGKILL again while any is left (one that
        forks away from the last). As Slurm ends a job's processes when
        its batch script exits (``KillWait`` between the signals).
        ``proc``: a launch of this engine's, or one adopted from an earlier
        engine (:meth:`_poll_adopted`; ``what`` names it in the log)."""
        if not self._launch_alive(pid, proc.mark, proc.groups):
            return False
        now = time.monotonic()
        if proc.reaping is None:
            proc.reaping = now
            log.info(
                "%s (pid %d): exited, ending the processes it left (SIGTERM)",
                f"lease {proc.spec.lease_id}" if isinstance(proc, _Proc) else what,
                pid,
            )
            self._kill_launch(pid, proc.mark, signal_module.SIGTERM, proc.groups)
        elif now - proc.reaping >= self.time_limit_grace:
            self._kill_until_gone(pid, proc.mark, proc.groups)
        return self._launch_alive(pid, proc.mark, proc.groups)

    def signal(self, handle: Handle, signum: int) -> None:
        """Send ``signum`` to the process group of ``handle`` (``os.killpg``).

        Does nothing when the process has ended. A pid this engine does not
        know is signalled only while it leads its own process group.

        Raises:
            EngineError: the handle is of another engine or node, its id is not
                a pid, an unknown pid is not a process-group leader (so not one
                this engine started), or the signal is not permitted.
        """
        pid = self._pid(handle)
        with self._lock:
            proc = self._procs.get(pid)
            if proc is not None:
                if proc.popen.poll() is None:
                    self._killpg(pid, signum)
                return
        if self._adoptable(pid, handle):
            self._killpg(pid, signum)

    def stop(self, handle: Handle, grace: float) -> Status:
        """End every process of ``handle``'s launch: SIGTERM, then SIGKILL after ``grace`` seconds.

        The processes of a launch are its process group and every other
        process of the launch's uid whose environment carries the launch's
        :data:`TAG_VARIABLE` (``/proc/PID/environ``), in whatever session
        (a notebook's kernel runs in one of its own, with its children).
        Waits up to ``grace`` seconds for them all to exit after SIGTERM;
        then SIGKILL to those left and waits up to :data:`KILL_WAIT` more
        seconds for the process. This is the one call that waits: run it
        off the event loop
        (``await asyncio.to_thread(engine.stop, handle, grace)``). A process
        that has already ended just gets its status (stragglers of its
        launch are still ended). An unknown pid (after a broker restart) is
        stopped only while it leads its own process group, with the tag and
        uid read from its ``/proc`` entry (its group only when they cannot
        be read); its final status is ``lost`` (the exit status is not
        known).

        Returns:
            The final status, as :meth:`poll` gives it.

        Raises:
            EngineError: as :meth:`signal`.
        """
        pid = self._pid(handle)
        with self._lock:
            proc = self._procs.get(pid)
        deadline = time.monotonic() + max(grace, 0.0)
        if proc is None:
            with self._lock:
                adopted = self._adopted.get(pid)
                if adopted is None and not _pid_alive(pid):
                    adopted = self._orphan(pid)  # exited while no broker ran
            if self._adoptable(pid, handle):
                self._stop_adopted(pid, self._adopted_mark(pid), deadline)
            elif adopted is not None:  # its leader has exited; what it left has not
                self._stop_adopted(pid, adopted.mark, deadline, adopted.groups)
            return self.poll(handle)
        popen, mark, groups = proc.popen, proc.mark, proc.groups
        if popen.poll() is None or self._launch_alive(pid, mark, groups):
            self._kill_launch(pid, mark, signal_module.SIGTERM, groups)
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeout=max(deadline - time.monotonic(), 0.0))
            self._wait_until(deadline, lambda: not self._launch_alive(pid, mark, groups))
            if popen.poll() is None or self._launch_alive(pid, mark, groups):
                self._kill_until_gone(pid, mark, groups)
                try:
                    popen.wait(timeout=KILL_WAIT)
                except subprocess.TimeoutExpired:
                    log.warning("pid %d survived SIGKILL for %g s", pid, KILL_WAIT)
        status = self.poll(handle)
        log.info(
            "stopped lease %d (pid %d): %s exit_code=%s signal=%s",
            proc.spec.lease_id,
            pid,
            status.state,
            status.exit_code,
            status.signal,
        )
        return status

    def _stop_adopted(
        self, pid: int, mark: _Mark | None, deadline: float, groups: set[int] | None = None
    ) -> None:
        """:meth:`stop` for a launch this engine did not start: SIGTERM to
        its processes, SIGKILL at ``deadline`` (a :func:`time.monotonic`
        time, seconds) to those left; then waits up to :data:`KILL_WAIT`
        seconds for ``pid``. ``groups``: its process groups seen before.

        Raises:
            EngineError: as :meth:`_killpg`.
        """
        groups = set() if groups is None else groups

        def alive() -> bool:
            return _pid_alive(pid) or self._launch_alive(pid, mark, groups)

        self._kill_launch(pid, mark, signal_module.SIGTERM, groups)
        self._wait_until(deadline, lambda: not alive())
        if alive():
            self._kill_until_gone(pid, mark, groups)
            self._wait_until(time.monotonic() + KILL_WAIT, lambda: not _pid_alive(pid))

    def forget(self, handle: Handle) -> None:
        """Drop an ended process from memory (later polls see it as ``lost``).

        Raises:
            EngineError: the handle is not this engine's, or it still runs.
        """
        pid = self._pid(handle)
        with self._lock:
            proc = self._procs.get(pid)
            if proc is None:
                self._adopted.pop(pid, None)
                return
            if proc.popen.poll() is None:
                raise EngineError(f"cannot forget pid {pid}: it still runs")
            for timer in proc.timers:
                timer.cancel()
            if proc.mark.cgroup:  # removed only once empty
                cgroups.LaunchCgroups.remove(Path(proc.mark.cgroup))
            del self._procs[pid]

    # --- helpers ------------------------------------------------------------------------

    def _pid(self, handle: Handle) -> int:
        if handle.engine != self.name:
            raise EngineError(f"not a handle of the local engine: {handle}")
        if handle.node != self.node_name:
            raise EngineError(
                f"handle of node {handle.node!r}, not of {self.node_name!r}: {handle}"
            )
        try:
            pid = int(handle.id)
        except ValueError:
            raise EngineError(f"handle id is not a pid: {handle}") from None
        if pid <= 0:
            raise EngineError(f"handle id is not a pid: {handle}")
        return pid

    @staticmethod
    def _adoptable(pid: int, handle: Handle) -> bool:
        """For a pid this engine did not start: ``False`` when it is gone, or
        when its environment has no :data:`TAG_VARIABLE` (every launch has
        one: this is another process given the pid of a launch that ended,
        e.g. after a reboot, and it is never signalled); ``True`` when it
        leads its own process group (as every launched process does).

        Raises:
            EngineError: it exists but is not a process-group leader.
        """
        if not _pid_alive(pid):
            return False
        try:
            pgid = os.getpgid(pid)
        except ProcessLookupError:
            return False
        if pgid != pid:
            raise EngineError(
                f"unknown handle {handle}: pid {pid} is not a process-group leader,"
                " so not a process this engine started"
            )
        if _launched_here(pid) is False:
            log.warning(
                "pid %d of %s carries no %s: not a launch of this engine (its pid was reused)",
                pid,
                handle,
                TAG_VARIABLE,
            )
            return False
        return True

    @classmethod
    def _kill_until_gone(cls, pgid: int, mark: _Mark | None, groups: set[int]) -> None:
        """SIGKILL the launch (:meth:`_kill_launch`) again and again until
        none of its processes is seen in five passes in a row, for up to
        :data:`KILL_WAIT` seconds: a pass over ``/proc`` misses a process
        forked after its listing, which the next pass's signal to its
        group, once seen, ends."""
        deadline = time.monotonic() + KILL_WAIT
        clean = 0
        while clean < 5 and time.monotonic() < deadline:
            cls._kill_launch(pgid, mark, signal_module.SIGKILL, groups)
            clean = 0 if cls._launch_alive(pgid, mark, groups) else clean + 1
            time.sleep(_POLL_INTERVAL / 10)

    @staticmethod
    def _launch_alive(pgid: int, mark: _Mark | None, groups: set[int] | None = None) -> bool:
        """Whether a process of the launch is left (zombies do not count):
        in process group ``pgid`` or one of ``groups`` (those gone are
        dropped from it: a group's number may be given out again), in
        the launch's cgroup, or marked with ``mark`` (:func:`_marked`)."""
        if mark is not None and mark.cgroup and cgroups.LaunchCgroups.populated(Path(mark.cgroup)):
            return True
        if groups:
            groups.difference_update([g for g in groups if not _group_alive(g)])
        if _group_alive(pgid) or groups:
            return True
        return mark is not None and bool(_marked(mark))

    @classmethod
    def _kill_launch(
        cls, pgid: int, mark: _Mark | None, signum: int, groups: set[int] | None = None
    ) -> None:
        """Send ``signum`` to process group ``pgid``, to the process group of
        every other process marked with ``mark`` (:func:`_marked_groups`:
        same uid and tag) and to ``groups`` (those seen before, to which
        the groups found now are added), each group once: a group's signal
        also reaches a child being forked, which a pass over ``/proc``
        misses. The group of a tagged process is the launch's: a process
        joins groups of its own session only. A group that may not be
        signalled is logged and skipped.

        Raises:
            EngineError: the group ``pgid`` may not be signalled (:meth:`_killpg`).
        """
        if mark is not None and mark.cgroup:  # every process of it, at once
            cgroups.LaunchCgroups.signal(Path(mark.cgroup), signum)
        cls._killpg(pgid, signum)
        if mark is None:
            return
        seen = groups if groups is not None else set()
        seen.update(g for _, g in _marked_groups(mark) if g > 1 and g != pgid)
        for group in sorted(seen):
            try:
                os.killpg(group, signum)
            except ProcessLookupError:
                seen.discard(group)  # gone: its number may be given out again
            except PermissionError as exc:
                log.warning("launch %s: not permitted to signal group %s: %s", mark.tag, group, exc)

    @staticmethod
    def _killpg(pgid: int, signum: int) -> None:
        try:
            os.killpg(pgid, signum)
        except ProcessLookupError:
            pass
        except PermissionError as exc:
            raise EngineError(f"not permitted to signal process group {pgid}: {exc}") from exc

    @staticmethod
    def _wait_until(deadline: float, done: Callable[[], bool]) -> None:
        while not done():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            time.sleep(min(_POLL_INTERVAL, remaining))

    def __repr__(self) -> str:
        return f"LocalEngine(node={self._node_name!r}, backend={type(self.backend).__name__})"
