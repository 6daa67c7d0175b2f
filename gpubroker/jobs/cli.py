"""``gpubroker jobs submit|list|show|logs|cancel``: batch jobs on the shell,
through the broker's REST API (``--url``, default ``$GPUBROKER_URL``; the
token in ``$GPUBROKER_API_TOKEN`` or ``$JUPYTERHUB_API_TOKEN``), with the
rights of that token's owner, like the notebook magics."""

from __future__ import annotations

import json
import math
import re
import sys
import time
from typing import Any

from traitlets import Bool, Float, Int, List, Unicode
from traitlets.config import Application

from ..client import BrokerClientError
from ..client_sync import SyncBrokerClient, job_body
from ..logfmt import OneLineFormatter
from .paths import job_path, relative_cwd
from .text import job_cells, job_what, one_line


class _JobsCall(Application):
    """A ``gpubroker jobs`` subcommand: one call of the API."""

    _log_formatter_cls = OneLineFormatter  # messages on one line (gpubroker.logfmt)

    url = Unicode("", help="The broker's URL (default: $GPUBROKER_URL).").tag(config=True)
    as_json = Bool(False, help="Print JSON.").tag(config=True)
    aliases = {"url": "_JobsCall.url"}
    flags = {"json": ({"_JobsCall": {"as_json": True}}, "Print JSON.")}

    def client(self) -> SyncBrokerClient:
        return SyncBrokerClient(self.url or None)

    def job_id(self) -> int:
        """The one positional argument, a job id (exits 2 otherwise)."""
        # ASCII digits only: "²".isdigit() is true, and int() refuses it
        if len(self.extra_args) != 1 or not re.fullmatch(r"[0-9]{1,18}", self.extra_args[0]):
            self.log.critical("give one job id, e.g. `gpubroker jobs %s 7`", self.name)
            self.exit(2)
        return int(self.extra_args[0])

    def run(self, call: Any) -> Any:
        """Make the call; a refusal exits 2 with the broker's message."""
        try:
            return call()
        except BrokerClientError as err:
            self.log.critical("%s", err.message)
            self.exit(2)

    def show(self, job: dict[str, Any]) -> None:
        if self.as_json:
            print(json.dumps(job, indent=2))
            return
        queue = job.get("queue") or {}
        reason = f" ({one_line(job['reason'], None)})" if job.get("reason") else ""
        print(f"job {job['id']} of {one_line(job['user'], None)}: {job['state']}{reason}")
        print(f"  {job['kind']}: {job_what(job, None)}")
        if job["state"] == "queued":
            granted = "its GPUs are granted; waiting for its launch"
            waiting = granted if job.get("devices") else "waiting"
            print(f"  {one_line(queue.get('message') or waiting, None)}")
        if job.get("engine_wait"):
            # running for the broker, not started by its engine yet (Slurm PENDING)
            print(f"  held by its engine: {one_line(job['engine_wait'], None)}")
        ended = [
            f"{name} {job[key]}"
            for name, key in (("exit code", "exit_code"), ("signal", "signal"))
            if job.get(key) is not None
        ]
        devices = ", ".join(job.get("devices") or []) or "-"
        print(f"  devices: {devices}" + "".join(f"; {x}" for x in ended))
        if job.get("output"):
            print(f"  output: {one_line(job['output'], None)}")


class SubmitCommand(_JobsCall):
    """``gpubroker jobs submit NOTEBOOK|--command LINE --gpus N ...``."""

    name = "submit"
    description = "Submit a notebook (or --command) as a batch job."
    gpus = Int(None, allow_none=True, help="Whole GPUs.").tag(config=True)
    mig = Unicode("", help="A MIG profile, e.g. 1g.10gb.").tag(config=True)
    memory = Float(None, allow_none=True, help="A share of this many GiB.").tag(config=True)
    time = Unicode("", help="Time limit: seconds, or 90s, 10m, 12h, 2d.").tag(config=True)
    param = List(Unicode(), help="Notebook parameters NAME=VALUE.").tag(config=True)
    kernel = Unicode("", help="The kernel (default: the notebook's).").tag(config=True)
    retries = Int(None, allow_none=True, help="Run again after a failure, this many times.").tag(
        config=True
    )
    command = Unicode("", help="A shell line to run instead of a notebook.").tag(config=True)
    priority_class = Unicode("", help="The priority class (default: batch).").tag(config=True)
    pool = Unicode("", help="The pool.").tag(config=True)
    aliases = {
        "url": "_JobsCall.url",
        "gpus": "SubmitCommand.gpus",
        "mig": "SubmitCommand.mig",
        "memory": "SubmitCommand.memory",
        "time": "SubmitCommand.time",
        "param": "SubmitCommand.param",
        "kernel": "SubmitCommand.kernel",
        "retries": "SubmitCommand.retries",
        "command": "SubmitCommand.command",
        "class": "SubmitCommand.priority_class",
        "pool": "SubmitCommand.pool",
    }

    def start(self) -> None:
        if self.memory is not None and not math.isfinite(self.memory):
            # JSON has no NaN or infinity: the broker could only say "not JSON"
            self.log.critical("--memory: must be a finite number of GiB, got %s", self.memory)
            self.exit(2)
        if self.command and (self.extra_args or self.param):
            given = "a notebook" if self.extra_args else "--param"
            self.log.critical("give one notebook or --command, not %s with --command", given)
            self.exit(2)
        # as the magics do: a relative notebook is one in this directory,
        # and a command runs in it (the broker reads both from $HOME)
        if self.command:
            what: dict[str, Any] = {"command": self.command}
            here = relative_cwd()
            if here is not None:
                what["cwd"] = here
        elif len(self.extra_args) == 1:
            what = {"notebook": job_path(self.extra_args[0]), "params": list(self.param)}
        else:
            self.log.critical("give one notebook, or --command")
            self.exit(2)
        body = job_body(
            what,
            gpus=self.gpus,
            mig_profile=self.mig,
            memory_gib=self.memory,
            time=self.time,
            kernel=self.kernel,
            pool=self.pool,
            priority_class=self.priority_class,
            retries=self.retries,
        )
        self.show(self.run(lambda: self.client().submit_job(body)))


