"""Notebook magics: ``%load_ext gpubroker``, then

* ``%gpu``: what this kernel's server holds (devices with their use now,
  state, age), the quota left, and the notices (cull warnings,
  preemptions, finished jobs);
* ``%gpu_submit [NOTEBOOK] --gpus N | --mig PROFILE | --memory GIB
  [--time 12h] [--param k=v ...] [--kernel NAME] [--retries N] [--pool P]
  [--class C] [--release [--yes]]``:
  run a notebook (default: the one this kernel belongs to, as last saved) as
  a batch job on a lease of its own;
* ``%%gpu_job --gpus N | --mig PROFILE | --memory GIB [--time 1h] ...``:
  run the cell's code as a script job (this kernel's Python);
* ``%gpu_jobs``; ``%gpu_logs ID [--follow]``; ``%gpu_cancel ID``.

``%gpu_submit --release`` ends this server's GPU lease once the job is
accepted (after a confirmation; ``--yes`` skips it): the hub stops this
server and its GPUs go to whoever waits. By default the job's kernel is this
kernel's Python (``sys.executable``), not only the name in the notebook's
metadata; ``--kernel NAME`` names another. A notebook with cells run here
that are not in its saved file gets a warning: the job runs the saved file.

A relative NOTEBOOK is one in this kernel's directory. Run as a job
(``$GPUBROKER_JOB_ID`` set), a notebook's own ``%gpu_submit`` and
``%%gpu_job`` cells submit nothing and return ``None``, and ``%gpu``,
``%gpu_jobs``, ``%gpu_logs`` and ``%gpu_cancel`` say that they are not
available there (a job has no broker token) and return ``None``, so the
job's run goes on.

They call the broker over HTTP with the server's own token
(``$JUPYTERHUB_API_TOKEN``: the user's rights only) through
:class:`~gpubroker.client_sync.SyncBrokerClient`. Arguments are declared
with IPython's ``magic_arguments`` and split as a POSIX shell does (quotes
are removed); a usage error, and any error of the broker's call, raises
``UsageError``. Tables are shown as HTML in notebooks and as text in
terminals.
"""

from __future__ import annotations

import argparse
import datetime as dt
import html
import math
import os
import shlex
import sys
import time
from typing import Any

from IPython.core.error import StdinNotImplementedError, UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.display import display

from .client import BrokerClientError
from .client_sync import SyncBrokerClient, job_body
from .jobs.paths import job_path, relative_cwd
from .jobs.text import job_cells, text_table

#: the columns of ``%gpu``'s table of held slots
SLOT_COLUMNS = ("uuid", "kind", "profile", "utilization", "memory used")

#: the columns of ``%gpu_jobs``
JOB_COLUMNS = ("id", "state", "kind", "what", "devices", "created", "reason")


class ShownJob(dict):  # type: ignore[type-arg]
    """A job a magic returns after printing it: a plain ``dict`` of the
    broker's answer, shown as a cell's value in one line
    (``<gpubroker job 3: running>``), not as the whole dict a second time
    below what the magic printed; ``dict(x)`` shows it all."""

    noun = "job"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(f"<gpubroker {self.noun} {self.get('id')}: {self.get('state')}>")


class ShownLease(ShownJob):
    """The lease ``%gpu`` returns after printing it (as :class:`ShownJob`)."""

    noun = "lease"


class ShownList(list):  # type: ignore[type-arg]
    """The jobs ``%gpu_jobs`` returns after its table: a plain ``list``,
    shown as a cell's value in one line (``<gpubroker: 4 jobs>``)."""

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(f"<gpubroker: {len(self)} job{'' if len(self) == 1 else 's'}>")


def _table(rows: list[dict[str, Any]], columns: tuple[str, ...]) -> None:
    """Show rows as an HTML table (notebooks) with a text fallback (terminals)."""
    plain = text_table(rows, columns)
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(r.get(c, '')))}</td>" for c in columns) + "</tr>"
        for r in rows
    )
    display({"text/plain": plain, "text/html": f"<table><tr>{head}</tr>{body}</table>"}, raw=True)


