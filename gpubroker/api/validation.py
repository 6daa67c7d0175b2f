"""Checks of request bodies and query arguments.

Each failure is a :class:`~gpubroker.errors.BadRequest` whose message names
the field and the limit, and is raised before anything changes.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ..devices.mig import PROFILE_NAME_RE
from ..errors import BadRequest
from ..store.models import HolderKind

#: JupyterHub user and server names: printable, at most 255 characters
_NAME = re.compile(r"^[^\s/][^/]{0,254}$")

LEASE_FIELDS = {
    "user",
    "server_name",
    "gpus",
    "holder_kind",
    "priority_class",
    "time_limit",
    "group",
    "mig_profile",
    "memory_gib",
    "count",
    "pool",
}

#: what a request may ask for: whole devices, one MIG instance, or shares
SLOT_FIELDS = ("gpus", "mig_profile", "memory_gib")

#: largest share one request may ask for, GiB (above any GPU made so far)
MAX_SHARE_GIB = 1024.0
#: smallest share, GiB: below it no framework cap or MPS limit is meaningful
MIN_SHARE_GIB = 0.25


#: longest time limit a lease may ask for, seconds (one year)
MAX_TIME_LIMIT = 365 * 86400.0


def parse_json_object(body: bytes) -> dict[str, Any]:
    """Decode a JSON object body (empty body → ``{}``).

    Raises:
        BadRequest: not JSON, or not an object.
    """
    if not body.strip():
        return {}
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as err:
        raise BadRequest(f"body: not valid JSON ({err})") from err
    if not isinstance(data, dict):
        raise BadRequest("body: must be a JSON object")
    return data


def require_int(data: dict[str, Any], key: str, low: int, high: int | None = None) -> int:
    """``data[key]`` as an int in ``low..high`` (booleans and strings refused).

    Raises:
        BadRequest: missing, not an integer, or out of range.
    """
    if key not in data:
        raise BadRequest(f"{key}: required")
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{key}: must be an integer, got {json.dumps(value)}")
    if value < low or (high is not None and value > high):
        upper = "" if high is None else f" and {high}"
        raise BadRequest(f"{key}: must be between {low}{upper}, got {value}")
    return value


def require_name(data: dict[str, Any], key: str, *, allow_empty: bool = False) -> str:
    """``data[key]`` as a JupyterHub-style name (no ``/``, 255 chars at most).

    Raises:
        BadRequest: missing, not a string, or malformed.
    """
    value = data.get(key, "" if allow_empty else None)
    if not isinstance(value, str):
        raise BadRequest(f"{key}: must be a string")
    if value == "" and allow_empty:
        return value
    if not _NAME.match(value):
        raise BadRequest(f"{key}: must be 1-255 characters without '/', got {value!r}")
    return value


def lease_request(data: dict[str, Any]) -> dict[str, Any]:
    """Validate a ``POST /leases`` body.

    Returns:
        ``{"user", "server_name", "gpus", "holder_kind", "priority_class",
        "time_limit", "group"}``; the upper bound of ``gpus``, the class
        names and the group membership are checked by the broker core.

    Raises:
        BadRequest: unknown field, or a field of the wrong type or range.
    """
    unknown = sorted(set(data) - LEASE_FIELDS)
    if unknown:
        raise BadRequest(
            f"{unknown[0]}: unknown field (allowed: {', '.join(sorted(LEASE_FIELDS))})"
        )
    kinds = [k.value for k in HolderKind]
    holder_kind = data.get("holder_kind", HolderKind.server.value)
    if holder_kind not in kinds:
        raise BadRequest(f"holder_kind: must be one of {kinds}, got {json.dumps(holder_kind)}")
    return {
        "user": require_name(data, "user"),
        "server_name": require_name(data, "server_name", allow_empty=True),
        **slot_request(data),
        "holder_kind": holder_kind,
        "priority_class": optional_name(data, "priority_class"),
        "time_limit": optional_seconds(data, "time_limit", MAX_TIME_LIMIT),
        "group": optional_name(data, "group"),
        "pool": optional_name(data, "pool"),
    }


def slot_request(data: dict[str, Any]) -> dict[str, Any]:
    """What a request asks for: exactly one of ``gpus`` (whole devices, >= 1),
    ``mig_profile`` (one MIG instance, e.g. ``1g.10gb``) or ``memory_gib``
    (a share of that many GiB, > 0; ``count`` shares on distinct devices,
    default 1).

    Returns:
        ``{"gpus": int | None, "mig_profile": str | None, "memory_gib":
        float | None, "count": int | None}``; limits that depend on the
        inventory (largest node, profiles of the pool's GPUs, device
        memory) are checked by the broker core.

    Raises:
        BadRequest: none or several of the three, wrong types or ranges,
            ``count`` without ``memory_gib``.
    """
    given = [k for k in SLOT_FIELDS if data.get(k) is not None]
    if len(given) != 1:
        raise BadRequest(
            f"{'/'.join(SLOT_FIELDS)}: give exactly one of them, got "
            + (", ".join(given) if given else "none")
        )
    shape: dict[str, Any] = {"gpus": None, "mig_profile": None, "memory_gib": None, "count": None}
    if given == ["gpus"]:
        shape["gpus"] = require_int(data, "gpus", 1)
    elif given == ["mig_profile"]:
        profile = data["mig_profile"]
        name = profile.strip().removeprefix("MIG ") if isinstance(profile, str) else None
        if name is None or not PROFILE_NAME_RE.match(name):
            raise BadRequest(
                f"mig_profile: must be a MIG profile name such as '1g.10gb', got "
                f"{json.dumps(profile)}"
            )
        shape["mig_profile"] = name
    else:
        memory = data["memory_gib"]
        if isinstance(memory, bool) or not isinstance(memory, (int, float)):
            raise BadRequest(f"memory_gib: must be a number of GiB, got {json.dumps(memory)}")
        if not MIN_SHARE_GIB <= memory <= MAX_SHARE_GIB:
            raise BadRequest(
                f"memory_gib: must be between {MIN_SHARE_GIB:g} and {MAX_SHARE_GIB:g} GiB,"
                f" got {memory}"
            )
        shape["memory_gib"] = float(memory)
    if data.get("count") is not None:
        if shape["memory_gib"] is None:
            raise BadRequest("count: only with memory_gib (the number of shares)")
        shape["count"] = require_int(data, "count", 1)
    return shape


def optional_name(data: dict[str, Any], key: str) -> str | None:
    """``data[key]`` as a name, or ``None`` when absent or null.

    Raises:
        BadRequest: present but not a well-formed name.
    """
    if data.get(key) is None:
        return None
    return require_name(data, key)


def optional_seconds(data: dict[str, Any], key: str, limit: float) -> float | None:
    """``data[key]`` as seconds in ``(0, limit]``, or ``None`` when absent or null.

    Raises:
        BadRequest: not a number, or out of range.
    """
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"{key}: must be a number of seconds, got {json.dumps(value)}")
    if not 0 < value <= limit:
        raise BadRequest(f"{key}: must be more than 0 and at most {limit:g} seconds, got {value}")
    return float(value)


def quota_body(data: dict[str, Any]) -> tuple[float, float | None]:
    """Validate a ``PUT /quotas/{kind}/{name}`` body ``{"guaranteed", "limit"}``.

    Raises:
        BadRequest: unknown field, negative numbers, limit below guarantee.
    """
    unknown = sorted(set(data) - {"guaranteed", "limit"})
    if unknown:
        raise BadRequest(f"{unknown[0]}: unknown field (allowed: guaranteed, limit)")
    guaranteed = data.get("guaranteed", 0)
    limit = data.get("limit")
    for key, value in (("guaranteed", guaranteed), ("limit", limit)):
        if value is None and key == "limit":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise BadRequest(f"{key}: must be a number of GPUs >= 0, got {json.dumps(value)}")
    if limit is not None and limit < guaranteed:
        raise BadRequest(f"limit: must be at least guaranteed ({guaranteed}), got {limit}")
    return float(guaranteed), None if limit is None else float(limit)


def flag(raw: str | None, name: str) -> bool:
    """A boolean query argument: absent/"false"/"0" or "true"/"1".

    Raises:
        BadRequest: any other value.
    """
    if raw is None or raw.lower() in ("false", "0"):
        return False
    if raw.lower() in ("true", "1"):
        return True
    raise BadRequest(f"{name}: must be true or false, got {raw!r}")


def wait_seconds(raw: str | None, limit: float) -> float:
    """The ``wait`` query argument in seconds, 0 (default) to ``limit``.

    Raises:
        BadRequest: not a number or outside ``0..limit``.
    """
    if raw is None:
        return 0.0
    try:
        value = float(raw)
    except ValueError as err:
        raise BadRequest(f"wait: must be a number of seconds, got {raw!r}") from err
    if not 0 <= value <= limit:
        raise BadRequest(f"wait: must be between 0 and {limit:g} seconds, got {raw}")
    return value


def optional_int(raw: str | None, name: str) -> int | None:
    """An optional non-negative integer query argument.

    Raises:
        BadRequest: present but not a non-negative integer.
    """
    if raw is None:
        return None
    if not raw.isdecimal():
        raise BadRequest(f"{name}: must be a non-negative integer, got {raw!r}")
    return int(raw)
