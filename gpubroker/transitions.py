"""Changing a lease's state, and writing down why: the one place where a
lease moves through its lifecycle (:mod:`gpubroker.model.lifecycle`).

Every change goes through a :class:`Recorder`, bound to the repository of the
command that causes it: it checks the transition against the lifecycle
table, sets the state, bumps the lease's ``version`` and appends a
:class:`~gpubroker.store.models.LeaseEvent` row in the same transaction, so
the transition log and the leases never disagree. The events are published
to in-process subscribers (:class:`EventBus`) once the command has
committed.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .model.lifecycle import Event, transition_kind
from .store.models import Lease, LeaseEvent
from .store.repository import Repository


@dataclass(frozen=True)
class Stimulus:
    """What started a change: who (``actor``) and an id shared by every
    event one command causes."""

    actor: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex)


class EventBus:
    """In-process subscribers of lease events, called after each commit in
    the order the events happened. A subscriber that raises is logged and
    kept; it never undoes the change.

    An event is *staged* when its row is added to the open transaction,
    *committed* with that transaction (:meth:`commit`) or dropped with its
    rollback (:meth:`discard`), and handed to the subscribers by
    :meth:`publish`: only committed events ever are, every one of them."""

    def __init__(self, log: Any) -> None:
        self.log = log
        self._subscribers: list[Callable[[Event], None]] = []
        self._unpublished: list[Event] = []
        self._committed: list[Event] = []

    def subscribe(self, subscriber: Callable[[Event], None]) -> None:
        """Call ``subscriber(event)`` for every event from now on."""
        self._subscribers.append(subscriber)

    def stage(self, event: Event) -> None:
        """Hold ``event`` until its transaction commits and :meth:`publish`."""
        self._unpublished.append(event)

    def commit(self) -> None:
        """The staged events' transaction committed: :meth:`publish` hands them on."""
        self._committed += self._unpublished
        self._unpublished = []

    def discard(self) -> None:
        """Drop the staged events of a transaction that rolled back (the
        committed ones stay, to be published)."""
        self._unpublished.clear()

    def publish(self) -> list[Event]:
        """Hand the committed events to every subscriber; return them."""
        events, self._committed = self._committed, []
        for event in events:
            for subscriber in self._subscribers:
                try:
                    subscriber(event)
                except Exception:
                    self.log.exception("Event subscriber %r failed on %s", subscriber, event)
        return events


class Recorder:
    """Transitions and notes of one command, in its transaction.

    Args:
        repo: the command's repository (its transaction holds the change).
        stimulus: the command's stimulus.
        now: the command's time, aware UTC.
        bus: where the events go after the commit.
        actor: who acts here, when not the stimulus's actor (the
            ``scheduler`` granting in a pass that a user's release ran).
        touched: where to add the ids of the leases changed.
        sink: where to put the event rows, for the caller to insert in
            one statement before the commit (``None``: added to the
            repository one by one).
    """

    def __init__(
        self,
        repo: Repository,
        stimulus: Stimulus,
        now: dt.datetime,
        bus: EventBus,
        actor: str | None = None,
        touched: set[int] | None = None,
        sink: list[dict[str, Any]] | None = None,
    ) -> None:
        self.repo = repo
        self.stimulus = stimulus
        self.now = now
        self.bus = bus
        self.actor = actor or stimulus.actor
        #: ids of the leases changed (the command's set, for the state check)
        self.touched: set[int] = set() if touched is None else touched
        self.sink = sink

    def created(self, lease: Lease, reason: str, detail: Mapping[str, Any] | None = None) -> Event:
        """Log the creation of ``lease`` (a new row, state ``pending``)."""
        kind = transition_kind(None, lease.state)
        return self._append(lease, kind, None, lease.state, reason, detail)

    def transition(
        self,
        lease: Lease,
        to_state: str,
        reason: str,
        detail: Mapping[str, Any] | None = None,
    ) -> Event:
        """Move ``lease`` to ``to_state``, bump its version and log the event.

        Raises:
            IllegalTransition: the lifecycle table does not allow it.
        """
        from_state = lease.state
        kind = transition_kind(from_state, to_state)
        lease.state = to_state
        lease.version += 1
        return self._append(lease, kind, from_state, to_state, reason, detail)

    def note(
        self,
        lease: Lease,
        kind: str,
        reason: str,
        detail: Mapping[str, Any] | None = None,
    ) -> Event:
        """Log that ``kind`` happened to ``lease`` without a change of state."""
        return self._append(lease, kind, lease.state, lease.state, reason, detail)

    def _append(
        self,
        lease: Lease,
        kind: str,
        from_state: str | None,
        to_state: str,
        reason: str,
        detail: Mapping[str, Any] | None,
    ) -> Event:
        if lease.id is None:
            self.repo.flush()
        event = Event(
            lease_id=lease.id,
            kind=kind,
            from_state=from_state,
            to_state=to_state,
            reason=reason,
            actor=self.actor,
            stimulus=self.stimulus.id,
            at=self.now,
            detail=dict(detail or {}),
        )
        row = {
            "lease_id": event.lease_id,
            "kind": kind,
            "from_state": from_state,
            "to_state": to_state,
            "reason": reason[:4000],
            "actor": self.actor[:255],
            "stimulus": self.stimulus.id,
            "at": self.now,
            "detail": dict(event.detail) or None,
        }
        if self.sink is not None:
            self.sink.append(row)  # written with the transaction's other events
        else:
            self.repo.add(LeaseEvent(**row))
        self.touched.add(event.lease_id)
        self.bus.stage(event)
        return event


def event_view(row: LeaseEvent) -> dict[str, Any]:
    """The JSON shape of one logged event (``LeaseEvent`` in the OpenAPI document)."""
    return {
        "id": row.id,
        "lease_id": row.lease_id,
        "kind": row.kind,
        "from": row.from_state,
        "to": row.to_state,
        "reason": row.reason,
        "actor": row.actor,
        "stimulus": row.stimulus,
        "at": row.at.isoformat(timespec="microseconds").replace("+00:00", "Z"),
        "detail": row.detail or {},
    }


def as_events(rows: Iterable[LeaseEvent]) -> list[Event]:
    """Logged rows as :class:`~gpubroker.model.lifecycle.Event` values."""
    return [
        Event(
            lease_id=r.lease_id,
            kind=r.kind,
            from_state=r.from_state,
            to_state=r.to_state,
            reason=r.reason,
            actor=r.actor,
            stimulus=r.stimulus,
            at=r.at,
            detail=r.detail or {},
        )
        for r in rows
    ]
