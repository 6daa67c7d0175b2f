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
import os
import signal
import sys
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


def watch(flag: Path, interval: float = 0.5) -> None:
    """Wait for ``flag`` to exist, then interrupt the kernel once."""
    kernels: list[int] = []
    while not (flag.exists() and kernels):  # and the kernel has started
        time.sleep(interval)
        kernels = children(os.getpid())
    for pid in kernels:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGINT)
    print(
        f"gpubroker: warned by the broker; kernel interrupted (pids {kernels})",
        file=sys.stderr,
        flush=True,
    )


def main(argv: list[str]) -> None:
    """Run papermill's command line on ``argv``, warned as described above."""
    warn = os.environ.get("GPUBROKER_WARN_SIGNAL", "")
    if warn:
        signal.signal(getattr(signal, f"SIG{warn}"), signal.SIG_IGN)
    flag = os.environ.get("GPUBROKER_WARN_FILE", "")
    if flag:
        threading.Thread(target=watch, args=(Path(flag),), daemon=True).start()
    from papermill.cli import papermill

    papermill.main(args=argv, prog_name="papermill")


if __name__ == "__main__":
    main(sys.argv[1:])
