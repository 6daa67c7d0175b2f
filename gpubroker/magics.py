"""Notebook magics: ``%load_ext gpubroker``, then

* ``%gpu``: what this kernel's server holds (devices, state, age) and its
  notices (cull warnings, preemptions, finished jobs);
* ``%gpu_submit [NOTEBOOK] --gpus N | --mig PROFILE | --memory GIB
  [--time 12h] [--param k=v ...] [--kernel NAME] [--retries N] [--pool P]
  [--class C]``:
  run a notebook (default: the one this kernel belongs to, as last saved) as
  a batch job on a lease of its own;
* ``%gpu_jobs``; ``%gpu_logs ID [--follow]``; ``%gpu_cancel ID``.

They call the broker over HTTP with the server's own token
(``$JUPYTERHUB_API_TOKEN``: the user's rights only) through
:class:`~gpubroker.client_sync.SyncBrokerClient`. Arguments are parsed with
IPython's ``magic_arguments``; a usage error raises ``UsageError``. Tables
are shown as HTML in notebooks and as text in terminals.
"""

from __future__ import annotations

import html
import os
import shlex
import sys
import time
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import display

from .client import BrokerClientError
from .client_sync import SyncBrokerClient, job_body

#: the columns of ``%gpu_jobs``
JOB_COLUMNS = ("id", "state", "kind", "what", "devices", "created", "reason")


def _table(rows: list[dict[str, Any]], columns: tuple[str, ...]) -> None:
    """Show rows as an HTML table (notebooks) with a text fallback (terminals)."""
    text = [columns] + [tuple(str(r.get(c, "")) for c in columns) for r in rows]
    widths = [max(len(row[i]) for row in text) for i in range(len(columns))]
    plain = "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in text
    )
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(r.get(c, '')))}</td>" for c in columns) + "</tr>"
        for r in rows
    )
    display({"text/plain": plain, "text/html": f"<table><tr>{head}</tr>{body}</table>"}, raw=True)


@magics_class
class GPUMagics(Magics):
    """The gpubroker magics (see the module's documentation)."""

    def __init__(self, shell: Any, client: SyncBrokerClient | None = None) -> None:
        super().__init__(shell)
        self.client = client or SyncBrokerClient()

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return getattr(self.client, method)(*args, **kwargs)
        except BrokerClientError as err:
            raise UsageError(f"gpubroker: {err.message}") from None

    @line_magic
    def gpu(self, line: str) -> dict[str, Any] | None:
        """``%gpu``: this server's lease and notices."""
        lease_id = os.environ.get("GPUBROKER_LEASE_ID")
        lease = self._call("lease", int(lease_id)) if lease_id else None
        if lease is None:
            print("This server holds no GPU lease (no GPUBROKER_LEASE_ID).")
        else:
            devices = ", ".join(s["uuid"] for s in lease.get("slots") or []) or "-"
            since = lease["granted_at"] or lease["created"]
            print(f"lease {lease['id']}: {lease['summary']}, {lease['state']} since {since}")
            print(f"devices: {devices}")
        notices = self._call("notices")[:5]
        if notices:
            _table(notices, ("created", "kind", "message"))
        return lease

    @magic_arguments()
    @argument("notebook", nargs="?", help="the notebook (default: this kernel's, as last saved)")
    @argument("--gpus", type=int, help="whole GPUs")
    @argument("--mig", help="a MIG profile, e.g. 1g.10gb")
    @argument("--memory", type=float, help="a share of this many GiB")
    @argument("--time", help="time limit: seconds, or 90s, 10m, 12h, 2d")
    @argument("--param", action="append", default=[], help="a parameter NAME=VALUE (repeat)")
    @argument("--kernel", help="the kernel (default: the notebook's)")
    @argument("--retries", type=int, help="run again after a failure, this many times")
    @argument("--pool", help="the pool")
    @argument("--class", dest="priority_class", help="the priority class (default: batch)")
    @line_magic
    def gpu_submit(self, line: str) -> dict[str, Any]:
        """Run a notebook as a batch job on GPUs of its own."""
        args = parse_argstring(self.gpu_submit, line)
        notebook = args.notebook or os.environ.get("JPY_SESSION_NAME")
        if not notebook:
            raise UsageError("%gpu_submit: name the notebook (this kernel's is not known)")
        chosen = [n for n in ("gpus", "mig", "memory") if getattr(args, n) is not None]
        if len(chosen) != 1:
            raise UsageError("%gpu_submit: give exactly one of --gpus, --mig and --memory")
        body = job_body(
            {"notebook": notebook, "params": list(args.param)},
            gpus=args.gpus,
            mig_profile=args.mig,
            memory_gib=args.memory,
            time=args.time,
            kernel=args.kernel,
            pool=args.pool,
            priority_class=args.priority_class,
            retries=args.retries,
        )
        job = self._call("submit_job", body)
        queue = job.get("queue") or {}
        print(f"job {job['id']} {job['state']}: {queue.get('message') or 'starting'}")
        return dict(job)

    @line_magic
    def gpu_jobs(self, line: str) -> list[dict[str, Any]]:
        """``%gpu_jobs``: your jobs, newest first."""
        jobs = self._call("jobs")
        rows = [
            {
                **j,
                "what": j["spec"].get("notebook") or shlex.join(j["spec"].get("command") or []),
                "devices": ", ".join(j.get("devices") or []),
            }
            for j in jobs
        ]
        _table(rows, JOB_COLUMNS)
        return list(jobs)

    @magic_arguments()
    @argument("job", type=int, help="the job's id")
    @argument("--follow", action="store_true", help="keep printing while the job runs")
    @line_magic
    def gpu_logs(self, line: str) -> None:
        """``%gpu_logs ID [--follow]``: the job's log."""
        args = parse_argstring(self.gpu_logs, line)
        offset = 0
        while True:
            logs = self._call("job_logs", args.job, offset, 10.0 if args.follow else 0)
            sys.stdout.write(logs["text"])
            offset = logs["offset"]
            if not args.follow or logs["state"] not in ("queued", "running"):
                return
            time.sleep(0.1)

    @magic_arguments()
    @argument("job", type=int, help="the job's id")
    @line_magic
    def gpu_cancel(self, line: str) -> dict[str, Any]:
        """``%gpu_cancel ID``: cancel a queued or running job."""
        args = parse_argstring(self.gpu_cancel, line)
        job = self._call("cancel_job", args.job)
        print(f"job {job['id']} {job['state']}")
        return dict(job)


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext gpubroker``."""
    ipython.register_magics(GPUMagics(ipython))
