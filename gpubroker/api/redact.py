"""Request logging without secrets.

JupyterHub tokens may come in the URL (``?token=…``): a logged URI must
never carry one. :func:`redact_uri` replaces the value of every query
argument whose name looks like a credential; :func:`log_request` is the
Tornado ``log_function`` of the API (the access log) and uses it.
"""

from __future__ import annotations

import logging
import re
from typing import Any
from urllib.parse import unquote

#: a query argument's name that marks its value as a secret (case-insensitive)
SECRET_NAME = re.compile(r"token|auth|secret|passw|key|session|cookie|xsrf", re.IGNORECASE)
#: what a secret value becomes in the log
REDACTED = "[redacted]"
#: longest URI written to the log, characters (the rest becomes ``…``)
MAX_LOGGED_URI = 300

_QUERY_ARG = re.compile(r"(?P<sep>^|[&;])(?P<name>[^=&;]*)=(?P<value>[^&;]*)")


def redact_uri(uri: str) -> str:
    """``uri`` with the values of credential-like query arguments replaced.

    Args:
        uri: a request URI, path and query (``/x?token=abc&user=ann``).

    Returns:
        the same URI with ``token=[redacted]`` (and likewise every argument
        whose name matches :data:`SECRET_NAME`), cut to
        :data:`MAX_LOGGED_URI` characters plus ``…``.
    """
    path, sep, query = uri.partition("?")
    if sep:

        def _hide(match: re.Match[str]) -> str:
            name = unquote(match.group("name"))
            if SECRET_NAME.search(name):
                return f"{match.group('sep')}{match.group('name')}={REDACTED}"
            return match.group(0)

        uri = path + "?" + _QUERY_ARG.sub(_hide, query)
    return uri if len(uri) <= MAX_LOGGED_URI else uri[:MAX_LOGGED_URI] + "…"


def request_summary(request: Any) -> str:
    """``METHOD URI (IP)`` of a Tornado request, with :func:`redact_uri`."""
    return f"{request.method} {redact_uri(request.uri or '')} ({request.remote_ip})"


def make_log_function(log: logging.Logger) -> Any:
    """A Tornado ``log_function`` writing the access log to ``log``.

    Successful requests are logged at DEBUG, 4xx at WARNING, 5xx at ERROR:
    ``STATUS METHOD URI (IP) MILLISECONDSms``, the URI redacted.
    """

    def log_request(handler: Any) -> None:
        status = handler.get_status()
        if status < 400:
            method = log.debug
        elif status < 500:
            method = log.warning
        else:
            method = log.error
        method(
            "%d %s %.2fms",
            status,
            request_summary(handler.request),
            1000.0 * handler.request.request_time(),
        )

    return log_request
