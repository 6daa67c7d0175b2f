"""Admission of lease requests: which group is charged, limits, classes.

Part of :class:`gpubroker.core.Broker` (a mixin); every check raises before
anything is stored (engineering rule 6).
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from . import scheduler
from .errors import Forbidden
from .store.models import ACTIVE_STATES, Lease


class AdmissionMixin:
    """Checks run by :meth:`Broker.request_lease` before a lease is created."""

    @staticmethod
    def _charge_group(
        user: str, group: str | None, groups: list[str] | None, policy: scheduler.Policy
    ) -> str | None:
        with_quota = sorted(g for g in groups or () if g in policy.group_quotas)
        if group is not None:
            if groups is None:
                raise Forbidden(f"group: cannot check that {user!r} is in group {group!r} now")
            if group not in groups:
                raise Forbidden(f"group: {user!r} is not a member of group {group!r}")
            if with_quota and group not in with_quota:
                raise Forbidden(
                    f"group: charge one of your groups with a quota ({', '.join(with_quota)}),"
                    f" not {group!r}"
                )
            return group
        return with_quota[0] if with_quota else None

    @staticmethod
    def _check_guarantee_room(
        policy: scheduler.Policy, cls: str, user: str, group: str | None, gpus: int
    ) -> None:
        """A non-preemptible class runs only within guarantees: refuse what
        can never fit in them (403) rather than queue it forever."""
        if policy.class_of(cls).preemptible:
            return
        group_quota = policy.group_quota(group)
        room = policy.user_quota(user).guaranteed + (group_quota.guaranteed if group_quota else 0)
        if gpus > room:
            raise Forbidden(
                f"priority_class: {cls!r} is not preemptible and runs only within guarantees;"
                f" {gpus} GPUs exceed the {room:g} guaranteed to {user}"
                + (f" and group {group}" if group_quota else "")
            )

    def class_for_caller(
        self, name: str | None, admin: bool, policy: scheduler.Policy | None = None
    ) -> None:
        """Non-admins may ask only for the default class or lower, never a
        preempting one (admins and the spawner choose freely). ``policy``:
        the one in force, if the caller has it already.

        Raises:
            Forbidden: the class is above the caller's reach.
        """
        if admin or name is None:
            return
        policy = policy or self._policy()
        default_rank = policy.class_of(self.policy.default_priority_class).rank
        cls = policy.class_of(name)
        if cls.preempting or cls.rank > default_rank:
            raise Forbidden(
                f"priority_class: {name!r} may be requested only by broker admins or the spawner"
            )

    def _check_limits(
        self, session: Session, policy: scheduler.Policy, user: str, group: str | None, gpus: int
    ) -> None:
        """Refuse what would take held plus pending GPUs above a limit (403)."""
        active = list(session.scalars(select(Lease).where(Lease.state.in_(ACTIVE_STATES))))
        checks = [("user", user, policy.user_quota(user), [x for x in active if x.user == user])]
        quota = policy.group_quota(group)
        if quota is not None and group is not None:
            checks.append(("group", group, quota, [x for x in active if x.group_name == group]))
        for kind, name, q, leases in checks:
            taken = sum(x.gpus for x in leases)
            if q.limit is not None and taken + gpus > q.limit:
                raise Forbidden(
                    f"quota: {kind} {name} holds or waits for {taken:g} GPUs; {gpus} more would "
                    f"exceed the {kind} limit of {q.limit:g} GPUs"
                )
