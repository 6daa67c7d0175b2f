"""Reading a file in a user's directory where the broker (or the hub) may
run as root: the user chooses what lies there (``ln -s /etc/shadow
job.log``), so no link at the path's end is followed and only a regular
file the user owns is read (the trust rule, DESIGN.md)."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from typing import BinaryIO


@contextlib.contextmanager
def open_owned(path: str, owner: int | None) -> Iterator[BinaryIO | None]:
    """``path`` opened for reading (binary), or ``None`` when it is missing,
    cannot be opened, is a link (not followed: ``O_NOFOLLOW``), is not a
    regular file, or is not owned by uid ``owner`` (``None``: no such
    account, nothing is read). A FIFO put there does not block the open
    (``O_NONBLOCK``); it is not a regular file, so it is not read. Closed at
    the end of the block."""
    if owner is None:
        yield None
        return
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        yield None
        return
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        yield f if stat.S_ISREG(info.st_mode) and info.st_uid == owner else None
