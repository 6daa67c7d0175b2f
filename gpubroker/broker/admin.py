"""Admin operations of the broker: quotas, priority classes, drain, the queue.

A part of the broker (:class:`gpubroker.core.Broker` delegates to it): each
is one command, one state change in one transaction, followed by a
scheduling pass, like every other change.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

from .. import scheduler
from ..commands import command
from ..errors import BadRequest, Conflict, NotFound
from ..policy_config import SchedulingPolicy
from ..scheduler.quota_check import quota_warnings
from ..store.models import Lease, LeaseState, QuotaRow
from ..store.repository import Repository
from ..views import device_view, lease_view
from .notices import notice_row
from .runner import CommandRunner, lease_or_404
from .world import World

#: ends a lease as an eviction does (:meth:`ServerStops.evict`): (lease, reason, now,
#: cause, actor) -> whether it is released now
Evict = Callable[[Lease, str, dt.datetime, str, str | None], bool]


class AdminOps:
    """Quotas, priority classes, drain, preemption and the queue (admin API).

    Args:
        runner: the broker's command runner.
        world: the broker's state in memory.
        config: the scheduling policy's configuration (configured quotas).
        policy: the pure policy in force (config plus stored quotas).
        schedule: run or ask for a scheduling pass in the open
            transaction (:meth:`Scheduling.schedule`).
        notify: wake the long-polls of changed leases.
        evict: end a lease as an eviction does.
        log: the broker's logger.
    """

    def __init__(
        self,
        runner: CommandRunner,
        world: World,
        config: SchedulingPolicy,
        policy: Callable[[], scheduler.Policy],
        schedule: Callable[[Repository, dt.datetime], None],
        notify: Callable[[], None],
        evict: Evict,
        log: Any,
    ) -> None:
        self.runner = runner
        self.world = world
        self.config = config
        self.policy = policy
        self.schedule = schedule
        self.notify = notify
        self.evict = evict
        self.log = log

    def quotas(self) -> dict[str, Any]:
        """Quotas in force: ``{"users": {…}, "groups": {…}, "default_user": {…},
        "warnings": [...]}``; ``warnings``: guarantees that cannot be met and
        limits that hold no one back, against the GPUs in service now
        (:func:`~gpubroker.scheduler.quota_check.quota_warnings`)."""
        policy = self.policy()
        capacity = float(sum(1 for d in self.world.present_devices() if not d.drained))

        def shape(q: scheduler.Quota) -> dict[str, float | None]:
            return {"guaranteed": q.guaranteed, "limit": q.limit}

        return {
            "users": {n: shape(q) for n, q in sorted(policy.user_quotas.items())},
            "groups": {n: shape(q) for n, q in sorted(policy.group_quotas.items())},
            "default_user": shape(policy.default_user_quota),
            "warnings": quota_warnings(policy, capacity),
        }

    @command("admin")
    def set_quota(self, kind: str, name: str, guaranteed: float, limit: float | None) -> None:
        """Store a quota (overrides config); applies from the next pass on.

        Lowering a quota never ends a running lease; it holds back pending ones.
        """
        with self.runner.write() as repo:
            row = repo.quota(kind, name) or QuotaRow(kind=kind, name=name)
            row.guaranteed, row.limit = guaranteed, limit
            repo.add(row)
            self.runner.audit(
                repo, "quota-set", f"{kind}:{name}", {"guaranteed": guaranteed, "limit": limit}
            )
            repo.flush()
            self.schedule(repo, self.runner.now())
        self.log.info("Quota of %s %s: guaranteed %s, limit %s", kind, name, guaranteed, limit)
        self.notify()

    @command("admin")
    def delete_quota(self, kind: str, name: str) -> None:
        """Remove a stored quota (the configured one, if any, applies again).

        Raises:
            NotFound: no quota stored for ``kind`` ``name`` (the message
                says so when the configuration sets one: that one is
                changed in the broker's config, not through the API).
        """
        with self.runner.write() as repo:
            row = repo.quota(kind, name)
            if row is None:
                configured = getattr(self.config, f"{kind}_quotas", {})
                where = (
                    f"; its quota {configured[name]} comes from the configuration "
                    f"(SchedulingPolicy.{kind}_quotas) and is changed there"
                    if name in configured
                    else ""
                )
                raise NotFound(f"quota: no stored quota for {kind} {name!r}{where}")
            repo.delete(row)
            self.runner.audit(repo, "quota-deleted", f"{kind}:{name}", {})
            repo.flush()
            self.schedule(repo, self.runner.now())
        self.notify()

    @command("admin")
    def set_priority_class(self, lease_id: int, priority_class: str) -> dict[str, Any]:
        """Move a pending request to another priority class.

        Raises:
            NotFound: no such lease. BadRequest: unknown class.
            Conflict: the lease is not pending.
        """
        classes = self.policy().classes
        if priority_class not in classes:
            raise BadRequest(
                f"priority_class: must be one of {sorted(classes)}, got {priority_class!r}"
            )
        with self.runner.write() as repo:
            lease = lease_or_404(repo, lease_id)
            if lease.state != LeaseState.pending.value:
                raise Conflict(f"priority_class: lease {lease_id} is {lease.state}, not pending")
            before, lease.priority_class = lease.priority_class, priority_class
            lease.version += 1
            now = self.runner.now()
            self.runner.rec(repo, now).note(
                lease, "priority-changed", f"priority class {before} -> {priority_class}"
            )
            repo.flush()
            self.schedule(repo, self.runner.now())
            view = lease_view(lease)
        self.notify()
        return view

    @command("admin")
    def set_drained(self, uuid: str, drained: bool) -> dict[str, Any]:
        """Drain (no new grants; running leases continue) or undrain a device.

        Raises:
            NotFound: no such device.
        """
        with self.runner.write() as repo:
            device = repo.device(uuid)
            if device is None:
                raise NotFound(f"device {uuid}: no such device")
            device.drained = drained
            action = "device-drained" if drained else "device-undrained"
            self.runner.audit(repo, action, uuid, {"node": device.node, "index": device.index})
            repo.flush()
            self.schedule(repo, self.runner.now())
            view = device_view(device) | {"drained": device.drained}
        self.log.info("Device %s %s", uuid, "drained" if drained else "back in service")
        self.notify()
        return view

    @command("admin")
    def preempt_lease(self, lease_id: int, reason: str) -> dict[str, Any]:
        """An admin's preemption of a granted lease: its holder gets a
        ``preempted`` notice with ``reason``; a hub server is stopped first
        and the lease released once it has stopped (as the scheduler's
        preemptions are; that release names the scheduler as its actor and
        carries the admin's name in its reason), a batch job's process is
        stopped first by the job service, anything else is released now.
        Recorded in the audit log (``lease-preempted``, target
        ``user:NAME``) with the admin's name.

        Raises:
            NotFound: no such lease. Conflict: the lease is not granted.
        """
        now = self.runner.now()
        actor = self.runner.actor
        with self.runner.write() as repo:
            lease = lease_or_404(repo, lease_id)
            if lease.state != LeaseState.granted.value:
                raise Conflict(
                    f"lease {lease_id}: is {lease.state}, only a granted lease is preempted"
                )
            text = f"preempted by {actor}: {reason}"
            self.runner.rec(repo, now).note(lease, "preempted", text)
            repo.add(notice_row(lease, "preempted", text, now))
            detail = {"lease_id": lease_id, "reason": reason}
            # target the user: the audit's user filter finds it
            self.runner.audit(repo, "lease-preempted", f"user:{lease.user}", detail, reason)
            if self.evict(lease, text, now, "preemption", actor):
                repo.flush()
                self.schedule(repo, now)
            view = lease_view(lease)
        self.log.warning("Lease %s of %s %s", lease_id, view["user"], text)
        self.notify()
        return view

    def queue(self) -> list[dict[str, Any]]:
        """Pending leases in queue order (position 1 first)."""
        pending = [x for x in self.world.active() if x.state == LeaseState.pending.value]
        views = [lease_view(lease) for lease in pending]
        # requests no pass has placed yet (``Queued``, no position) come last
        return sorted(views, key=lambda v: (v["queue"]["position"] or float("inf"), v["id"]))
