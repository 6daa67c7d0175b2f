"""Notebook servers as Slurm jobs: SlurmSpawner and SlurmGPUSpawner.

:class:`SlurmGPUSpawner` asks the broker for a lease first (its queue,
quotas and reasons, as every gpubroker spawner), then submits
``jupyterhub-singleuser`` as a Slurm job on the node of the granted GPUs,
through :class:`gpubroker.engines.slurm.SlurmEngine` (``sbatch --parsable
--nodelist=NODE --gres=gpu:N``; its settings, e.g. the partition, account
and QOS, are ``c.SlurmEngine`` in the hub's config). Slurm binds the GPU
indices and sets the job's ``CUDA_VISIBLE_DEVICES``; the broker records
them on the lease.

* **The server's address.** On the node the job runs
  :mod:`gpubroker_spawner.slurm_server`, which takes a port free on that
  node and tells it through the job's comment; the hub reaches the server
  at the node's ``NodeAddr`` (``sinfo``) and that port. No shared file
  system, no token and no hub API extension is needed.
* **Start.** The spawn progress says the job id and Slurm's state and
  reason while the job waits (``PENDING (Resources)``) and starts;
  ``start()`` returns once the server answers HTTP. A job that ends first
  (a bad command, a node failure, ``scancel``) fails the spawn at once with
  Slurm's state and the end of the job's output file, where the hub can
  read it; the lease is released.
* **Status.** ``poll()`` asks ``squeue`` (then ``sacct``): a command that
  fails is *unknown* and the server counts as running (the hub asks again
  at its next poll; one failure never orphans a server, batchspawner
  #315). The broker too asks Slurm about the job every
  ``reconcile_interval`` and releases the lease of a job gone.
* **Stop.** SIGTERM to the job's processes, ``stop_grace`` seconds, then
  ``scancel`` (Slurm's SIGKILL after its ``KillWait``); the lease is
  released.

The hub must be able to run Slurm's commands (a submit host) and, to start
servers as their users, run as root (``sbatch --uid``), or start every
server as its own user (``system_user``). gpubroker and jupyterhub must be
installed on the nodes at ``node_python``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import pwd
import secrets
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

from jupyterhub.spawner import Spawner
from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest
from traitlets import Float, Integer, Unicode, default

from gpubroker.engines.base import EngineError, Handle, LaunchSpec, LaunchUnknown, Status
from gpubroker.engines.slurm import JOB_NAME_PREFIX, SlurmEngine
from gpubroker.engines.slurm_json import NEVER_STARTS, JobView
from gpubroker.userfiles import open_owned

from .mixin import GPUSpawnerMixin, spawn_error
from .progress import ProgressFeed

#: the module the batch script runs on the node (it chooses the port)
SERVER_MODULE = "gpubroker_spawner.slurm_server"
#: lines of the job's output file shown when its server fails to start
OUTPUT_LINES = 8
#: bytes read from the end of that file
TAIL_BYTES = 16384
#: pending reasons that do not clear by waiting: the spawn fails at once
#: (Slurm's squeue(1) REASON CODES; the job service fails batch jobs alike)
HOPELESS = NEVER_STARTS | {"JobHeldAdmin"}
#: looks for a job by its tag when Slurm could not tell whether it queued it
FIND_TRIES = 3
#: seconds between two HTTP looks at a starting server whose port is known
HTTP_PROBE = 0.2
#: a job whose state Slurm could not say (its command failed): still starting
_UNKNOWN = Status("running")


def output_tail(path: str, uid: int, lines: int = OUTPUT_LINES) -> str:
    """The last ``lines`` lines of ``path``, read only when it is a regular
    file owned by ``uid`` (the server's user) and not a symbolic link: the
    hub may run as root, and the user chooses what lies in her home
    (``ln -s /etc/shadow``). ``""`` when it cannot be read here (e.g. a
    node's local disk) or is not such a file."""
    with open_owned(path, uid) as file:
        if file is None:
            return ""
        file.seek(max(0, os.fstat(file.fileno()).st_size - TAIL_BYTES))
        text = file.read(TAIL_BYTES).decode(errors="replace")
    return "\n".join(text.strip().splitlines()[-lines:])


class SlurmSpawner(Spawner):  # type: ignore[misc]
    """JupyterHub Spawner whose servers run as Slurm jobs (no GPUs of its
    own: :class:`SlurmGPUSpawner` adds the broker's lease). See the module."""

    system_user = Unicode(
        "{username}",
        help="""The POSIX user a server runs as; ``{username}`` is the hub
        user's name. Another user than the hub's own needs a hub run as root
        (``sbatch --uid``).""",
    ).tag(config=True)

    min_uid = Integer(
        1000,
        min=0,
        help="""Where ``system_user`` names the account after the hub user
        (``{username}``), a server never runs as an account whose uid is
        below this (root and the system accounts, as login.defs' UID_MIN),
        nor as the hub's own account: a hub user named 'root' or 'daemon'
        (an OAuth login may pick any name) gets a spawn error. A
        ``system_user`` without ``{username}`` is the admin's own choice and
        is not checked. 0 turns the check off.""",
    ).tag(config=True)

    node_python = Unicode(
        sys.executable,
        help="""The Python on the nodes that runs
        ``gpubroker_spawner.slurm_server`` (gpubroker installed) before
        ``Spawner.cmd``; default: the hub's own, for nodes that share its
        installation.""",
    ).tag(config=True)

    output_template = Unicode(
        "{home}/.jupyterhub-slurm-{servername}.log",
        help="""The server job's output file (sbatch ``--output``, standard
        output and error appended) on the node: ``{home}``, ``{username}``
        and ``{servername}`` (empty for the default server) are filled in.
        Its last lines are shown when a server fails to start, where the hub
        can read the file (a shared home).""",
    ).tag(config=True)

    slurm_poll_interval = Float(
        1.0,
        help="""Seconds between two looks at the job (``squeue``) and at the
        server (HTTP) while a server starts.""",
    ).tag(config=True)

    stop_grace = Float(
        10.0,
        help="""Seconds between the SIGTERM of a stop and ``scancel`` (a
        ``stop(now=True)`` waits none).""",
    ).tag(config=True)

    slurm_job_id: str = ""
    slurm_node: str = ""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._engine: SlurmEngine | None = None
        #: the job's part of the spawn progress
        self._slurm_feed = ProgressFeed()

    @default("ip")
    def _default_ip(self) -> str:
        # the server runs on another host than the hub: every interface of its node
        return "0.0.0.0"

    @property
    def engine(self) -> SlurmEngine:
        """The Slurm engine submitting and following this server's job
        (``c.SlurmEngine`` of the hub's config)."""
        if self._engine is None:
            self._engine = SlurmEngine(parent=self)
        return self._engine

    @property
    def _handle(self) -> Handle:
        return Handle("slurm", self.slurm_job_id, self.slurm_node)

    # -- state -----------------------------------------------------------------

    def get_state(self) -> dict[str, Any]:
        """Spawner state plus the job's id and node (a hub restart keeps them)."""
        state: dict[str, Any] = super().get_state()
        if self.slurm_job_id:
            state["slurm_job_id"] = self.slurm_job_id
            state["slurm_node"] = self.slurm_node
        return state

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore the job's id and node."""
        super().load_state(state)
        self.slurm_job_id = str(state.get("slurm_job_id") or "")
        self.slurm_node = str(state.get("slurm_node") or "")

    def clear_state(self) -> None:
        """Forget the job (after it ended)."""
        super().clear_state()
        self.slurm_job_id = self.slurm_node = ""

    # -- the job ---------------------------------------------------------------

    def _user(self) -> pwd.struct_passwd:
        """The account the server runs as (``system_user``).

        Raises:
            SpawnError: no such account; or one named after the hub user
                that is root, a system account or the hub's own
                (:attr:`min_uid`): the server would carry more than its
                user's rights (and ``sbatch --uid`` is left out for the
                hub's own account).
        """
        name = self.system_user.format(username=self.user.name)
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            raise spawn_error(
                f"No system user {name!r} to run the server as (SlurmSpawner.system_user)",
                "slurm-no-user",
            ) from None
        named_by_user = "{username}" in self.system_user
        privileged = entry.pw_uid < self.min_uid or entry.pw_uid == os.geteuid()
        if named_by_user and self.min_uid > 0 and privileged:
            raise spawn_error(
                f"Servers do not run as {name!r} (uid {entry.pw_uid}): accounts below "
                f"SlurmSpawner.min_uid ({self.min_uid}) and the hub's own account are "
                "not servers' accounts",
                "slurm-system-user",
            )
        return entry

    def user_env(self, env: dict[str, str], entry: pwd.struct_passwd) -> dict[str, str]:
        """``env`` with the user's ``HOME``, ``USER``, ``LOGNAME`` and
        ``SHELL`` (Slurm passes the submitted environment as it is)."""
        return env | {
            "HOME": entry.pw_dir,
            "USER": entry.pw_name,
            "LOGNAME": entry.pw_name,
            "SHELL": entry.pw_shell or "/bin/sh",
        }

    def _start_dir(self, entry: pwd.struct_passwd) -> str:
        """Where the job starts: ``Spawner.notebook_dir`` (``~`` being the
        user's home) when set, else the home; kernels started without a
        path (the hub API, scripts) run there."""
        if not self.notebook_dir:
            return entry.pw_dir
        root = self.format_string(self.notebook_dir)
        return entry.pw_dir + root[1:] if root.startswith("~") else root

    def launch_spec(self) -> LaunchSpec:
        """What the job runs: ``node_python -m gpubroker_spawner.slurm_server
        CMD ARGS`` in ``notebook_dir`` (else the user's home), as the user,
        with the server's environment; no devices (:class:`SlurmGPUSpawner`
        adds the lease's). Its tag (``server-`` and 12 random hex digits)
        lets the engine find the job again when ``sbatch`` fails or times
        out after Slurm queued it."""
        entry = self._user()
        output = self.output_template.format(
            home=entry.pw_dir, username=self.user.name, servername=self.name or ""
        )
        argv = (self.node_python, "-m", SERVER_MODULE, *self.cmd, *self.get_args())
        return LaunchSpec(
            argv=argv,
            env=self.user_env(self.get_env(), entry),
            cwd=self._start_dir(entry),
            user=entry.pw_name,
            lease_id=0,
            stdout=output,
            stderr=output,
            tag=f"server-{secrets.token_hex(6)}",
        )

    def _slurm_event(self, progress: int, message: str) -> None:
        if self._slurm_feed.add(progress, message, once=True):
            self.log.info("%s: %s", self._log_name, message)

    async def start(self) -> tuple[str, int]:
        """Submit the server's job and wait until the server answers.

        Returns:
            ``(address, port)``: the node's ``NodeAddr`` and the port its
            server chose.

        Raises:
            SpawnException: ``sbatch`` refused, or the job ended before its
                server answered (Slurm's state and reason, and the end of
                its output where readable); or the hub runs with
                ``internal_ssl``, which this spawner does not support (the
                hub makes a server's certificate before its node is known).
        """
        if getattr(self, "internal_ssl", False):
            raise spawn_error(
                "SlurmGPUSpawner does not support JupyterHub's internal_ssl: the hub makes "
                "a server's certificate before Slurm picks its node, so the hub could not "
                "check it (docs/slurm.md)",
                "slurm-internal-ssl",
            )
        if self._slurm_feed.over:  # a start after a failed one, without a stop
            self._slurm_feed = ProgressFeed()
        feed = self._slurm_feed
        try:
            spec = self.launch_spec()
            handle = await self._submit(spec)
        except EngineError as err:
            feed.close()
            raise spawn_error(f"Slurm refused the server's job: {err}", "slurm-refused") from err
        except BaseException:
            feed.close()
            raise
        self.slurm_job_id, self.slurm_node = handle.id, handle.node
        where = f" on {handle.node}" if handle.node else ""
        self._slurm_event(50, f"Slurm job {handle.id} submitted{where}")
        try:
            return await self._wait_for_server(spec)
        finally:
            feed.close()

    async def _submit(self, spec: LaunchSpec) -> Handle:
        """``sbatch`` in a thread; a start cancelled meanwhile (the hub's
        start timeout, a user's cancel) cancels the job once it is known,
        so no job runs that nothing follows. A launch whose outcome Slurm
        could not tell (:class:`~gpubroker.engines.base.LaunchUnknown`) is
        looked for by its tag up to :data:`FIND_TRIES` times,
        ``slurm_poll_interval`` apart."""
        submitted = asyncio.ensure_future(asyncio.to_thread(self._launch, spec))
        try:
            return await asyncio.shield(submitted)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                handle = await submitted
                await asyncio.to_thread(self.engine.stop, handle, 0.0)
            raise

    def _launch(self, spec: LaunchSpec) -> Handle:
        """:meth:`SlurmEngine.launch`, then, while whether Slurm queued the
        job is not known, :meth:`SlurmEngine.find` by its tag (blocking:
        run in a thread).

        Raises:
            EngineError: ``sbatch`` refused, or no job of the tag is found
                (``sbatch`` failed), or it still cannot be told (the message
                says the job may run).
        """
        try:
            return self.engine.launch(spec)
        except LaunchUnknown as err:
            unknown: EngineError = err
        for _ in range(FIND_TRIES):
            time.sleep(self.slurm_poll_interval)
            try:
                found = self.engine.find(spec.tag, spec.user)
            except EngineError as err:
                unknown = err
                continue
            if found is None:
                raise EngineError(f"sbatch failed and Slurm has no job of it: {unknown}")
            return found
        raise EngineError(
            f"{unknown}; the job may still be queued: Slurm could not be asked "
            f"(cancel jobs named {JOB_NAME_PREFIX}{spec.lease_id} of {spec.user})"
        )

    async def _wait_for_server(self, spec: LaunchSpec) -> tuple[str, int]:
        """Follow the job (``squeue`` every ``slurm_poll_interval``) until
        its server answers HTTP (asked every :data:`HTTP_PROBE` seconds once
        its port is known); fail at once when the job ends first."""
        address: tuple[str, int] | None = None
        while True:
            view = await self._describe()
            if view is None or not view.status.running:
                raise self._ended(view, spec)
            if view.state == "PENDING":
                why = f" ({view.reason})" if view.reason else ""
                self._slurm_event(55, f"Slurm job {view.job_id}: PENDING{why}")
                if view.reason in HOPELESS:
                    raise await self._hopeless(view)
            elif view.port is not None and address is None:
                address = await self._address(view)
            next_look = time.monotonic() + self.slurm_poll_interval
            while True:
                if address is not None and await self._answers(*address):
                    self._slurm_event(90, f"Slurm job {self.slurm_job_id}: server answers")
                    return address
                remaining = next_look - time.monotonic()
                if remaining <= 0:
                    break
                await asyncio.sleep(min(HTTP_PROBE, remaining))

    async def _address(self, view: JobView) -> tuple[str, int] | None:
        """The server's (node address, port); ``None`` while ``sinfo``
        cannot say (asked again at the next look)."""
        try:
            host = await asyncio.to_thread(self.engine.node_address, view.node)
        except EngineError as err:
            self._slurm_event(65, f"Slurm job {view.job_id}: node {view.node} not known ({err})")
            return None
        running = f"RUNNING on {view.node}, server on port {view.port}"
        self._slurm_event(70, f"Slurm job {view.job_id}: {running}")
        return host, int(view.port or 0)

    async def _hopeless(self, view: JobView) -> Exception:
        """Cancel a job Slurm will never start; the spawn's failure."""
        with contextlib.suppress(EngineError):
            await asyncio.to_thread(self.engine.stop, self._handle, 0.0)
        self.slurm_job_id = self.slurm_node = ""
        return spawn_error(
            f"Slurm will not start the server's job {view.job_id}: PENDING ({view.reason}); "
            "it was cancelled. Ask your administrator (partition, account, QOS, time limit).",
            "slurm-job-hopeless",
        )

    async def _describe(self) -> JobView | None:
        """``squeue``'s view of the job; while Slurm does not answer, the
        last view is unknown: say so and treat the job as still starting."""
        try:
            return await asyncio.to_thread(self.engine.describe, self._handle)
        except EngineError as err:
            self._slurm_event(55, f"Slurm job {self.slurm_job_id}: Slurm not answering ({err})")
            return JobView(self.slurm_job_id, "UNKNOWN", str(err), "", None, _UNKNOWN)

    async def _answers(self, host: str, port: int) -> bool:
        """Whether the server answers HTTP at its API URL (any status)."""
        base = self.server.base_url if self.server else "/"
        url = f"http://{host}:{port}{base.rstrip('/')}/api"
        request = HTTPRequest(url, connect_timeout=2, request_timeout=5, follow_redirects=False)
        try:
            await AsyncHTTPClient().fetch(request, raise_error=False)
        except (OSError, HTTPClientError):  # refused, unreachable, timed out: not yet
            return False
        return True

    def _ended(self, view: JobView | None, spec: LaunchSpec) -> Exception:
        """The spawn failure of a job that ended before its server answered."""
        job = self.slurm_job_id
        self.slurm_job_id = self.slurm_node = ""  # not clear_state: the lease is released after
        if view is None:
            what = "is gone from Slurm"
        else:
            status = view.status
            how = (
                f"signal {status.signal}"
                if status.signal is not None
                else f"exit status {status.exit_code}"
            )
            why = f", reason {view.reason}" if view.reason else ""
            what = f"ended: {view.state} ({how}{why})"
        tail = output_tail(spec.stdout or "", self._user().pw_uid)
        output = f"; the end of {spec.stdout}:\n{tail}" if tail else ""
        return spawn_error(
            f"The server's Slurm job {job} {what} before the server answered{output}",
            "slurm-job-ended",
        )

    async def progress(self) -> AsyncIterator[dict[str, Any]]:
        """The job's progress: submitted, Slurm's state and reason, running
        on which node and port, answering."""
        async for event in self._slurm_feed.follow():
            yield event

    async def poll(self) -> int | None:
        """None while the job runs (or pends, or Slurm cannot be asked: the
        state is unknown, see the module); else its exit status (128 plus
        the signal of a job a signal ended; 1 when Slurm does not say)."""
        if not self.slurm_job_id:
            return 0
        try:
            status = await asyncio.to_thread(self.engine.poll, self._handle)
        except EngineError as err:
            self.log.warning("%s: Slurm not answering, status unknown: %s", self._log_name, err)
            return None
        if status.running:
            return None
        self.log.info("%s: Slurm job %s ended: %s", self._log_name, self.slurm_job_id, status)
        self.clear_state()
        if status.signal is not None:
            return 128 + status.signal
        return status.exit_code if status.exit_code is not None else 1

    async def stop(self, now: bool = False) -> None:
        """SIGTERM, ``stop_grace`` seconds (none with ``now``), then
        ``scancel``. Slurm not answering: the job is cancelled outright
        (``scancel --full --signal=9``), and an error is raised if that fails
        too (the broker's reconciliation releases the lease once the job
        is gone)."""
        if not self.slurm_job_id:
            return
        started = time.monotonic()
        try:
            await asyncio.to_thread(self.engine.stop, self._handle, 0.0 if now else self.stop_grace)
        except EngineError as err:
            self.log.warning("%s: stopping Slurm job failed (%s); killing", self._log_name, err)
            await asyncio.to_thread(self.engine.signal, self._handle, 9)
        self.log.info(
            "%s: Slurm job %s stopped in %.1f s",
            self._log_name,
            self.slurm_job_id,
            time.monotonic() - started,
        )
        self.clear_state()
        self._slurm_feed = ProgressFeed()  # the next start's


class SlurmGPUSpawner(GPUSpawnerMixin, SlurmSpawner):  # type: ignore[misc]
    """:class:`SlurmSpawner` whose servers get the GPUs the broker leases
    them: the job goes to the node of the lease's devices with ``--gres``
    for their count and the lease's time limit as ``--time``; the broker is
    told the job's id (it counts the job's GPUs as the lease's and follows
    the job). See the module's documentation."""

    def launch_spec(self) -> LaunchSpec:
        """:meth:`SlurmSpawner.launch_spec` with the lease's devices, id and
        time limit."""
        spec = super().launch_spec()
        return dataclasses.replace(
            spec,
            devices=tuple(self.gpu_devices),
            lease_id=self.gpu_lease_id or 0,
            time_limit=self.time_limit,
        )

    async def gpu_server_record(self) -> dict[str, str]:
        """The server's Slurm job id, for the broker's reconciliation."""
        return {"slurm_job": self.slurm_job_id} if self.slurm_job_id else {}
