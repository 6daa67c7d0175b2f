"""The spawn form and the parsing and checking of ``user_options``.

The form and the hub REST API share one ``user_options`` shape and one
check, so a request that the form could not make is refused the same way
when posted to the API:

- without profiles: ``{"gpus": N}``, checked by :func:`check_gpu_options`;
- with ``gpu_profiles``: ``{"profile": SLUG}`` (KubeSpawner's key), checked by
  :func:`select_profile` and shown by :func:`render_profiles`.
"""

from __future__ import annotations

import html
import json
import re
from typing import Any

from . import profiles as _profiles

#: keys ``user_options`` may have
OPTION_KEYS = ("gpus",)


class OptionsError(ValueError):
    """``user_options`` are malformed or out of range; the message names the field."""


def options_from_form(formdata: dict[str, list[str]]) -> dict[str, Any]:
    """Turn the form's POST data (``{"gpus": ["2"]}``) into ``{"gpus": 2}``.

    A value that is not a decimal integer, or has more than
    :data:`MAX_FORM_DIGITS` digits, is kept as the string it was, so that
    :func:`check_gpu_options` refuses it with its usual message.
    """
    options: dict[str, Any] = {}
    for key in OPTION_KEYS:
        values = formdata.get(key)
        if values:
            raw = values[0].strip()
            options[key] = int(raw) if raw.isdecimal() and len(raw) <= MAX_FORM_DIGITS else raw
    return options


#: most digits of a form value turned into an integer (longer: kept as text)
MAX_FORM_DIGITS = 6
#: most characters of a refused value quoted in an error message
MAX_SHOWN = 40


def shown(value: Any) -> str:
    """``value`` as JSON for an error message, cut to :data:`MAX_SHOWN` characters."""
    try:
        text = json.dumps(value)
    except TypeError:  # not JSON
        text = f"a value of type {type(value).__name__}"
    except ValueError:  # an int too long to write out
        text = "a number too long to show"
    return text if len(text) <= MAX_SHOWN else f"{text[: MAX_SHOWN - 3]}..."


#: an option name or slug shown as sent in a message; any other is escaped
_PLAIN = re.compile(r"[A-Za-z0-9_.-]+")


def _key(name: Any) -> str:
    """An option's name (or a slug) for an error message and the hub's log:
    as sent when plain, else JSON-escaped (a line break or a terminal
    escape in a name must not reach either raw), cut to :data:`MAX_SHOWN`
    characters."""
    text = str(name)
    if not _PLAIN.fullmatch(text):
        text = json.dumps(text, ensure_ascii=True)
    return text if len(text) <= MAX_SHOWN else f"{text[: MAX_SHOWN - 3]}..."


def check_gpu_options(
    user_options: dict[str, Any] | None, limit: int | None, default: int = 0
) -> int:
    """Validate ``user_options`` and return the number of GPUs asked for.

    Args:
        user_options: ``{"gpus": N}`` or ``{}``/``None``; ``{"gpus": None}``
            (JSON ``null``) means not given, like ``{}``: ``default``.
        limit: the most GPUs this server may have (from the broker and
            config); ``None`` when the broker cannot be asked now: only the
            local checks run (an integer, not negative) and the caller checks
            the limit later.
        default: GPUs when ``gpus`` is absent or ``None``.

    Returns:
        an int in ``0..limit`` (``>= 0`` when ``limit`` is ``None``).

    Raises:
        OptionsError: unknown key, non-integer ``gpus``, or out of range.
    """
    options = dict(user_options or {})
    unknown = sorted(set(options) - set(OPTION_KEYS), key=str)
    if unknown:
        raise OptionsError(
            f"{_key(unknown[0])}: unknown option (allowed: {', '.join(OPTION_KEYS)})"
        )
    gpus = requested_gpus(options, default)
    between = f"between 0 and {limit}" if limit is not None else "0 or more"
    if isinstance(gpus, bool) or not isinstance(gpus, int):
        raise OptionsError(f"gpus: must be an integer {between}, got {shown(gpus)}")
    if gpus < 0 or (limit is not None and gpus > limit):
        most = " (the most this server may have)" if limit is not None else ""
        raise OptionsError(f"gpus: must be {between}{most}, got {shown(gpus)}")
    return gpus


