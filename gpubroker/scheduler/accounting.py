"""Who holds how much, what is within guarantees and what is borrowed.

Guarantees cover leases oldest first: first the user's own guarantee, then
the guarantee of the group the lease is charged to. A lease not covered is
*borrowed*: it runs on idle capacity and may be reclaimed.

Whether a new request is *within guarantee* (so it may reclaim, and a
non-preemptible class may run) is a different question: it asks what is
left of the guarantees after **all** GPUs held, borrowed ones included
(:meth:`Accounting.within_guarantee`). A lease larger than what was left
of a guarantee is borrowed as a whole, but it still uses that guarantee up:
otherwise a user above her guarantee could reclaim from others (docs/
scheduling.md, "Who may take GPUs back").
"""

from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass, field

from .types import Policy, Request, Running

#: slack in comparisons of GPU amounts (fractions add up with rounding errors)
EPS = 1e-9
_EPS = EPS


#: sort key of leases: oldest first, then by id
_by_start = operator.attrgetter("started", "lease_id")


@dataclass
class Accounting:
    """Holdings and guarantee coverage, updated as the pass grants requests.

    Attributes:
        user_held / group_held: GPUs held per user / group.
        user_covered / group_covered: GPUs held within guarantee.
        borrowed: ids of leases not covered by any guarantee.
        user_used / group_used: GPUs of the guarantees used by what is held,
            borrowed leases included (the user's guarantee first, then the
            group's): ``user_used`` is ``min(guaranteed, held)``.
    """

    policy: Policy
    user_held: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    group_held: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    user_covered: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    group_covered: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    borrowed: set[int] = field(default_factory=set)
    user_used: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    group_used: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    #: guaranteed GPUs per user, and per group (``None``: the group has no quota)
    _user_guarantee: dict[str, float] = field(default_factory=dict, repr=False)
    _group_guarantee: dict[str, float | None] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, policy: Policy, running: tuple[Running, ...]) -> Accounting:
        """Account for ``running`` leases, oldest first (as :meth:`add` each,
        with the quotas looked up once per user and group)."""
        acct = cls(policy)
        user_held, group_held = acct.user_held, acct.group_held
        user_covered, group_covered = acct.user_covered, acct.group_covered
        borrowed = acct.borrowed
        user_used, group_used = acct.user_used, acct.group_used
        user_guarantee, group_guarantee = acct._user_guarantee, acct._group_guarantee
        for lease in sorted(running, key=_by_start):
            user, group = lease.user, lease.group
            parts = lease.parts
            gpus = float(len(lease.devices))
            if parts:
                gpus += sum([p.weight for p in parts])
            # within_guarantee, then add: the arithmetic of _room, inlined
            guaranteed = user_guarantee.get(user)
            if guaranteed is None:
                guaranteed = user_guarantee[user] = policy.user_quota(user).guaranteed
            user_room = guaranteed - user_covered[user]
            if user_room < 0.0:
                user_room = 0.0
            group_room = 0.0
            group_guaranteed = None
            if group is not None:
                if group in group_guarantee:
                    group_guaranteed = group_guarantee[group]
                else:
                    quota = policy.group_quota(group)
                    group_guaranteed = None if quota is None else quota.guaranteed
                    group_guarantee[group] = group_guaranteed
                if group_guaranteed is not None:
                    group_room = group_guaranteed - group_covered[group]
                    if group_room < 0.0:
                        group_room = 0.0
            # _use, inlined
            unused = guaranteed - user_used[user]
            if unused > 0.0:
                from_user = unused if unused < gpus else gpus
                user_used[user] += from_user
                rest = gpus - from_user
            else:
                rest = gpus
            if group is not None and group_guaranteed is not None and rest > 0.0:
                unused = group_guaranteed - group_used[group]
                if unused > 0.0:
                    group_used[group] += unused if unused < rest else rest
            if gpus <= user_room + group_room + EPS:
                from_user = user_room if user_room < gpus else gpus
                user_covered[user] += from_user
                if group is not None:
                    group_covered[group] += gpus - from_user
            else:
                borrowed.add(lease.lease_id)
            user_held[user] += gpus
            if group is not None:
                group_held[group] += gpus
        return acct

    def holdings(self) -> Accounting:
        """A copy of the GPUs held per user and group (what
        :meth:`over_guarantee` reads), unaffected by later :meth:`add` calls."""
        return Accounting(
            self.policy,
            user_held=defaultdict(float, self.user_held),
            group_held=defaultdict(float, self.group_held),
        )

    def _room(self, user: str, group: str | None) -> tuple[float, float]:
        """GPUs ``user`` and ``group`` may still get within their guarantees (>= 0)."""
        guaranteed = self._user_guarantee.get(user)
        if guaranteed is None:
            guaranteed = self._user_guarantee[user] = self.policy.user_quota(user).guaranteed
        user_room = guaranteed - self.user_covered[user]
        if user_room < 0.0:  # max(user_room, 0.0)
            user_room = 0.0
        group_room = 0.0
        if group is not None:
            if group in self._group_guarantee:
                group_guaranteed = self._group_guarantee[group]
            else:
                quota = self.policy.group_quota(group)
                group_guaranteed = None if quota is None else quota.guaranteed
                self._group_guarantee[group] = group_guaranteed
            if group_guaranteed is not None:
                group_room = group_guaranteed - self.group_covered[group]
                if group_room < 0.0:
                    group_room = 0.0
        return user_room, group_room

    def _covers(self, user: str, group: str | None, gpus: float) -> bool:
        """Whether a lease of ``gpus`` more for ``user`` (charged to
        ``group``) would be covered: it fits in what the covered leases left
        of the guarantees (borrowed leases use none)."""
        guaranteed = self._user_guarantee.get(user)
        if guaranteed is None or (group is not None and group not in self._group_guarantee):
            user_room, group_room = self._room(user, group)  # looks the quotas up
            return gpus <= user_room + group_room + EPS
        user_room = guaranteed - self.user_covered[user]  # _room, inlined (hot)
        if user_room < 0.0:
            user_room = 0.0
        group_room = 0.0
        if group is not None:
            group_guaranteed = self._group_guarantee[group]
            if group_guaranteed is not None:
                group_room = group_guaranteed - self.group_covered[group]
                if group_room < 0.0:
                    group_room = 0.0
        return gpus <= user_room + group_room + EPS

    def within_guarantee(self, user: str, group: str | None, gpus: float) -> bool:
        """Whether ``gpus`` more for ``user`` (charged to ``group``) fit in
        what is left of the user's and the group's guarantees after all that
        is held, borrowed leases included: ``max(0, guaranteed - held)`` for
        the user, and the same for the group with what the users' own
        guarantees took first. Decides reclaim and whether a non-preemptible
        class may run (docs/scheduling.md, "Who may take GPUs back")."""
        self._room(user, group)  # looks the quotas up once
        left = self._user_guarantee[user] - self.user_used[user]
        if left < 0.0:
            left = 0.0
        if group is not None:
            group_guaranteed = self._group_guarantee[group]
            if group_guaranteed is not None:
                group_left = group_guaranteed - self.group_used[group]
                if group_left > 0.0:
                    left += group_left
        return gpus <= left + EPS

    def _use(self, user: str, group: str | None, gpus: float) -> None:
        """Count ``gpus`` more held by ``user`` against the unused part of
        the user's guarantee, then the rest against the group's."""
        unused = self._user_guarantee[user] - self.user_used[user]
        from_user = min(gpus, unused) if unused > 0.0 else 0.0
        self.user_used[user] += from_user
        rest = gpus - from_user
        if group is not None and rest > 0.0:
            group_guaranteed = self._group_guarantee[group]
            if group_guaranteed is not None:
                unused = group_guaranteed - self.group_used[group]
                if unused > 0.0:
                    self.group_used[group] += min(rest, unused)

    def add(self, lease_id: int, user: str, group: str | None, gpus: float) -> bool:
        """Record a lease; return whether it is covered (not borrowed)."""
        covered = self._covers(user, group, gpus)
        if covered:
            user_room, _ = self._room(user, group)
            from_user = min(gpus, user_room)
            self.user_covered[user] += from_user
            if group is not None:
                self.group_covered[group] += gpus - from_user
        else:
            self.borrowed.add(lease_id)
        self._use(user, group, gpus)
        self.user_held[user] += gpus
        if group is not None:
            self.group_held[group] += gpus
        return covered

    def limit_hit(
        self, request: Request, amount: float | None = None
    ) -> tuple[str, str, float, float] | None:
        """The first limit ``request`` would exceed, or ``None``; ``amount``:
        the GPUs it adds to what is held (default: ``request.amount``; 0 for
        a request already counted as held).

        Returns:
            ``("user"|"group", name, held, limit)``.
        """
        if amount is None:
            amount = request.amount
        limit = self.policy.user_quota(request.user).limit
        held = self.user_held[request.user]
        if limit is not None and held + amount > limit + _EPS:
            return ("user", request.user, held, limit)
        quota = self.policy.group_quota(request.group)
        if quota is not None and quota.limit is not None and request.group is not None:
            held = self.group_held[request.group]
            if held + amount > quota.limit + _EPS:
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
