"""Checks of request bodies and query arguments.

Each failure is a :class:`~gpubroker.errors.BadRequest` whose message names
the field and the limit, and is raised before anything changes.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

from ..devices.mig import PROFILE_NAME_RE, profile_for_many
from ..errors import BadRequest, NotFound
from ..model.echo import echo
from ..model.limits import MAX_SHARE_GIB, MIN_SHARE_GIB
from ..store.models import HolderKind

#: longest name (user, server, group, pool, class, quota name), characters
MAX_NAME = 255
#: JupyterHub user and server names: no leading space, no '/', no control
#: characters (C0, DEL, C1) and no lone surrogates, at most MAX_NAME characters
_NAME = re.compile(r"^[^\s/\x00-\x1f\x7f-\x9f\ud800-\udfff][^/\x00-\x1f\x7f-\x9f\ud800-\udfff]*$")

#: deepest nesting of arrays/objects a JSON body may have
MAX_JSON_DEPTH = 32
#: largest id or version (SQLite and PostgreSQL integers are signed 64-bit)
MAX_INT64 = 2**63 - 1
#: a query argument's name shown as it is in a message (others JSON-escaped)
_PLAIN_ARG = re.compile(r"[A-Za-z0-9_.-]{1,60}")
#: a JSON string (skipped whole) or one bracket, for the depth check
_JSON_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def unknown_field(data: Mapping[str, Any], allowed: Iterable[str], what: str = "field") -> None:
    """Refuse the first key of ``data`` not in ``allowed``, naming it as
    sent when it is a plain name, else escaped and cut (:func:`echo`): a
    caller's key never puts a line break or a long text into a message
    or the log.

    Raises:
        BadRequest: ``<key>: unknown field (allowed: a, b)``.
    """
    known = set(allowed)
    unknown = sorted(set(data) - known)
    if unknown:
        name = unknown[0] if _PLAIN_ARG.fullmatch(unknown[0]) else echo(unknown[0])
        raise BadRequest(f"{name}: unknown {what} (allowed: {', '.join(sorted(known))})")


LEASE_FIELDS = {
    "restart_of",
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


#: longest time limit a lease may ask for, seconds (one year)
MAX_TIME_LIMIT = 365 * 86400.0


def _refuse_constant(name: str) -> Any:
    raise BadRequest(f"body: {name} is not a number JSON allows (finite numbers only)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BadRequest(f"body: number {echo(text)} is out of range (finite numbers only)")
    return value


def _int64(text: str) -> int:
    if len(text.lstrip("-")) > 19 or abs(value := int(text)) > MAX_INT64:
        raise BadRequest(
            f"body: integer {echo(text)} is out of range (at most {MAX_INT64} in magnitude)"
        )
    return value


def json_depth(body: bytes, limit: int = MAX_JSON_DEPTH) -> int:
    """How deeply arrays and objects nest in ``body`` (strings skipped), up to
    the first point beyond ``limit``; a cheap scan, no parse.

    Returns:
        the depth, or ``limit + 1`` as soon as the nesting exceeds ``limit``.
    """
    depth = deepest = 0
    for match in _JSON_TOKEN.finditer(body):
        token = match.group()
        if token in (b"[", b"{"):
            depth += 1
            if depth > limit:
                return depth
            deepest = max(deepest, depth)
        elif token in (b"]", b"}"):
            depth -= 1
    return deepest


def _check_strings(value: Any, where: str) -> None:
    """Refuse lone surrogates and NUL characters anywhere (keys and values)
    in a parsed body: no store keeps a NUL in text (PostgreSQL refuses it),
    and no program argument, environment variable or path can hold one."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            raise BadRequest(
                f"{where}: not valid Unicode (lone surrogate at character {err.start}),"
                f" got {echo(value)}"
            ) from err
        if "\x00" in value:
            raise BadRequest(
                f"{where}: must not contain a NUL character (at character"
                f" {value.index(chr(0))}), got {echo(value)}"
            )
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_strings(key, "body: a field name")
            _check_strings(item, key if where == "body" else where)
    elif isinstance(value, list):
        for item in value:
            _check_strings(item, where)


