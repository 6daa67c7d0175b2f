"""Quotas that cannot do what they say, told to the admin who sets them.

Pure: from the policy in force and the GPUs in service. Nothing here
refuses a quota (capacity changes: devices are drained, nodes are added);
it says which guarantees cannot be met and which limits never hold anyone
back, so that a mistake is seen when it is made, not when a user waits.
"""

from __future__ import annotations

from collections.abc import Mapping

from .messages import gpus
from .types import Policy, Quota

EPS = 1e-9


def quota_warnings(policy: Policy, capacity: float) -> list[str]:
    """Sentences about the quotas of ``policy`` against ``capacity``.

    Args:
        policy: the policy in force (configured and stored quotas).
        capacity: GPUs in service (present, not drained), in device units
            (a MIG device or a time-sliced device counts as 1).

    Returns:
        one sentence per finding, in a stable order: for each quota (users,
        then groups, then the default user quota, by name) a guarantee above
        ``capacity`` (it cannot be met) or a limit above it (it never holds
        anyone back); then the users' and the groups' guarantees added up,
        when above ``capacity`` (they cannot all be met at once). Empty when
        there is nothing to say.
    """
    found: list[str] = []
    for kind, quotas in (("user", policy.user_quotas), ("group", policy.group_quotas)):
        for name, quota in sorted(quotas.items()):
            found += _one(f"{kind} {name}", quota, capacity)
    found += _one("the default user quota", policy.default_user_quota, capacity)
    found += _summed("users'", policy.user_quotas, capacity)
    found += _summed("groups'", policy.group_quotas, capacity)
    return found


def _one(who: str, quota: Quota, capacity: float) -> list[str]:
    """A guarantee above ``capacity``, else a limit above it."""
    if quota.guaranteed > capacity + EPS:
        return [
            f"{who}: its guarantee of {gpus(quota.guaranteed)} is above the "
            f"{gpus(capacity)} in service: it cannot be met"
        ]
    if quota.limit is not None and quota.limit > capacity + EPS:
        return [
            f"{who}: its limit of {gpus(quota.limit)} is above the {gpus(capacity)} "
            "in service: it never holds anyone back"
        ]
    return []


def _summed(whose: str, quotas: Mapping[str, Quota], capacity: float) -> list[str]:
    """The guarantees of ``quotas`` added up, when above ``capacity``."""
    total = sum(q.guaranteed for q in quotas.values())
    if total <= capacity + EPS:
        return []
    return [
        f"the {whose} guarantees add up to {gpus(total)}, above the {gpus(capacity)} "
        "in service: they cannot all be met at once"
    ]
