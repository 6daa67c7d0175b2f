"""The Docker engine: a holder's process runs in a container of its own.

Used by the batch jobs' ``docker`` runner (``JobService.runner``). For
each :class:`~gpubroker.engines.base.LaunchSpec` it creates a container
with the Docker SDK:

* **devices**: a device request (driver ``nvidia``, capabilities
  ``[["gpu"]]``) naming exactly the lease's UUIDs (``GPU-…`` or ``MIG-…``),
  none when the lease has no devices; the NVIDIA container toolkit then
  exposes only those devices;
* the image ``DockerEngine.image`` (the users' image), the network
  ``DockerEngine.network`` (``none`` by default), ``docker-init`` as PID 1
  (so a stop's SIGTERM reaches the job);
* the spec's user as ``UID:GID`` (from the host's user database), its
  environment exactly (nothing of the broker's), its working directory;
* for a share, its framework caps: the start-up hook mounted read-only at
  :data:`STARTUP_PATH` and put there on ``PYTHONPATH``; its ``CUDA_MPS_*``
  variables dropped (no MPS in containers, as ``DockerGPUSpawner``);
* the user's root directory (``spec.home``, which the broker decides, never
  the user) mounted read-write at the same path, so the job's files, log and
  checkpoints are where the broker reads them; the log is written by the job
  (standard output and error appended to ``spec.stdout``); the image's
  ``PATH`` and ``ENV`` stay, Docker adds ``HOSTNAME`` and, for the device
  request, ``NVIDIA_VISIBLE_DEVICES``, the engine ``GPUBROKER_LOG``.

A launch with a :attr:`~gpubroker.engines.base.LaunchSpec.tag` names its
container ``gpubroker-TAG`` (Docker refuses a second container of that
name), and :meth:`DockerEngine.find` finds it by that name after a broker
restart. A container is removed once the broker has read how it ended (its exit code
is also in the job's exit file, which a restarted broker reads). Time limits
are enforced at :meth:`DockerEngine.poll` (from the container's start time
and its ``gpubroker.time_limit`` label, so they hold across restarts too).
Signals and stops reach every process of the container but its init
(``kill -SIG -1`` run inside it as the job's user): a stop sends SIGTERM,
waits its grace period, then kills the container. The containers run with
every capability dropped and ``no-new-privileges``. The inventory and
telemetry come from the broker's device backend (the engine runs on the
broker's host): :meth:`nodes` and :meth:`telemetry` give nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import pwd
import signal as signal_module
import socket
from collections.abc import Iterable
from typing import Any

from traitlets import Float, TraitError, Unicode, validate
from traitlets.config import LoggingConfigurable

from ..devices.base import DeviceUsage
from .base import EngineError, Handle, LaunchSpec, Node, Status


def _errors() -> tuple[type[BaseException], ...]:
    """What the Docker SDK raises: its own errors and those of ``requests``
    (an engine that cannot be reached, a timeout)."""
    try:
        import docker.errors
        import requests
    except ImportError:
        return (OSError,)
    return (docker.errors.DockerException, requests.exceptions.RequestException, OSError)


_ERRORS = _errors()

#: where a notebook job's runner (``gpubroker/jobs/nbrun.py``) is mounted
NBRUN_PATH = "/opt/gpubroker/nbrun.py"

#: where the shares' start-up hook (``gpubroker/enforce/startup``) is mounted
STARTUP_PATH = "/opt/gpubroker/startup"

# the job's output goes to its log file (inside the mounted home directory)
_LOGGED = 'exec "$@" >> "$GPUBROKER_LOG" 2>&1'


class DockerEngine(LoggingConfigurable):
    """Runs each holder's process in a container (see the module's documentation).

    Args:
        nbrun: the host path of the notebook runner, mounted read-only at
            :data:`NBRUN_PATH` in every container.
    """

    name = "docker"

    image = Unicode(
        "",
        help="The image jobs run in (built or loaded on the Docker host; nothing is "
        "pulled). It needs /bin/sh and mkdir, and python with papermill for notebook jobs.",
    ).tag(config=True)

    network = Unicode(
        "none",
        help="The containers' network: none (default), host, or the name of a Docker network.",
    ).tag(config=True)

    docker_url = Unicode(
        "",
        help="The Docker engine's address (e.g. unix:///var/run/docker.sock); empty: "
        "from DOCKER_HOST, as the docker command does.",
    ).tag(config=True)

    python = Unicode(
        "python3",
        help="The Python of the image that runs papermill for notebook jobs.",
    ).tag(config=True)

    stop_grace = Float(
        30.0,
        help="Seconds between SIGTERM and the kill when a job's time limit passes "
        "(a cancel or preemption uses JobService.stop_grace).",
    ).tag(config=True)

    @validate("network")
    def _valid_network(self, proposal: Any) -> str:
        value = str(proposal["value"])
        if not value or any(c.isspace() for c in value):
            raise TraitError(f"DockerEngine.network: not a network name: {value!r}")
        return value

    def __init__(self, nbrun: str = "", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.nbrun = nbrun
        self.node = socket.gethostname()
        self._client: Any = None

    # --- the Docker client ------------------------------------------------------

    def client(self) -> Any:
        """The Docker SDK client (made once).

        Raises:
            EngineError: the SDK is not installed or the engine cannot be reached.
        """
        if self._client is None:
            try:
                import docker
            except ImportError as err:
                raise EngineError(
                    "the docker runner needs the Docker SDK: pip install docker"
                ) from err
            try:
                self._client = (
                    docker.DockerClient(base_url=self.docker_url)
                    if self.docker_url
                    else docker.from_env()
                )
            except Exception as err:
                raise EngineError(f"cannot reach the Docker engine: {err}") from err
        return self._client

    def _container(self, handle: Handle) -> Any:
        """The container of ``handle``, or ``None`` when Docker knows none."""
        if handle.engine != self.name:
            raise EngineError(f"handle of engine {handle.engine!r}, not {self.name!r}")
        import docker.errors

        try:
            return self.client().containers.get(handle.id)
        except docker.errors.NotFound:
            return None
        except _ERRORS as err:
            raise EngineError(f"cannot read container {handle.id[:12]}: {err}") from err

    # --- the protocol -----------------------------------------------------------

    def nodes(self) -> list[Node]:
        """No nodes of its own: the broker's device backend has the inventory."""
        return []

    def telemetry(self, uuids: Iterable[str]) -> dict[str, DeviceUsage]:
        """Nothing: the broker's device backend reads the devices' use."""
        return {}

    def launch(self, spec: LaunchSpec) -> Handle:
        """Create and start the container of ``spec`` (see the module's documentation).

        Raises:
            EngineError: no image is configured, the user is unknown on the
                host, or Docker refused (no such image, no NVIDIA runtime for
                the device request, ...): the message says which.
        """
        if not self.image:
            raise EngineError("DockerEngine.image is not set: no image to run jobs in")
        from docker.types import DeviceRequest

        try:
            account = pwd.getpwnam(spec.user)
        except KeyError as err:
            raise EngineError(f"no such user on this host: {spec.user!r}") from err
        if not spec.home:
            raise EngineError("the docker engine needs the user's root directory to mount")
        volumes = {spec.home: {"bind": spec.home, "mode": "rw"}}
        if self.nbrun:
            volumes[self.nbrun] = {"bind": NBRUN_PATH, "mode": "ro"}
        env, hook = self._share_env(spec)
        if hook:
            volumes[hook] = {"bind": STARTUP_PATH, "mode": "ro"}
        env |= {"GPUBROKER_LOG": spec.stdout or "/dev/null"}
        requests = (
            [DeviceRequest(driver="nvidia", device_ids=list(spec.devices), capabilities=[["gpu"]])]
            if spec.devices
            else []
        )
        labels = {"gpubroker.lease": str(spec.lease_id), "gpubroker.user": spec.user}
        if spec.time_limit is not None:
            labels["gpubroker.time_limit"] = repr(float(spec.time_limit))
        named = {"name": container_name(spec.tag)} if spec.tag else {}
        if spec.tag:
            labels["gpubroker.tag"] = spec.tag
        try:
            container = self.client().containers.create(
                self.image,
                **named,
                command=["/bin/sh", "-c", _LOGGED, "gpubroker-log", *spec.argv],
                environment=env,
                working_dir=spec.cwd,
                user=f"{account.pw_uid}:{account.pw_gid}",
                volumes=volumes,
                device_requests=requests,
                network_mode=self.network,
                labels=labels,
                init=True,
                cap_drop=["ALL"],
                security_opt=["no-new-privileges"],
                detach=True,
            )
        except _ERRORS as err:
            raise EngineError(f"cannot create a container of {self.image}: {err}") from err
        try:
            container.start()
        except _ERRORS as err:
            with contextlib.suppress(*_ERRORS):
                container.remove(force=True)
            raise EngineError(f"cannot start container {container.id[:12]}: {err}") from err
        self.log.info(
            "Docker: started container %s of lease %s (%s)",
            container.id[:12],
            spec.lease_id,
            ", ".join(spec.devices) or "no devices",
        )
        return Handle(self.name, container.id, self.node)

    def find(self, tag: str, user: str) -> Handle | None:
        """The container of the launch tagged ``tag`` (named
        ``gpubroker-TAG``) as ``user``, running or ended; ``None`` when
        Docker has none. One created but never started (the broker stopped
        between the two) is removed, and ``None`` returned: nothing ran.

        Raises:
            EngineError: Docker cannot be read, or the container of that
                name is another user's.
        """
        container = self._container(Handle(self.name, container_name(tag), self.node))
        if container is None:
            return None
        owner = container.attrs.get("Config", {}).get("Labels", {}).get("gpubroker.user")
        if owner != user:
            raise EngineError(f"container {container_name(tag)} is not one of {user!r}")
        if container.attrs.get("State", {}).get("Status") == "created":
            self._remove(container)
            return None
        self.log.info("Docker: found container %s of launch %s", container.id[:12], tag)
        return Handle(self.name, container.id, self.node)

    def _share_env(self, spec: LaunchSpec) -> tuple[dict[str, str], str]:
        """The job's environment for a container, and the host directory of
        the shares' start-up hook to mount at :data:`STARTUP_PATH` (``""``:
        none). A share's framework caps hold in the container: the hook's
        host path on ``PYTHONPATH`` becomes :data:`STARTUP_PATH`. Its
        ``CUDA_MPS_*`` variables are dropped (an MPS client would need the
        host's IPC namespace, which would let every user's container read
        the others' shared memory), with a warning, as ``DockerGPUSpawner``
        does; the watchdog still holds the share's memory."""
        from ..enforce.caps import STARTUP_DIR

        env = dict(spec.env)
        mps = sorted(name for name in env if name.startswith("CUDA_MPS_"))
        if mps:
            self.log.warning(
                "Docker: lease %s: MPS is not passed into containers; dropped %s",
                spec.lease_id,
                ", ".join(mps),
            )
            for name in mps:
                del env[name]
        entries = env.get("PYTHONPATH", "").split(":") if env.get("PYTHONPATH") else []
        if STARTUP_DIR not in entries:
            return env, ""
        env["PYTHONPATH"] = ":".join(STARTUP_PATH if p == STARTUP_DIR else p for p in entries)
        return env, STARTUP_DIR

    def poll(self, handle: Handle) -> Status:
        """The container's status; one past its time limit is stopped
        (SIGTERM, then a kill after ``stop_grace`` seconds) and reported
        ``timed_out``; an ended one is removed (its end is returned).

        Raises:
            EngineError: the handle is not of this engine, or Docker cannot be read.
        """
        container = self._container(handle)
        if container is None:
            return Status("lost")
        status = _status(container.attrs)
        limit = container.attrs.get("Config", {}).get("Labels", {}).get("gpubroker.time_limit")
        if status.state == "running" and limit and status.started is not None:
            ran = (dt.datetime.now(dt.timezone.utc) - status.started).total_seconds()
            if ran >= float(limit):
                return dataclasses.replace(self.stop(handle, self.stop_grace), timed_out=True)
        if status.state != "running":
            self._remove(container)
        return status

    def container_status(self, container_id: str) -> Status:
        """The status of any container of this engine (e.g. a
        ``DockerGPUSpawner`` server's), read only: nothing is stopped or
        removed. ``lost`` when Docker knows no such container.

        Raises:
            EngineError: Docker cannot be read.
        """
        container = self._container(Handle(self.name, container_id, self.node))
        return Status("lost") if container is None else _status(container.attrs)

    def container_env(self, container_id: str) -> dict[str, str] | None:
        """The environment (``Config.Env``) of any container of this
        engine, read only; ``None`` when Docker knows no such container.

        Raises:
            EngineError: Docker cannot be read.
        """
        container = self._container(Handle(self.name, container_id, self.node))
        if container is None:
            return None
        pairs = container.attrs.get("Config", {}).get("Env") or []
        return dict(x.split("=", 1) for x in pairs if "=" in x)

    def engine_id(self) -> str:
        """The ID of the Docker engine this talks to (``docker info``'s ``ID``).

        Raises:
            EngineError: Docker cannot be read.
        """
        try:
            info = self.client().info()
        except _ERRORS as err:
            raise EngineError(f"cannot read the Docker engine's ID: {err}") from err
        if not info.get("ID"):
            raise EngineError("the Docker engine does not say its ID (docker info)")
        return str(info["ID"])

    def ended_containers(
        self, watched: dict[int, tuple[str, str | None]]
    ) -> tuple[dict[int, tuple[str, str]], list[int]]:
        """Which of the ``watched`` containers (lease id -> (container id, ID
        of the engine that runs it, or ``None``: not known)) no longer run,
        and what Docker says of each: ``"is gone from the Docker engine"``,
        ``"exited with status N"`` or ``"was ended by signal SIGNAME"``.
        Containers of another engine than this one, or of an engine not
        known, are not checked (a container this engine has never seen is
        not thereby gone).
        Blocking (Docker API calls): run it off the event loop.

        Returns:
            (lease id -> (container id, what Docker says), the lease ids
            whose container is on another engine or one not known).

        Raises:
            EngineError: Docker cannot be read (nothing is concluded then).
        """
        here = self.engine_id()
        elsewhere = [x for x, (_, engine) in watched.items() if engine != here]
        ended: dict[int, tuple[str, str]] = {}
        for lease_id, (container_id, _) in watched.items():
            if lease_id in elsewhere:
                continue
            status = self.container_status(container_id)
            if status.state == "lost":
                ended[lease_id] = (container_id, "is gone from the Docker engine")
            elif status.state == "exited" and status.signal is not None:
                ended[lease_id] = (container_id, f"was ended by {_signal_name(status.signal)}")
            elif status.state == "exited":
                ended[lease_id] = (container_id, f"exited with status {status.exit_code}")
        return ended, elsewhere

    def signal(self, handle: Handle, signum: int) -> None:
        """Send ``signum`` to every process of the container but its init
        (``kill -SIG -1`` inside it), as the local engine signals a
        process group. Does nothing when the container is not running.

        Raises:
            EngineError: the handle is not of this engine, or Docker refused.
        """
        container = self._container(handle)
        if container is None or container.status != "running":
            return
        self._kill_all(container, signum)

    def _kill_all(self, container: Any, signum: int) -> None:
        """``kill -SIG -1`` inside ``container``, as its own user (the job's)."""
        name = signal_module.Signals(signum).name.removeprefix("SIG")
        user = container.attrs.get("Config", {}).get("User") or ""
        try:
            done = container.exec_run(["/bin/sh", "-c", f"kill -{name} -1"], user=user)
        except _ERRORS as err:
            raise EngineError(f"cannot signal container {container.id[:12]}: {err}") from err
        if done.exit_code != 0:
            why = done.output.decode("utf-8", "replace").strip()
            raise EngineError(f"cannot signal container {container.id[:12]}: {why}")

    def stop(self, handle: Handle, grace: float) -> Status:
        """Stop the container (SIGTERM, SIGKILL after ``grace`` seconds) and
        return its final status.

        Raises:
            EngineError: the handle is not of this engine, or Docker refused.
        """
        container = self._container(handle)
        if container is None:
            return Status("lost")
        import docker.errors

        try:
            if container.status == "running":
                with contextlib.suppress(EngineError):  # it may be ending already
                    self._kill_all(container, signal_module.SIGTERM)
                try:
                    container.wait(timeout=max(grace, 0.1))
                except _ERRORS:  # still running after its grace
                    container.kill()
                    container.wait(timeout=30)
            container.reload()
        except docker.errors.NotFound:
            return Status("lost")
        except _ERRORS as err:
            raise EngineError(f"cannot stop container {handle.id[:12]}: {err}") from err
        status = _status(container.attrs)
        self._remove(container)
        return status

    def _remove(self, container: Any) -> None:
        """Delete an ended container (its end is read; the job's exit file keeps it)."""
        try:
            container.remove(force=True)
        except _ERRORS as err:
            self.log.warning("Docker: cannot remove container %s: %s", container.id[:12], err)

    def close(self) -> None:
        """Close the connection to the Docker engine (a later call opens one)."""
        if self._client is not None:
            self._client.close()
            self._client = None


