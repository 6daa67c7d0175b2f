"""Spawn-form profiles (``GPUSpawnerMixin.gpu_profiles``): checking the
configured list, and what each profile's GPU request means.

A profile is a dict in the style of KubeSpawner's ``profile_list``::

    {
        "display_name": "MIG 1g.10gb",          # required
        "slug": "mig-small",                    # default: slugified display_name
        "description": "A seventh of an H100",  # optional
        "request": {"mig_profile": "1g.10gb"},  # {} = no GPU; see below
        "default": False,                       # at most one profile is the default
        "spawner_override": {"mem_limit": "16G"},
        "guarantee": "...",                     # default: from the request's kind
    }

``request`` is the GPU part of the broker's ``POST /leases`` body: ``{}`` (no
GPU), ``{"gpus": N}`` (whole devices), ``{"mig_profile": "1g.10gb"}`` (one
MIG instance) or ``{"memory_gib": X, "count": N}`` (N time-sliced shares of
X GiB), each optionally with ``"pool": NAME``.

Nothing here calls the broker; :mod:`.form` renders and selects profiles.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

#: keys a profile may have
PROFILE_KEYS = (
    "display_name",
    "slug",
    "description",
    "request",
    "default",
    "spawner_override",
    "guarantee",
)

#: keys of a profile's ``request`` (and of a lease request); one kind at most
REQUEST_KEYS = ("gpus", "mig_profile", "memory_gib", "count", "pool")
#: the broker's smallest share, GiB (gpubroker.model.limits.MIN_SHARE_GIB)
MIN_SHARE_GIB = 0.25
KIND_KEYS = ("gpus", "mig_profile", "memory_gib")

#: what each kind of slot guarantees, shown when a profile does not say
GUARANTEES = {
    "none": "no GPU is visible to the server",
    "gpus": "dedicated device: all memory and compute",
    "mig": "memory and compute isolated in hardware (MIG)",
    "share": (
        "memory cap enforced by the broker (soft unless MPS is on; with MPS the "
        "cap applies per CUDA process, so two processes of one server can each "
        "use the cap, while the broker's watchdog enforces the total per "
        "server); compute time-sliced with other users, no guaranteed share"
    ),
}

#: slices of compute a whole MIG-capable GPU has (a MIG instance weighs slices / 7)
MIG_COMPUTE_SLICES = 7

SLUG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
#: MIG profile names as NVIDIA writes them: "1g.10gb", "1g.10gb+me", "3g.40gb"
MIG_PROFILE_RE = re.compile(r"^([1-9])g\.([0-9]+)gb(\+me)?$")


def slugify(name: str) -> str:
    """``"Full H100 (80 GB)"`` → ``"full-h100-80-gb"``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def request_kind(request: dict[str, Any] | None) -> str:
    """``"none"``, ``"gpus"``, ``"mig"`` or ``"share"``."""
    request = request or {}
    if "gpus" in request:
        return "gpus"
    if "mig_profile" in request:
        return "mig"
    if "memory_gib" in request:
        return "share"
    return "none"


def mig_slices(mig_profile: str) -> int:
    """Compute slices of a MIG profile: ``"3g.40gb"`` → 3."""
    match = MIG_PROFILE_RE.match(mig_profile)
    if not match:
        raise ValueError(f"not a MIG profile name: {mig_profile!r}")
    return int(match.group(1))


def request_weight(request: dict[str, Any] | None, device_gib: float) -> float:
    """Device-units the request counts against a quota, as the broker charges:
    a whole GPU 1, a MIG instance its compute slices / 7, a share its memory
    over the device's (``device_gib``), times ``count``."""
    request = request or {}
    kind = request_kind(request)
    if kind == "gpus":
        return float(request["gpus"])
    if kind == "mig":
        return mig_slices(request["mig_profile"]) / MIG_COMPUTE_SLICES
    if kind == "share":
        return int(request.get("count", 1)) * float(request["memory_gib"]) / device_gib
    return 0.0


def fmt(value: float) -> str:
    """A number for people: ``1.5``, ``2``, ``0.14``."""
    return f"{round(value, 2):g}"


def request_summary(request: dict[str, Any] | None) -> str:
    """What a request asks for, worded like the broker's lease ``summary``:
    ``"2 x GPU"``, ``"1 x MIG 1g.10gb"``, ``"2 x shared GPU (10 GiB each)"``."""
    request = request or {}
    kind = request_kind(request)
    if kind == "gpus":
        return f"{request['gpus']} x GPU"
    if kind == "mig":
        return f"1 x MIG {request['mig_profile']}"
    if kind == "share":
        count = int(request.get("count", 1))
        each = " each" if count > 1 else ""
        return f"{count} x shared GPU ({fmt(float(request['memory_gib']))} GiB{each})"
    return "no GPU"


