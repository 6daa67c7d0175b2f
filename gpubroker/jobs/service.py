"""Batch jobs in the broker: submission, supervision and cancel.

A job holds a lease of its own (``holder_kind`` ``job``, priority class
``JobService.default_priority_class`` unless asked), so it is queued,
scheduled, counted against quotas and fair share, preempted and reported
like any lease, and never tied to an interactive server's life. Once the
lease is granted the job's process starts through the broker's engine
(the local engine: a subprocess), with exactly the lease's environment
(``CUDA_VISIBLE_DEVICES`` and ``NVIDIA_VISIBLE_DEVICES`` naming the leased
UUIDs, ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, ``GPUBROKER_LEASE_ID``), the job's
own variables and ``GPUBROKER_JOB_ID``, ``HOME``, ``USER`` and ``PATH``;
nothing of the broker's own environment (trust rule).

A notebook job runs papermill (``IN OUT -y PARAMS``, through
:mod:`gpubroker.jobs.nbrun`, which interrupts its kernel on a warning; papermill
saves the output notebook after every cell, so a failed or cancelled job
leaves its partial output with the error cell marked); its output is
``<name>.<job id>.ipynb`` beside the input, its log (papermill's, with the
cells' output) ``<name>.<job id>.log``. A command job's log is
``job-<id>.log`` in its working directory.

A notebook job's ``python``, ``kernel`` and notebook are checked at submit
with its user's rights and kernels (:mod:`gpubroker.jobs.probe`, run as
the user), never the broker's. A launch is recorded as an *intent* (a tag
in the job's handle) before the engine starts it, and the engine records
the tag with what it starts, so a broker that crashed between the two
finds and adopts (or stops) that launch instead of starting a second one.

When the process ends, the job's state says how (:func:`gpubroker.model.jobs.outcome`),
the exit code and the signal are kept apart, and the lease is released.
Every change is an event in the lease's transition log (``job-started``,
``job-ended``), with the job's id.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import datetime as dt
import functools
import json
import os
import pwd
import secrets
import select
import selectors
import signal as signal_module
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from traitlets import Bool, Float, Integer, List, TraitError, Unicode, validate
from traitlets.config import LoggingConfigurable

from ..broker.rebind import Rebinder
from ..engines.base import EngineError, Handle, LaunchSpec, LaunchUnknown, Status
from ..errors import BadRequest, BrokerError, Conflict, Forbidden, NotFound, Unavailable
from ..model import jobs as model
from ..model.echo import echo
from ..store import jobs_repo as repo
from ..usage.intervals import event_cause
from ..userfiles import open_owned
from ..views import isoformat, lease_view
from .text import one_line

#: fields of a job request that go to its lease
LEASE_FIELDS = ("gpus", "mig_profile", "memory_gib", "count", "pool", "group")

#: a job's spec as :meth:`JobService.check` found it: the spec, a note for
#: the job ("" when none), the language papermill is told ("" when the
#: notebook says it), and its paths (:meth:`JobService._paths_of`)
Checked = tuple[model.JobSpec, str, str, dict[str, Path]]


class JobService(LoggingConfigurable):
    """Batch jobs of one broker (see the module's documentation).

    Args:
        broker: the broker (its lease commands).
        engine: where jobs run (:class:`~gpubroker.engines.base.Engine`).
    """

    root_dir_template = Unicode(
        "~{username}",
        help="Each user's root directory, where job paths (notebook, cwd) are resolved "
        "and must stay: '~{username}' (the POSIX home) or a template such as "
        "'/srv/home/{username}' (the same as the spawner's home directory).",
    ).tag(config=True)

    run_as_self = Bool(
        False,
        help="Run jobs as the broker's own POSIX user (as SimpleLocalGPUSpawner runs "
        "servers), not as the job's user. For demos and tests on one account only.",
    ).tag(config=True)

    min_uid = Integer(
        1000,
        min=0,
        help="Jobs never run as a POSIX account whose uid is below this (root and the "
        "system accounts, as login.defs' UID_MIN): a hub user named 'root' or 'daemon' "
        "is refused at submit (403), whatever the runner. Not checked with run_as_self "
        "(jobs then run as the broker's own account). Nor does a job run as the broker's "
        "own account otherwise. 0 turns both checks off.",
    ).tag(config=True)

    shared_uids = List(
        Integer(),
        [65534, 4294967294],
        help="Jobs never run as these POSIX accounts: shared ones such as 'nobody' "
        "(65534, the kernel's overflow uid) and 'nfsnobody' (4294967294), which own "
        "root-squashed NFS files and daemons' data: refused at submit (403), as below "
        "min_uid.",
    ).tag(config=True)

    max_uid = Integer(
        0,
        min=0,
        help="Jobs never run as a POSIX account whose uid is above this; 0 (the "
        "default): no upper limit. Directory-service accounts (LDAP, FreeIPA, SSSD) "
        "often have uids far above login.defs' UID_MAX (60000): set it only where "
        "every account above it is a shared one.",
    ).tag(config=True)

    runner = Unicode(
        "local",
        help="Where jobs run: 'local' (a process on the broker's host, as the job's "
        "user), 'docker' (a container per job, configure DockerEngine: image, "
        "network) or 'slurm' (a Slurm job on the node of the lease's GPUs; needs "
        "Broker.engine_kind = 'slurm', configure SlurmEngine; paths must be the same "
        "on the nodes: a shared home and Python). Running jobs keep the runner they "
        "started with.",
    ).tag(config=True)

    @validate("runner")
    def _valid_runner(self, proposal: Any) -> str:
        value = str(proposal["value"])
        if value not in RUNNERS:
            raise TraitError(f"JobService.runner: must be one of {RUNNERS}, not {value!r}")
        return value

    python = Unicode(
        sys.executable,
        help="The Python that runs papermill for notebook jobs (the users' environment).",
    ).tag(config=True)

    default_priority_class = Unicode(
        "batch", help="Priority class of a job that asks for none."
    ).tag(config=True)

    poll_interval = Float(2.0, help="Seconds between checks of queued and running jobs.").tag(
        config=True
    )

    warn_signal = Unicode(
        "SIGUSR1",
        help="The signal a running command job's processes get warn_before seconds "
        "before its time limit, and when a preemption's grace period starts (Slurm's "
        "--signal); a name such as SIGUSR1. A notebook job's papermill and kernel "
        "ignore it (its kernel is interrupted instead).",
    ).tag(config=True)

    warn_before = Float(
        60.0,
        help="Seconds before a job's time limit at which it is warned: a command job "
        "gets warn_signal, a notebook job's kernel is interrupted (a job with a shorter "
        "limit is not warned). A program that does not catch the signal ends on it "
        "(failed), as with Slurm's --signal.",
    ).tag(config=True)

    max_restarts = Integer(
        3, help="Most times a preempted job is queued again (then it ends failed)."
    ).tag(config=True)

    @validate("warn_signal")
    def _valid_signal(self, proposal: Any) -> str:
        name = str(proposal["value"])
        if not name.startswith("SIG") or not isinstance(getattr(signal_module, name, None), int):
            raise TraitError(f"JobService.warn_signal: not a signal name: {name!r}")
        return name

    stop_grace = Float(
        30.0,
        help="Seconds between SIGTERM and SIGKILL when a job is cancelled, or stopped "
        "because its lease ends (a preemption's end, an admin's release).",
    ).tag(config=True)

    cancel_wait = Float(
        5.0,
        min=0.0,
        help="Most seconds a cancel (DELETE /jobs/{id}) waits for the job's process to "
        "end before it answers; a process that takes longer (up to stop_grace) is "
        "answered as still running, being cancelled, and the stop goes on. Keep it "
        "well below the clients' 20 s timeout.",
    ).tag(config=True)

    def __init__(self, broker: Any, engine: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.broker = broker
        #: the engines jobs run on, by name (the docker one made on first use)
        self.engines: dict[str, Any] = {engine.name: engine}
        self.rebinder = Rebinder(broker, self.log)
        self.sessions = broker.session_factory
        self._cancelling: set[int] = set()
        #: the checks as users (:meth:`check_off_loop`) run on workers of their
        #: own: a user's slow probes never hold the loop's default workers,
        #: which carry the broker's side effects (launches, stops, MIG)
        self._checks = concurrent.futures.ThreadPoolExecutor(
            CHECK_WORKERS, thread_name_prefix="gpubroker-job-check"
        )
        #: reads of job logs (:meth:`logs_off_loop`): a log is in the user's
        #: directory, which may be on a slow or hung network file system
        self._log_reads = concurrent.futures.ThreadPoolExecutor(
            LOG_READ_WORKERS, thread_name_prefix="gpubroker-job-log"
        )
        #: reads of failed jobs' error files (:meth:`_error_of`), one at a
        #: time on a worker of their own, so that users' log reads never
        #: hold them up; the read in flight (one hung on a file system is
        #: not waited for again)
        self._error_reads = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="gpubroker-job-error"
        )
        self._error_read: concurrent.futures.Future[str] | None = None
        #: checks in flight per user, under ``_checking_lock``
        self._checking: dict[str, int] = {}
        self._checking_lock = threading.Lock()
        #: jobs the supervisor is acting on (across its awaits)
        self._busy: set[int] = set()
        #: stops of job processes (SIGTERM, up to stop_grace, SIGKILL) run on
        #: workers of their own, off the supervisor's round: at most
        #: STOP_WORKERS at once, the others wait their turn
        self._stoppers = concurrent.futures.ThreadPoolExecutor(
            STOP_WORKERS, thread_name_prefix="gpubroker-job-stop"
        )
        #: stops under way and stops done (their final status, or why they
        #: failed) not yet recorded, by job id, under ``_stops_lock``
        self._stops_lock = threading.Lock()
        self._stop_futures: dict[int, concurrent.futures.Future[Status]] = {}
        self._stop_results: dict[int, Status | str] = {}
        #: wakes the supervisor's loop when a stop ends (:meth:`run`)
        self._wake: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None
        # a job lease's devices are freed only once its process has ended: the
        # broker keeps an evicted job lease granted, with an open stop, until
        # this service has stopped the process and released it
        broker.stops.jobs_stopped_first = True

    def _engine(self, name: str) -> Any:
        """The engine ``name`` (``local``, ``docker``).

        Raises:
            EngineError: a runner this broker has no engine for.
        """
        engine = self.engines.get(name)
        if engine is None and name == "docker":
            from ..engines.docker import DockerEngine

            engine = DockerEngine(nbrun=str(_NBRUN), parent=self.parent)
            self.engines[name] = engine
        if engine is None:
            why = " (it needs Broker.engine_kind = 'slurm')" if name == "slurm" else ""
            raise EngineError(f"no {name!r} engine here{why}")
        return engine

    # --- paths ------------------------------------------------------------------

    def root_of(self, user: str) -> Path:
        """The user's root directory (resolved)."""
        text = self.root_dir_template.format(username=user)
        return Path(os.path.expanduser(text)).resolve()

    def _inside(self, user: str, relative: str, field: str) -> Path:
        root = self.root_of(user)
        try:
            path = (root / relative).resolve()
        except (OSError, RuntimeError) as err:  # a symlink loop
            raise model.JobError(field, _unusable(err)) from None
        if path != root and root not in path.parents:
            raise model.JobError(field, f"must stay inside your home directory: {echo(relative)}")
        return path

    # --- commands ---------------------------------------------------------------

    def check(self, user: str, data: dict[str, Any]) -> Checked:
        """Check a job's spec for ``user`` with their rights (their account,
        the paths, and for a notebook its kernel and language, by
        :mod:`gpubroker.jobs.probe` run as them: at most
        :data:`PROBE_TIMEOUT` seconds). Reads files and runs the probe but
        no broker state, so it may run on a worker thread.

        Returns:
            The spec as checked, a note for the job (a dropped ``python``;
            ``""``: none), the language papermill is told (``""``: the
            notebook's own), and the job's paths.

        Raises:
            BadRequest: naming the bad field.
            Forbidden: ``user`` has no POSIX account on the broker's host, or
                one below :attr:`min_uid`.
        """
        self._check_account(user)
        try:
            spec = model.parse_spec(data)
            paths = self._paths_of(user, spec)
            return (*self._checked_as_user(user, spec, paths), paths)
        except model.JobError as err:
            raise BadRequest(str(err)) from None
        except (OSError, RuntimeError) as err:  # a name too long, a symlink loop
            raise BadRequest(
                f"notebook: cannot use this path: {getattr(err, 'strerror', None) or err}"
            ) from None

    async def check_off_loop(self, user: str, data: dict[str, Any]) -> Checked:
        """:meth:`check` on the job service's own :data:`CHECK_WORKERS`
        workers, never the event loop's default ones (the broker's side
        effects run there, and a check may take :data:`PROBE_TIMEOUT`
        seconds: its probe is the user's), and at most
        :data:`MAX_CHECKS_PER_USER` of one user at a time (counted until
        each check ends, even when its caller left).

        Raises:
            Conflict: ``user`` has that many checks under way.
            BadRequest, Forbidden: as :meth:`check`.
        """
        with self._checking_lock:
            if self._checking.get(user, 0) >= MAX_CHECKS_PER_USER:
                raise Conflict(
                    f"user: {MAX_CHECKS_PER_USER} jobs of {user!r} are being checked; "
                    "submit again when one is done"
                )
            self._checking[user] = self._checking.get(user, 0) + 1
        future = self._checks.submit(self.check, user, data)
        future.add_done_callback(lambda _: self._checked(user))
        return await asyncio.wrap_future(future)

    def _checked(self, user: str) -> None:
        with self._checking_lock:
            left = self._checking.pop(user, 1) - 1
            if left:
                self._checking[user] = left

    def submit(
        self,
        user: str,
        data: dict[str, Any],
        groups: list[str] | None = None,
        actor: str | None = None,
        admin: bool = True,
        checked: Checked | None = None,
    ) -> dict[str, Any]:
        """Queue a job for ``user``: check its spec, make its lease.

        Args:
            user: whose job it is.
            data: what to run and on what (``POST /jobs``'s body).
            groups: the user's hub groups (for group quotas).
            actor: who submits (the user, an admin); default ``user``.
            admin: whether the caller is a broker admin (as for leases).
            checked: what :meth:`check` gave for ``user`` and ``data``
                (the API runs it off the event loop); ``None``: checked here.

        Raises:
            BadRequest: naming the bad field; nothing is queued.
            Forbidden: ``user`` has no POSIX account on the broker's host, or
                one below :attr:`min_uid` (root, system accounts); a
                non-admin asked for a class above :attr:`default_priority_class`;
                or from the lease request (quota, limits).
            Conflict: from the lease request.
        """
        spec, note, language, paths = checked if checked is not None else self.check(user, data)
        lease_args = {k: data[k] for k in LEASE_FIELDS if data.get(k) is not None}
        if not any(k in lease_args for k in ("gpus", "mig_profile", "memory_gib")):
            raise BadRequest("gpus: a job asks for gpus, mig_profile or memory_gib")
        if not admin and isinstance(data.get("priority_class"), str):
            self._class_for_user(data["priority_class"])
        now = dt.datetime.now(dt.timezone.utc)
        priority_class = data.get("priority_class") or self.default_priority_class
        # the lease it asks for, and the groups it was charged by, for a requeue
        stored = spec.as_dict() | {"lease": lease_args | {"priority_class": priority_class}}
        stored["groups"] = list(groups) if groups is not None else None
        if language:  # the notebook has none: papermill is told (--language)
            stored["language"] = language
        with self.sessions.begin() as session:
            job = repo.add(session, user, spec.kind, stored, now)
            job.reason = note
            job_id = job.id
        try:
            lease = self.broker.request_lease(
                user,
                "",
                holder_kind="job",
                priority_class=priority_class,
                time_limit=spec.time_limit,
                groups=groups,
                admin=admin,
                actor=actor or user,
                **lease_args,
            )
        except BrokerError:
            with self.sessions.begin() as session:
                repo.delete(session, repo.get(session, job_id))
            raise
        output, log = self._outputs(paths, spec, job_id)
        with self.sessions.begin() as session:
            job = repo.get(session, job_id)
            job.lease_id, job.log_path = lease["id"], str(log)
            job.output_path = "" if output is None else str(output)
            view = self._view(job, lease)
        self.log.info("Job %s of %s queued on lease %s", job_id, user, lease["id"])
        return view

    def _class_for_user(self, name: str) -> None:
        """A user's job may ask for :attr:`default_priority_class` or a lower
        class, never a preempting one: the servers' rule (the default class
        or lower), with the jobs' default; admins choose freely. A class the
        policy does not have is left to the lease request (a 400).

        Raises:
            Forbidden: naming ``priority_class``, the class and the limit.
        """
        policy = self.broker.scheduling.policy()
        if name not in policy.classes:
            return
        cls, default = policy.class_of(name), policy.class_of(self.default_priority_class)
        if cls.preempting or cls.rank > default.rank:
            raise Forbidden(
                f"priority_class: {name!r} (rank {cls.rank}) is above the jobs' default "
                f"class {default.name!r} (rank {default.rank}); only broker admins may ask "
                "for it"
            )

    def _check_account(self, user: str) -> None:
        """Refuse a job that would run as no account or as root or a system
        account (uid below :attr:`min_uid`): every runner starts the job as
        ``user``'s POSIX account on the broker's host (rule 7: a job carries
        no more than its user's rights).

        Raises:
            Forbidden: naming the user and the limit.
        """
        if self.run_as_self:
            return
        uid = _uid_of(user)
        if uid is None:
            raise Forbidden(
                f"user: {user!r} has no POSIX account on the broker's host: jobs run as "
                "their user's account"
            )
        if uid < self.min_uid:
            raise Forbidden(
                f"user: jobs do not run as {user!r} (uid {uid}): accounts below "
                f"JobService.min_uid ({self.min_uid}) are root and system accounts"
            )
        if uid in self.shared_uids:
            raise Forbidden(
                f"user: jobs do not run as {user!r} (uid {uid}): a shared account "
                "(JobService.shared_uids)"
            )
        if self.max_uid and uid > self.max_uid:
            raise Forbidden(
                f"user: jobs do not run as {user!r} (uid {uid}): accounts above "
                f"JobService.max_uid ({self.max_uid}) are refused"
            )
        if uid == os.geteuid() and self.min_uid > 0:
            # a broker run as an ordinary account (uid >= min_uid): a hub user
            # named like it would get the broker's rights (its database, its
            # token in /proc/PID/environ); run_as_self is the way to mean that
            raise Forbidden(
                f"user: jobs do not run as {user!r} (uid {uid}): it is the broker's own "
                "account (JobService.run_as_self runs every job as it, for demos)"
            )

    def _refuse_account(self, user: str) -> None:
        """:meth:`_check_account` at launch, as an :class:`EngineError`."""
        try:
            self._check_account(user)
        except Forbidden as err:
            raise EngineError(str(err)) from None

    def _checked_as_user(
        self, user: str, spec: model.JobSpec, paths: dict[str, Path]
    ) -> tuple[model.JobSpec, str, str]:
        """Check a notebook job with its user's rights (:mod:`gpubroker.jobs.probe`
        run as ``user``: the broker may be root, whose own checks would accept
        what the user cannot use, and show the user what only root sees):

        * ``python``: kept only where it can be used (the local runner, a
          file ``user`` may execute on this host; a server in a container
          sends a path of the container); else dropped, with a note saying so;
        * ``kernel`` (not with the docker runner: the image has its own):
          one of the kernelspecs ``user``'s ``jupyter_client`` finds (their
          ``~/.local/share/jupyter/kernels``, ``JUPYTER_PATH``, the
          environment of :attr:`python`, the system's);
        * the notebook: readable by ``user`` as JSON, and its metadata (or
          the request) says which kernel runs it and, when there are
          parameters to inject, in which language.

        Returns:
            The spec (``python`` maybe dropped), the note (``""``: none) and
            the language papermill is to be told (``""``: the notebook's own).

        Raises:
            JobError: naming ``kernel`` or ``notebook``.
        """
        if spec.kind != "notebook":
            return spec, "", ""
        python, note = spec.python, ""
        if python and self.runner != "local":
            note = f"python {python} not used by the {self.runner} runner: the notebook's kernel"
            python = ""
        # the kernels are listed where a kernel of this host runs the notebook:
        # the one it names, or its metadata's when neither it nor a python does
        check_kernel = self.runner != "docker"
        asked = {"python": python, "notebook": str(paths["notebook"]), "kernels": check_kernel}
        answer = self._probe(user, self._base_env(user, spec.env, self.runner), asked)
        if answer is None:  # not known: the job's own run will tell
            if python:
                note = (
                    f"python {python} could not be checked as {user}: the notebook's kernel runs it"
                )
            return dataclasses.replace(spec, python=""), note[:500], ""
        if python and answer.get("python") is not True:
            note = (
                f"python {python} is not on the broker's host as a program {user} may run: "
                "the notebook's kernel runs it"
            )
            python = ""
        kernel_language = ""
        meta = answer.get("notebook")
        if check_kernel:
            listed = answer.get("kernels")
            kernels: dict[str, Any] = listed if isinstance(listed, dict) else {}
            specs = kernels.get("specs")
            own = str(meta.get("kernel") or "") if isinstance(meta, dict) else ""
            if not isinstance(specs, dict):
                if spec.kernel or not python:
                    self.log.warning(
                        "Jobs: cannot list the kernels of %s: %s", user, kernels.get("error")
                    )
            elif spec.kernel:
                if spec.kernel not in specs:
                    there = ", ".join(sorted(map(str, specs))) or "none"
                    raise model.JobError(
                        "kernel",
                        f"no such kernel: {echo(spec.kernel)} (the kernels {user} has on the "
                        f"broker's host: {there})"[:1000],
                    )
                kernel_language = str(specs[spec.kernel] or "")
            elif not python and own and own not in specs:
                # the notebook's own kernel runs it: it must be one of the user's
                there = ", ".join(sorted(map(str, specs))) or "none"
                raise model.JobError(
                    "notebook",
                    f"its metadata's kernelspec.name {own!r} is no kernel {user} has on the "
                    f"broker's host ({there}): name one with kernel (%gpu_submit --kernel "
                    "NAME)"[:1000],
                )
        language = self._language(spec, python, meta, kernel_language)
        return dataclasses.replace(spec, python=python), note[:500], language

    @staticmethod
    def _language(spec: model.JobSpec, python: str, meta: Any, kernel_language: str) -> str:
        """The language papermill is to be told for a notebook whose
        metadata (``meta``, from the probe) has none: the named kernel's,
        or ``python`` for a kernel of the submitting Python; ``""`` when the
        notebook has one (or it is not known and not needed).

        Raises:
            JobError: naming ``notebook``: it cannot be read as JSON, or
                neither it nor the request says which kernel runs it, or
                which language its parameters are written in.
        """
        if not isinstance(meta, dict):
            return ""
        if meta.get("error"):
            raise model.JobError("notebook", f"cannot read it as a notebook: {meta['error']}")
        if not (spec.kernel or python or meta.get("kernel")):
            raise model.JobError(
                "notebook",
                "its metadata has no kernelspec.name (which kernel runs it): save it "
                "from a kernel, or name one with kernel (%gpu_submit --kernel NAME)",
            )
        if meta.get("language"):
            return ""
        language = kernel_language or ("python" if python else "")
        if not language and spec.params:
            raise model.JobError(
                "notebook",
                "its metadata has no language_info.name (nor kernelspec.language), "
                "which papermill needs to inject params: save it from a kernel, or name "
                "a kernel installed here with kernel",
            )
        return language

    def _run_as(self, user: str) -> str:
        """The POSIX account a job of ``user`` runs as."""
        return pwd.getpwuid(os.getuid()).pw_name if self.run_as_self else user

    def _base_env(self, user: str, own: Mapping[str, str], runner: str) -> dict[str, str]:
        """A job's environment before its lease's and the broker's variables:
        ``PATH`` (not with the ``docker`` ``runner``: the image's), ``HOME``
        (the user's root directory), ``USER``, ``LANG`` and the job's own ``env``."""
        # a container keeps its image's PATH (the host's means nothing there)
        path = (
            {}
            if runner == "docker"
            else {"PATH": f"{Path(self.python).parent}:/usr/local/bin:/usr/bin:/bin"}
        )
        home = {"HOME": str(self.root_of(user)), "USER": self._run_as(user), "LANG": "C.UTF-8"}
        return {**path, **home, **own}

    def _probe(
        self, user: str, env: dict[str, str], asked: dict[str, Any]
    ) -> dict[str, Any] | None:
        """Run :mod:`gpubroker.jobs.probe` as ``user`` (the broker's own
        account with :attr:`run_as_self`) with :attr:`python` and ``env``,
        for at most :data:`PROBE_TIMEOUT` seconds; its answer, or ``None``
        (logged) when it cannot run as the user, fails or answers nothing.

        Its output is the user's (it says what her notebook and kernelspecs
        say, and her ``env`` reaches it, ``LD_PRELOAD`` included): at most
        :data:`PROBE_MAX_OUTPUT` bytes of its standard output are read, and
        the last :data:`PROBE_STDERR_TAIL` of its standard error; a longer
        answer is no answer and the probe is killed (trust rule: a user
        cannot fill the broker's memory)."""
        creds: dict[str, Any] = {}
        account = None if self.run_as_self else _account(user)
        if account is not None and account.pw_uid != os.geteuid():
            if os.geteuid() != 0:
                self.log.warning("Jobs: cannot check as %s: the broker is not root", user)
                return None
            creds = {
                "user": account.pw_uid,
                "group": account.pw_gid,
                "extra_groups": os.getgrouplist(account.pw_name, account.pw_gid),
            }
        try:
            proc = subprocess.Popen(
                [self.python, "-I", str(_PROBE)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                cwd="/",
                start_new_session=True,
                **creds,
            )
        except (OSError, ValueError, subprocess.SubprocessError) as err:
            self.log.warning("Jobs: cannot check as %s with %s: %s", user, self.python, err)
            return None
        try:
            out, said = _communicate_bounded(
                proc, json.dumps(asked).encode(), PROBE_TIMEOUT, PROBE_MAX_OUTPUT
            )
        except (subprocess.TimeoutExpired, _TooLong) as err:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal_module.SIGKILL)
            # not communicate(): a process that left the group may hold the pipes
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                with contextlib.suppress(OSError):
                    pipe.close()  # type: ignore[union-attr]
            proc.wait()
            why = (
                f"took over {PROBE_TIMEOUT} s"
                if isinstance(err, subprocess.TimeoutExpired)
                else f"answered over {PROBE_MAX_OUTPUT} bytes"
            )
            self.log.warning("Jobs: the check as %s %s", user, why)
            return None
        try:
            answer = json.loads(out) if proc.returncode == 0 else None
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            tail = said.decode("utf-8", "replace").strip()[-300:]
            self.log.warning(
                "Jobs: the check as %s failed (exit %s): %s", user, proc.returncode, tail
            )
            return None
        return answer

    def _paths_of(self, user: str, spec: model.JobSpec) -> dict[str, Path]:
        if spec.kind == "notebook":
            notebook = self._inside(user, spec.notebook, "notebook")
            if not _is(notebook.is_file, "notebook"):
                raise model.JobError("notebook", f"no such notebook: {echo(spec.notebook)}")
            cwd = self._inside(user, spec.cwd, "cwd") if spec.cwd else notebook.parent
            if not _is(cwd.is_dir, "cwd"):
                raise model.JobError("cwd", f"no such directory: {echo(spec.cwd)}")
            return {"notebook": notebook, "cwd": cwd}
        cwd = self._inside(user, spec.cwd, "cwd") if spec.cwd else self.root_of(user)
        if not _is(cwd.is_dir, "cwd"):
            raise model.JobError("cwd", f"no such directory: {echo(spec.cwd or '~')}")
        return {"cwd": cwd}

    @staticmethod
    def _outputs(
        paths: dict[str, Path], spec: model.JobSpec, job_id: int
    ) -> tuple[Path | None, Path]:
        """The job's output notebook (``None`` for a command job: it has
        none) and its log."""
        if spec.kind == "notebook":
            notebook = paths["notebook"]
            stem = notebook.name[: -len(".ipynb")]
            return notebook.with_name(f"{stem}.{job_id}.ipynb"), notebook.with_name(
                f"{stem}.{job_id}.log"
            )
        return None, paths["cwd"] / f"job-{job_id}.log"

    async def cancel(self, job_id: int, reason: str, actor: str) -> dict[str, Any]:
        """Cancel a job, as ``scancel`` does.

        A queued job leaves the queue (its lease ends) at once. A running
        one is marked as being cancelled and its process stopped (SIGTERM,
        then SIGKILL after :attr:`stop_grace` seconds) on the stop workers;
        the cancel waits at most :attr:`cancel_wait` seconds for that stop:

        * the process ended: the job is ``cancelled`` and its lease released;
        * it still runs (it takes its grace): the job is answered still
          ``running``, with ``stopping`` true and the reason ``being
          cancelled: ...``; it keeps its lease, so its GPUs, until its
          process has ended, and then ends ``cancelled`` (the supervisor);
        * its engine could not stop it (an error, or it survived SIGKILL):
          :class:`Unavailable` (503); the cancel is withdrawn and the job
          keeps running on its GPUs.

        Idempotent: a job that has ended, or is being cancelled, is answered
        as it is. A job the supervisor is acting on (a launch, a preemption's
        requeue) is cancelled once that step is done, from the state it left.

        Args:
            job_id: the job.
            reason: the reason recorded on the job and its lease.
            actor: who cancels (recorded on the lease's release).

        Returns:
            The job's view.

        Raises:
            NotFound: no such job.
            Unavailable: the job's engine is not here, could not stop its
                process within :attr:`cancel_wait` seconds, or cannot tell
                whether a launch of it started (it may run).
        """
        if job_id in self._cancelling:
            return self.get(job_id)
        self._cancelling.add(job_id)  # the supervisor leaves it alone meanwhile
        try:
            while job_id in self._busy:
                await asyncio.sleep(0.05)
            with self.sessions() as session:
                job = self._get(session, job_id)
                state, lease_id, handle = job.state, job.lease_id, _handle(job)
                asked = _cancel_of(job) is not None
            if state in model.FINAL or asked:
                return self.get(job_id)
            intent = self._intent(job_id) if state == model.QUEUED else None
            if intent is not None:  # a launch under way, or whose outcome is unknown
                try:
                    found = await self._launched(job_id, intent)
                except EngineError as err:
                    # it may run: ending it here would give its GPUs away
                    self.log.warning("Job %s: finding launch %s: %s", job_id, intent[1], err)
                    raise Unavailable(
                        f"job {job_id}: whether its launch started cannot be told now ({err}); "
                        "it keeps its GPUs, cancel it again later"
                    ) from None
                if isinstance(found, Handle):  # it runs: stopped as a running job
                    self._started(job_id, found)
                    state, handle = model.RUNNING, found
            if state == model.RUNNING and handle is not None:
                await self._cancel_running(job_id, handle, reason, actor)
                return self.get(job_id)
            self._finish(job_id, model.CANCELLED, reason, None)
        finally:
            self._cancelling.discard(job_id)
        if lease_id is not None:
            self.broker.release_lease(lease_id, reason, actor=actor)
        return self.get(job_id)

    async def _cancel_running(self, job_id: int, handle: Handle, reason: str, actor: str) -> None:
        """Mark a running job as being cancelled, start the stop of its
        process, and wait up to :attr:`cancel_wait` seconds for it (then
        record its end, :meth:`_step`).

        Raises:
            Unavailable: its engine is not here, or the stop failed within the
                wait (the mark is taken back: the job runs on, on its GPUs).
        """
        try:
            self._engine(handle.engine)
        except EngineError as err:
            raise Unavailable(
                f"job {job_id}: its engine cannot stop it: {err}; the job keeps running "
                "and its GPUs"
            ) from None
        self._mark_cancel(job_id, reason, actor)
        try:
            self._begin_stop(job_id, handle)
        except EngineError as err:  # pragma: no cover - the engine was found above
            self._unmark_cancel(job_id)
            raise Unavailable(f"job {job_id}: cannot stop it: {err}") from None
        deadline = time.monotonic() + self.cancel_wait
        while self._stop_in_flight(job_id) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._stop_in_flight(job_id):
            self.log.info(
                "Job %s: its process takes its grace; the cancel answers, the stop goes on",
                job_id,
            )
            return
        with self._stops_lock:
            result = self._stop_results.get(job_id)
        if not isinstance(result, Status) or result.running:
            with self._stops_lock:
                self._stop_results.pop(job_id, None)
            self._unmark_cancel(job_id)
            raise Unavailable(
                f"job {job_id}: its engine could not stop its process now; the job keeps "
                "running and its GPUs, cancel it again later"
            )
        self._busy.add(job_id)
        try:
            await self._step(job_id, model.RUNNING, handle, None)
        finally:
            self._busy.discard(job_id)

    def _mark_cancel(
        self, job_id: int, reason: str, actor: str, ends: str = model.CANCELLED
    ) -> None:
        """Record (committed: it survives a restart) that a running job is
        being cancelled: ``spec["cancel"]`` keeps the reason, the actor, the
        job's reason before and the state it ends in (``ends``:
        ``cancelled``, or ``failed`` for a job the broker ends because it
        can never run); the job's reason says so."""
        with self.sessions.begin() as session:
            job = self._get(session, job_id)
            mark = {"reason": reason, "actor": actor, "was": job.reason, "ends": ends}
            job.spec = {**job.spec, "cancel": mark}
            doing = "being cancelled" if ends == model.CANCELLED else "being stopped"
            job.reason = f"{doing}: {reason}"[:1000]

    def _unmark_cancel(self, job_id: int) -> None:
        """Take back :meth:`_mark_cancel` (the stop failed)."""
        with self.sessions.begin() as session:
            job = self._get(session, job_id)
            mark = _cancel_of(job) or {}
            job.spec = {k: v for k, v in job.spec.items() if k != "cancel"}
            job.reason = str(mark.get("was") or "")

    # --- queries ------------------------------------------------------------------

    def get(self, job_id: int) -> dict[str, Any]:
        """The job's view. Raises NotFound."""
        with self.sessions() as session:
            job = self._get(session, job_id)
            return self._view(job, self._lease(job))

    def owner(self, job_id: int) -> str:
        """The job's user. Raises NotFound."""
        with self.sessions() as session:
            return self._get(session, job_id).user

    def list(self, user: str | None) -> list[dict[str, Any]]:
        """Jobs newest first (only ``user``'s when given), each with its
        lease's ``queue`` and ``devices`` as :meth:`get` shows them
        (:meth:`_leases_of`: no read per job)."""
        with self.sessions() as session:
            jobs = repo.listed(session, user)
            leases = self._leases_of(session, jobs, user)
            return [self._view(job, leases.get(job.lease_id or 0)) for job in jobs]

    def _leases_of(
        self, session: Any, jobs: list[Any], user: str | None
    ) -> dict[int, dict[str, Any]]:
        """The views of the leases of ``jobs`` (all ``user``'s when given)
        by lease id: the pending and granted ones from the broker's memory,
        the released ones (the devices a job ran on) in one read of the
        store for all of them."""
        wanted = {job.lease_id for job in jobs if job.lease_id is not None}
        if not wanted:
            return {}
        views = {x["id"]: x for x in self.broker.list_leases(user) if x["id"] in wanted}
        gone = wanted - views.keys()
        if gone:
            views |= {lease.id: lease_view(lease) for lease in repo.leases(session, gone)}
        return views

    def logs(self, job_id: int, offset: int = 0, limit: int = 1 << 20) -> dict[str, Any]:
        """The job's log from byte ``offset``: ``{"text", "offset" (the
        next), "state"}``; at most ``limit`` bytes, ending at a whole UTF-8
        character (a character cut by the limit comes with the next read).
        Reads the file in the caller's thread: the API uses
        :meth:`logs_off_loop`. Raises NotFound."""
        path, state, user = self._log_of(job_id)
        return _log_view(self._read_log(path, user, offset, limit) if path else b"", offset, state)

    async def logs_off_loop(
        self, job_id: int, offset: int = 0, limit: int = 1 << 20
    ) -> dict[str, Any]:
        """:meth:`logs`, with the file read on the job service's own
        :data:`LOG_READ_WORKERS` workers, never on the event loop (the log is
        in the user's directory: a hung network file system would stop the
        broker) and never on the loop's default workers.

        Raises:
            NotFound: no such job.
            Unavailable: the read took longer than :data:`LOG_READ_TIMEOUT`
                seconds (it goes on in its worker; the broker answers 503).
        """
        path, state, user = self._log_of(job_id)
        if not path:
            return _log_view(b"", offset, state)
        future = self._log_reads.submit(self._read_log, path, user, offset, limit)
        try:
            data = await asyncio.wait_for(asyncio.wrap_future(future), LOG_READ_TIMEOUT)
        except asyncio.TimeoutError:  # not TimeoutError before Python 3.11
            self.log.warning(
                "Reading job %s's log %s took over %ss", job_id, path, LOG_READ_TIMEOUT
            )
            raise Unavailable(
                f"job {job_id}: its log could not be read within {LOG_READ_TIMEOUT:g} s"
                " (its file system may be slow); try again later"
            ) from None
        return _log_view(data, offset, state)

    def _log_of(self, job_id: int) -> tuple[str | None, str, str]:
        """The job's (log path, state, user). Raises NotFound."""
        with self.sessions() as session:
            job = self._get(session, job_id)
            return job.log_path, job.state, job.user

    def close(self) -> None:
        """Stop the job service's workers (checks as users, log reads, stops):
        those not started are dropped; running ones are not waited for here,
        but the process's exit waits for them (Python joins its pool
        workers): a stop under way ends its job's process first, at most
        ``stop_grace`` seconds plus its engine's kill."""
        self._checks.shutdown(wait=False, cancel_futures=True)
        self._log_reads.shutdown(wait=False, cancel_futures=True)
        self._error_reads.shutdown(wait=False, cancel_futures=True)
        self._stoppers.shutdown(wait=False, cancel_futures=True)

    def _read_log(self, path: str, user: str, offset: int, limit: int) -> bytes:
        """The log's bytes, read without following a link at its end and only
        if the job's own user owns the file: the log's path is in the user's
        directory, so the user could put a link to a file of someone else
        there (trust rule). Missing or refused: nothing."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return b""
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            owner = os.getuid() if self.run_as_self else _uid_of(user)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != owner:
                self.log.warning("Job log %s is not a file of %s: not read", path, user)
                return b""
            if offset >= info.st_size:  # nothing there yet (and no seek past a file's limit)
                return b""
            f.seek(max(offset, 0))
            return f.read(limit)

    @staticmethod
    def _get(session: Any, job_id: int) -> Any:
        job = repo.get(session, job_id)
        if job is None:
            raise NotFound(f"job {job_id}: no such job")
        return job

    def _lease(self, job: Any) -> dict[str, Any] | None:
        if job.lease_id is None:
            return None
        try:
            return dict(self.broker.get_lease(job.lease_id))
        except NotFound:
            return None

    def _view(self, job: Any, lease: dict[str, Any] | None) -> dict[str, Any]:
        view = {
            "id": job.id,
            "user": job.user,
            "kind": job.kind,
            "state": job.state,
            "reason": job.reason,
            "spec": job.spec,
            "lease_id": job.lease_id,
            "created": isoformat(job.created),
            "started_at": isoformat(job.started_at),
            "ended_at": isoformat(job.ended_at),
            "exit_code": job.exit_code,
            "signal": job.signal,
            # a command job has no output notebook (those submitted before
            # this was so have "." stored)
            "output": (job.output_path or None) if job.kind == "notebook" else None,
            "log": job.log_path or None,
            "restarts": job.restarts,
            "warned_at": isoformat(job.warned_at),
            # while running: what holds it in its engine before its program
            # starts (a Slurm job PENDING for Resources), else null
            "engine_wait": (job.spec.get("engine_wait") or None)
            if job.state == model.RUNNING
            else None,
            # its process is being stopped (a cancel, or its lease ends): it
            # keeps its lease and GPUs until the process has ended
            "stopping": job.state == model.RUNNING
            and (_cancel_of(job) is not None or self._open_stop(job.lease_id) is not None),
        }
        if lease is not None:
            view["queue"] = lease.get("queue")
            view["devices"] = [d["uuid"] for d in lease.get("slots") or []]
        return view

    # --- supervision --------------------------------------------------------------

    async def run(self) -> None:
        """Release orphaned job leases, then check jobs every
        ``poll_interval`` seconds (and as soon as a stop of a job's process
        ends) until cancelled."""
        try:
            self.release_orphans()
        except Exception:
            self.log.exception("Jobs: releasing orphaned job leases failed")
        wake = asyncio.Event()
        self._wake = (asyncio.get_running_loop(), wake)
        try:
            while True:
                try:
                    await self.tick()
                except Exception:
                    self.log.exception("Jobs: a check failed")
                # the next round: after poll_interval, or sooner when a stop ends
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(wake.wait(), self.poll_interval)
                wake.clear()
        finally:
            self._wake = None

    def release_orphans(self) -> list[int]:
        """Release the active job leases no unfinished job holds (a broker
        that crashed between making a job's lease and recording it). Run at
        start-up, before any submission. Returns their ids."""
        with self.sessions() as session:
            held = {j.lease_id for j in repo.unfinished(session)}
        orphans = [
            x["id"]
            for x in self.broker.list_leases()
            if x["holder_kind"] == "job" and x["id"] not in held
        ]
        for lease_id in orphans:
            why = "no job holds this lease (the broker stopped while submitting it)"
            self.broker.release_lease(lease_id, why, actor="broker")
            self.log.warning("Jobs: released orphaned job lease %s", lease_id)
        return orphans

    async def tick(self) -> int:
        """Start the queued jobs whose lease is granted, warn and record the
        ends of running ones, cancel queued jobs whose lease ended, and start
        the stops of running jobs whose lease ends or that are cancelled.
        Engine calls run in worker threads; a stop (up to
        :attr:`stop_grace` seconds) runs on the stop workers and is not
        waited for: its end is recorded at a later round. A job whose step
        fails is logged and tried again next round; the jobs after it are
        still checked. Returns how many jobs changed."""
        with self.sessions() as session:
            pending = [
                (j.id, j.state, _handle(j))
                for j in repo.unfinished(session)
                if not self._held(j.id)
            ]
        running = [h for _, state, h in pending if state == model.RUNNING and h is not None]
        polled = await self._poll_together(running)
        changed = 0
        for job_id, state, handle in pending:
            if self._held(job_id):  # a cancel, or a stop began meanwhile
                continue
            self._busy.add(job_id)  # a cancel waits for this step
            try:
                found = polled.get((handle.engine, handle.id)) if handle is not None else None
                changed += await self._step(job_id, state, handle, found)
            except Exception:
                # one job's failure (an engine that does not answer, a record
                # the store refuses) is that job's: the others go on, and
                # its step is tried again at the next round
                self.log.exception("Jobs: the check of job %s failed; tried again", job_id)
            finally:
                self._busy.discard(job_id)
        return changed

    def _held(self, job_id: int) -> bool:
        """Whether the supervisor leaves the job alone now: a cancel or one
        of its steps is under way, or a stop of its process."""
        return job_id in self._cancelling or job_id in self._busy or self._stop_in_flight(job_id)

    async def _step(
        self,
        job_id: int,
        state: str,
        handle: Handle | None,
        polled: Status | EngineError | None,
    ) -> int:
        """One check of a job found ``state`` (:meth:`_tick_queued`,
        :meth:`_tick_running`); nothing when it changed meanwhile.
        Returns 1 when the job changed, else 0."""
        with self.sessions() as session:
            job = self._get(session, job_id)
            if job.state != state:  # a cancel ended it meanwhile
                return 0
            lease_id, watch = job.lease_id, _Watch.of(job)
        lease = self.broker.get_lease(lease_id) if lease_id is not None else None
        if state == model.QUEUED:
            return await self._tick_queued(job_id, lease)
        if state == model.RUNNING and handle is not None:
            return await self._tick_running(job_id, lease, handle, watch, polled)
        return 0

    async def _poll_together(
        self, handles: list[Handle]
    ) -> dict[tuple[str, str], Status | EngineError]:
        """The statuses of running jobs on engines that read many at once
        (Slurm: one ``squeue`` for all, not one per job), by (engine, id);
        an engine that cannot say gives each of its jobs the error. Jobs of
        other engines are not in the result (polled one by one)."""
        found: dict[tuple[str, str], Status | EngineError] = {}
        loop = asyncio.get_running_loop()
        for name in sorted({h.engine for h in handles}):
            engine = self.engines.get(name)
            poll_many = getattr(engine, "poll_many", None)
            if poll_many is None:
                continue
            mine = [h for h in handles if h.engine == name]
            try:
                statuses = await loop.run_in_executor(None, poll_many, mine)
            except EngineError as err:
                found.update({(name, h.id): err for h in mine})
                continue
            found.update({(name, h.id): statuses[h.id] for h in mine if h.id in statuses})
        return found

    async def _tick_queued(self, job_id: int, lease: dict[str, Any] | None) -> int:
        """Start a queued job whose lease is granted, or cancel one whose
        lease ended. A launch is made idempotent across a broker crash by
        its *intent*, recorded before the engine is called: a job found
        queued with one was being launched when the broker stopped, so its
        engine is asked first whether that launch happened
        (:meth:`_launched`): its process is adopted (or stopped, when the
        lease ended meanwhile), or its recorded end taken, and it is started
        only when it never was."""
        granted = lease is not None and lease["state"] == "granted"
        ended = lease is None or lease["state"] == "released"
        # a granted lease the broker is ending (its time limit, a preemption's
        # end, an admin's release) starts nothing: it is released at once
        stopping = self._open_stop(lease["id"] if granted and lease else None)
        intent = self._intent(job_id)
        if intent is not None and (granted or ended):
            try:
                self._engine(intent[0])
            except EngineError as err:  # its runner is gone from this broker
                self._finish(job_id, model.FAILED, f"could not start: {err}", None)
                if granted:
                    assert lease is not None
                    self.broker.release_lease(
                        lease["id"], f"job {job_id} could not start", actor="broker"
                    )
                return 1
            try:
                found = await self._launched(job_id, intent)
            except EngineError as err:  # not known now (Docker, Slurm down): next time
                self.log.warning(
                    "Job %s: cannot tell whether launch %s happened: %s", job_id, intent[1], err
                )
                return 0
            if isinstance(found, Handle) and granted:
                self.log.warning(
                    "Job %s: adopted the process of launch %s (%s %s), started before the "
                    "broker stopped",
                    job_id,
                    intent[1],
                    found.engine,
                    found.id,
                )
                self._started(job_id, found)
                return 1
            if isinstance(found, Handle):  # its lease ended meanwhile: so does it
                status = await self._stop_quietly(job_id, found)
                why = (lease or {}).get("release_reason") or "its lease ended"
                self._finish(job_id, model.CANCELLED, f"cancelled in the queue: {why}", status)
                return 1
            if found is not None:  # it ran and ended while the broker was away
                self.log.warning(
                    "Job %s: launch %s ended before the broker saw it", job_id, intent[1]
                )
                handle = Handle(intent[0], "", "")
                self._started(job_id, handle)
                with self.sessions() as session:
                    watch = _Watch.of(self._get(session, job_id))
                return await self._tick_running(job_id, lease, handle, watch, found)
        if granted and stopping is None:
            assert lease is not None
            try:
                self._refuse_account(self._owner_of(job_id))  # queued before min_uid was raised
                runner, tag = intent or await self._intend(job_id)
                spec = self._launch_spec(job_id, lease, runner, tag)
                handle = await asyncio.get_running_loop().run_in_executor(
                    None,
                    _launch_if_there,
                    self._engine(runner).launch,
                    spec,
                    self._notebook(job_id),
                    self.root_of(self.owner(job_id)),
                )
            except LaunchUnknown as err:
                # it may run: its launch intent stays, and the next check
                # asks its engine again (_launched) before launching anew
                self.log.warning("Job %s: %s; asked again at the next check", job_id, err)
                return 0
            except EngineError as err:
                self._finish(job_id, model.FAILED, f"could not start: {err}", None)
                why = f"job {job_id} could not start"
                self.broker.release_lease(lease["id"], why, actor="broker")
            else:
                self._started(job_id, handle)
            return 1
        if stopping is not None:
            assert lease is not None
            cause, why = self._end_cause(job_id, lease)
            self.broker.release_lease(lease["id"], why, actor="broker")
            if cause == "preemption" and self._restarts_left(job_id, True):
                # preempted before it started: queued again, as a running job is
                self._requeue(job_id, why, None)
            else:
                self._finish(job_id, model.CANCELLED, f"cancelled in the queue: {why}", None)
            return 1
        if ended:
            why = (lease or {}).get("release_reason") or "its lease ended"
            self._finish(job_id, model.CANCELLED, f"cancelled in the queue: {why}", None)
            return 1
        return 0

    def _notebook(self, job_id: int) -> Path | None:
        """The input notebook of a notebook job (``None``: a command job)."""
        with self.sessions() as session:
            job = self._get(session, job_id)
            user, kind, relative = job.user, job.kind, str(job.spec.get("notebook") or "")
        return self.root_of(user) / relative if kind == "notebook" else None

    def _owner_of(self, job_id: int) -> str:
        """The account a job runs as (its user's, or the broker's own)."""
        return self._run_as(self.owner(job_id))

    def _intent(self, job_id: int) -> tuple[str, str] | None:
        """The launch intent recorded for a queued job: (runner, tag), or
        ``None`` when no launch was under way."""
        with self.sessions() as session:
            job = self._get(session, job_id)
            if job.handle_id.startswith(_INTENT):
                return job.handle_engine, job.handle_id[len(_INTENT) :]
        return None

    async def _intend(self, job_id: int) -> tuple[str, str]:
        """Record, before anything is launched, that the job is about to be
        launched by :attr:`runner` with a new tag (committed: it survives a
        crash during the launch); the run before a requeue's warning and
        exit files are removed first, off the event loop (the user's folder
        may hang: a stale NFS mount), so those found later are this
        launch's. Returns (runner, tag)."""
        with self.sessions() as session:
            job = self._get(session, job_id)
            user, log, restarts = job.user, job.log_path, job.restarts

        def clear() -> None:
            root = self.root_of(user)
            _unlink(root, _warn_file(log))  # a run before a requeue was warned: not this one
            _unlink(root, f"{log}.exit")  # nor did this one end
            _unlink(root, f"{log}.error")  # nor fail

        await asyncio.get_running_loop().run_in_executor(None, clear)
        tag = f"job{job_id}-{restarts}-{secrets.token_hex(4)}"
        with self.sessions.begin() as session:
            job = self._get(session, job_id)
            job.handle_engine, job.handle_id, job.handle_node = self.runner, _INTENT + tag, ""
        return self.runner, tag

    async def _launched(self, job_id: int, intent: tuple[str, str]) -> Handle | Status | None:
        """What became of the launch ``intent`` (runner, tag) of a queued job:
        the handle of its process where its engine finds it (running, or
        ended but still known); else, where the job's shell recorded its
        start beside the log, how it ended (``exited`` with the recorded
        code, ``lost`` without one); else ``None``: it never started.

        Raises:
            EngineError: its engine cannot tell now.
        """
        runner, tag = intent
        engine = self._engine(runner)
        find = getattr(engine, "find", None)
        if find is None:  # an engine that cannot find launches: as before
            self.log.warning("Job %s: the %s engine cannot find launch %s", job_id, runner, tag)
            return None
        user = self._owner_of(job_id)
        handle: Handle | None = await asyncio.get_running_loop().run_in_executor(
            None, find, tag, user
        )
        if handle is not None:
            return handle
        with self.sessions() as session:
            log = self._get(session, job_id).log_path
        record = (
            await asyncio.get_running_loop().run_in_executor(
                None, _exit_record, f"{log}.exit", _uid_of(user)
            )
            if log
            else None
        )
        if record is None:
            return None
        return _exit_status(record) or Status("lost")

    async def _stop_quietly(self, job_id: int, handle: Handle) -> Status | None:
        """Stop a job's process (SIGTERM, SIGKILL after ``stop_grace``) in a
        worker thread; its final status, or ``None`` (logged) on an error."""
        loop = asyncio.get_running_loop()
        try:
            status: Status = await loop.run_in_executor(
                None, self._engine(handle.engine).stop, handle, self.stop_grace
            )
        except EngineError as err:
            self.log.warning("Job %s: stopping its process: %s", job_id, err)
            return None
        return status

    async def _tick_running(
        self,
        job_id: int,
        lease: dict[str, Any] | None,
        handle: Handle,
        watch: _Watch,
        polled: Status | EngineError | None = None,
    ) -> int:
        """Check a running job: record its end once its process has ended
        (:meth:`_ended`); while it runs, warn it and record where its engine
        bound it, or, when it is to stop (it is being cancelled, or its
        lease ends: :meth:`_stop_reason`), start the stop of its process
        (:meth:`_begin_stop`, not waited for). A stop that failed is logged
        and started again: the job keeps its lease, so its GPUs, until its
        process has ended. Returns 1 when the job changed, else 0."""
        stopped = self._take_stop(job_id)
        if isinstance(stopped, Status) and not stopped.running:
            return self._ended(job_id, lease, stopped, stopped=True)
        if stopped is not None:
            why = stopped if isinstance(stopped, str) else "it still runs after SIGKILL"
            self.log.warning(
                "Job %s: its process could not be stopped (%s); tried again", job_id, why
            )
        loop = asyncio.get_running_loop()
        try:
            if isinstance(polled, EngineError):
                raise polled
            engine = self._engine(handle.engine)
            status: Status = (
                polled
                if polled is not None
                else await loop.run_in_executor(None, engine.poll, handle)
            )
        except EngineError as err:  # its engine cannot tell now (Docker down): next time
            self.log.warning("Job %s: cannot read its process: %s", job_id, err)
            return 0
        if not status.running:
            why = await self._error_of(job_id) if status.exit_code not in (None, 0) else ""
            return self._ended(job_id, lease, status, stopped=False, why=why)
        stop_why = self._stop_reason(job_id, lease)
        if stop_why is None and status.never_starts:
            return await self._never_starts(job_id, handle)
        if status.waiting != watch.engine_wait:
            self._note_engine_wait(job_id, status.waiting)
        if stop_why is None:
            assert lease is not None
            self._rebind(job_id, lease, status.devices)
            if not status.waiting:  # a job its engine has not started has nothing to warn
                await self._maybe_warn(job_id, lease, handle, watch)
            return 0
        try:
            self._begin_stop(job_id, handle)
        except EngineError as err:  # its runner is gone from this broker: next time
            self.log.warning("Job %s: cannot stop its process (%s): %s", job_id, stop_why, err)
        return 0

    def _note_engine_wait(self, job_id: int, waiting: str) -> None:
        """Keep what holds a running job in its engine before its program
        starts (``Status.waiting``: Slurm's ``PENDING (Resources)``) in
        ``spec["engine_wait"]``, shown as the view's ``engine_wait``
        (the caller writes only a change: :attr:`_Watch.engine_wait`), and
        drop it once it has started."""
        with self.sessions.begin() as session:
            job = self._get(session, job_id)
            spec = {k: v for k, v in job.spec.items() if k != "engine_wait"}
            job.spec = {**spec, "engine_wait": waiting} if waiting else spec

    async def _never_starts(self, job_id: int, handle: Handle) -> int:
        """A job its engine says will never start (Slurm holds it pending
        for a partition's time limit, an account or QOS it may not use):
        asked once more (it may have started since the round's poll), it is
        stopped and ends ``failed``, saying why, as a spawn does (its lease
        stays granted until its engine has let it go). Returns 1 when it
        is being stopped, else 0."""
        loop = asyncio.get_running_loop()
        try:
            status = await loop.run_in_executor(None, self._engine(handle.engine).poll, handle)
        except EngineError as err:
            self.log.warning("Job %s: cannot read its process: %s", job_id, err)
            return 0
        if not (status.running and status.never_starts):
            return 0  # started (or ended) meanwhile: the next round sees it
        reason = (
            f"its engine will never start it: {status.waiting}; ask your administrator "
            "(partition, account, QOS, time limit)"
        )
        self.log.warning("Job %s: %s", job_id, reason)
        self._mark_cancel(job_id, reason, "broker", ends=model.FAILED)
        try:
            self._begin_stop(job_id, handle)
        except EngineError as err:  # its runner is gone from this broker: next time
            self.log.warning("Job %s: cannot stop its process: %s", job_id, err)
        return 1

    def _stop_reason(self, job_id: int, lease: dict[str, Any] | None) -> str | None:
        """Why a running job's process is to be stopped: it is being
        cancelled, or its lease is ending (the broker's open stop: a time
        limit, a preemption's end, an admin's release) or has ended; ``None``
        while it may run on."""
        with self.sessions() as session:
            mark = _cancel_of(self._get(session, job_id))
        if mark is not None:
            return f"being cancelled: {mark.get('reason')}"
        if lease is None or lease["state"] != "granted":
            return str((lease or {}).get("release_reason") or "its lease ended")
        return self._open_stop(lease["id"])

    def _end_cause(self, job_id: int, lease: dict[str, Any] | None) -> tuple[str, str]:
        """Why the job's lease ends or ended: (cause, reason in words). The
        cause is the broker's record (``preemption``, ``time-limit``,
        ``release``, ``cull``, ``reconcile``): the open stop's, else the
        release event's (:func:`gpubroker.usage.intervals.event_cause`);
        ``release`` when neither says."""
        if lease is None:
            return "release", "its lease ended"
        intent = self.broker.stops.open_stop(lease["id"])
        if intent is not None:
            return intent.cause or "release", str(intent.reason or "its lease ends")
        why = str(lease.get("release_reason") or "its lease ended")
        try:
            events = self.broker.lease_events(lease["id"])
        except BrokerError as err:
            self.log.warning("Job %s: cannot read how lease %s ended: %s", job_id, lease["id"], err)
            return "release", why
        for event in reversed(events):
            if event.get("to") == "released":
                detail = event.get("detail") or {}
                cause = event_cause(
                    detail,
                    str(event.get("reason") or ""),
                    str(event.get("actor") or ""),
                    event.get("from"),
                )
                return cause, why
        return "release", why

    def _open_stop(self, lease_id: int | None) -> str | None:
        """The reason of the broker's open stop of lease ``lease_id`` (it is
        being ended: its holder is stopped first), or ``None``."""
        intent = self.broker.stops.open_stop(lease_id) if lease_id is not None else None
        return None if intent is None else str(intent.reason or "its lease ends")

    async def _error_of(self, job_id: int) -> str:
        """The line the job's run wrote to say why it failed (its error
        file, ``$GPUBROKER_JOB_ERROR_FILE``: :func:`_error_record`), read
        on a worker of its own within :data:`ERROR_READ_TIMEOUT` seconds
        (the supervisor's round waits for it); ``""`` when there is none,
        it cannot be read in time, or an earlier read still hangs (then
        it is not tried: the round never waits on a hung file system
        twice)."""
        path, _state, user = self._log_of(job_id)
        if not path:
            return ""
        if self._error_read is not None and not self._error_read.done():
            self.log.warning("Job %s: its error file is not read (an earlier read hangs)", job_id)
            return ""
        owner = os.getuid() if self.run_as_self else _uid_of(user)
        future = self._error_reads.submit(_error_record, f"{path}.error", owner)
        self._error_read = future
        try:
            return await asyncio.wait_for(
                asyncio.shield(asyncio.wrap_future(future)), ERROR_READ_TIMEOUT
            )
        except asyncio.TimeoutError:
            self.log.warning(
                "Job %s: its error file took over %ss to read", job_id, ERROR_READ_TIMEOUT
            )
            return ""

    def _ended(
        self,
        job_id: int,
        lease: dict[str, Any] | None,
        status: Status,
        stopped: bool,
        why: str = "",
    ) -> int:
        """Record the end of a job's process and release its lease (its
        devices are free only now); ``stopped``: a stop of this service
        ended it; ``why``: the line its run wrote to say why it failed
        (:meth:`_error_of`; ``""``: none), added to its reason.

        * a job being cancelled ends ``cancelled``;
        * one whose lease the broker is ending (an open stop), or whose
          lease ended and that this service stopped: queued again after a
          preemption while it has restarts left, else ``timed-out`` at its
          time limit and ``failed`` otherwise ("its lease ended: ...");
        * else its own outcome (:func:`gpubroker.model.jobs.outcome`): a
          preempted job that ended itself in its grace period is queued
          again (or fails with no restarts left), a failure is retried
          while the job has retries left.

        Returns 1 (the job changed)."""
        if status.state == "lost":
            status = _recorded(status, job_id, self.sessions, _uid_of(self._owner_of(job_id)))
        granted = lease is not None and lease["state"] == "granted"
        with self.sessions() as session:
            mark = _cancel_of(self._get(session, job_id))
        if mark is not None:
            reason = str(mark.get("reason") or "cancelled")
            ends = model.FAILED if mark.get("ends") == model.FAILED else model.CANCELLED
            self._finish(job_id, ends, reason, status)
            if granted:
                assert lease is not None
                actor = str(mark.get("actor") or "broker")
                self.broker.release_lease(lease["id"], reason, actor=actor)
            return 1
        closing = self._open_stop(lease["id"]) if granted and lease else None
        if stopped and (closing is not None or not granted):
            # this service stopped it because its lease ends (or ended): judged
            # by why the lease ends, as the broker recorded it (its cause,
            # never the words of whoever released it). A process that ended by
            # itself first is judged by its own outcome, below.
            cause, why = self._end_cause(job_id, lease)
            if granted:
                assert lease is not None
                self.broker.release_lease(lease["id"], f"job {job_id} stopped", actor="broker")
            if cause == "preemption" and self._restarts_left(job_id, True):
                self._requeue(job_id, why, status)
                return 1
            # the lease's time limit runs from its grant: it may end first
            ended = model.TIMED_OUT if cause == "time-limit" else model.FAILED
            self._finish(job_id, ended, f"its lease ended: {why}", status)
            return 1
        lost = status.state == "lost"
        state_now = model.outcome(status.exit_code, status.signal, status.timed_out, lost)
        preempted = granted and (lease or {}).get("preemption")
        ended_itself = state_now not in (model.SUCCEEDED, model.TIMED_OUT)
        if preempted and ended_itself:
            # it ended in its grace period (on the warning, checkpointed): run
            # it again, or, with no restarts left, end it as a stop would
            assert lease is not None
            why = str(lease["preemption"].get("reason") or "preempted")
            self.broker.release_lease(lease["id"], f"job {job_id} {why}", actor="broker")
            if self._restarts_left(job_id, True):
                self._requeue(job_id, why, status)
            else:
                self._finish(job_id, model.FAILED, f"its lease ended: {why}", status)
            return 1
        if granted:
            assert lease is not None
            self.broker.release_lease(lease["id"], f"job {job_id} {state_now}", actor="broker")
        if state_now == model.FAILED and self._restarts_left(job_id, False):
            said = _describe(state_now, status, why)
            self._requeue(job_id, f"retried: {said}", status, retry=True)
        else:
            self._finish(job_id, state_now, _describe(state_now, status, why), status)
        return 1

    # --- stops of job processes, off the supervisor's round ---------------------------

    def _begin_stop(self, job_id: int, handle: Handle) -> None:
        """Start stopping the job's process (SIGTERM, SIGKILL after
        :attr:`stop_grace` seconds: its engine's ``stop``) on a stop worker,
        unless a stop of it is under way. Its end (the final status, or why
        it failed) is kept for the job's next check (:meth:`_take_stop`),
        and wakes the supervisor (:meth:`run`).

        Raises:
            EngineError: the job's runner has no engine here.
        """
        engine = self._engine(handle.engine)
        with self._stops_lock:
            if job_id in self._stop_futures:
                return
            self._stop_results.pop(job_id, None)
            future = self._stoppers.submit(engine.stop, handle, self.stop_grace)
            self._stop_futures[job_id] = future
        self.log.info(
            "Job %s: stopping its process (%s %s), grace %ss",
            job_id,
            handle.engine,
            handle.id,
            self.stop_grace,
        )
        future.add_done_callback(functools.partial(self._stop_done, job_id))

    def _stop_done(self, job_id: int, future: concurrent.futures.Future[Status]) -> None:
        """Keep the end of a job's stop (called in the worker that ran it, or
        where it was dropped) and wake the supervisor."""
        result: Status | str
        try:
            result = future.result()
        except concurrent.futures.CancelledError:
            result = "the stop was dropped (the job service closed)"
        except EngineError as err:
            result = str(err) or type(err).__name__
        except Exception as err:  # an engine's bug: logged, the stop is tried again
            self.log.exception("Job %s: stopping its process failed", job_id)
            result = f"{type(err).__name__}: {err}"
        with self._stops_lock:
            self._stop_futures.pop(job_id, None)
            self._stop_results[job_id] = result
        wake = self._wake
        if wake is not None:
            with contextlib.suppress(RuntimeError):  # its loop closed
                wake[0].call_soon_threadsafe(wake[1].set)

    def _stop_in_flight(self, job_id: int) -> bool:
        """Whether a stop of the job's process is under way."""
        with self._stops_lock:
            return job_id in self._stop_futures

    def _take_stop(self, job_id: int) -> Status | str | None:
        """The end of the job's last stop not recorded yet (its final status,
        or why it failed), or ``None``; taken: a second call gives ``None``."""
        with self._stops_lock:
            return self._stop_results.pop(job_id, None)

    def _rebind(self, job_id: int, lease: dict[str, Any], bound: tuple[str, ...]) -> None:
        """Record on the lease the devices its engine bound the job to, where
        they are not the ones the lease holds (Slurm picks the GPU indices)."""
        held = [d["uuid"] for d in lease.get("slots") or []]
        self.rebinder.apply(lease["id"], held, bound, f"job {job_id}")

    async def _maybe_warn(
        self, job_id: int, lease: dict[str, Any], handle: Handle, watch: _Watch
    ) -> None:
        """Warn a job once, ``warn_before`` seconds before its time limit,
        or when a preemption's grace period starts: a command job's
        processes get the warning signal; a notebook job's kernel is
        interrupted (its runner, :mod:`gpubroker.jobs.nbrun`, sees the
        warning file appear), so the running cell gets ``KeyboardInterrupt``."""
        now = dt.datetime.now(dt.timezone.utc)
        warned, started, limit = watch.warned_at, watch.started_at, watch.time_limit
        if warned is not None:
            return
        # a limit shorter than the warning gets none (it would come at the start)
        near = limit is not None and started is not None and limit > self.warn_before
        near = near and (now - started).total_seconds() >= limit - self.warn_before
        preempting = bool(lease.get("preemption"))
        if not (near or preempting):
            return
        signum = int(getattr(signal_module, self.warn_signal))
        loop = asyncio.get_running_loop()
        try:
            if watch.kind == "command":
                await loop.run_in_executor(None, self._engine(handle.engine).signal, handle, signum)
            else:  # its runner interrupts the kernel (gpubroker/jobs/nbrun.py)
                root = self.root_of(watch.user)
                await loop.run_in_executor(None, _flag, root, _warn_file(watch.log))
        except (EngineError, OSError) as err:
            self.log.warning("Job %s: warning: %s", job_id, err)
        with self.sessions.begin() as session:
            self._get(session, job_id).warned_at = now
        why = "its lease is being preempted" if preempting else "its time limit is near"
        warned = (
            f"got {self.warn_signal}" if watch.kind == "command" else "had its kernel interrupted"
        )
        message = f"job {job_id} {warned}: {why}"
        self.broker.note_lease(lease["id"], "job-warned", message, {"job": job_id})

    def _restarts_left(self, job_id: int, preempted: bool) -> bool:
        """Whether the job may run again: after a preemption up to
        ``max_restarts`` preemptions, after a failure up to its ``retries``
        failures (each counted apart: ``jobs.retried``)."""
        with self.sessions() as session:
            job = self._get(session, job_id)
            if preempted:
                return bool(job.restarts - job.retried < self.max_restarts)
            return bool(job.retried < int(job.spec.get("retries") or 0))

    def _requeue(self, job_id: int, reason: str, status: Any, retry: bool = False) -> None:
        """Queue the job again on a new lease of the same shape, charged by
        the groups it had at its submission; ``retry``: after a failure
        (counted in ``jobs.retried``), else after a preemption."""
        with self.sessions() as session:
            job = self._get(session, job_id)
            user, asked, old = job.user, dict(job.spec.get("lease") or {}), job.lease_id
            limit, groups = job.spec.get("time_limit"), job.spec.get("groups")
        try:
            lease = self.broker.request_lease(
                user,
                "",
                holder_kind="job",
                time_limit=limit,
                groups=groups,
                actor="broker",
                **asked,
            )
        except BrokerError as err:
            self._finish(job_id, model.FAILED, f"{reason}; could not queue again: {err}", status)
            return
        with self.sessions.begin() as session:
            job = self._get(session, job_id)
            model.check_transition(job.state, model.QUEUED)
            job.state, job.reason, job.lease_id = model.QUEUED, reason, lease["id"]
            job.restarts += 1
            job.retried += int(retry)
            job.warned_at = job.started_at = None
            job.handle_engine = job.handle_id = job.handle_node = ""
            if status is not None:
                job.exit_code, job.signal = status.exit_code, status.signal
            restarts = job.restarts
        self.log.info(
            "Job %s queued again on lease %s (%s): %s", job_id, lease["id"], restarts, reason
        )
        if old is not None:
            detail = {"job": job_id, "lease": lease["id"], "restarts": restarts}
            message = f"job {job_id} queued again: {reason}"
            self.broker.note_lease(old, "job-requeued", message, detail)

    def _launch_spec(self, job_id: int, lease: dict[str, Any], runner: str, tag: str) -> LaunchSpec:
        """What the engine of ``runner`` starts for the job on ``lease``,
        tagged ``tag`` (its launch intent)."""
        with self.sessions() as session:
            job = self._get(session, job_id)
            spec, user, output, log = dict(job.spec), job.user, job.output_path, job.log_path
            restarts = job.restarts
        root = self.root_of(user)
        run_as = self._run_as(user)
        env = {
            **self._base_env(user, spec["env"], runner),
            **lease["env"],
            **_pythonpath(spec["env"], lease["env"]),
            "GPUBROKER_JOB_ID": str(job_id),
            "GPUBROKER_RESTART_COUNT": str(restarts),
            "GPUBROKER_CHECKPOINT_DIR": str(root / ".gpubroker" / "checkpoints" / str(job_id)),
        }
        if spec["kind"] == "notebook":
            notebook = root / spec["notebook"]
            cwd = root / spec["cwd"] if spec["cwd"] else notebook.parent
            python, nbrun = (self.python, str(_NBRUN))
            if runner == "docker":  # the image's Python, the runner mounted
                from ..engines.docker import NBRUN_PATH

                python, nbrun = self._engine("docker").python, NBRUN_PATH
            argv = [
                python,
                nbrun,  # papermill, interrupted on a warning
                str(notebook),
                output,
                "--log-output",
                "--no-progress-bar",
            ]
            # papermill reads -y as YAML 1.1, where JSON's 1e-05 is a string:
            # PyYAML writes floats so that they read back as floats (1.0e-05)
            argv += ["--cwd", str(cwd), "-y", yaml.safe_dump(spec["params"], sort_keys=False)]
            if spec["kernel"]:
                argv += ["-k", spec["kernel"]]
            elif spec.get("python") and runner == "local":  # nbrun makes a kernel of it
                env["GPUBROKER_KERNEL_PYTHON"] = spec["python"]
            if spec.get("language"):  # the notebook's metadata has none
                argv += ["--language", spec["language"]]
        else:
            cwd = root / spec["cwd"] if spec["cwd"] else root
            argv = list(spec["command"])
        # the shell records the exit code beside the log, so a broker restarted
        # after the job ended still learns its real outcome
        env["GPUBROKER_JOB_EXIT_FILE"] = f"{log}.exit"
        # why it failed, in one line (nbrun writes papermill's error there;
        # a command may write its own): added to a failed job's reason
        env["GPUBROKER_JOB_ERROR_FILE"] = f"{log}.error"
        env["GPUBROKER_WARN_SIGNAL"] = self.warn_signal.removeprefix("SIG")
        env["GPUBROKER_WARN_FILE"] = _warn_file(log)
        argv = ["/bin/sh", "-c", _RECORD_EXIT, "gpubroker-job", *argv]
        return LaunchSpec(
            argv=tuple(argv),
            env=env,
            cwd=str(cwd),
            user=run_as,
            lease_id=int(lease["id"]),
            devices=tuple(d["uuid"] for d in lease.get("slots") or []),
            time_limit=spec["time_limit"],
            stdout=log,
            stderr=log,
            home=str(root),
            tag=tag,
        )

    def _started(self, job_id: int, handle: Handle) -> None:
        now = dt.datetime.now(dt.timezone.utc)
        with self.sessions.begin() as session:
            job = self._get(session, job_id)
            model.check_transition(job.state, model.RUNNING)
            job.state, job.started_at = model.RUNNING, now
            job.handle_engine, job.handle_id, job.handle_node = (
                handle.engine,
                handle.id,
                handle.node,
            )
            lease_id, user = job.lease_id, job.user
        self.log.info("Job %s of %s started (%s %s)", job_id, user, handle.engine, handle.id)
        self.broker.note_lease(lease_id, "job-started", f"job {job_id} started", {"job": job_id})

    def _finish(self, job_id: int, state: str, reason: str, status: Any) -> None:
        now = dt.datetime.now(dt.timezone.utc)
        with self.sessions.begin() as session:
            job = self._get(session, job_id)
            if job.state in model.FINAL:
                return
            model.check_transition(job.state, state)
            job.state, job.reason, job.ended_at = state, reason, now
            if status is not None:
                job.exit_code, job.signal = status.exit_code, status.signal
            lease_id, user = job.lease_id, job.user
            detail = {
                "job": job_id,
                "state": state,
                "exit_code": job.exit_code,
                "signal": job.signal,
            }
        self.log.info("Job %s of %s %s: %s", job_id, user, state, reason)
        if lease_id is not None:  # the owner is told (GET /notices, %gpu)
            message = f"job {job_id} {state}: {reason}"
            self.broker.note_lease(lease_id, "job-ended", message, detail, notify=True)


#: the job's shell: run the program, write its exit code, exit with it
#: the runners of jobs (``JobService.runner``)
RUNNERS = ("local", "docker", "slurm")

#: the notebook jobs' runner script (papermill, interrupted on a warning)
_NBRUN = Path(__file__).with_name("nbrun.py")

#: the script that checks a notebook job with its user's rights at submit
_PROBE = Path(__file__).with_name("probe.py")

#: seconds the check as the user may take (Python and jupyter_client start)
PROBE_TIMEOUT = 20.0

#: most bytes of the probe's standard output the broker reads (it is the
#: user's: a longer answer is none)
PROBE_MAX_OUTPUT = 1 << 20

#: bytes kept of the end of the probe's standard error (for the log)
PROBE_STDERR_TAIL = 4096

#: workers of the checks as users (:meth:`JobService.check_off_loop`)
CHECK_WORKERS = 4

#: most checks of one user's jobs under way at once (more: 409)
MAX_CHECKS_PER_USER = 2

#: workers of the job log reads (:meth:`JobService.logs_off_loop`)
LOG_READ_WORKERS = 2

#: seconds a job log read may take before the API answers 503
LOG_READ_TIMEOUT = 10.0

#: stops of job processes under way at once (:meth:`JobService._begin_stop`);
#: each holds a worker for up to ``JobService.stop_grace`` seconds
STOP_WORKERS = 8

#: what a launch intent's handle id starts with (then its tag)
_INTENT = "launch:"

_RECORD_EXIT = (
    # the shell outlives the warning signal and SIGTERM (its program gets them
    # and may take its grace period), marks its start with an empty exit file
    # (a broker that crashed during the launch learns that it ran), records
    # the exit code, and ends as its program did: by the same signal, or with
    # the same code
    'trap : "$GPUBROKER_WARN_SIGNAL"; trap : TERM; mkdir -p "$GPUBROKER_CHECKPOINT_DIR"; '
    'true > "$GPUBROKER_JOB_EXIT_FILE"; "$@"; code=$?; echo "$code" > "$GPUBROKER_JOB_EXIT_FILE"; '
    'if [ "$code" -gt 128 ] && [ "$code" -le 192 ]; then '
    'trap - TERM "$GPUBROKER_WARN_SIGNAL"; kill -$((code - 128)) $$; fi; exit "$code"'
)


class _TooLong(Exception):
    """A process wrote more than it may to its standard output."""


def _communicate_bounded(
    proc: subprocess.Popen[bytes], data: bytes, timeout: float, limit: int
) -> tuple[bytes, bytes]:
    """``proc.communicate(data, timeout)`` that keeps at most ``limit`` bytes
    of standard output and the last :data:`PROBE_STDERR_TAIL` bytes of
    standard error: what a process run as a user writes is hers, and may be
    endless (the caller kills ``proc`` on an error).

    Raises:
        subprocess.TimeoutExpired: ``timeout`` seconds passed first.
        _TooLong: the standard output passed ``limit`` bytes.
    """
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    deadline = time.monotonic() + timeout
    out, err = bytearray(), bytearray()
    pending = memoryview(data)
    with selectors.DefaultSelector() as selector:
        if pending:
            selector.register(proc.stdin, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
        selector.register(proc.stdout, selectors.EVENT_READ, out)
        selector.register(proc.stderr, selectors.EVENT_READ, err)
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(proc.args, timeout)
            for key, _ in selector.select(left):
                if key.fileobj is proc.stdin:
                    try:  # at most PIPE_BUF bytes: a write select allows never blocks
                        pending = pending[os.write(key.fd, pending[: select.PIPE_BUF]) :]
                    except BrokenPipeError:
                        pending = pending[:0]
                    if not pending:
                        selector.unregister(proc.stdin)
                        proc.stdin.close()
                    continue
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                key.data.extend(chunk)
                if len(out) > limit:
                    raise _TooLong(f"over {limit} bytes")
                del err[:-PROBE_STDERR_TAIL]
    proc.stdout.close()
    proc.stderr.close()
    try:
        proc.wait(max(deadline - time.monotonic(), 0.01))
    except subprocess.TimeoutExpired:
        raise subprocess.TimeoutExpired(proc.args, timeout) from None
    return bytes(out), bytes(err)


def _recorded(status: Any, job_id: int, sessions: Any, owner: int | None) -> Any:
    """The status of a process a restarted broker lost sight of, from the
    exit code its shell recorded (unchanged when there is none; ``owner``:
    the uid the job ran as, :func:`_exit_record`)."""
    with sessions() as session:
        job = repo.get(session, job_id)
        path = f"{job.log_path}.exit" if job is not None and job.log_path else ""
    recorded = _exit_status(_exit_record(path, owner) or "") if path else None
    if recorded is None:
        return status
    return dataclasses.replace(
        status, state="exited", exit_code=recorded.exit_code, signal=recorded.signal
    )


def _exit_status(text: str) -> Status | None:
    """The end a job's shell wrote to its exit file (its ``$?``): an exit
    code 0-255, where 129-192 means the signal ``code - 128`` ended the
    program (as a POSIX shell reports it); ``None`` for anything else. The
    file is in the user's directory and the job can write it: a number of
    any size or a word is not an end."""
    text = text.strip()
    if not (text.isascii() and text.isdigit() and len(text) <= 3) or int(text) > 255:
        return None
    code = int(text)
    if 128 < code <= 128 + 64:
        return Status("exited", signal=code - 128)
    return Status("exited", exit_code=code)


def _exit_record(path: str, owner: int | None) -> str | None:
    """What a job's shell wrote to its exit file ``path``: ``""`` from its
    start, the exit code once its program ended; ``None`` when there is no
    such plain file of ``owner`` (the uid the job ran as, whose shell made
    it; ``None``: no such account, nothing is read). A link put there is
    not followed, and a file of another owner is not read: the path is in
    the user's directory, and a link to a directory on the way could lead
    the broker (maybe root) to someone else's file. At most 64 bytes."""
    with open_owned(path, owner) as f:
        return None if f is None else f.read(64).decode("ascii", "replace").strip()


#: most bytes read of a job's error file
ERROR_MAX_BYTES = 1024

#: seconds the supervisor waits for a failed job's error file
ERROR_READ_TIMEOUT = 2.0

#: most characters of its line kept in the job's reason
ERROR_WIDTH = 200


def _error_record(path: str, owner: int | None) -> str:
    """The first line of a job's error file ``path`` (what its run wrote to
    say why it failed), on one line of at most :data:`ERROR_WIDTH`
    characters (:func:`~gpubroker.jobs.text.one_line`); ``""`` when there
    is no such plain file of ``owner`` or it is empty. Read as
    :func:`_exit_record` reads (no link followed, another owner's file not
    read: the path is in the user's directory); at most
    :data:`ERROR_MAX_BYTES` bytes, as UTF-8 (a bad byte shown as U+FFFD)."""
    with open_owned(path, owner) as f:
        if f is None:
            return ""
        text = f.read(ERROR_MAX_BYTES).decode("utf-8", "replace")
    lines = text.strip().splitlines()
    return one_line(lines[0].strip(), ERROR_WIDTH) if lines else ""


@dataclass(frozen=True)
class _Watch:
    """What the supervisor needs of a running job to warn it (read once per
    check), and what it last noted holds it in its engine (``engine_wait``)."""

    kind: str
    started_at: dt.datetime | None
    warned_at: dt.datetime | None
    time_limit: float | None
    log: str = ""
    user: str = ""
    engine_wait: str = ""

    @classmethod
    def of(cls, job: Any) -> _Watch:
        limit = job.spec.get("time_limit")
        waited = str(job.spec.get("engine_wait") or "")
        return cls(
            job.kind, job.started_at, job.warned_at, limit, job.log_path or "", job.user, waited
        )


def _warn_file(log: str) -> str:
    """The file whose appearance warns a notebook job's runner."""
    return f"{log}.warn"


def _dir_inside(root: Path, path: str) -> int:
    """A descriptor of the directory of ``path``, opened from ``root`` one
    component at a time without following any link, so a link the user put
    anywhere on the way cannot lead the broker (maybe root) outside.

    Raises:
        OSError: ``path`` is not under ``root``, or a component is a link or
            not a directory."""
    parent = Path(path).parent
    parts = parent.relative_to(root).parts  # ValueError: not under root
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in parts:
            step = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = step
    except BaseException:
        os.close(fd)
        raise
    return fd


def _flag(root: Path, path: str) -> None:
    """Create ``path`` (empty) under ``root``, never through a link or over
    a file already there (it is in the user's directory; the broker may be
    root).

    Raises:
        OSError: it cannot be created (one already there is fine)."""
    try:
        where = _dir_inside(root, path)
    except ValueError as err:
        raise OSError(f"{path} is not under {root}") from err
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        os.close(os.open(Path(path).name, flags, 0o644, dir_fd=where))
    except FileExistsError:
        pass
    finally:
        os.close(where)


def _unlink(root: Path, path: str) -> None:
    """Remove ``path`` under ``root`` if it is there (a link is removed, not
    followed; nothing is removed through a link on the way)."""
    # not there, or not ours to remove (then the runner is warned at once)
    with contextlib.suppress(OSError, ValueError):
        where = _dir_inside(root, path)
        try:
            os.unlink(Path(path).name, dir_fd=where)
        finally:
            os.close(where)


def _uid_of(user: str) -> int | None:
    account = _account(user)
    return None if account is None else account.pw_uid


def _account(user: str) -> pwd.struct_passwd | None:
    try:
        return pwd.getpwnam(user)
    except KeyError:
        return None


def _launch_if_there(
    launch: Callable[[LaunchSpec], Handle],
    spec: LaunchSpec,
    notebook: Path | None,
    root: Path,
) -> Handle:
    """``launch(spec)``, unless ``notebook`` (a notebook job's input; ``None``
    for a command job) is no longer a file in the user's directory ``root``:
    it was moved or removed after the submit, and the job could not start
    (it is not retried). Run in a worker (the notebook is in the user's
    directory). The broker checks as itself (root in production), so a
    link the user put in the notebook's place is followed only within
    ``root``: one to a file elsewhere reads as gone, whether that file
    exists or not (the user learns nothing of other users' files).

    Raises:
        EngineError: the notebook is gone, or from ``launch``.
    """
    if notebook is not None:
        try:
            real = notebook.resolve()
            there = real.is_relative_to(root.resolve()) and real.is_file()
        except (OSError, RuntimeError) as err:  # RuntimeError: a loop of links
            raise EngineError(f"notebook: cannot use {notebook}: {err}") from None
        if not there:
            raise EngineError(f"notebook: no such notebook: {notebook} (moved or removed?)")
    return launch(spec)


def _cancel_of(job: Any) -> dict[str, Any] | None:
    """The cancel under way of a running job (``spec["cancel"]``: reason,
    actor, its reason before), or ``None``."""
    mark = (job.spec or {}).get("cancel")
    return mark if isinstance(mark, dict) else None


def _handle(job: Any) -> Handle | None:
    if not job.handle_id or job.handle_id.startswith(_INTENT):
        return None
    return Handle(job.handle_engine, job.handle_id, job.handle_node)


def _describe(state: str, status: Any, why: str = "") -> str:
    """A job's end in words; ``why``: the line its run wrote to say why it
    failed, added after an exit code other than 0."""
    if state == model.TIMED_OUT:
        return "its time limit was reached"
    if status.state == "lost":
        return "it ended while the broker could not see how"
    if status.signal is not None:
        return f"ended by signal {status.signal}"
    if why and status.exit_code not in (None, 0):
        return f"exit code {status.exit_code}: {why}"
    return f"exit code {status.exit_code}"


def _log_view(data: bytes, offset: int, state: str) -> dict[str, Any]:
    """What :meth:`JobService.logs` answers for ``data`` read at byte
    ``offset``: the text up to its last whole UTF-8 character, the offset
    of the next read, and the job's state."""
    text = _whole_chars(data)
    return {"text": text.decode("utf-8", "replace"), "offset": offset + len(text), "state": state}


def _whole_chars(data: bytes) -> bytes:
    """``data`` without a UTF-8 character cut at its end (RFC 3629: a lead
    byte 110xxxxx, 1110xxxx or 11110xxx starts 2, 3 or 4 bytes)."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 == 0x80:  # a continuation byte: look further back
            continue
        need = {0xC0: 2, 0xD0: 2, 0xE0: 3, 0xF0: 4}.get(byte & 0xF0, 1)
        if byte >= 0xF8:  # not UTF-8: the reader shows U+FFFD, nothing to wait for
            need = 1
        return data if back >= need else data[:-back]
    return data


def _pythonpath(own: dict[str, str], lease: dict[str, str]) -> dict[str, str]:
    """``PYTHONPATH`` when a share's caps put their start-up hook there and
    the job has its own: the hook first, then the job's entries (neither is
    lost); else nothing to change."""
    if not (own.get("PYTHONPATH") and lease.get("PYTHONPATH")):
        return {}
    return {"PYTHONPATH": f"{lease['PYTHONPATH']}:{own['PYTHONPATH']}"}


def _unusable(err: BaseException) -> str:
    """Why a path cannot be used (the system's words)."""
    return f"cannot use this path: {getattr(err, 'strerror', None) or err}"


def _is(test: Callable[[], bool], field: str) -> bool:
    """``test()`` (a path's ``is_file``/``is_dir``), an error naming ``field``
    when the system refuses the path (a name too long)."""
    try:
        return test()
    except OSError as err:
        raise model.JobError(field, _unusable(err)) from None
