"""The broker's repository: every ORM operation the broker's core makes.

A :class:`Repository` wraps one SQLAlchemy session. The broker keeps one
for its whole life (:class:`gpubroker.broker.world.World`): the session's
identity map holds the in-memory state (devices, active leases with their
allocations, quotas, open intents), so a lookup by key (:meth:`device`,
:meth:`lease`, :meth:`quota`) is a dictionary read, and the unit of work
writes exactly the objects a command changed. Commands outside the store
see this class only: no module outside :mod:`gpubroker.store` imports
SQLAlchemy (DESIGN.md, layout: ``store/`` is the only SQLAlchemy importer;
``tests/unit/test_layout.py`` checks it).

The helpers at the end (:func:`loaded_values`, :func:`set_loaded`,
:func:`set_in_memory`) set and read attributes the store must not write:
the queue position, reason, message and ETA of a waiting lease live in
memory only (``docs/architecture.md``, "Passes are coalesced").
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeAlias, TypeVar

from sqlalchemy import event, func, insert, inspect, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.orm.attributes import set_committed_value

from ..scheduler import UsageRecord
from .models import (
    ACTIVE_STATES,
    Allocation,
    Base,
    Device,
    Intent,
    Lease,
    LeaseEvent,
    Notice,
    QuotaRow,
)
from .usage_repo import lease_charge, ledger_segments, load_usage, write_usage

#: an ORM class, for :meth:`Repository.loaded`
T = TypeVar("T")

#: the store's session factory (:func:`gpubroker.store.db.make_session_factory`)
SessionFactory: TypeAlias = "sessionmaker[Session]"

#: the store's error type: a failed statement or commit
StoreError = SQLAlchemyError

#: called after each flush with the objects it wrote: (new, dirty, deleted)
FlushHook = Callable[[Sequence[object], Sequence[object], Sequence[object]], None]


class Repository:
    """One session on the store, with the operations the broker uses.

    Args:
        factory: the store's session factory
            (:func:`gpubroker.store.db.make_session_factory`;
            ``expire_on_commit=False`` keeps loaded objects in memory).
    """

    def __init__(self, factory: SessionFactory) -> None:
        self.factory = factory
        #: the session (for the store's own modules, e.g. ``audit_repo``)
        self.session: Session = factory()

    @classmethod
    @contextlib.contextmanager
    def fresh(cls, factory: SessionFactory) -> Iterator[Repository]:
        """A repository on a new session, outside the broker's memory (what
        a restart would load), closed at the end of the block."""
        repo = cls(factory)
        try:
            yield repo
        finally:
            repo.close()

    # -- transactions ---------------------------------------------------------------

    def begin(self) -> None:
        """Begin a transaction."""
        self.session.begin()

    def commit(self) -> None:
        """Flush and commit the open transaction (objects stay loaded)."""
        self.session.commit()

    def rollback(self) -> None:
        """Roll the open transaction back (every loaded object expires)."""
        self.session.rollback()

    def in_transaction(self) -> bool:
        """Whether a transaction is open (a read opens one)."""
        return self.session.in_transaction()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """A transaction committed at the end of the block, rolled back on
        an exception."""
        with self.session.begin():
            yield

    def close(self) -> None:
        """Release the session's connection."""
        self.session.close()

    # -- the unit of work -----------------------------------------------------------

    def add(self, obj: Base) -> None:
        """Write ``obj`` (new or changed) at the next flush."""
        self.session.add(obj)

    def delete(self, obj: Base) -> None:
        """Delete ``obj``'s row at the next flush."""
        self.session.delete(obj)

    def flush(self) -> None:
        """Write what changed so far, in the open transaction."""
        self.session.flush()

    def loaded(self, cls: type[T]) -> list[T]:
        """The objects of ``cls`` the session holds in memory now (its
        identity map), whatever indexes the caller keeps."""
        return [obj for obj in self.session.identity_map.values() if isinstance(obj, cls)]

    def unflushed(self) -> list[object]:
        """Objects new or changed since the last flush."""
        return [*self.session.new, *self.session.dirty]

    def on_flush(self, hook: FlushHook) -> None:
        """Call ``hook(new, dirty, deleted)`` after every flush."""

        def after_flush(session: Session, _context: Any) -> None:
            hook(list(session.new), list(session.dirty), list(session.deleted))

        event.listen(self.session, "after_flush", after_flush)

    def insert_events(self, rows: list[dict[str, Any]]) -> None:
        """Insert lease event rows (``lease_events`` columns), one statement."""
        if rows:
            self.session.execute(insert(LeaseEvent.__table__), rows)

    # -- lookups by key (in memory once loaded) ---------------------------------------

    def device(self, uuid: str) -> Device | None:
        """The device ``uuid`` (any, present or not), or ``None``."""
        return self.session.get(Device, uuid)

    def lease(self, lease_id: int) -> Lease | None:
        """Lease ``lease_id`` (any state), or ``None``."""
        return self.session.get(Lease, lease_id)

    def quota(self, kind: str, name: str) -> QuotaRow | None:
        """The stored quota of ``kind`` (``user``/``group``) ``name``, or ``None``."""
        return self.session.get(QuotaRow, (kind, name))

    # -- queries ------------------------------------------------------------------

    def devices(self) -> list[Device]:
        """Every device the store knows, present or not, in store order."""
        return list(self.session.scalars(select(Device)))

    def leases(self, user: str | None = None) -> list[Lease]:
        """Every lease, released ones too, oldest first; only ``user``'s when given."""
        stmt = select(Lease).order_by(Lease.id)
        if user is not None:
            stmt = stmt.where(Lease.user == user)
        return list(self.session.scalars(stmt))

    def active_leases(self) -> list[Lease]:
        """Pending and granted leases, oldest first."""
        stmt = select(Lease).where(Lease.state.in_(ACTIVE_STATES)).order_by(Lease.id)
        return list(self.session.scalars(stmt))

    def active_allocations(self, on: Iterable[str] | None = None) -> list[Allocation]:
        """Active allocations; only of the devices ``on`` (UUIDs) when given."""
        stmt = select(Allocation).where(Allocation.active)
        if on is not None:
            stmt = stmt.where(Allocation.device_uuid.in_(list(on)))
        return list(self.session.scalars(stmt))

    def events_of(self, lease_id: int) -> list[LeaseEvent]:
        """The transition log of lease ``lease_id``, oldest first."""
        stmt = select(LeaseEvent).where(LeaseEvent.lease_id == lease_id).order_by(LeaseEvent.id)
        return list(self.session.scalars(stmt))

    def quotas(self) -> list[QuotaRow]:
        """Every stored quota."""
        return list(self.session.scalars(select(QuotaRow)))

    def open_stops(self) -> list[Intent]:
        """Open ``stop-server`` intents."""
        stmt = select(Intent).where(Intent.kind == "stop-server", Intent.state == "open")
        return list(self.session.scalars(stmt))

    def top_lease_id(self) -> int:
        """The largest lease id stored (0: none)."""
        return self.session.scalar(select(func.max(Lease.id))) or 0

    def notices(self, user: str | None = None, limit: int = 100) -> list[Notice]:
        """Notices newest first, at most ``limit``; only ``user``'s when given."""
        stmt = select(Notice).order_by(Notice.id.desc()).limit(limit)
        if user is not None:
            stmt = stmt.where(Notice.user == user)
        return list(self.session.scalars(stmt))

    # -- fair-share usage (:mod:`gpubroker.store.usage_repo`) -------------------------

    def usage(self, half_life: float) -> tuple[dict[str, UsageRecord], set[str], set[str]]:
        """The usage records a start-up loads: (records, users with a row,
        users whose row is behind); see :func:`~.usage_repo.load_usage`."""
        return load_usage(self.session, half_life)

    def lease_charge(
        self, lease: Lease, now: Any, half_life: float, from_ledger: bool
    ) -> UsageRecord:
        """What granted ``lease`` used until ``now``; see :func:`~.usage_repo.lease_charge`."""
        return lease_charge(self.session, lease, now, half_life, from_ledger=from_ledger)

    def ledger_segments(self, lease_ids: Iterable[int]) -> dict[int, list[Any]]:
        """The usage ledger's intervals of ``lease_ids``
        (:func:`~.usage_repo.ledger_segments`)."""
        return ledger_segments(self.session, lease_ids)

    def write_usage(
        self, usage: dict[str, UsageRecord], users: Iterable[str], stored: set[str]
    ) -> None:
        """Write ``users``' usage records; see :func:`~.usage_repo.write_usage`."""
        write_usage(self.session, usage, set(users), stored)


def session_of(handle: Repository | Session) -> Session:
    """The session behind ``handle`` (for the store's own modules, which
    accept a repository or a bare session)."""
    return handle.session if isinstance(handle, Repository) else handle


def loaded_values(obj: Base, names: Iterable[str]) -> dict[str, Any]:
    """The in-memory values of ``names`` on ``obj``; empty when the object
    is expired (a rollback) or its ``version`` was never loaded."""
    state = inspect(obj)
    if state.expired or "version" in state.unloaded:
        return {}
    return {name: state.dict.get(name) for name in names}


def set_loaded(obj: Base, name: str, value: Any) -> None:
    """Set ``obj.name`` as if loaded: no write follows."""
    set_committed_value(obj, name, value)


def set_in_memory(obj: Base, name: str, value: Any) -> None:
    """Set ``obj.name`` in memory only, unless the open command already
    changed it (then the change, still to be written, takes the value)."""
    if inspect(obj).attrs[name].history.has_changes():
        setattr(obj, name, value)
    else:
        set_committed_value(obj, name, value)
