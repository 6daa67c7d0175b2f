"""How a caller's value is shown in an error message (pure), shared by the
API's validation and the modules that check request fields (jobs, usage
reports), so every message cuts and escapes alike."""

from __future__ import annotations

import json
from typing import Any

#: characters of a caller's value echoed back in an error message
MAX_ECHO = 60


def echo(value: Any) -> str:
    """A caller's value for an error message: its JSON form, ASCII only (so
    control characters and lone surrogates show escaped, ``"\\ud800"``), cut
    to :data:`MAX_ECHO` characters plus ``…``."""
    try:
        text = json.dumps(value, ensure_ascii=True)
    except (TypeError, ValueError, RecursionError):
        text = type(value).__name__
    return text if len(text) <= MAX_ECHO else text[:MAX_ECHO] + "…"
