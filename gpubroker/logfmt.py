"""The broker's log format: one record, one line.

Log messages carry text users chose (a release's reason, a job's command,
a server's name, an error a user's program printed). A newline in it forged
log lines that read as the broker's own ("... Lease 9 of bob: granted"),
and a terminal escape reached an admin's terminal. The message part of
every record is written with :func:`gpubroker.oneline.one_line`; a
traceback still follows on its own lines.
"""

from __future__ import annotations

import logging

from traitlets.config.application import LevelFormatter

from .oneline import one_line


class OneLineFormatter(LevelFormatter):
    """traitlets' :class:`LevelFormatter` (the ``WARNING |`` marks of
    ``gpubroker`` commands) with each record's message on one line."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = one_line(record.message)
        return super().formatMessage(record)