def requested_gpus(user_options: dict[str, Any] | None, default: int = 0) -> Any:
    """The ``gpus`` value of ``user_options`` as given (unchecked), or
    ``default`` when absent or ``None`` (JSON ``null``: not given)."""
    gpus = (user_options or {}).get("gpus")
    return default if gpus is None else gpus


def count_choices(
    limit: int, default: int = 0, quota: dict[str, Any] | None = None, selected: Any = None
) -> tuple[list[int], int]:
    """Which GPU counts of ``0..limit`` the user's quota forbids, and which
    count the form preselects.

    Args:
        limit: the most GPUs this server may have.
        default: the configured ``default_gpus``.
        quota: the ``quota`` part of the broker's ``GET /pools?user=NAME``
            answer (GPU units; ``remaining`` ``None``: no limit), or ``None``
            when unknown (nothing is disabled).
        selected: the user's last choice (``user_options["gpus"]``, e.g. kept
            after the hub refused it with 403), preselected instead of
            ``default`` when it is an allowed count.

    Returns:
        ``(disabled, preselected)``: the counts over the remaining quota
        (never 0), and the preselected count: ``selected`` if allowed, else
        the largest allowed count below it, else ``default`` if allowed,
        else 0.
    """
    remaining = (quota or {}).get("remaining")
    disabled = [
        n for n in range(1, limit + 1) if remaining is not None and n > float(remaining) + 1e-9
    ]
    allowed = [n for n in range(limit + 1) if n not in disabled]
    if isinstance(selected, int) and not isinstance(selected, bool) and selected >= 0:
        below = [n for n in allowed if n <= selected]
        return disabled, below[-1]
    return disabled, default if default in allowed else 0


def render_form(
    limit: int,
    devices: dict[str, Any],
    default: int = 0,
    quota: dict[str, Any] | None = None,
    selected: Any = None,
) -> str:
    """HTML of the spawn form: a choice of 0..``limit`` GPUs with
    availability and, when the broker says, the user's quota room.

    Args:
        limit: the most GPUs this server may have.
        devices: the broker's ``GET /devices`` answer.
        default: the preselected count (``default_gpus``).
        quota: the ``quota`` part of ``GET /pools?user=NAME`` (GPU units), or
            ``None`` when the broker did not say: counts over ``remaining``
            are shown ``disabled`` with "(over your quota)", and a line says
            how many more GPUs the user may hold.
        selected: the user's last choice, preselected if allowed (see
            :func:`count_choices`).
    """
    summary = devices.get("summary", {})
    backend = devices.get("backend", {})
    # free whole GPUs (a broker before free_whole counted only those as free)
    free, total = summary.get("free_whole", summary.get("free", 0)), summary.get("total", 0)
    one_node = _free_on_one_node(devices.get("devices"), free)
    disabled, preselected = count_choices(limit, default, quota, selected)
    choices = []
    for n in range(limit + 1):
        label = "No GPU" if n == 0 else f"{n} x GPU"
        if n in disabled:
            label += " (over your quota)"
        elif n > one_node:  # a request's GPUs are all on one node
            label += " (will queue)"
        attrs = " selected" if n == preselected else ""
        attrs += " disabled" if n in disabled else ""
        choices.append(f'<option value="{n}"{attrs}>{html.escape(label)}</option>')
    note = ""
    if backend.get("simulated"):
        note = '<p class="text-warning">Simulated GPUs: these are not real NVIDIA GPUs.</p>'
    model = ""
    names = sorted({d["name"] for d in devices.get("devices", []) if d.get("present", True)})
    if names:
        model = f" ({html.escape(', '.join(names))})"
    quota_line = ""
    if quota:
        quota_line = (
            f'\n  <p class="help-block gpubroker-quota">{html.escape(_quota_line(quota))}</p>'
        )
    return f"""
<div class="form-group">
  <label for="gpubroker-gpus">GPUs</label>{quota_line}
  <select id="gpubroker-gpus" name="gpus" class="form-select form-control">
    {"".join(choices)}
  </select>
  <p class="help-block">{free} of {total} GPUs free now{model}. If none are free,
  your server waits in the queue and this page shows your position.</p>
  {note}
</div>
"""


