"""Who holds how much, what is within guarantees and what is borrowed.

Guarantees cover leases oldest first: first the user's own guarantee, then
the guarantee of the group the lease is charged to. A lease not covered is
*borrowed*: it runs on idle capacity and may be reclaimed.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from .types import Policy, Request, Running

_EPS = 1e-9


@dataclass
class Accounting:
    """Holdings and guarantee coverage, updated as the pass grants requests.

    Attributes:
        user_held / group_held: GPUs held per user / group.
        user_covered / group_covered: GPUs held within guarantee.
        borrowed: ids of leases not covered by any guarantee.
    """

    policy: Policy
    user_held: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    group_held: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    user_covered: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    group_covered: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    borrowed: set[int] = field(default_factory=set)

    @classmethod
    def of(cls, policy: Policy, running: tuple[Running, ...]) -> Accounting:
        """Account for ``running`` leases, oldest first."""
        acct = cls(policy)
        for lease in sorted(running, key=lambda r: (r.started, r.lease_id)):
            acct.add(lease.lease_id, lease.user, lease.group, lease.gpus)
        return acct

    def _room(self, user: str, group: str | None) -> tuple[float, float]:
        user_room = self.policy.user_quota(user).guaranteed - self.user_covered[user]
        quota = self.policy.group_quota(group)
        group_room = 0.0
        if quota is not None and group is not None:
            group_room = quota.guaranteed - self.group_covered[group]
        return max(user_room, 0.0), max(group_room, 0.0)

    def within_guarantee(self, user: str, group: str | None, gpus: float) -> bool:
        """Whether ``gpus`` more for ``user`` (charged to ``group``) stay covered."""
        user_room, group_room = self._room(user, group)
        return gpus <= user_room + group_room + _EPS

    def add(self, lease_id: int, user: str, group: str | None, gpus: float) -> bool:
        """Record a lease; return whether it is within guarantee."""
        covered = self.within_guarantee(user, group, gpus)
        if covered:
            user_room, _ = self._room(user, group)
            from_user = min(gpus, user_room)
            self.user_covered[user] += from_user
            if group is not None:
                self.group_covered[group] += gpus - from_user
        else:
            self.borrowed.add(lease_id)
        self.user_held[user] += gpus
        if group is not None:
            self.group_held[group] += gpus
        return covered

    def limit_hit(self, request: Request) -> tuple[str, str, float, float] | None:
        """The first limit ``request`` would exceed, or ``None``.

        Returns:
            ``("user"|"group", name, held, limit)``.
        """
        limit = self.policy.user_quota(request.user).limit
        held = self.user_held[request.user]
        if limit is not None and held + request.amount > limit + _EPS:
            return ("user", request.user, held, limit)
        quota = self.policy.group_quota(request.group)
        if quota is not None and quota.limit is not None and request.group is not None:
            held = self.group_held[request.group]
            if held + request.amount > quota.limit + _EPS:
                return ("group", request.group, held, quota.limit)
        return None

    def over_guarantee(self, user: str, group: str | None) -> float:
        """How far ``user`` (or its group, whichever is more) is above guarantee."""
        user_over = self.user_held[user] - self.policy.user_quota(user).guaranteed
        quota = self.policy.group_quota(group)
        group_over = 0.0
        if quota is not None and group is not None:
            group_over = self.group_held[group] - quota.guaranteed
        return max(user_over, group_over)