def parse_json_object(body: bytes) -> dict[str, Any]:
    """Decode a JSON object body (empty body → ``{}``).

    Only standard JSON is taken: ``NaN``, ``Infinity``, ``-Infinity`` and
    numbers beyond the float range (``1e400``) and integers beyond signed
    64 bits are refused, nesting deeper
    than :data:`MAX_JSON_DEPTH` is refused before parsing, and strings with
    lone surrogates (``"\\ud800"``) or NUL characters are refused.

    Raises:
        BadRequest: not JSON, not an object, too deep, a non-finite number, or
            a string that is not valid Unicode or holds a NUL character.
    """
    if not body.strip():
        return {}
    try:  # JSON text is UTF-8 (RFC 8259 §8.1); other encodings could hide brackets
        body.decode("utf-8")
    except UnicodeDecodeError as err:
        raise BadRequest(f"body: not UTF-8 ({err.reason} at byte {err.start})") from None
    if json_depth(body) > MAX_JSON_DEPTH:
        raise BadRequest(f"body: JSON nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        data = json.loads(
            body, parse_constant=_refuse_constant, parse_float=_finite_float, parse_int=_int64
        )
    except RecursionError as err:  # the depth scan should prevent it; never a 500
        raise BadRequest(f"body: JSON nested deeper than {MAX_JSON_DEPTH} levels") from err
    except (ValueError, UnicodeDecodeError) as err:
        raise BadRequest(f"body: not valid JSON ({err})") from err
    if not isinstance(data, dict):
        raise BadRequest("body: must be a JSON object")
    _check_strings(data, "body")
    return data


def check_name(value: Any, field: str, *, allow_empty: bool = False) -> str:
    """``value`` as a name of a user, server, group, pool, class or quota:
    1-:data:`MAX_NAME` characters, no ``/``, no control characters, no lone
    surrogates, no leading space, not ``.`` or ``..`` (``""`` too with
    ``allow_empty``).

    Args:
        value: what the caller sent (any JSON value, path or query argument).
        field: the field's name, for the message.

    Returns:
        the name, unchanged.

    Raises:
        BadRequest: not a string, or malformed.
    """
    if not isinstance(value, str):
        raise BadRequest(f"{field}: must be a string, got {echo(value)}")
    if value == "" and allow_empty:
        return value
    if len(value) > MAX_NAME or value in (".", "..") or not _NAME.match(value):
        raise BadRequest(
            f"{field}: must be 1-{MAX_NAME} characters without '/', control characters or"
            f" a leading space, and not '.' or '..', got {echo(value)}"
        )
    return value


def optional_name_arg(raw: str | None, field: str) -> str | None:
    """A name query argument (e.g. ``?user=``), or ``None`` when absent.

    Raises:
        BadRequest: present but malformed (see :func:`check_name`).
    """
    return None if raw is None else check_name(raw, field)


def lease_id(raw: str, what: str = "lease") -> int:
    """A lease (or job: ``what``) id from the URL path: ASCII digits, 1 to
    :data:`MAX_INT64`.

    Raises:
        NotFound: anything else (no lease or job can have that id).
    """
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 19 or not 0 < int(raw) <= MAX_INT64:
        raise NotFound(f"{what} {echo(raw)}: no such {what} (ids are 1 to {MAX_INT64})")
    return int(raw)


def require_int(data: dict[str, Any], key: str, low: int, high: int | None = None) -> int:
    """``data[key]`` as an int in ``low..high`` (booleans and strings refused).

    Raises:
        BadRequest: missing, not an integer, or out of range.
    """
    if key not in data:
        raise BadRequest(f"{key}: required")
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{key}: must be an integer, got {echo(value)}")
    if value < low or (high is not None and value > high):
        bounds = f"at least {low}" if high is None else f"between {low} and {high}"
        raise BadRequest(f"{key}: must be {bounds}, got {value}")
    return value