def _gib(text: str) -> float:
    """``--memory``: a finite number of GiB (``nan`` and ``inf`` are no
    size; JSON has no such numbers, so the broker could not say which
    field was wrong)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number of GiB, got {text!r}")
    return value


def _resources(func: Any) -> Any:
    """The options of what a job asks for (``%gpu_submit``, ``%%gpu_job``)."""
    for option in reversed(
        [
            argument("--gpus", type=int, help="whole GPUs"),
            argument("--mig", help="a MIG profile, e.g. 1g.10gb"),
            argument("--memory", type=_gib, help="a share of this many GiB"),
            argument("--time", help="time limit: seconds, or 90s, 10m, 12h, 2d"),
            argument("--retries", type=int, help="run again after a failure, this many times"),
            argument("--pool", help="the pool"),
            argument("--class", dest="priority_class", help="the priority class (default: batch)"),
        ]
    ):
        func = option(func)
    return func


def _age(since: str) -> str:
    """How long ago ``since`` (ISO 8601, UTC) was, as ``2h05m`` (or ``""``)."""
    try:
        then = dt.datetime.fromisoformat(since.replace("Z", "+00:00"))
    except (TypeError, ValueError):
        return ""
    seconds = int(max((dt.datetime.now(dt.timezone.utc) - then).total_seconds(), 0))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def _slot_rows(slots: list[dict[str, Any]], devices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per held slot, with its device's use now (NVML's, from the
    broker: a MIG instance or a share shows its whole device's)."""
    by_uuid = {d["uuid"]: d.get("usage") or {} for d in devices}
    rows = []
    for slot in slots:
        usage = by_uuid.get(slot.get("device") or slot["uuid"], {})
        util, used = usage.get("utilization_gpu"), usage.get("memory_used_mib")
        rows.append(
            {
                "uuid": slot["uuid"],
                "kind": slot["kind"],
                "profile": slot.get("profile") or "",
                "utilization": "-" if util is None else f"{util}%",
                "memory used": "-" if used is None else f"{used / 1024:.1f} GiB",
            }
        )
    return rows


def _parse(magic: Any, line: str) -> Any:
    """``line`` parsed by ``magic``'s arguments, split as a POSIX shell does
    (``"my notebook.ipynb"``, ``--param 'msg=hello world'``: the quotes
    go; IPython's own ``parse_argstring`` keeps them).

    Raises:
        UsageError: unbalanced quotes, or arguments the magic does not take.
    """
    try:
        argv = shlex.split(line)
    except ValueError as err:
        raise UsageError(f"%{magic.__name__}: {err} in {line!r}") from None
    return magic.parser.parse_args(argv)


def _not_in_job(name: str) -> bool:
    """Whether this kernel runs outside a batch job; inside one (a notebook
    run as a job that also shows ``%gpu`` or ``%gpu_jobs``), says why the
    magic does nothing there: a job carries no broker token (it gets no
    more than it needs to run), so the magic would fail the job's run."""
    job_id = os.environ.get("GPUBROKER_JOB_ID")
    if job_id:
        devices = os.environ.get("CUDA_VISIBLE_DEVICES") or "none"
        print(
            f"{name}: not available inside job {job_id}, which has no broker token "
            f"(its devices: {devices}); run it in your server"
        )
    return not job_id


def _in_job(name: str) -> bool:
    """Whether this kernel runs inside a batch job (``$GPUBROKER_JOB_ID``):
    then the notebook being run holds its own ``%gpu_submit`` cell, which
    says so and submits nothing (it would submit the job again)."""
    job_id = os.environ.get("GPUBROKER_JOB_ID")
    if job_id:
        print(f"{name}: not submitted: this kernel runs as job {job_id} already")
    return bool(job_id)


def _session_notebook() -> str | None:
    """This kernel's notebook (``$JPY_SESSION_NAME``) as an absolute path, or
    ``None``. Jupyter Server sets it to the file's absolute path when the
    client names the session (JupyterLab, Notebook 7), else to the API path,
    relative to the server's root: taken as relative to the home directory,
    which is the single-user server's root as the spawner starts it."""
    name = os.environ.get("JPY_SESSION_NAME")
    if not name:
        return None
    return name if os.path.isabs(name) else os.path.join(os.path.expanduser("~"), name)


def _one_resource(name: str, args: Any) -> None:
    """Raises ``UsageError`` unless exactly one of --gpus, --mig, --memory is given."""
    chosen = [n for n in ("gpus", "mig", "memory") if getattr(args, n) is not None]
    if len(chosen) != 1:
        raise UsageError(f"{name}: give exactly one of --gpus, --mig and --memory")