# -- profiles ------------------------------------------------------------------------

#: the kind of pool each kind of request is placed in
POOL_MODES = {"gpus": "exclusive", "mig": "mig", "share": "timeslice"}
#: device memory assumed for a share's weight when the broker does not say
DEFAULT_DEVICE_GIB = 80.0


def profile_options_from_form(formdata: dict[str, list[str]]) -> dict[str, Any]:
    """The profile form's POST data (``{"profile": ["mig-small"]}``) →
    ``{"profile": "mig-small"}``; ``{}`` when no profile was chosen."""
    values = formdata.get("profile")
    if values and values[0].strip():
        return {"profile": values[0].strip()}
    return {}


def select_profile(
    profiles: list[dict[str, Any]], user_options: dict[str, Any] | None
) -> dict[str, Any]:
    """Validate ``user_options`` against checked ``profiles``; return the chosen one.

    Args:
        profiles: ``gpu_profiles`` as checked by
            :func:`~gpubroker_spawner.profiles.check_profiles`.
        user_options: ``{"profile": SLUG}``, or ``{}``/``None`` for the default
            profile (the one marked ``default``, else the first).

    Raises:
        OptionsError: a request field (``gpus``, ``mig_profile``, …) posted
            directly, an unknown option, or an unknown slug.
    """
    options = dict(user_options or {})
    slugs = ", ".join(p["slug"] for p in profiles)
    for key in _profiles.REQUEST_KEYS:
        if key in options:
            raise OptionsError(f"{key}: choose a profile (profile: {slugs})")
    unknown = sorted(set(options) - {"profile"}, key=str)
    if unknown:
        raise OptionsError(f"{_key(unknown[0])}: unknown option (allowed: profile)")
    slug = options.get("profile")
    if slug is None:
        return _profiles.default_profile(profiles)
    if not isinstance(slug, str):
        raise OptionsError(
            f"profile: must be the slug of a profile (choices: {slugs}), got {shown(slug)}"
        )
    for profile in profiles:
        if profile["slug"] == slug:
            return profile
    raise OptionsError(f"profile: unknown profile '{_key(slug)}' (choices: {slugs})")


def _article(word: str) -> str:
    return "an" if word[:1] in ("a", "e", "i", "o", "u") else "a"