def require_name(data: dict[str, Any], key: str, *, allow_empty: bool = False) -> str:
    """``data[key]`` as a name (see :func:`check_name`).

    Raises:
        BadRequest: missing, not a string, or malformed.
    """
    if key not in data and not allow_empty:
        raise BadRequest(f"{key}: required, and missing")
    return check_name(data.get(key, ""), key, allow_empty=allow_empty)


#: what a ``DELETE /leases/{id}`` body may hold
RELEASE_FIELDS = frozenset({"reason", "holder_stopped"})
#: most characters of a release's reason
MAX_REASON = 1000


def release_body(data: dict[str, Any]) -> tuple[str | None, bool]:
    """Validate a ``DELETE /leases/{id}`` body: ``{"reason": TEXT,
    "holder_stopped": BOOL}``, both optional.

    Returns:
        the reason (``None``: absent, or empty) and ``holder_stopped``.

    Raises:
        BadRequest: an unknown field (a misspelt ``holder_stopped`` would
            otherwise be dropped and the server stopped first), a reason
            that is not a string of at most :data:`MAX_REASON` characters
            (``null`` included),
            a ``holder_stopped`` that is not a boolean.
    """
    unknown_field(data, RELEASE_FIELDS)
    reason = data.get("reason", "")
    if not isinstance(reason, str) or len(reason) > MAX_REASON:
        raise BadRequest(
            f"reason: must be a string of at most {MAX_REASON} characters, got {echo(reason)}"
        )
    stopped = data.get("holder_stopped", False)
    if not isinstance(stopped, bool):
        raise BadRequest(f"holder_stopped: must be true or false, got {echo(stopped)}")
    return reason or None, stopped


def lease_request(data: dict[str, Any]) -> dict[str, Any]:
    """Validate a ``POST /leases`` body.

    Returns:
        ``{"user", "server_name", "gpus", "holder_kind", "priority_class",
        "time_limit", "group"}``; the upper bound of ``gpus``, the class
        names and the group membership are checked by the broker core.

    Raises:
        BadRequest: unknown field, or a field of the wrong type or range.
    """
    unknown_field(data, LEASE_FIELDS)
    kinds = [k.value for k in HolderKind if k is not HolderKind.job]  # jobs: POST /jobs
    holder_kind = data.get("holder_kind", HolderKind.server.value)
    if holder_kind not in kinds:
        raise BadRequest(f"holder_kind: must be one of {kinds}, got {echo(holder_kind)}")
    return {
        "user": require_name(data, "user"),
        "server_name": require_name(data, "server_name", allow_empty=True),
        **slot_request(data),
        "holder_kind": holder_kind,
        "priority_class": optional_name(data, "priority_class"),
        "time_limit": optional_seconds(data, "time_limit", MAX_TIME_LIMIT),
        "group": optional_name(data, "group"),
        "pool": optional_name(data, "pool"),
        "restart_of": None
        if data.get("restart_of") is None
        else require_int(data, "restart_of", 1, MAX_INT64),
    }


#: fields of a ``POST /jobs`` body
JOB_FIELDS = frozenset(
    {"user", "notebook", "command", "params", "kernel", "python", "cwd", "env", "time", "retries"}
    | {"gpus", "mig_profile", "memory_gib", "count", "pool", "priority_class", "group"}
)


