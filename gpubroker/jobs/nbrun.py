"""Run a notebook job's papermill, and interrupt its kernel on the broker's
warning (run as a script by the job's Python: it needs only the standard
library and papermill, not gpubroker).

``python nbrun.py IN OUT [papermill options]`` runs papermill's own command
line with those arguments. Two things are added:

* The warning signal (``$GPUBROKER_WARN_SIGNAL``, e.g. ``USR1``) is ignored
  by this process and so by the kernel it starts (an ignored signal stays
  ignored across ``exec``): the broker's signal to the job's process group
  must not end papermill or the kernel midway. Code in the notebook may
  still install a handler of its own.
* ``$GPUBROKER_KERNEL_PYTHON`` (the Python of the kernel the notebook was
  submitted from) without a ``-k``: the notebook runs in a kernel of that
  Python, through a kernelspec made for it in a temporary directory.
* When papermill fails (a cell raised, or the notebook could not be read
  or written), one line saying why (``ValueError: boom (at "In [3]")``)
  is written to ``$GPUBROKER_JOB_ERROR_FILE``, and the error goes on as
  before (traceback on standard error, exit status 1): the broker adds
  that line to the failed job's reason. A kernel that died (killed, out of
  memory) is said so (``DeadKernelError: the kernel died ...``), with exit
  status 1: papermill's own 138 reads as a job ended by signal 10.
* When the broker warns (the file ``$GPUBROKER_WARN_FILE`` appears: a time
  limit is near, or the job's lease is being preempted), the kernel is
  interrupted (SIGINT to this process's children), as Jupyter's
  "interrupt" button does: the running cell gets ``KeyboardInterrupt`` and
  may save a checkpoint. A cell that does not catch it fails, and the job
  ends there with its output saved (papermill saves after every cell). A
  kernel between two cells ignores the interrupt, as Jupyter's does.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path


def children(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` (from ``/proc``)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # after "pid (comm) "
        if len(fields) > 1 and int(fields[1]) == pid:
            found.append(int(entry))
    return found


#: set once :func:`watch` interrupted the kernel on the broker's warning
INTERRUPTED = threading.Event()


def watch(flag: Path, interval: float = 0.5) -> None:
    """Wait for ``flag`` to exist, then interrupt the kernel once."""
    kernels: list[int] = []
    while not (flag.exists() and kernels):  # and the kernel has started
        time.sleep(interval)
        kernels = children(os.getpid())
    INTERRUPTED.set()
    for pid in kernels:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGINT)
    print(
        f"gpubroker: warned by the broker; kernel interrupted (pids {kernels})",
        file=sys.stderr,
        flush=True,
    )


def kernel_of(python: str, where: Path) -> str:
    """Make a kernelspec, under ``where``, that runs ``python``'s ipykernel;
    returns its name (``where`` goes on ``JUPYTER_PATH``)."""
    spec = where / "kernels" / "gpubroker-job"
    spec.mkdir(parents=True, exist_ok=True)
    argv = [python, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    kernel = {"argv": argv, "display_name": f"Python ({python})", "language": "python"}
    (spec / "kernel.json").write_text(json.dumps(kernel))
    os.environ["JUPYTER_PATH"] = os.pathsep.join(
        p for p in (str(where), os.environ.get("JUPYTER_PATH", "")) if p
    )
    return spec.name


def main(argv: list[str]) -> None:
    """Run papermill's command line on ``argv``, warned as described above;
    with ``$GPUBROKER_KERNEL_PYTHON`` (and no ``-k``), the notebook runs in a
    kernel of that Python (the one it was submitted from)."""
    warn = os.environ.get("GPUBROKER_WARN_SIGNAL", "")
    if warn:
        signal.signal(getattr(signal, f"SIG{warn}"), signal.SIG_IGN)
    flag = os.environ.get("GPUBROKER_WARN_FILE", "")
    if flag:
        threading.Thread(target=watch, args=(Path(flag),), daemon=True).start()
    from papermill.cli import papermill

    python = os.environ.get("GPUBROKER_KERNEL_PYTHON", "")
    with tempfile.TemporaryDirectory(prefix="gpubroker-kernel-") as where:
        # the kernel's connection file goes here too, and a stop (SIGTERM)
        # removes the folder before it ends the run as the signal would
        tempfile.tempdir = where
        if warn != "TERM":
            signal.signal(signal.SIGTERM, functools.partial(_end_on_term, Path(where)))
        if python and "-k" not in argv:
            argv = [*argv, "-k", kernel_of(python, Path(where))]
        try:
            papermill.main(args=argv, prog_name="papermill")
        except SystemExit as end:
            if end.code != DEAD_KERNEL_EXIT:
                raise
            # papermill's exit for a dead kernel reads as "ended by signal
            # 10" (128 + 10: the broker's own warning signal); say what it is
            record_error(DeadKernelError(DEAD_KERNEL))
            raise SystemExit(1) from None
        except Exception as err:
            record_error(err)
            raise


#: papermill's command line exits with this when the kernel died
#: (``nbclient.exceptions.DeadKernelError``; papermill/cli.py)
DEAD_KERNEL_EXIT = 138
#: what the job's reason says then
DEAD_KERNEL = "the kernel died (killed, out of memory, or crashed); output up to its last cell"


class DeadKernelError(RuntimeError):
    """The notebook's kernel died (papermill exited :data:`DEAD_KERNEL_EXIT`)."""


def _end_on_term(where: Path, signum: int, _frame: object) -> None:
    """SIGTERM (the job's stop): remove ``where`` (the kernelspec and the
    kernel's connection file, which Python's default action would leave in
    the node's /tmp), then end by the signal itself, as the job's status
    reads it."""
    shutil.rmtree(where, ignore_errors=True)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


#: most characters of the line :func:`record_error` writes
ERROR_WIDTH = 300


def error_line(err: BaseException, interrupted: bool = False) -> str:
    """One line saying why papermill failed: a cell's exception as
    ``ENAME: EVALUE (at "In [N]")`` (papermill's ``PapermillExecutionError``
    names the cell's execution count; ``ENAME`` alone without a value),
    else ``Type: message``; after the broker's warning interrupted the
    kernel (``interrupted``), a ``KeyboardInterrupt`` is said to be that;
    at most :data:`ERROR_WIDTH` characters."""
    ename = getattr(err, "ename", None)
    if ename is not None:
        evalue = str(getattr(err, "evalue", "") or "").strip()
        line = f"{ename}: {evalue}" if evalue else str(ename)
        if interrupted and ename == "KeyboardInterrupt":
            line = f"interrupted on the broker's warning (time limit or preemption near): {line}"
        count = getattr(err, "exec_count", None)
        if count is not None:
            line += f' (at "In [{count}]")'
    else:
        line = f"{type(err).__name__}: {err}"
    line = " ".join(line.split())
    return line[:ERROR_WIDTH]


def record_error(err: BaseException) -> None:
    """Write :func:`error_line` of ``err`` to ``$GPUBROKER_JOB_ERROR_FILE``
    (none named: nothing); a write that fails is only reported on
    standard error (the job fails as it would anyway)."""
    path = os.environ.get("GPUBROKER_JOB_ERROR_FILE", "")
    if not path:
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(error_line(err, INTERRUPTED.is_set()) + "\n")
    except OSError as exc:
        print(f"gpubroker: cannot record the error in {path}: {exc}", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
