"""Admin operations of the broker: quotas, priority classes, drain, the queue.

Part of :class:`gpubroker.core.Broker` (a mixin): each is one state change in
one transaction, followed by a scheduling pass, like every other change.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from . import scheduler
from .commands import command
from .errors import BadRequest, Conflict, NotFound
from .notices import notice_row
from .store import audit_repo
from .store.models import LeaseState, QuotaRow
from .store.repository import Repository
from .views import device_view, lease_view


class AdminMixin:
    """Quotas, priority classes, drain and the queue (admin API)."""

    def quotas(self) -> dict[str, Any]:
        """Quotas in force: ``{"users": {…}, "groups": {…}, "default_user": {…}}``."""
        policy = self._policy()

        def shape(q: scheduler.Quota) -> dict[str, float | None]:
            return {"guaranteed": q.guaranteed, "limit": q.limit}

        return {
            "users": {n: shape(q) for n, q in sorted(policy.user_quotas.items())},
            "groups": {n: shape(q) for n, q in sorted(policy.group_quotas.items())},
            "default_user": shape(policy.default_user_quota),
        }

    @command("admin")
    def set_quota(self, kind: str, name: str, guaranteed: float, limit: float | None) -> None:
        """Store a quota (overrides config); applies from the next pass on.

        Lowering a quota never ends a running lease; it holds back pending ones.
        """
        with self._write() as repo:
            row = repo.quota(kind, name) or QuotaRow(kind=kind, name=name)
            row.guaranteed, row.limit = guaranteed, limit
            repo.add(row)
            self._audit(
                repo, "quota-set", f"{kind}:{name}", {"guaranteed": guaranteed, "limit": limit}
            )
            repo.flush()
            self._schedule(repo, dt.datetime.now(dt.timezone.utc))
        self.log.info("Quota of %s %s: guaranteed %s, limit %s", kind, name, guaranteed, limit)
        self._notify()

    @command("admin")
    def delete_quota(self, kind: str, name: str) -> None:
        """Remove a stored quota (the configured one, if any, applies again).

        Raises:
            NotFound: no quota stored for ``kind`` ``name`` (the message
                says so when the configuration sets one: that one is
                changed in the broker's config, not through the API).
        """
        with self._write() as repo:
            row = repo.quota(kind, name)
            if row is None:
                configured = getattr(self.policy, f"{kind}_quotas", {})
                where = (
                    f"; its quota {configured[name]} comes from the configuration "
                    f"(SchedulingPolicy.{kind}_quotas) and is changed there"
                    if name in configured
                    else ""
                )
                raise NotFound(f"quota: no stored quota for {kind} {name!r}{where}")
            repo.delete(row)
            self._audit(repo, "quota-deleted", f"{kind}:{name}", {})
            repo.flush()
            self._schedule(repo, dt.datetime.now(dt.timezone.utc))
        self._notify()

    @command("admin")
    def set_priority_class(self, lease_id: int, priority_class: str) -> dict[str, Any]:
        """Move a pending request to another priority class.

        Raises:
            NotFound: no such lease. BadRequest: unknown class.
            Conflict: the lease is not pending.
        """
        classes = self._policy().classes
        if priority_class not in classes:
            raise BadRequest(
                f"priority_class: must be one of {sorted(classes)}, got {priority_class!r}"
            )
        with self._write() as repo:
            lease = self._get(repo, lease_id)
            if lease.state != LeaseState.pending.value:
                raise Conflict(f"priority_class: lease {lease_id} is {lease.state}, not pending")
            before, lease.priority_class = lease.priority_class, priority_class
            lease.version += 1
            now = dt.datetime.now(dt.timezone.utc)
            self._rec(repo, now).note(  # type: ignore[attr-defined]
                lease, "priority-changed", f"priority class {before} -> {priority_class}"
            )
            repo.flush()
            self._schedule(repo, dt.datetime.now(dt.timezone.utc))
            view = lease_view(lease)
        self._notify()
        return view

    @command("admin")
    def set_drained(self, uuid: str, drained: bool) -> dict[str, Any]:
        """Drain (no new grants; running leases continue) or undrain a device.

        Raises:
            NotFound: no such device.
        """
        with self._write() as repo:
            device = repo.device(uuid)
            if device is None:
                raise NotFound(f"device {uuid}: no such device")
            device.drained = drained
            action = "device-drained" if drained else "device-undrained"
            self._audit(repo, action, uuid, {"node": device.node, "index": device.index})
            repo.flush()
            self._schedule(repo, dt.datetime.now(dt.timezone.utc))
            view = device_view(device) | {"drained": device.drained}
        self.log.info("Device %s %s", uuid, "drained" if drained else "back in service")
        self._notify()
        return view

    @command("admin")
    def preempt_lease(self, lease_id: int, reason: str) -> dict[str, Any]:
        """An admin's preemption of a granted lease: its holder gets a
        ``preempted`` notice with ``reason``; a hub server is stopped first
        and the lease released once it has stopped (as the scheduler's
        preemptions are; that release names the scheduler as its actor and
        carries the admin's name in its reason), anything else is released
        now. Recorded in the audit log (``lease-preempted``, target
        ``user:NAME``) with the admin's name.

        Raises:
            NotFound: no such lease. Conflict: the lease is not granted.
        """
        now = dt.datetime.now(dt.timezone.utc)
        stimulus = self._stimulus
        actor = stimulus.actor if stimulus is not None else "admin"
        with self._write() as repo:
            lease = self._get(repo, lease_id)
            if lease.state != LeaseState.granted.value:
                raise Conflict(
                    f"lease {lease_id}: is {lease.state}, only a granted lease is preempted"
                )
            text = f"preempted by {actor}: {reason}"
            self._rec(repo, now).note(lease, "preempted", text)
            repo.add(notice_row(lease, "preempted", text, now))
            detail = {"lease_id": lease_id, "reason": reason}
            # target the user: the audit's user filter finds it
            self._audit(repo, "lease-preempted", f"user:{lease.user}", detail)
            if self._evict(lease, text, now, "preemption", actor):
                repo.flush()
                self._schedule(repo, now)
            view = lease_view(lease)
        self.log.warning("Lease %s of %s %s", lease_id, view["user"], text)
        self._notify()
        return view

    def _audit(self, repo: Repository, action: str, target: str, detail: dict[str, Any]) -> None:
        """Record an admin action in the audit log, in the open transaction (``repo``)."""
        stimulus = self._stimulus  # type: ignore[attr-defined]
        actor = stimulus.actor if stimulus is not None else "admin"
        now = dt.datetime.now(dt.timezone.utc)
        audit_repo.record(repo, now, actor, action, target, detail, stimulus.id if stimulus else "")

    def queue(self) -> list[dict[str, Any]]:
        """Pending leases in queue order (position 1 first)."""
        pending = [x for x in self._world.active() if x.state == LeaseState.pending.value]
        views = [lease_view(lease) for lease in pending]
        # requests no pass has placed yet (``Queued``, no position) come last
        return sorted(views, key=lambda v: (v["queue"]["position"] or float("inf"), v["id"]))