def job_request(data: dict[str, Any]) -> dict[str, Any]:
    """Validate a ``POST /jobs`` body's fields of the lease (what to run is
    checked by :func:`gpubroker.model.jobs.parse_spec`).

    Returns:
        the body with ``user`` and the slot fields checked.

    Raises:
        BadRequest: unknown field, or a field of the wrong type or range.
    """
    unknown_field(data, JOB_FIELDS)
    return {
        **data,
        "user": require_name(data, "user"),
        **slot_request(data),
        "priority_class": optional_name(data, "priority_class"),
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
        if data["gpus"] == 0 and not isinstance(data["gpus"], bool):
            raise BadRequest(
                "gpus: must be at least 1, got 0 (a lease holds GPUs: a server or "
                "job without a GPU needs no lease)"
            )
        shape["gpus"] = require_int(data, "gpus", 1)
    elif given == ["mig_profile"]:
        profile = data["mig_profile"]
        name = profile.strip().removeprefix("MIG ") if isinstance(profile, str) else None
        if name is None or not PROFILE_NAME_RE.match(name):
            raise BadRequest(
                f"mig_profile: must be a MIG profile name such as '1g.10gb', got {echo(profile)}"
            )
        shape["mig_profile"] = name
    else:
        memory = data["memory_gib"]
        if isinstance(memory, bool) or not isinstance(memory, (int, float)):
            raise BadRequest(f"memory_gib: must be a number of GiB, got {echo(memory)}")
        if not MIN_SHARE_GIB <= memory <= MAX_SHARE_GIB:
            raise BadRequest(
                f"memory_gib: must be between {MIN_SHARE_GIB:g} and {MAX_SHARE_GIB:g} GiB,"
                f" got {echo(memory)}"
            )
        shape["memory_gib"] = float(memory)
    if data.get("count") is not None:
        if shape["mig_profile"] is not None:
            raise BadRequest(_mig_count_hint(shape["mig_profile"], data["count"]))
        if shape["memory_gib"] is None:
            raise BadRequest("count: only with memory_gib (the number of shares)")
        shape["count"] = require_int(data, "count", 1)
    return shape


def _mig_count_hint(profile: str, count: Any) -> str:
    """The refusal of ``count`` with ``mig_profile``, with the profile to ask
    for instead (:func:`~gpubroker.devices.mig.profile_for_many`)."""
    message = "count: a MIG request is one instance (count is only for memory_gib shares)"
    if isinstance(count, bool) or not isinstance(count, int) or count < 2:
        return message
    found = profile_for_many(profile, count)
    if not found:
        return f"{message}; no single profile holds {count} x {profile}"
    names = sorted(set(found.values()))
    if len(names) == 1:
        return f"{message}; for {count} x {profile} ask for mig_profile {names[0]!r}"
    per_model = ", ".join(f"{name} on {model}" for model, name in sorted(found.items()))
    return f"{message}; for {count} x {profile} ask for one larger profile: {per_model}"


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
        raise BadRequest(f"{key}: must be a number of seconds, got {echo(value)}")
    if not 0 < value <= limit:
        raise BadRequest(
            f"{key}: must be more than 0 and at most {limit:g} seconds, got {echo(value)}"
        )
    return float(value)


#: what ``/quotas/{kind}/{name}`` may name
QUOTA_KINDS = ("user", "group")


def quota_path(kind: str, name: str) -> tuple[str, str]:
    """The ``{kind}`` and ``{name}`` of ``/quotas/{kind}/{name}``, checked.

    Returns:
        ``(kind, name)``, unchanged.

    Raises:
        BadRequest: ``kind`` is not ``user`` or ``group``
            (``kind: must be user or group, got "team"``), or ``name`` is
            malformed (see :func:`check_name`).
    """
    if kind not in QUOTA_KINDS:
        raise BadRequest(f"kind: must be {' or '.join(QUOTA_KINDS)}, got {echo(kind)}")
    return kind, check_name(name, "name")


def quota_body(data: dict[str, Any]) -> tuple[float, float | None]:
    """Validate a ``PUT /quotas/{kind}/{name}`` body ``{"guaranteed", "limit"}``.

    Raises:
        BadRequest: no field (an empty body would silently set the quota to
            0 guaranteed and no limit), an unknown field, negative numbers,
            limit below guarantee.
    """
    unknown_field(data, ("guaranteed", "limit"))
    if not data:
        raise BadRequest(
            'body: give "guaranteed" and/or "limit" (a PUT sets the whole quota: a missing '
            "guaranteed is 0, a missing limit is no limit)"
        )
    guaranteed = data.get("guaranteed", 0)
    limit = data.get("limit")
    for key, value in (("guaranteed", guaranteed), ("limit", limit)):
        if value is None and key == "limit":
            continue
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or value < 0
        ):
            raise BadRequest(f"{key}: must be a finite number of GPUs >= 0, got {echo(value)}")
    if limit is not None and limit < guaranteed:
        raise BadRequest(
            f"limit: must be at least guaranteed ({echo(guaranteed)}), got {echo(limit)}"
        )
    # + 0.0: a "-0.0" sent is stored and shown as 0.0
    return float(guaranteed) + 0.0, None if limit is None else float(limit) + 0.0


