"""The spawn form and the parsing and checking of ``user_options``.

The form and the hub REST API share one ``user_options`` shape,
``{"gpus": N}``, and one check (:func:`check_gpu_options`), so a request that
the form could not make is refused the same way when posted to the API.
"""

from __future__ import annotations

import html
import json
from typing import Any

#: keys ``user_options`` may have
OPTION_KEYS = ("gpus",)


class OptionsError(ValueError):
    """``user_options`` are malformed or out of range; the message names the field."""


def options_from_form(formdata: dict[str, list[str]]) -> dict[str, Any]:
    """Turn the form's POST data (``{"gpus": ["2"]}``) into ``{"gpus": 2}``.

    A value that is not a decimal integer is kept as the string it was, so
    that :func:`check_gpu_options` refuses it with its usual message.
    """
    options: dict[str, Any] = {}
    for key in OPTION_KEYS:
        values = formdata.get(key)
        if values:
            raw = values[0].strip()
            options[key] = int(raw) if raw.isdecimal() else raw
    return options


def check_gpu_options(user_options: dict[str, Any] | None, limit: int, default: int = 0) -> int:
    """Validate ``user_options`` and return the number of GPUs asked for.

    Args:
        user_options: ``{"gpus": N}`` or ``{}``/``None`` (meaning ``default``).
        limit: the most GPUs this server may have (from the broker and config).
        default: GPUs when ``gpus`` is absent.

    Returns:
        an int in ``0..limit``.

    Raises:
        OptionsError: unknown key, non-integer ``gpus``, or out of range.
    """
    options = dict(user_options or {})
    unknown = sorted(set(options) - set(OPTION_KEYS))
    if unknown:
        raise OptionsError(f"{unknown[0]}: unknown option (allowed: {', '.join(OPTION_KEYS)})")
    gpus = options.get("gpus", default)
    if isinstance(gpus, bool) or not isinstance(gpus, int):
        raise OptionsError(
            f"gpus: must be an integer between 0 and {limit}, got {json.dumps(gpus)}"
        )
    if not 0 <= gpus <= limit:
        raise OptionsError(
            f"gpus: must be between 0 and {limit} (the most this server may have), got {gpus}"
        )
    return gpus


def render_form(limit: int, devices: dict[str, Any], default: int = 0) -> str:
    """HTML of the spawn form: a choice of 0..``limit`` GPUs with availability.

    Args:
        limit: the most GPUs this server may have.
        devices: the broker's ``GET /devices`` answer.
        default: the preselected count.
    """
    summary = devices.get("summary", {})
    backend = devices.get("backend", {})
    free, total = summary.get("free", 0), summary.get("total", 0)
    choices = []
    for n in range(limit + 1):
        label = "No GPU" if n == 0 else f"{n} x GPU" + (" (will queue)" if n > free else "")
        selected = " selected" if n == default else ""
        choices.append(f'<option value="{n}"{selected}>{html.escape(label)}</option>')
    note = ""
    if backend.get("simulated"):
        note = '<p class="text-warning">Simulated GPUs: these are not real NVIDIA GPUs.</p>'
    model = ""
    names = sorted({d["name"] for d in devices.get("devices", []) if d.get("present", True)})
    if names:
        model = f" ({html.escape(', '.join(names))})"
    return f"""
<div class="form-group">
  <label for="gpubroker-gpus">GPUs</label>
  <select id="gpubroker-gpus" name="gpus" class="form-select form-control">
    {"".join(choices)}
  </select>
  <p class="help-block">{free} of {total} GPUs free now{model}. If none are free,
  your server waits in the queue and this page shows your position.</p>
  {note}
</div>
"""
