"""Notices for lease holders (cull warnings, culls, preemptions): a part of
the broker (:class:`gpubroker.core.Broker` delegates to it)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from ..commands import command
from ..model.holdings import LeaseRef
from ..store.models import Lease, Notice
from ..views import isoformat
from .runner import CommandRunner, lease_or_404


class Notices:
    """Record and list notices (see :class:`gpubroker.store.models.Notice`).

    Args:
        runner: the broker's command runner.
        log: the broker's logger.
    """

    def __init__(self, runner: CommandRunner, log: Any) -> None:
        self.runner = runner
        self.log = log

    @command("culler")
    def add_notice(
        self,
        lease: LeaseRef | Lease,
        kind: str,
        message: str,
        deadline: dt.datetime | None = None,
        detail: dict[str, Any] | None = None,
    ) -> None:
        """Record a notice for ``lease``'s holder (see :class:`Notice`), and
        the notice in the lease's transition log (kind: the notice's kind;
        ``detail`` and the deadline in its detail: a ``culled`` notice says
        ``idle_seconds``, which the usage ledger reads). ``lease``: a
        picture of it (:class:`~gpubroker.model.holdings.LeaseRef`, as the
        culler and the watchdog hold) or its row.

        Raises:
            NotFound: no such lease.
        """
        now = self.runner.now()
        with self.runner.write() as repo:
            row = lease_or_404(repo, lease.id)
            detail = dict(detail or {})
            if deadline:
                detail["deadline"] = isoformat(deadline)
            self.runner.rec(repo, now).note(row, kind, message, detail)
            repo.add(notice_row(row, kind, message, now, deadline))
        self.log.info("Notice for %s/%s (%s): %s", lease.user, lease.server_name, kind, message)

    @command("broker")
    def note_lease(
        self,
        lease_id: int,
        kind: str,
        reason: str,
        detail: dict[str, Any] | None = None,
        notify: bool = False,
    ) -> None:
        """Record that ``kind`` happened to lease ``lease_id`` in its
        transition log (e.g. ``job-started``, ``job-ended``); with
        ``notify``, also as a notice for its holder (``GET /notices``).

        Raises:
            NotFound: no such lease.
        """
        now = self.runner.now()
        with self.runner.write() as repo:
            lease = lease_or_404(repo, lease_id)
            self.runner.rec(repo, now).note(lease, kind, reason, detail)
            if notify:
                repo.add(notice_row(lease, kind, reason, now))

    def notices(self, user: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        """Newest first; only ``user``'s when given."""
        with self.runner.read() as repo:
            return [
                {
                    "id": n.id,
                    "lease_id": n.lease_id,
                    "user": n.user,
                    "server_name": n.server_name,
                    "kind": n.kind,
                    "message": n.message,
                    "created": isoformat(n.created),
                    "deadline": isoformat(n.deadline),
                }
                for n in repo.notices(user, limit)
            ]


def notice_row(
    lease: Lease, kind: str, message: str, now: dt.datetime, deadline: dt.datetime | None = None
) -> Notice:
    """A notice row for ``lease``'s holder."""
    return Notice(
        lease_id=lease.id,
        user=lease.user,
        server_name=lease.server_name,
        kind=kind,
        message=message,
        created=now,
        deadline=deadline,
    )