def check_request(request: Any) -> dict[str, Any]:
    """Check a profile's ``request``; return a copy.

    Raises:
        ValueError: the message starts with ``request.FIELD:`` (or ``request:``).
    """
    if not isinstance(request, dict):
        raise ValueError(f"request: must be a dict such as {{'gpus': 1}}, got {request!r}")
    unknown = sorted(set(request) - set(REQUEST_KEYS))
    if unknown:
        allowed = ", ".join(sorted(REQUEST_KEYS))
        raise ValueError(f"request.{unknown[0]}: unknown field (allowed: {allowed})")
    kinds = [key for key in KIND_KEYS if key in request]
    if len(kinds) > 1:
        raise ValueError(f"request: give one of {', '.join(KIND_KEYS)}, not {' and '.join(kinds)}")
    gpus = request.get("gpus")
    if "gpus" in request and (isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1):
        raise ValueError(f"request.gpus: must be an integer >= 1, got {gpus!r}")
    mig = request.get("mig_profile")
    if "mig_profile" in request and not (isinstance(mig, str) and MIG_PROFILE_RE.match(mig)):
        raise ValueError(
            f"request.mig_profile: must be a MIG profile name such as '1g.10gb', got {mig!r}"
        )
    memory = request.get("memory_gib")
    if "memory_gib" in request and (
        isinstance(memory, bool)
        or not isinstance(memory, (int, float))
        or not math.isfinite(memory)
        or memory < MIN_SHARE_GIB
    ):
        raise ValueError(
            f"request.memory_gib: must be a number >= {MIN_SHARE_GIB:g} (GiB), got {memory!r}"
        )
    if "count" in request:
        count = request["count"]
        if "memory_gib" not in request:
            raise ValueError("request.count: only goes with memory_gib (shares on distinct GPUs)")
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"request.count: must be an integer >= 1, got {count!r}")
    if "pool" in request:
        pool = request["pool"]
        if not kinds:
            raise ValueError("request.pool: needs gpus, mig_profile or memory_gib")
        if not isinstance(pool, str) or not pool:
            raise ValueError(f"request.pool: must be a pool name, got {pool!r}")
    return dict(request)


def check_profiles(profiles: list[Any], is_setting: Callable[[str], bool]) -> list[dict[str, Any]]:
    """Check ``gpu_profiles`` and fill in every default.

    Args:
        profiles: the configured list.
        is_setting: whether a ``spawner_override`` key names a setting the
            spawner lets profiles change.

    Returns:
        new dicts with all of :data:`PROFILE_KEYS`.

    Raises:
        ValueError: naming the item (``gpu_profiles[2] ('MIG 1g.10gb')``) and
            the field.
    """
    checked: list[dict[str, Any]] = []
    slugs: dict[str, int] = {}
    default_at: int | None = None
    for index, item in enumerate(profiles):
        where = f"gpu_profiles[{index}]"
        if not isinstance(item, dict):
            raise ValueError(f"{where}: must be a dict, got {item!r}")
        name = item.get("display_name")
        if isinstance(name, str) and name.strip():
            where += f" ({name!r})"
        try:
            profile = _check_profile(item, is_setting)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
        slug = profile["slug"]
        if slug in slugs:
            raise ValueError(
                f"{where}: slug: {slug!r} is already the slug of gpu_profiles[{slugs[slug]}]"
            )
        slugs[slug] = index
        if profile["default"]:
            if default_at is not None:
                raise ValueError(
                    f"{where}: default: only one profile may be the default "
                    f"(gpu_profiles[{default_at}] is)"
                )
            default_at = index
        checked.append(profile)
    return checked


def _check_profile(item: dict[str, Any], is_setting: Callable[[str], bool]) -> dict[str, Any]:
    unknown = sorted(set(item) - set(PROFILE_KEYS), key=str)
    if unknown:
        raise ValueError(f"{unknown[0]}: unknown key (allowed: {', '.join(PROFILE_KEYS)})")
    name = item.get("display_name")
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"display_name: must be a non-empty string, got {name!r}")
    slug = item.get("slug")
    if slug is None:
        slug = slugify(name)
        if not slug:
            raise ValueError("slug: cannot be made from display_name; set one")
    elif not isinstance(slug, str) or not SLUG_RE.match(slug):
        raise ValueError(
            f"slug: must be letters, digits, '.', '_' or '-' (not first), got {slug!r}"
        )
    description = item.get("description", "")
    if not isinstance(description, str):
        raise ValueError(f"description: must be a string, got {description!r}")
    request = check_request(item.get("request", {}))
    default = item.get("default", False)
    if not isinstance(default, bool):
        raise ValueError(f"default: must be True or False, got {default!r}")
    override = item.get("spawner_override", {})
    if not isinstance(override, dict):
        raise ValueError(f"spawner_override: must be a dict of settings, got {override!r}")
    for key in override:
        if not isinstance(key, str) or not is_setting(key):
            raise ValueError(f"spawner_override.{key}: not a setting a profile may change")
    guarantee = item.get("guarantee", GUARANTEES[request_kind(request)])
    if not isinstance(guarantee, str):
        raise ValueError(f"guarantee: must be a string, got {guarantee!r}")
    return {
        "display_name": name,
        "slug": slug,
        "description": description,
        "request": request,
        "default": default,
        "spawner_override": dict(override),
        "guarantee": guarantee,
    }


def default_profile(profiles: list[dict[str, Any]]) -> dict[str, Any]:
    """The profile marked ``default``, else the first."""
    for profile in profiles:
        if profile.get("default"):
            return profile
    return profiles[0]


def merged(current: dict[Any, Any], update: dict[Any, Any]) -> dict[Any, Any]:
    """``current`` updated recursively by ``update`` (a ``None`` value removes
    the key), as JupyterHub merges ``group_overrides``; neither is changed."""
    result = dict(current)
    for key, value in update.items():
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = merged(result[key], value)
        else:
            result[key] = value
    return result