class ListCommand(_JobsCall):
    """``gpubroker jobs list``: one line per job (its notebook or command on
    one line, cut to :data:`~gpubroker.jobs.text.WHAT_WIDTH` characters;
    its devices, ``-`` when none; the queue's reason while it waits, and
    the job's own reason); ``--json``: the jobs as the broker gave them."""

    name = "list"
    description = (
        "Your jobs (an admin's token: everyone's), newest first, one line each: "
        "id, user, state, notebook or command, devices, reason."
    )

    def start(self) -> None:
        jobs = self.run(lambda: self.client().jobs())
        if self.as_json:
            print(json.dumps(jobs, indent=2))
            return
        cells = [job_cells(job) for job in jobs]
        what = max((len(c["what"]) for c in cells), default=0)
        devices = max((len(c["devices"] or "-") for c in cells), default=0)
        for job, cell in zip(jobs, cells, strict=True):
            line = (
                f"{job['id']:>6}  {one_line(job['user'], None):<12} {job['state']:<10} "
                f"{cell['what']:<{what}}  {cell['devices'] or '-':<{devices}}  {cell['reason']}"
            )
            print(line.rstrip())


class ShowCommand(_JobsCall):
    """``gpubroker jobs show ID``."""

    name = "show"
    description = "One job."

    def start(self) -> None:
        job_id = self.job_id()
        self.show(self.run(lambda: self.client().job(job_id)))


class LogsCommand(_JobsCall):
    """``gpubroker jobs logs ID [--follow]``."""

    name = "logs"
    description = "A job's log; --follow keeps printing while it runs."
    follow = Bool(False, help="Keep printing while the job runs.").tag(config=True)
    flags = {"follow": ({"LogsCommand": {"follow": True}}, "Keep printing while the job runs.")}

    def start(self) -> None:
        """Print the log; Ctrl-C stops following (exit status 130, no
        traceback; the job goes on)."""
        try:
            self._print_log()
        except KeyboardInterrupt:
            print(file=sys.stderr)
            self.exit(130)

    def _print_log(self) -> None:
        job_id, offset = self.job_id(), 0
        while True:
            wait = 10.0 if self.follow else 0.0
            logs = self.run(lambda: self.client().job_logs(job_id, offset, wait))  # noqa: B023
            sys.stdout.write(logs["text"])
            sys.stdout.flush()
            offset = logs["offset"]
            if logs["text"]:  # more may follow at once (a read is at most 1 MiB)
                continue
            if not self.follow or logs["state"] not in ("queued", "running"):
                return
            time.sleep(0.1)


class CancelCommand(_JobsCall):
    """``gpubroker jobs cancel ID``."""

    name = "cancel"
    description = "Cancel a queued or running job."

    def start(self) -> None:
        job_id = self.job_id()
        self.show(self.run(lambda: self.client().cancel_job(job_id)))


class JobsCommand(Application):
    """``gpubroker jobs``: batch jobs through the broker's API."""

    _log_formatter_cls = OneLineFormatter  # messages on one line (gpubroker.logfmt)

    name = "jobs"
    description = "Batch jobs: submit, list, show, logs, cancel."
    subcommands = {
        "submit": ("gpubroker.jobs.cli.SubmitCommand", SubmitCommand.description),
        "list": ("gpubroker.jobs.cli.ListCommand", ListCommand.description),
        "show": ("gpubroker.jobs.cli.ShowCommand", ShowCommand.description),
        "logs": ("gpubroker.jobs.cli.LogsCommand", LogsCommand.description),
        "cancel": ("gpubroker.jobs.cli.CancelCommand", CancelCommand.description),
    }

    def start(self) -> None:
        if self.subapp is not None:
            self.subapp.start()
            return
        self.print_subcommands()
        self.exit(2)