def _pools_for(request: dict[str, Any], pools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The pools a request may be placed in: its ``pool``, else the pools of
    its kind's mode (interactive ones first), else all (the broker decides)."""
    if "pool" in request:
        return [p for p in pools if p.get("name") == request["pool"]]
    mode = POOL_MODES[_profiles.request_kind(request)]
    same = [p for p in pools if p.get("mode") == mode]
    interactive = [p for p in same if p.get("purpose", "interactive") == "interactive"]
    return interactive or same or list(pools)


def device_gib(pools: list[dict[str, Any]], devices: list[dict[str, Any]]) -> float:
    """Memory (GiB) of the largest device of ``pools``: from ``GET /devices``
    (``memory_total_mib`` of the devices in the pool, or of its models), else
    from the model names ("... 80GB ..."), else :data:`DEFAULT_DEVICE_GIB`.

    The largest device gives a share its smallest weight, so the form greys out
    only what the broker would surely refuse; the dry run at spawn decides."""
    names = {p.get("name") for p in pools}
    models = {m for p in pools for m in p.get("models") or []}
    mibs = [
        float(d["memory_total_mib"])
        for d in devices
        if d.get("memory_total_mib")
        and d.get("present", True)
        and (d["pool"] in names if d.get("pool") else d.get("name") in models)
    ]
    if mibs:
        return max(mibs) / 1024
    sizes = [float(m.group(1)) for m in map(re.compile(r"(\d+)\s*GB").search, models) if m]
    return max(sizes) if sizes else DEFAULT_DEVICE_GIB


def _free_on_one_node(devices: Any, free: int) -> int:
    """The most free whole GPUs on one node of ``GET /devices``'s
    ``devices`` (free, present, in an exclusive pool); ``free`` (the
    summary's ``free_whole``) when the list is empty or says nothing of nodes."""
    if (
        not isinstance(devices, list)
        or not devices
        or not all(isinstance(d, dict) and "state" in d and "node" in d for d in devices)
    ):
        return int(free)
    on_node: dict[str, int] = {}
    for d in devices:
        if (
            d.get("state") == "free"
            and d.get("present", True)
            and d.get("pool_mode")
            in (
                None,
                "exclusive",
            )
        ):
            node = str(d.get("node", ""))
            on_node[node] = on_node.get(node, 0) + 1
    return max(on_node.values(), default=0)


def _availability(request: dict[str, Any], pools: list[dict[str, Any]]) -> str:
    kind = _profiles.request_kind(request)
    if kind == "none":
        return "starts at once"
    free = [p.get("free") or {} for p in pools]
    if kind == "gpus":
        # its GPUs must all be on one node: free GPUs spread over nodes queue
        count = sum(int(f.get("gpus", 0)) for f in free)
        one_node = max((int(f.get("gpus_one_node", f.get("gpus", 0))) for f in free), default=0)
        return f"{count} free now" if one_node >= request["gpus"] else "will queue"
    if kind == "mig":
        count = sum(int((f.get("mig") or {}).get(request["mig_profile"], 0)) for f in free)
        return f"{count} free now" if count else "will queue"
    largest = max((float(f.get("share_gib", 0)) for f in free), default=0.0)
    if largest < float(request["memory_gib"]):
        return "will queue"
    count = int(request.get("count") or 1)
    if count > 1:
        # GET /pools gives the most free on one GPU, not how many GPUs have
        # that much: several shares (one per GPU) may wait
        return (
            f"may queue: {count} shares need {count} GPUs with "
            f"{_profiles.fmt(float(request['memory_gib']))} GiB free each; "
            f"up to {_profiles.fmt(largest)} GiB on one GPU"
        )
    return f"free now: up to {_profiles.fmt(largest)} GiB on one GPU"


def _quota_line(quota: dict[str, Any]) -> str:
    held = float(quota.get("held") or 0)
    pending = float(quota.get("pending") or 0)
    now = f"you hold {_profiles.fmt(held)}"
    if pending:
        now += f" and wait for {_profiles.fmt(pending)}"
    remaining = quota.get("remaining")
    if remaining is None:
        return f"No GPU quota limit applies to you ({now} GPU-equivalents)."
    return (
        f"You may hold {_equivalents(max(float(remaining), 0), 'more ')} "
        f"({now} of your limit of {_profiles.fmt(float(quota.get('limit') or 0))})."
    )


def _equivalents(value: float, between: str = "") -> str:
    """``1 GPU-equivalent``, ``1.5 more GPU-equivalents``."""
    text = _profiles.fmt(value)
    return f"{text} {between}GPU-equivalent" + ("" if text == "1" else "s")


def profile_choices(
    profiles: list[dict[str, Any]], pools: dict[str, Any], devices: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """What the form shows for each profile, unescaped: ``{"profile", "weight",
    "availability", "disabled" (a reason, or "")}``.

    Args:
        profiles: the checked ``gpu_profiles``.
        pools: the broker's ``GET /pools?user=NAME`` answer.
        devices: the broker's ``GET /devices`` answer (for device memory).
    """
    pool_list = list(pools.get("pools") or [])
    device_list = list((devices or {}).get("devices") or [])
    remaining = (pools.get("quota") or {}).get("remaining")
    choices = []
    for profile in profiles:
        request = profile["request"]
        kind = _profiles.request_kind(request)
        candidates = _pools_for(request, pool_list) if kind != "none" else []
        weight = _profiles.request_weight(request, device_gib(candidates, device_list))
        if kind == "mig":  # the broker's own weight where it says (A30: slices / 4)
            said = [p.get("mig_weights", {}).get(request["mig_profile"]) for p in candidates]
            weight = max((float(w) for w in said if w is not None), default=weight)
        disabled = ""
        if "pool" in request and not candidates:
            disabled = f"the broker has no pool {request['pool']!r}"
        elif kind != "none" and "pool" in request:
            wrong = [p for p in candidates if p.get("mode") != POOL_MODES[kind]]
            if wrong:
                mode, wanted = str(wrong[0].get("mode")), POOL_MODES[kind]
                disabled = (
                    f"pool {request['pool']!r} is {_article(mode)} {mode} pool, "
                    f"not {_article(wanted)} {wanted} one"
                )
        if not disabled and kind == "mig":
            offered = {m for p in candidates for m in (p.get("free") or {}).get("mig", {})}
            if candidates and request["mig_profile"] not in offered:
                disabled = f"no GPU here offers MIG {request['mig_profile']}"
        over = remaining is not None and weight > 0 and weight > float(remaining) + 1e-9
        if not disabled and over:
            disabled = (
                f"needs {_equivalents(weight)}; you may hold "
                f"{_profiles.fmt(max(float(remaining), 0))} more"
            )
        choices.append(
            {
                "profile": profile,
                "weight": weight,
                "availability": "" if disabled else _availability(request, candidates),
                "disabled": disabled,
            }
        )
    return choices


def render_profiles(
    profiles: list[dict[str, Any]],
    pools: dict[str, Any],
    devices: dict[str, Any] | None = None,
    selected: Any = None,
) -> str:
    """HTML of the spawn form with profiles: one radio choice per profile.

    Each choice shows the profile's name, description, guarantee, what is
    free now and its weight against the quota; a profile heavier than the
    user's remaining quota (or in a pool the broker lacks) is ``disabled``
    with the reason. The user's last choice (``selected``) is preselected
    when it is still offered and not disabled, else the ``default``
    profile, else the first that is not disabled. Every text is escaped.

    Args:
        profiles: the checked ``gpu_profiles``.
        pools: the broker's ``GET /pools?user=NAME`` answer.
        devices: the broker's ``GET /devices`` answer (device memory, and
            whether the GPUs are simulated).
        selected: the slug the user chose last (``user_options["profile"]``,
            e.g. kept after the hub refused it with 403), or ``None``.
    """
    choices = profile_choices(profiles, pools, devices)
    enabled = [c["profile"]["slug"] for c in choices if not c["disabled"]]
    default = _profiles.default_profile(profiles)["slug"] if profiles else None
    checked = default if default in enabled else (enabled[0] if enabled else None)
    if selected in enabled:
        checked = selected
    items = []
    for choice in choices:
        profile = choice["profile"]
        slug = html.escape(profile["slug"])
        attrs = " checked" if profile["slug"] == checked else ""
        attrs += " disabled" if choice["disabled"] else ""
        lines = [f"<strong>{html.escape(profile['display_name'])}</strong>"]
        if choice["availability"]:
            lines[0] += (
                f' <span class="gpubroker-availability text-muted">'
                f"({html.escape(choice['availability'])})</span>"
            )
        if profile["description"]:
            lines.append(f"<span>{html.escape(profile['description'])}</span>")
        lines.append(
            f'<small class="gpubroker-guarantee text-muted">Guarantee: '
            f"{html.escape(profile['guarantee'])}</small>"
        )
        if choice["weight"]:
            summary = html.escape(_profiles.request_summary(profile["request"]))
            lines.append(
                f'<small class="text-muted">{summary}; counts as '
                f"{_equivalents(choice['weight'])} against your quota</small>"
            )
        if choice["disabled"]:
            lines.append(
                f'<small class="gpubroker-disabled text-danger">Not available: '
                f"{html.escape(choice['disabled'])}</small>"
            )
        muted = " text-muted" if choice["disabled"] else ""
        items.append(
            f"""  <div class="form-check gpubroker-profile{muted}">
    <input class="form-check-input" type="radio" name="profile"
      id="gpubroker-profile-{slug}" value="{slug}"{attrs}>
    <label class="form-check-label" for="gpubroker-profile-{slug}">
      {"<br>".join(lines)}
    </label>
  </div>"""
        )
    quota = html.escape(_quota_line(pools.get("quota") or {}))
    note = ""
    if ((devices or {}).get("backend") or {}).get("simulated"):
        note = '<p class="text-warning">Simulated GPUs: these are not real NVIDIA GPUs.</p>'
    body = "\n".join(items)
    return f"""
<div class="form-group gpubroker-profiles">
  <label>GPU profile</label>
  <p class="help-block gpubroker-quota">{quota}</p>
{body}
  <p class="help-block">If what you choose is not free, your server waits in the queue
  and this page shows your position.</p>
  {note}
</div>
"""
