"""The scheduling policy as configuration: priority classes, quotas, fair share.

:class:`SchedulingPolicy` holds the traits an admin sets in
``gpubroker_config.py`` and builds the pure :class:`gpubroker.scheduler.Policy`
each pass, with quotas set through the admin API (stored in the database)
taking precedence over configured ones.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from traitlets import Dict, Float, Integer, List, TraitError, Unicode, validate
from traitlets.config import LoggingConfigurable

from .scheduler import DEFAULT_CLASSES, Policy, PriorityClass, Quota

_CLASS_KEYS = {"name", "rank", "preempting", "preemptible", "min_runtime", "grace"}

#: longest priority class name, characters (``leases.priority_class``)
MAX_CLASS_NAME = 64


def _quota(where: str, value: Any) -> Quota:
    """``{"guaranteed": GPUs, "limit": GPUs | None}`` -> :class:`Quota`.

    Raises:
        ValueError: unknown keys, negative numbers, or limit below guarantee.
    """
    if not isinstance(value, dict) or set(value) - {"guaranteed", "limit"}:
        raise ValueError(f"{where}: must be {{'guaranteed': GPUs, 'limit': GPUs or None}}")
    guaranteed = float(value.get("guaranteed", 0) or 0)
    limit = value.get("limit")
    limit = None if limit is None else float(limit)
    if guaranteed < 0 or (limit is not None and limit < guaranteed):
        raise ValueError(f"{where}: need 0 <= guaranteed <= limit, got {guaranteed} and {limit}")
    return Quota(guaranteed, limit)


class SchedulingPolicy(LoggingConfigurable):
    """Policy knobs of the broker's scheduler (see the "Scheduling policy" page)."""

    priority_classes = List(
        Dict(),
        default_value=[
            {
                "name": c.name,
                "rank": c.rank,
                "preempting": c.preempting,
                "preemptible": c.preemptible,
                "min_runtime": c.min_runtime,
                "grace": c.grace,
            }
            for c in DEFAULT_CLASSES
        ],
        help="""Priority classes, each a dict: name, rank (higher goes first),
        preempting (may preempt lower-rank preemptible classes), preemptible
        (may be preempted or reclaimed; a class that is not only runs within
        guarantees), min_runtime (seconds before it may be preempted), grace
        (seconds between the notice and the eviction).""",
    ).tag(config=True)

    default_priority_class = Unicode(
        "interactive", help="Class of requests that name none (notebook servers)."
    ).tag(config=True)

    user_quotas = Dict(
        help="""Per-user quotas in GPUs: {"ann": {"guaranteed": 1, "limit": 2}}.
        Quotas set through the admin API take precedence.""",
    ).tag(config=True)

    group_quotas = Dict(
        help="""Per-group (JupyterHub group) quotas in GPUs:
        {"vision": {"guaranteed": 4, "limit": 8}}. A lease is charged to one
        group: the one it names, else the user's first group with a quota.""",
    ).tag(config=True)

    default_user_quota = Dict(
        {"guaranteed": 0, "limit": None},
        help="Quota of users without their own: no guarantee, no limit by default.",
    ).tag(config=True)

    fairshare_half_life = Float(
        7 * 86400.0,
        help="""Seconds after which past GPU usage counts half for fair share
        (default 7 days, Slurm's default); a positive, finite number (Slurm's
        0, no decay at all, is not offered: usage is measured against the GPU
        capacity of one half-life).""",
    ).tag(config=True)

    fairshare_shares = Dict(
        help="""Fair-share weight per user (default 1), a positive, finite
        number: {'ann': 2} gives ann twice the share.""",
    ).tag(config=True)

    fairshare_resolution = Float(
        0.01,
        help="""Fair-share factors (0-1) are compared rounded to this step
        (more than 0, at most 1); ties go by age.""",
    ).tag(config=True)

    max_reservations = Integer(
        100,
        help="Blocked requests that get a reservation and an ETA per scheduling pass.",
    ).tag(config=True)

    def check_default_class(self) -> None:
        """Check that the default class is one of the classes, as the broker
        does at start (traitlets validates a value only when it is set: a
        ``priority_classes`` list without ``interactive`` and no
        ``default_priority_class`` loaded, and every spawn was then
        refused). The simulator does not ask: its jobs' default class is
        ``Enrichment.default_class``.

        Raises:
            TraitError: the default class is not one of the classes.
        """
        names = [c.get("name") for c in self.priority_classes]
        if self.default_priority_class not in names:
            raise TraitError(
                f"default_priority_class: must be one of {names}, got "
                f"{self.default_priority_class!r} (set it when priority_classes leaves "
                f"out {self.default_priority_class!r})"
            )

    @validate("priority_classes")
    def _check_classes(self, proposal: Any) -> list[dict[str, Any]]:
        self._classes(proposal["value"])
        return list(proposal["value"])

    @validate("default_user_quota")
    def _check_default_quota(self, proposal: Any) -> dict[str, Any]:
        try:
            _quota("default_user_quota", proposal["value"])
        except ValueError as err:
            raise TraitError(str(err)) from None
        return dict(proposal["value"])

    @validate("default_priority_class")
    def _check_default_class(self, proposal: Any) -> str:
        names = [c.get("name") for c in self.priority_classes]
        if proposal["value"] not in names:
            raise TraitError(f"default_priority_class: must be one of {names}")
        return str(proposal["value"])

    @validate("fairshare_half_life")
    def _check_half_life(self, proposal: Any) -> float:
        value = float(proposal["value"])
        if not (math.isfinite(value) and value > 0):
            raise TraitError(
                f"fairshare_half_life: must be a positive, finite number of seconds, got {value!r}"
            )
        return value

    @validate("fairshare_resolution")
    def _check_resolution(self, proposal: Any) -> float:
        value = float(proposal["value"])
        if not (math.isfinite(value) and 0 < value <= 1):
            raise TraitError(
                f"fairshare_resolution: must be more than 0 and at most 1, got {value!r}"
            )
        return value

    @validate("fairshare_shares")
    def _check_shares(self, proposal: Any) -> dict[str, float]:
        shares = {}
        for name, value in proposal["value"].items():
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not (ok and math.isfinite(value) and value > 0):
                raise TraitError(
                    f"fairshare_shares[{name!r}]: must be a positive, finite number, got {value!r}"
                )
            shares[str(name)] = float(value)
        return shares

    @validate("user_quotas", "group_quotas")
    def _check_quotas(self, proposal: Any) -> dict[str, Any]:
        for name, value in proposal["value"].items():
            try:
                _quota(f"{proposal['trait'].name}[{name!r}]", value)
            except ValueError as err:
                raise TraitError(str(err)) from None
        return dict(proposal["value"])

    @staticmethod
    def _classes(items: Iterable[dict[str, Any]]) -> dict[str, PriorityClass]:
        """The configured classes by name, checked as docs/scheduling.md
        ("Priority classes") lists: a bad value is refused here, at load,
        not left to crash every scheduling pass.

        Raises:
            TraitError: naming the class and the field at fault.
        """
        classes = {}
        for item in items:
            unknown = set(item) - _CLASS_KEYS
            if unknown or "name" not in item or "rank" not in item:
                raise TraitError(
                    f"priority_classes: each needs name and rank, and only {sorted(_CLASS_KEYS)};"
                    f" got {item!r}"
                )
            name = item["name"]
            if not isinstance(name, str) or not name:
                raise TraitError(f"priority_classes: name must be a non-empty string, got {name!r}")
            if len(name) > MAX_CLASS_NAME or "\x00" in name:
                # the store keeps it in 64 characters (leases, usage intervals):
                # PostgreSQL refuses a longer one at the first request of the class
                raise TraitError(
                    f"priority_classes: name must be at most {MAX_CLASS_NAME} characters"
                    f" without NUL, got {name[:80]!r} ({len(name)} characters)"
                )
            if name in classes:
                raise TraitError(f"priority_classes: class {name!r} is defined twice")
            rank = item["rank"]
            # bool is an int subclass; True as a rank is a mistake, not 1
            if not isinstance(rank, int) or isinstance(rank, bool):
                raise TraitError(
                    f"priority_classes: class {name!r}: rank must be an integer, got {rank!r}"
                )
            for key in ("preempting", "preemptible"):
                if key in item and not isinstance(item[key], bool):
                    raise TraitError(
                        f"priority_classes: class {name!r}: {key} must be True or False,"
                        f" got {item[key]!r}"
                    )
            for key in ("min_runtime", "grace"):
                value = item.get(key, 0)
                if (
                    not isinstance(value, (int, float))
                    or isinstance(value, bool)
                    or not 0 <= value < math.inf
                ):
                    raise TraitError(
                        f"priority_classes: class {name!r}: {key} must be seconds >= 0,"
                        f" got {value!r}"
                    )
            classes[name] = PriorityClass(**item)
        return classes

    def fingerprint(self) -> str:
        """The configured values :meth:`build` reads, as one string: equal
        strings build equal policies (for the broker's policy cache)."""
        return repr(
            (
                self.user_quotas,
                self.group_quotas,
                self.default_user_quota,
                self.priority_classes,
                self.fairshare_shares,
                self.fairshare_half_life,
                self.fairshare_resolution,
                self.max_reservations,
            )
        )

    def build(self, stored: Iterable[tuple[str, str, float, float | None]] = ()) -> Policy:
        """The pure :class:`Policy`, with ``stored`` quotas
        ``(kind, name, guaranteed, limit)`` overriding configured ones."""
        users = {n: _quota(f"user_quotas[{n!r}]", q) for n, q in self.user_quotas.items()}
        groups = {n: _quota(f"group_quotas[{n!r}]", q) for n, q in self.group_quotas.items()}
        for kind, name, guaranteed, limit in stored:
            (users if kind == "user" else groups)[name] = Quota(guaranteed, limit)
        return Policy(
            classes=self._classes(self.priority_classes),
            user_quotas=users,
            group_quotas=groups,
            default_user_quota=_quota("default_user_quota", self.default_user_quota),
            shares={k: float(v) for k, v in self.fairshare_shares.items()},
            half_life=self.fairshare_half_life,
            fairshare_resolution=self.fairshare_resolution,
            max_reservations=self.max_reservations,
        )
