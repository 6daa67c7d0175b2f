"""The broker's log lines: a user's text cannot forge lines or reach an
admin's terminal as escapes (found by an adversarial review: a release
reason with a newline wrote a line that read as the broker's own)."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import pytest

from gpubroker.app import GPUBrokerApp
from gpubroker.logfmt import OneLineFormatter
from gpubroker.oneline import one_line

FORGED = "bye\n[I 2026-12-07 10:00:00.000 GPUBrokerApp] Lease 9 of bob: granted\x1b[2K\u2028"


def _logger(stream: io.StringIO) -> logging.Logger:
    handler = logging.StreamHandler(stream)
    handler.setFormatter(OneLineFormatter(fmt="[%(levelname)1.1s %(name)s] %(message)s"))
    log = logging.getLogger("test-logfmt")
    log.handlers[:] = [handler]
    log.propagate = False
    log.setLevel(logging.INFO)
    return log


def test_a_users_text_in_a_message_stays_on_its_line() -> None:
    stream = io.StringIO()
    _logger(stream).info("Released lease %s of %s: %s", 7, "ann", FORGED)
    (line,) = stream.getvalue().splitlines()
    assert line == (
        "[I test-logfmt] Released lease 7 of ann: bye\\n[I 2026-12-07 10:00:00.000 "
        "GPUBrokerApp] Lease 9 of bob: granted\\x1b[2K\\u2028"
    )


def test_a_traceback_still_follows_on_its_own_lines() -> None:
    stream = io.StringIO()
    log = _logger(stream)
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("Failed: %s", "a\nb")
    lines = stream.getvalue().splitlines()
    assert lines[0] == "[I test-logfmt] Failed: a\\nb".replace("[I", "[E")
    assert lines[1] == "Traceback (most recent call last):" and lines[-1] == "ValueError: boom"


@pytest.fixture
def app_logging() -> Iterator[None]:
    """Put back the loggers an application's logging setup changes (the
    ``gpubroker`` logger stops propagating: caplog in later tests reads
    the root logger)."""
    names = ("gpubroker", "GPUBrokerApp")
    saved = [(logging.getLogger(n), logging.getLogger(n).handlers[:]) for n in names]
    propagate = [logger.propagate for logger, _ in saved]
    yield
    for (logger, handlers), flag in zip(saved, propagate, strict=True):
        logger.handlers[:] = handlers
        logger.propagate = flag


def test_the_broker_logs_with_it(app_logging: None) -> None:
    app = GPUBrokerApp()
    app.log_level = logging.INFO  # the log's handler is configured on first use
    (handler,) = app.log.handlers
    assert isinstance(handler.formatter, OneLineFormatter)


def test_one_line_keeps_printable_text() -> None:
    assert one_line("Zoë's notebook (1).ipynb") == "Zoë's notebook (1).ipynb"
    assert one_line("a\tb\r\n") == "a\\tb\\r\\n"


def test_the_modules_loggers_and_the_subcommands_write_one_line_too(app_logging: None) -> None:
    """The local engine logs through ``gpubroker.engines.local``: its lines
    reached stderr through Python's last resort, unformatted; and the
    subcommands (report, audit, jobs, simulate, serve, upgrade-db) are
    applications of their own, with traitlets' plain formatter."""
    from gpubroker.app import ServeCommand, UpgradeDBCommand
    from gpubroker.jobs.cli import JobsCommand, ListCommand
    from gpubroker.observe.cli import AuditCommand
    from gpubroker.simulate.cli import SimulateCommand
    from gpubroker.usage.cli import ReportCommand

    GPUBrokerApp().log_level = logging.INFO
    (handler,) = logging.getLogger("gpubroker").handlers
    assert not logging.getLogger("gpubroker").propagate
    assert isinstance(handler.formatter, OneLineFormatter)
    for command in (
        ServeCommand,
        UpgradeDBCommand,
        JobsCommand,
        ListCommand,
        AuditCommand,
        ReportCommand,
        SimulateCommand,
    ):
        assert command._log_formatter_cls is OneLineFormatter, command
