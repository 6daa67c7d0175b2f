"""NVIDIA MPS: hard memory caps and SM shares for the clients of a device.

One MPS control daemon runs per shared device, each with its own pipe and
log directory under ``MPSControl.pipe_root`` (``<root>/<safe uuid>/pipe``
and ``.../log``), started with ``CUDA_VISIBLE_DEVICES`` = that device's UUID
so its servers see exactly that device. A share's processes get
:meth:`MPSControl.client_env` in their environment: they connect to that
daemon, may allocate at most ``memory_mib`` of device memory each
(``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``) and use at most ``thread_percentage``
percent of the device's threads (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``).
Those are client-side variables: the cap is hard for a process that keeps
them, and a holder who starts a process without them runs it outside the
cap (or outside MPS); the share watchdog is then the only check.

Rules (NVIDIA "Multi-Process Service" documentation, "Appendix: Tools and
Interface Reference" / "Environment Variables" and ``man
nvidia-cuda-mps-control``):

- ``nvidia-cuda-mps-control -d`` starts the control daemon in the
  background; ``echo quit | nvidia-cuda-mps-control`` shuts it down. Both
  talk to the daemon named by ``CUDA_MPS_PIPE_DIRECTORY`` (default
  ``/tmp/nvidia-mps``), which must be the same for the daemon and all its
  clients; logs go to ``CUDA_MPS_LOG_DIRECTORY``. The daemon creates the
  ``control`` endpoint and ``nvidia-cuda-mps-control.pid`` in the pipe
  directory, which is how a running daemon is recognised here.
- ``CUDA_VISIBLE_DEVICES`` set for the daemon remaps devices for its
  clients; UUIDs (recommended by NVIDIA) avoid the ambiguity, so a client
  keeps ``CUDA_VISIBLE_DEVICES=<uuid>`` and sees that device as ordinal 0.
- ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` is a comma-separated list of
  ``<device ordinal>=<size>`` pairs (e.g. ``0=1G``, ``0=512M``); here always
  one pair for ordinal 0 in MiB (``0=<N>M``).
- ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` caps the fraction of the device's
  threads (SMs) a client may use, a percentage; here an integer 1-100.

Limits: MPS needs a Volta or newer GPU on Linux. Legacy MPS runs one server
per user id at a time under a control daemon: a client of another user
waits until the current server's clients have all exited, so shares of
different users on one device need a multi-user MPS setup (see NVIDIA's
documentation) or they serialise. The memory cap is per client *process*, so
a share with several CUDA processes can hold a multiple of it; the watchdog
(:mod:`gpubroker.enforce.watchdog`) covers the sum. The broker needs the
rights to start the daemon (usually root) and the users' kernels need access
to the pipe directory.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

from traitlets import Bool, Float, Unicode
from traitlets.config import LoggingConfigurable

from . import EnforcementError

#: what a device UUID may look like: NVML ``GPU-…`` and ``MIG-…`` UUIDs
#: (old MIG UUIDs contain ``/``); no leading dot, so no ``..``
_UUID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,127}")
#: what the pid file of the control daemon is called (NVIDIA MPS docs)
PID_FILE = "nvidia-cuda-mps-control.pid"
#: the daemon's control endpoint in the pipe directory
CONTROL = "control"


def safe_name(device_uuid: str) -> str:
    """The directory name used for ``device_uuid``: every character other
    than ``A-Z a-z 0-9 . _ -`` replaced by ``_`` (``/`` of old MIG UUIDs).

    Raises:
        ValueError: ``device_uuid`` is empty, longer than 128 characters, or
            holds characters other than letters, digits, ``.``, ``_``,
            ``-`` and ``/`` (or starts with something other than a letter or
            digit).
    """
    if not isinstance(device_uuid, str) or not _UUID_RE.fullmatch(device_uuid):
        raise ValueError(
            f"device_uuid {device_uuid!r} must be 1-128 characters of letters, digits, "
            "'.', '_', '-' or '/', starting with a letter or digit (an NVML UUID)"
        )
    return re.sub(r"[^A-Za-z0-9._-]", "_", device_uuid)


def _strict_int(name: str, value: Any, low: int, high: int | None = None) -> int:
    """``value`` as an int in ``[low, high]``; ValueError naming ``name`` and the limit."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        limit = f"at least {low}" if high is None else f"between {low} and {high}"
        raise ValueError(f"{name} must be {limit}, got {value}")
    return value