def unsaved_cells(shell: Any, notebook: str) -> int:
    """How many distinct code cells run in ``shell`` this session are not in
    ``notebook``'s saved file (0 when it cannot be read). Magics and blank
    inputs are left out. The kernel's history has no cell identity, so the
    code of a cell run and then edited counts too, after any save."""
    import nbformat

    try:
        saved = nbformat.read(notebook, as_version=4)
    except (OSError, ValueError):
        return 0
    sources = {c.source.strip() for c in saved.cells if c.cell_type == "code"}
    history = getattr(getattr(shell, "history_manager", None), "input_hist_raw", [])
    ran = {str(x).strip() for x in history[1:]}
    # the cell that submits is not the job's business (the job skips it)
    ran = {x for x in ran if x and not x.startswith("%") and "gpu_submit" not in x}
    return len(ran - sources)


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
        if not _not_in_job("%gpu"):
            return None
        lease_id = os.environ.get("GPUBROKER_LEASE_ID")
        lease = self._call("lease", int(lease_id)) if lease_id else None
        if lease is None:
            print("This server holds no GPU lease (no GPUBROKER_LEASE_ID).")
        else:
            since = lease["granted_at"] or lease["created"]
            age = _age(since)
            print(
                f"lease {lease['id']}: {lease['summary']}, {lease['state']} since {since}"
                f"{f' ({age})' if age else ''}"
            )
            slots = lease.get("slots") or []
            if slots:
                _table(_slot_rows(slots, self._call("devices")), SLOT_COLUMNS)
        quota = self._call("pools").get("quota") or {}
        if quota:
            left = quota.get("remaining")
            print(
                f"quota: {quota['held']:g} held, {quota['pending']:g} pending, "
                f"{'no limit' if left is None else f'{left:g} left'} (device units)"
            )
        notices = self._call("notices")[:5]
        if notices:
            _table(notices, ("created", "kind", "message"))
        return None if lease is None else ShownLease(lease)

    @magic_arguments()
    @argument("notebook", nargs="?", help="the notebook (default: this kernel's, as last saved)")
    @_resources
    @argument("--param", action="append", default=[], help="a parameter NAME=VALUE (repeat)")
    @argument("--kernel", help="the kernel (default: this kernel's Python)")
    @argument(
        "--release",
        action="store_true",
        help="end this server's GPU lease once the job is accepted (the server stops)",
    )
    @argument("--yes", action="store_true", help="with --release: do not ask first")
    @line_magic
    def gpu_submit(self, line: str) -> dict[str, Any] | None:
        """Run a notebook as a batch job on GPUs of its own (give exactly one
        of --gpus, --mig and --memory). A relative NOTEBOOK is one in this
        kernel's directory. Inside a job it submits nothing (returns None)."""
        args = _parse(self.gpu_submit, line)
        if _in_job("%gpu_submit"):
            return None
        notebook = args.notebook or _session_notebook()
        if not notebook:
            raise UsageError("%gpu_submit: name the notebook (this kernel's is not known)")
        if not args.notebook and not os.path.isfile(notebook):
            # the kernel's environment names the file it was started for
            raise UsageError(
                f"%gpu_submit: this kernel's notebook {notebook} is not there (renamed or "
                "moved since the kernel started?): name it, e.g. %gpu_submit train.ipynb"
            )
        _one_resource("%gpu_submit", args)
        self._warn_unsaved(notebook)
        release = self._release_lease(args)
        what = {"notebook": job_path(notebook), "params": list(args.param)}
        if not args.kernel:
            what["python"] = sys.executable
        job = self._submit("%gpu_submit", args, what, kernel=args.kernel)
        if release is not None:
            try:
                self.client.release_lease(release, f"released for job {job['id']} (%gpu_submit)")
            except BrokerClientError as err:  # the job is queued all the same
                print(
                    f"job {job['id']} is queued, but lease {release} was not released: "
                    f"{err.message}; stop this server from the hub's home page to release it",
                    file=sys.stderr,
                )
            else:
                print(f"lease {release} released: this server stops now")
        return job

    @magic_arguments()
    @_resources
    @cell_magic
    def gpu_job(self, line: str, cell: str) -> dict[str, Any] | None:
        """``%%gpu_job --gpus 1 --time 1h``: run the cell's code as a script
        job, with this kernel's Python, in this kernel's directory (inside a
        job: nothing is submitted, and it returns None)."""
        args = _parse(self.gpu_job, line)
        if _in_job("%%gpu_job"):
            return None
        if not cell.strip():
            raise UsageError("%%gpu_job: the cell is empty")
        what = {"command": [sys.executable, "-c", cell], "cwd": relative_cwd()}
        return self._submit("%%gpu_job", args, what)

    def _submit(self, name: str, args: Any, what: dict[str, Any], **more: Any) -> dict[str, Any]:
        _one_resource(name, args)
        body = job_body(
            {k: v for k, v in what.items() if v is not None},
            gpus=args.gpus,
            mig_profile=args.mig,
            memory_gib=args.memory,
            time=args.time,
            pool=args.pool,
            priority_class=args.priority_class,
            retries=args.retries,
            **more,
        )
        job = self._call("submit_job", body)
        queue = job.get("queue") or {}
        # its GPUs free at once: granted, its launch comes at the job service's next check
        granted = "its GPUs are granted; waiting for its launch" if job.get("devices") else ""
        print(f"job {job['id']} {job['state']}: {queue.get('message') or granted or 'waiting'}")
        return ShownJob(job)

    def _release_lease(self, args: Any) -> int | None:
        """The lease ``--release`` will end (asked first, unless ``--yes``)."""
        if not args.release:
            return None
        lease_id = os.environ.get("GPUBROKER_LEASE_ID")
        if not lease_id:
            raise UsageError("%gpu_submit --release: this server holds no GPU lease")
        if not args.yes:
            try:
                answer = input(
                    f"Release lease {lease_id} once the job is accepted? This server stops "
                    "(save your work first). [y/N] "
                )
            except (StdinNotImplementedError, EOFError):  # nbconvert, papermill, some IDEs
                raise UsageError(
                    "%gpu_submit --release: cannot ask for confirmation here (this "
                    "frontend takes no input); add --yes to release without asking"
                ) from None
            if answer.strip().lower() not in ("y", "yes"):
                raise UsageError("%gpu_submit: not submitted (--release was not confirmed)")
        return int(lease_id)

    def _warn_unsaved(self, notebook: str) -> None:
        """Warn when code run in this kernel is missing from the saved notebook
        (the job runs the file as last saved), on stderr, flushed at once: a
        kernel sends stdout and stderr each when flushed, so an unflushed
        warning could reach the notebook after the job's and the release's
        lines (stdout), which come later."""
        session = _session_notebook()
        if not session or job_path(notebook) != job_path(session):
            return  # another notebook: this kernel's history says nothing of it
        missing = unsaved_cells(self.shell, notebook)
        if missing:
            sys.stdout.flush()  # what the cell printed before stays before it
            print(
                f"Warning: {missing} cell(s) run in this kernel are not in {notebook} as "
                "saved; the job runs the saved file (save it first to include them; "
                "code you ran and then edited counts too, until the kernel restarts).",
                file=sys.stderr,
                flush=True,
            )

    @line_magic
    def gpu_jobs(self, line: str) -> list[dict[str, Any]] | None:
        """``%gpu_jobs``: your jobs, newest first, as a table of one line per
        job (the notebook or command on one line, cut to
        :data:`~gpubroker.jobs.text.WHAT_WIDTH` characters; the devices; the
        queue's reason while waiting, and the job's own); returns the jobs
        as the broker gave them (``None`` inside a job)."""
        if not _not_in_job("%gpu_jobs"):
            return None
        jobs = self._call("jobs")
        _table([{**j, **job_cells(j)} for j in jobs], JOB_COLUMNS)
        return ShownList(jobs)

    @magic_arguments()
    @argument("job", type=int, help="the job's id")
    @argument("--follow", action="store_true", help="keep printing while the job runs")
    @line_magic
    def gpu_logs(self, line: str) -> None:
        """``%gpu_logs ID [--follow]``: the job's log."""
        args = _parse(self.gpu_logs, line)
        if not _not_in_job("%gpu_logs"):
            return
        offset = 0
        while True:
            logs = self._call("job_logs", args.job, offset, 10.0 if args.follow else 0)
            sys.stdout.write(logs["text"])
            if offset == 0 and not logs["text"] and logs["state"] == "queued" and not args.follow:
                print(f"job {args.job} is queued: no log yet (--follow waits for it)")
            offset = logs["offset"]
            if logs["text"]:  # more may follow at once (a read is at most 1 MiB)
                continue
            if not args.follow or logs["state"] not in ("queued", "running"):
                return
            time.sleep(0.1)

    @magic_arguments()
    @argument("job", type=int, help="the job's id")
    @line_magic
    def gpu_cancel(self, line: str) -> dict[str, Any] | None:
        """``%gpu_cancel ID``: cancel a queued or running job (``None``
        inside a job)."""
        args = _parse(self.gpu_cancel, line)
        if not _not_in_job("%gpu_cancel"):
            return None
        job = self._call("cancel_job", args.job)
        print(f"job {job['id']} {job['state']}")
        return ShownJob(job)


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext gpubroker``."""
    ipython.register_magics(GPUMagics(ipython))
