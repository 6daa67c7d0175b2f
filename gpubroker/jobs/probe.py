"""Check, with a job's user's own rights, what a notebook job will use
(run as a script, as the job's user, by ``JobService.python`` with ``-I``:
it needs only the standard library, and ``jupyter_client`` when kernels are
asked for; never gpubroker).

The broker may be root: a check it made itself would accept a Python the
user may not run, or a notebook the user may not read, and would tell the
user about paths only root can see (trust rule). So the broker runs this
script as the user, with the job's ``HOME`` and the user's own variables,
and trusts its answer only for that user's job.

Reads one JSON object on standard input::

    {"python": PATH or "", "notebook": PATH or "", "kernels": true/false}

and writes one JSON object on standard output:

* ``python``: whether PATH is a regular file this user may execute
  (``null`` when none was asked);
* ``notebook``: ``{"kernel": NAME, "language": LANGUAGE}`` from the
  notebook's metadata (``kernelspec.name``; ``language_info.name``, else
  ``kernelspec.language``, as papermill reads them; ``""`` where missing),
  or ``{"error": WHY}`` when it cannot be read as JSON (``null``: none
  asked);
* ``kernels``: ``{"specs": {NAME: LANGUAGE}}`` of every kernelspec this
  user's ``jupyter_client`` finds (their ``~/.local/share/jupyter/kernels``,
  ``JUPYTER_PATH``, the Python's environment, the system's), or
  ``{"error": WHY}`` (``null``: none asked).
"""

from __future__ import annotations

import json
import os
import stat
import sys
from typing import Any


def python_ok(path: str) -> bool:
    """Whether ``path`` is a regular file this process's user may execute."""
    return os.path.isfile(path) and os.access(path, os.X_OK)


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def notebook_meta(path: str) -> dict[str, str]:
    """The kernel name and language a notebook's metadata gives papermill."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO put there does not block
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return {"error": "not a plain file"}
            nb = json.load(f)
    except (OSError, ValueError) as err:
        return {"error": getattr(err, "strerror", None) or str(err)}
    meta = nb.get("metadata") if isinstance(nb, dict) else None
    meta = meta if isinstance(meta, dict) else {}
    spec = meta.get("kernelspec") if isinstance(meta.get("kernelspec"), dict) else {}
    info = meta.get("language_info") if isinstance(meta.get("language_info"), dict) else {}
    language = _text(info.get("name")) or _text(spec.get("language"))
    return {"kernel": _text(spec.get("name")), "language": language}


def kernels() -> dict[str, Any]:
    """Every kernelspec this user's ``jupyter_client`` sees: ``{"specs":
    {name: language}}``, or ``{"error": why}``."""
    try:
        from jupyter_client.kernelspec import KernelSpecManager

        specs = KernelSpecManager().get_all_specs()
    except Exception as err:  # not installed, a broken kernel.json
        return {"error": f"{type(err).__name__}: {err}"}
    found = {str(n): _text((s.get("spec") or {}).get("language")) for n, s in specs.items()}
    return {"specs": found}


def main() -> None:
    """Answer the request on standard input (see the module's documentation)."""
    asked = json.load(sys.stdin)
    answer = {
        "python": python_ok(asked["python"]) if asked.get("python") else None,
        "notebook": notebook_meta(asked["notebook"]) if asked.get("notebook") else None,
        "kernels": kernels() if asked.get("kernels") else None,
    }
    sys.stdout.write(json.dumps(answer))


if __name__ == "__main__":
    main()
