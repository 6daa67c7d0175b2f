"""Where a job's notebook and directory are, as the broker reads them:
relative to the user's home directory (the job's root), from the
directory a researcher submits in (a kernel's, or a shell's). Used by the
magics and by ``gpubroker jobs submit``."""

from __future__ import annotations

import os


def job_path(notebook: str) -> str:
    """``notebook`` as the broker reads it (relative to the home directory,
    the job's root): a relative name is one in the current directory, as
    Python's ``open()`` reads it; an absolute (or ``~``) path inside the
    home directory is made relative to it. A relative name is normalised
    (``sub/../a.ipynb`` is ``a.ipynb``), and taken from the home directory
    when the current directory is outside it; an absolute path outside
    the home directory is left as given (the broker refuses it)."""
    path = os.path.expanduser(notebook)
    if not os.path.isabs(path):
        here = relative_cwd()
        return os.path.normpath(path if here is None else os.path.join(here, path))
    home = os.path.realpath(os.path.expanduser("~"))
    real = os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
    return os.path.relpath(real, home) if real.startswith(home + os.sep) else path


def relative_cwd() -> str | None:
    """The current directory relative to the home directory (the job's
    root), or ``None`` (the root) when it is not inside it."""
    home, here = os.path.realpath(os.path.expanduser("~")), os.path.realpath(os.getcwd())
    if here == home or not here.startswith(home + os.sep):
        return None
    return os.path.relpath(here, home)
