"""The engine protocol: where and how the broker runs holders' processes.

An *engine* runs the processes of lease holders somewhere: on the local host
(:class:`gpubroker.engines.local.LocalEngine`, plain processes), in Docker
containers (:class:`gpubroker.engines.docker.DockerEngine`) or as Slurm jobs
on cluster nodes (:class:`gpubroker.engines.slurm.SlurmEngine`). The core of the broker
never calls NVML, Docker or Slurm itself; it asks an engine (and the engine
asks its device backend) through this one protocol:

* inventory: :meth:`Engine.nodes`, the nodes and their devices;
* :meth:`Engine.launch` a :class:`LaunchSpec`, which gives a :class:`Handle`;
* :meth:`Engine.signal` and :meth:`Engine.stop` it;
* :meth:`Engine.poll` its :class:`Status` (exit code and signal apart, so
  batch jobs can record both);
* :meth:`Engine.telemetry` of devices (:class:`~gpubroker.devices.base.DeviceUsage`);
* optionally ``find(tag, user) -> Handle | None``: what a launch whose
  :attr:`LaunchSpec.tag` is ``tag`` started as ``user``, also one an
  earlier broker made (the local, Docker and Slurm engines have it), so a
  caller that recorded the tag before launching can tell after a crash
  whether that launch happened, and adopt or end it instead of launching
  twice.

A node may be one the broker does not run processes on itself (a Slurm
node); its inventory then comes from the engine, not from a local device
backend.

Units: times in seconds (durations, ``float``) and UTC (``datetime`` with
``tzinfo=timezone.utc``); memory in MiB as in :mod:`gpubroker.devices.base`.

Errors: every refusal of an engine is an :class:`EngineError` whose message
says what was refused and why (unknown handle, launch failure with its
cause, inventory that cannot be read).

This module imports nothing heavy (no SQLAlchemy, no NVML, no Docker).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from types import MappingProxyType
from typing import Literal, Protocol, runtime_checkable

from gpubroker.devices.base import DeviceInfo, DeviceUsage

#: state of a node: ``up`` (takes new work), ``drained`` (runs what it has,
#: takes nothing new), ``down`` (unreachable or failed)
NodeState = Literal["up", "drained", "down"]

#: state of a launched process: ``running``; ``exited`` (ended, and the engine
#: knows how: exit code or signal); ``lost`` (gone, or not known to the engine,
#: and how it ended is not known)
RunState = Literal["running", "exited", "lost"]

NODE_STATES: tuple[NodeState, ...] = ("up", "drained", "down")
RUN_STATES: tuple[RunState, ...] = ("running", "exited", "lost")

#: what a :attr:`LaunchSpec.tag` may be (a Docker container name's rule, and
#: one word of a Slurm comment)
TAG_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")


class EngineError(RuntimeError):
    """An engine refused or failed a request.

    Raised for: a handle the engine does not know (or one of another engine
    or node), a launch that failed (the message names the argv and the cause,
    e.g. "No such file or directory"; the original exception is chained as
    ``__cause__``), a user the engine cannot run as, devices that are not on
    the node, and an inventory or telemetry the engine cannot read.
    """


class LaunchUnknown(EngineError):
    """A launch whose outcome the engine cannot tell: its submit failed
    or timed out, and asking whether it started failed too (Slurm's
    ``sbatch`` answered "Socket timed out", then ``squeue`` could not be
    asked). The process may run: a caller that recorded the launch's
    :attr:`LaunchSpec.tag` asks ``find(tag, user)`` again later instead
    of taking the launch for failed."""


@dataclass(frozen=True)
class OutsideHold:
    """Work the broker did not launch that holds a device, e.g. a Slurm job
    someone submitted with ``sbatch``.

    Attributes:
        what: what holds it, naming no user (``"Slurm job 41"``): shown to
            everyone who sees the device.
        user: whose work it is, as the engine says (``""``: not known):
            shown to broker admins only, as a device's holders are
            (``GPUBrokerApp.private_queue``).
    """

    what: str
    user: str = ""

    def describe(self, admin: bool) -> str:
        """``what``, and for an admin ``"… of <user>"`` (``?``: not known)."""
        return f"{self.what} of {self.user or '?'}" if admin else self.what


@dataclass(frozen=True)
class Node:
    """One node (host) of an engine and its devices.

    Attributes:
        name: the node's name, e.g. a host name or a Slurm node name; the same
            as the ``node`` of each of its devices.
        state: ``"up"``, ``"drained"`` or ``"down"`` (:data:`NodeState`).
        devices: the node's GPUs, ordered by index.
        reason: why the node is drained or down, as its engine says (e.g.
            Slurm's drain reason); ``""`` when up or not known.
        outside: the devices something outside the broker holds, by UUID,
            each with what holds it and whose it is (:class:`OutsideHold`):
            the broker grants none of them until they are free. Stored as a
            read-only copy.
    """

    name: str
    state: NodeState
    devices: tuple[DeviceInfo, ...] = ()
    reason: str = ""
    outside: Mapping[str, OutsideHold] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.state not in NODE_STATES:
            raise ValueError(f"node state must be one of {NODE_STATES}, not {self.state!r}")
        object.__setattr__(self, "devices", tuple(self.devices))
        object.__setattr__(self, "outside", MappingProxyType(dict(self.outside)))


@dataclass(frozen=True)
class LaunchSpec:
    """What to run, as whom, where, with which devices.

    Attributes:
        argv: the program and its arguments; ``argv[0]`` is looked up in the
            ``PATH`` of :attr:`env` when it has no ``/``.
        env: the complete environment of the process. Engines pass exactly
            this (trust rule: anything the broker starts for a user carries
            only that user's rights and settings, never the broker's own
            environment); an engine may only add ``PATH`` when it is missing,
            and says so. Put ``CUDA_VISIBLE_DEVICES`` etc. here. Stored as a
            read-only copy.
        cwd: working directory, an absolute path on the node.
        user: the (POSIX) user name the process runs as.
        lease_id: the lease the process belongs to (for names, labels, logs).
        devices: UUIDs (``GPU-...`` or ``MIG-...``) of the devices the lease
            holds; engines that isolate devices (Docker, Slurm) expose only
            these, the local engine checks they are on its node.
        time_limit: wall-clock limit in seconds from launch, ``None`` for
            none; when it passes the engine ends the process (SIGTERM, then
            SIGKILL after a grace) and its status says ``timed_out``.
        stdout: file the process's standard output is appended to, or
            ``None`` to discard it.
        stderr: the same for standard error (may be the same path as stdout).
        home: the user's root directory on the node, decided by the broker
            (never by the user): engines that isolate the file system
            (Docker) mount exactly it; ``None``: none to mount.
        tag: a name of this launch, unique, which the engine records with
            what it starts so that ``find(tag, user)`` finds it again, also
            after a broker restart: the local engine as
            ``GPUBROKER_LAUNCH_TAG`` in the process's environment, Docker in
            the container's name (``gpubroker-TAG``), Slurm in the job's
            comment. 1 to 100 letters, digits, ``.``, ``_`` and ``-``
            (:data:`TAG_PATTERN`); ``""``: none.

    Raises:
        ValueError: ``argv`` is empty, ``time_limit`` is not positive,
            ``env`` has a key or value that is not a string, or ``tag`` is
            not one :data:`TAG_PATTERN` allows.
    """

    argv: tuple[str, ...]
    env: Mapping[str, str]
    cwd: str
    user: str
    lease_id: int
    devices: tuple[str, ...] = ()
    time_limit: float | None = None
    stdout: str | None = None
    stderr: str | None = None
    home: str | None = None
    tag: str = ""

    def __post_init__(self) -> None:
        argv = tuple(self.argv)
        if not argv:
            raise ValueError("LaunchSpec.argv must not be empty")
        if self.tag and not TAG_PATTERN.fullmatch(self.tag):
            raise ValueError(f"LaunchSpec.tag must match {TAG_PATTERN.pattern}, not {self.tag!r}")
        if self.time_limit is not None and not self.time_limit > 0:
            raise ValueError(f"LaunchSpec.time_limit must be > 0 seconds, not {self.time_limit}")
        env = dict(self.env)
        for key, value in env.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise ValueError(f"LaunchSpec.env must map str to str, not {key!r}: {value!r}")
        object.__setattr__(self, "argv", argv)
        object.__setattr__(self, "env", MappingProxyType(env))
        object.__setattr__(self, "devices", tuple(self.devices))


@dataclass(frozen=True)
class Handle:
    """How an engine names something it launched.

    Store all three fields (e.g. in the lease's row) to poll or stop the
    process later, also after a broker restart.

    Attributes:
        engine: :attr:`Engine.name` of the engine that launched it.
        id: the engine's id for it: the process id (``"12345"``) for the local
            engine, a container id for Docker, a job id for Slurm.
        node: name of the node it runs on.
    """

    engine: str
    id: str
    node: str


@dataclass(frozen=True)
class Status:
    """What became of a launched process.

    Attributes:
        state: ``"running"``, ``"exited"`` or ``"lost"`` (:data:`RunState`).
        exit_code: the exit status (0-255) when it exited by itself; ``None``
            while running, when a signal ended it, or when lost.
        signal: the number of the signal that ended it (e.g. 9 for SIGKILL);
            ``None`` when it exited by itself, while running, or when lost.
        started: when it was launched (UTC), ``None`` when not known.
        ended: when the engine saw it end (UTC; at most one poll interval
            after the real end), ``None`` while running or when not known.
        timed_out: ``True`` when the engine ended it because its
            :attr:`LaunchSpec.time_limit` passed.
        devices: the devices (UUIDs) the process is bound to where the
            engine chose them itself (Slurm binds GPU indices of its own
            choosing); empty where the engine used the spec's devices, or
            does not know yet (a Slurm job still pending).
        waiting: while ``running``, what holds it where its engine has not
            started its program yet, in the engine's words (a Slurm job
            ``PENDING (Resources)``); ``""`` once it has started, and for
            engines that start at once.
        never_starts: ``True`` when its engine says it will never start as
            it is (a Slurm job pending for a reason that waiting does not
            clear: :data:`~gpubroker.engines.slurm_json.NEVER_STARTS`).
    """

    state: RunState
    exit_code: int | None = None
    signal: int | None = None
    started: datetime | None = None
    ended: datetime | None = None
    timed_out: bool = False
    devices: tuple[str, ...] = ()
    waiting: str = ""
    never_starts: bool = False

    def __post_init__(self) -> None:
        if self.state not in RUN_STATES:
            raise ValueError(f"run state must be one of {RUN_STATES}, not {self.state!r}")

    @property
    def running(self) -> bool:
        """``True`` while the process runs."""
        return self.state == "running"


@runtime_checkable
class Engine(Protocol):
    """Runs holders' processes somewhere: the local host, Docker, Slurm.

    Only :meth:`stop` may wait (bounded by its ``grace`` plus a few seconds);
    every other call returns promptly. All calls are blocking (subprocesses,
    system calls, maybe network): callers on an event loop run them in a
    thread (``await asyncio.to_thread(engine.stop, handle, 10.0)``).
    Implementations are safe to call from several threads.
    """

    #: short name of the engine kind, e.g. ``"local"``; :attr:`Handle.engine`
    name: str

    def nodes(self) -> list[Node]:
        """Return the engine's nodes with their devices (inventory).

        Raises:
            EngineError: the inventory cannot be read (the message says why).
        """
        ...

    def launch(self, spec: LaunchSpec) -> Handle:
        """Start ``spec`` and return its handle; does not wait for it.

        Raises:
            EngineError: it cannot be started: the program or ``cwd`` does not
                exist, the engine cannot run as ``spec.user``, a device is not
                on the node, an output file cannot be opened, ... (the message
                names the cause).
        """
        ...

    def signal(self, handle: Handle, signum: int) -> None:
        """Send signal ``signum`` (e.g. ``signal.SIGINT``) to the process.

        Does nothing when the process has already ended.

        Raises:
            EngineError: the handle is not one of this engine, or the signal
                cannot be sent.
        """
        ...

    def stop(self, handle: Handle, grace: float) -> Status:
        """End the process: SIGTERM, then SIGKILL after ``grace`` seconds.

        Waits up to ``grace`` seconds (plus a few seconds after SIGKILL) and is
        the only call that waits: run it off the event loop
        (``asyncio.to_thread``). Stopping a process that already ended just
        returns its status.

        Returns:
            The final status (``"running"`` only if the process survived
            SIGKILL within the bounded wait, e.g. stuck in the kernel).

        Raises:
            EngineError: the handle is not one of this engine.
        """
        ...

    def poll(self, handle: Handle) -> Status:
        """Return the current status of the process, without waiting.

        Raises:
            EngineError: the handle is not one of this engine.
        """
        ...

    def telemetry(self, uuids: Iterable[str]) -> dict[str, DeviceUsage]:
        """Return the current usage of each device in ``uuids``, by UUID.

        UUIDs the engine does not know are left out of the result.

        Raises:
            EngineError: the usage cannot be read.
        """
        ...