def flag(raw: str | None, name: str) -> bool:
    """A boolean query argument: absent/"false"/"0" or "true"/"1".

    Raises:
        BadRequest: any other value.
    """
    if raw is None or raw.lower() in ("false", "0"):
        return False
    if raw.lower() in ("true", "1"):
        return True
    raise BadRequest(f"{name}: must be true or false, got {echo(raw)}")


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
        raise BadRequest(f"wait: must be a number of seconds, got {echo(raw)}") from err
    if not 0 <= value <= limit:
        raise BadRequest(f"wait: must be between 0 and {limit:g} seconds, got {echo(raw)}")
    return value


def optional_int(raw: str | None, name: str, low: int = 0, high: int = MAX_INT64) -> int | None:
    """An optional integer query argument: ASCII digits, ``low`` to ``high``
    (default 0 to :data:`MAX_INT64`).

    Returns:
        the integer, or ``None`` when ``raw`` is ``None`` (absent).

    Raises:
        BadRequest: present but not such an integer; the message gives the
            range, e.g. ``limit: must be an integer from 1 to 10000, got "abc"``.
    """
    if raw is None:
        return None
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 19 or not low <= int(raw) <= high:
        raise BadRequest(f"{name}: must be an integer from {low} to {high}, got {echo(raw)}")
    return int(raw)


def query_argument(arguments: dict[str, list[bytes]], name: str) -> str | None:
    """The query argument ``name`` exactly as sent, decoded from UTF-8.

    Tornado's own ``get_argument`` turns control characters into spaces and
    strips the value, so ``?user=%00`` and ``?user=%20x`` would reach the
    checks as ``""`` and ``"x"``; this one keeps them, so that a check
    refuses them and its message shows them (``"\\u0000"``).

    Args:
        arguments: the request's ``query_arguments``.
        name: the argument's name.

    Returns:
        the value, or ``None`` when absent.

    Raises:
        BadRequest: given more than once (``?dry_run=true&dry_run=false``:
            which one counts is not for the server to guess), or not UTF-8.
    """
    values = arguments.get(name) or []
    if len(values) > 1:
        raise BadRequest(f"{name}: given {len(values)} times; give it once")
    if not values:
        return None
    try:
        return values[0].decode("utf-8")
    except UnicodeDecodeError as err:
        raise BadRequest(f"{name}: not UTF-8 ({err.reason} at byte {err.start})") from None


def known_arguments(arguments: dict[str, list[bytes]], allowed: frozenset[str]) -> None:
    """Refuse a query argument that is not in ``allowed``.

    Raises:
        BadRequest: naming the first unknown argument (in sorted order) and
            listing the allowed ones, e.g. ``limit: unknown query argument
            (allowed: by, format, from, to, tz, user)``.
    """
    unknown_field(arguments, allowed, "query argument")