def container_name(tag: str) -> str:
    """The name of the container of the launch tagged ``tag``."""
    return f"gpubroker-{tag}"


def _signal_name(number: int) -> str:
    """``"signal SIGKILL"`` for 9; ``"signal 32"`` for a number with no name."""
    try:
        return f"signal {signal_module.Signals(number).name}"
    except ValueError:
        return f"signal {number}"


def _time(text: str | None) -> dt.datetime | None:
    """A Docker timestamp (RFC 3339, nanoseconds) as aware UTC; ``None`` for
    none or Docker's zero time."""
    if not text or text.startswith("0001-"):
        return None
    head, _, rest = text.partition(".")
    return (
        dt.datetime.fromisoformat(head).replace(tzinfo=dt.timezone.utc)
        if not rest
        else (
            dt.datetime.fromisoformat(f"{head}.{rest.rstrip('Z')[:6]}").replace(
                tzinfo=dt.timezone.utc
            )
        )
    )


def _status(attrs: dict[str, Any]) -> Status:
    """A :class:`Status` from a container's inspect data. An exit code of
    129 to 192 is a signal's (``128 + N``, the shell's rule: the job's shell
    ends by the signal that ended its program)."""
    state = attrs.get("State", {})
    started, ended = _time(state.get("StartedAt")), _time(state.get("FinishedAt"))
    if state.get("Running") or state.get("Status") in ("created", "restarting"):
        return Status("running", started=started)
    code = int(state.get("ExitCode", 0))
    if 128 < code <= 192:
        return Status("exited", None, code - 128, started, ended)
    return Status("exited", code, None, started, ended)