class MPSControl(LoggingConfigurable):
    """Starts and stops one MPS control daemon per device and gives clients
    the environment that caps them (see the module docstring).

    The methods act whatever ``enabled`` says; the broker reads ``enabled``
    to decide whether to call them. Not thread-safe: call from one thread
    (the broker's event loop).
    """

    enabled = Bool(
        False,
        help="Use NVIDIA MPS on shared devices: one control daemon per device, each share's "
        "processes capped in device memory (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT) and SM share "
        "(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE). Needs Volta or newer GPUs, Linux, and the "
        "rights to start nvidia-cuda-mps-control (usually root).",
    ).tag(config=True)
    control_command = Unicode(
        "nvidia-cuda-mps-control",
        help="The MPS control program: a name looked up on PATH or an absolute path.",
    ).tag(config=True)
    pipe_root = Unicode(
        "/run/gpubroker-mps",
        help="Directory holding one pipe directory (<root>/<device>/pipe, the daemon's "
        "CUDA_MPS_PIPE_DIRECTORY) and one log directory (<root>/<device>/log) per device. "
        "Must be local to the node and reachable by the users' kernels; keep it short, "
        "since UNIX socket paths are limited to 107 bytes. It and the directories under "
        "it must be the broker's account's own (mode 0755, no links): others found there "
        "are refused, since a daemon planted in them would serve every share of the "
        "device; so keep it out of world-writable places such as /tmp.",
    ).tag(config=True)
    start_timeout = Float(
        10, help="Seconds 'nvidia-cuda-mps-control -d' may take to start the daemon."
    ).tag(config=True)
    stop_timeout = Float(
        10, help="Seconds 'echo quit | nvidia-cuda-mps-control' may take to stop a daemon."
    ).tag(config=True)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        #: devices whose daemon this object started or adopted
        self.started: set[str] = set()
        # the broker starts daemons in worker threads: one start at a time
        self._starting = threading.Lock()

    # -- paths and environment -------------------------------------------------------

    def pipe_dir(self, device_uuid: str) -> Path:
        """The daemon's ``CUDA_MPS_PIPE_DIRECTORY`` for ``device_uuid``.

        Raises:
            ValueError: ``device_uuid`` is not UUID-like (see :func:`safe_name`).
        """
        return Path(self.pipe_root) / safe_name(device_uuid) / "pipe"

    def log_dir(self, device_uuid: str) -> Path:
        """The daemon's ``CUDA_MPS_LOG_DIRECTORY`` for ``device_uuid``.

        Raises:
            ValueError: ``device_uuid`` is not UUID-like (see :func:`safe_name`).
        """
        return Path(self.pipe_root) / safe_name(device_uuid) / "log"

    def _daemon_env(self, device_uuid: str) -> dict[str, str]:
        """The broker's environment without inherited ``CUDA_MPS_*`` settings
        and without the broker's credentials (``JUPYTERHUB_*``,
        ``GPUBROKER_*``: the daemon outlives the broker and serves users'
        processes), plus the device and the daemon's directories."""
        private = ("CUDA_MPS_", "JUPYTERHUB_", "GPUBROKER_")
        env = {k: v for k, v in os.environ.items() if not k.startswith(private)}
        env["CUDA_VISIBLE_DEVICES"] = device_uuid
        env["CUDA_MPS_PIPE_DIRECTORY"] = str(self.pipe_dir(device_uuid))
        env["CUDA_MPS_LOG_DIRECTORY"] = str(self.log_dir(device_uuid))
        return env

    def client_env(
        self, device_uuid: str, memory_mib: int, thread_percentage: int
    ) -> dict[str, str]:
        """The environment that makes a share's processes MPS clients of the
        daemon of ``device_uuid``, capped.

        Args:
            device_uuid: the device's NVML UUID; the client must also have
                ``CUDA_VISIBLE_DEVICES`` = this UUID (the lease environment
                sets it), so the device is its ordinal 0.
            memory_mib: device memory each client process may allocate, MiB
                (>= 1).
            thread_percentage: percent of the device's threads (SMs) each
                client may use, integer 1-100.

        Returns:
            ``CUDA_MPS_PIPE_DIRECTORY``, ``CUDA_MPS_LOG_DIRECTORY``,
            ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` (``"0=<memory_mib>M"``) and
            ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` (``"<thread_percentage>"``),
            formats as in NVIDIA's MPS documentation, sections
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" and
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE".

        Raises:
            ValueError: ``device_uuid`` is not UUID-like, ``memory_mib`` is
                not an integer >= 1, or ``thread_percentage`` not an integer
                in 1-100.
        """
        safe_name(device_uuid)
        _strict_int("memory_mib", memory_mib, 1)
        _strict_int("thread_percentage", thread_percentage, 1, 100)
        return {
            "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir(device_uuid)),
            "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir(device_uuid)),
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={memory_mib}M",
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(thread_percentage),
        }

    # -- daemon state ----------------------------------------------------------------

    def daemon_state(self, device_uuid: str) -> str:
        """Whether a control daemon serves ``device_uuid``'s pipe directory.

        Returns:
            ``"running"``: the ``control`` endpoint exists and the pid in
            ``nvidia-cuda-mps-control.pid`` is alive (or there is no readable
            pid file); ``"stale"``: the pid file names a process that is
            gone; ``"absent"``: no ``control`` endpoint.

        Raises:
            ValueError: ``device_uuid`` is not UUID-like.
        """
        pipe = self.pipe_dir(device_uuid)
        try:
            pid = int((pipe / PID_FILE).read_text().strip())
        except (OSError, ValueError):
            pid = None
        if pid is not None and pid > 0:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return "stale"
            except PermissionError:
                pass  # alive, another user's
        if not os.path.lexists(pipe / CONTROL):
            return "absent"
        return "running"

    def _own_directories(self, device_uuid: str) -> None:
        """Create ``pipe_root`` (and its missing parents), the device's
        directory and its pipe and log directories where missing (mode
        0755, whatever the umask), and
        check that each is a directory of the broker's account that no one
        else can write (the daemon, run as the broker, serves every share of
        the device from them; its log is written into the log directory).

        Raises:
            EnforcementError: one cannot be created, or one is a link, not a
                directory, another account's, or writable by group or others
                (e.g. made beforehand in a world-writable ``pipe_root`` by a
                user who wants their own daemon to serve others' shares).
        """
        root = Path(self.pipe_root)
        device = root / safe_name(device_uuid)
        try:
            missing = [p for p in reversed(root.parents) if not os.path.lexists(p)]
            for path in missing:  # pipe_root's parents it makes: 0755 too
                path.mkdir(mode=0o755)
                os.chmod(path, 0o755)
            for path in (root, device, device / "pipe", device / "log"):
                try:
                    path.mkdir(mode=0o755)
                except FileExistsError:
                    pass
                else:
                    os.chmod(path, 0o755)
                problem = _not_own_directory(os.lstat(path))
                if problem:
                    raise EnforcementError(
                        f"MPS directory {path} {problem}: not used, since a daemon found "
                        "there would serve every share of the device; remove it, or set "
                        "MPSControl.pipe_root to a directory only the broker's account "
                        "can write"
                    )
        except OSError as exc:
            message = f"cannot create MPS directories under {self.pipe_root}: {exc}"
            raise EnforcementError(message) from exc

    def _command(self) -> str:
        """The control command's path.

        Raises:
            EnforcementError: it is not found on ``PATH`` (or not executable).
        """
        path = shutil.which(self.control_command)
        if path is None:
            raise EnforcementError(
                f"MPS control command {self.control_command!r} not found (PATH or path not "
                "executable); install the NVIDIA driver's nvidia-cuda-mps-control or set "
                "MPSControl.control_command"
            )
        return path

    # -- start and stop ----------------------------------------------------------------

    def ensure_daemon(self, device_uuid: str) -> None:
        """Make sure a control daemon runs for ``device_uuid``; idempotent.

        Starts ``<control_command> -d`` with ``CUDA_VISIBLE_DEVICES`` = the
        UUID and the device's pipe and log directories (created as needed),
        unless this object started it already or a daemon already serves
        the pipe directory (its ``control`` endpoint exists: adopted, e.g.
        after a broker restart). A stale pipe directory (pid file naming a
        dead process) is cleaned and a new daemon started. Thread-safe: the
        broker calls it from worker threads (one start at a time).

        Raises:
            ValueError: ``device_uuid`` is not UUID-like.
            EnforcementError: the pipe or log directory cannot be created,
                or the command is missing, exits non-zero (its standard
                error is in the message), or takes longer than
                ``start_timeout`` seconds. A daemon that starts but whose
                server later fails (e.g. a pre-Volta GPU) is not detected
                here: see ``control.log`` in the log directory.
        """
        with self._starting:
            self._ensure_daemon(device_uuid)

    def _ensure_daemon(self, device_uuid: str) -> None:
        self._own_directories(device_uuid)
        state = self.daemon_state(device_uuid)
        if state == "running":
            if device_uuid not in self.started:
                self.log.info("MPS daemon for %s already running; adopted", device_uuid)
                self.started.add(device_uuid)
            return
        if state == "absent" and device_uuid in self.started:
            return  # started by us; its control endpoint is not up yet
        command = self._command()
        pipe = self.pipe_dir(device_uuid)
        if state == "stale":
            self.log.warning("MPS daemon for %s is gone; starting a new one", device_uuid)
            for name in (CONTROL, PID_FILE):
                (pipe / name).unlink(missing_ok=True)
            self.started.discard(device_uuid)
        # stderr to a file, not a pipe: the daemon forks and may keep inherited
        # descriptors, which would make reading a pipe wait for it to exit
        with tempfile.TemporaryFile() as err:
            try:
                proc = subprocess.run(
                    [command, "-d"],
                    env=self._daemon_env(device_uuid),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                    timeout=self.start_timeout,
                    start_new_session=True,
                    check=False,
                )
            except subprocess.TimeoutExpired as exc:
                raise EnforcementError(
                    f"'{command} -d' for {device_uuid} took longer than "
                    f"start_timeout={self.start_timeout:g} s"
                ) from exc
            except OSError as exc:
                raise EnforcementError(f"cannot run '{command} -d': {exc}") from exc
            err.seek(0)
            stderr = err.read().decode(errors="replace").strip()
        if proc.returncode != 0:
            raise EnforcementError(
                f"'{command} -d' for {device_uuid} exited {proc.returncode}: "
                f"{stderr or '(no standard error)'}"
            )
        self.started.add(device_uuid)
        self.log.info("Started MPS daemon for %s (pipe directory %s)", device_uuid, pipe)

    def stop_daemon(self, device_uuid: str) -> None:
        """Stop the control daemon of ``device_uuid`` by writing ``quit`` to
        ``<control_command>`` (same environment as the daemon); nothing to do
        when no daemon runs and this object did not start one.

        Raises:
            ValueError: ``device_uuid`` is not UUID-like.
            EnforcementError: the command is missing, exits non-zero (its
                standard error is in the message), or takes longer than
                ``stop_timeout`` seconds.
        """
        state = self.daemon_state(device_uuid)
        if state != "running" and device_uuid not in self.started:
            self.log.debug("No MPS daemon for %s to stop", device_uuid)
            return
        if state == "stale":
            self.log.info("MPS daemon for %s already gone", device_uuid)
            self.started.discard(device_uuid)
            return
        command = self._command()
        try:
            proc = subprocess.run(
                [command],
                env=self._daemon_env(device_uuid),
                input="quit\n",
                capture_output=True,
                text=True,
                timeout=self.stop_timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise EnforcementError(
                f"'echo quit | {command}' for {device_uuid} took longer than "
                f"stop_timeout={self.stop_timeout:g} s"
            ) from exc
        except OSError as exc:
            raise EnforcementError(f"cannot run '{command}': {exc}") from exc
        if proc.returncode != 0:
            stderr = (proc.stderr or "").strip()
            raise EnforcementError(
                f"'echo quit | {command}' for {device_uuid} exited {proc.returncode}: "
                f"{stderr or '(no standard error)'}"
            )
        self.started.discard(device_uuid)
        self.log.info("Stopped MPS daemon for %s", device_uuid)

    def stop_all(self) -> None:
        """Stop every daemon this object started or adopted (each tried once).

        Raises:
            EnforcementError: one or more could not be stopped; the message
                lists each device's error. The others are stopped anyway.
        """
        errors = []
        for device_uuid in sorted(self.started):
            try:
                self.stop_daemon(device_uuid)
            except EnforcementError as err:
                self.log.error("Cannot stop MPS daemon for %s: %s", device_uuid, err)
                errors.append(f"{device_uuid}: {err}")
        if errors:
            raise EnforcementError("cannot stop MPS daemons: " + "; ".join(errors))


def _not_own_directory(found: os.stat_result) -> str:
    """What is wrong with a directory the broker's MPS daemons use, from its
    ``lstat`` (empty: nothing): a link or not a directory, another
    account's, or writable by group or others."""
    if not stat.S_ISDIR(found.st_mode):
        return "is not a directory (a link or a file)"
    if found.st_uid != os.geteuid():
        return f"belongs to uid {found.st_uid}, not to the broker's account ({os.geteuid()})"
    if found.st_mode & 0o022:
        return f"can be written by group or others (mode {stat.S_IMODE(found.st_mode):04o})"
    return ""
