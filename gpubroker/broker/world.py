"""The broker's in-memory state, written through to the store.

One long-lived :class:`~gpubroker.store.repository.Repository` (one session
on the store) is the broker's memory: its identity map holds every device,
every active lease with its allocations, the usage
records, the stored quotas and the open intents, loaded once at start-up.
Commands change those objects inside :meth:`World.write` and the session
writes exactly the objects that changed (the unit of work) in one
transaction, before the command answers; nothing is read back. A pass reads
the indexes here, never the database.

The database stays the truth: when a transaction fails, the session rolls
back (SQLAlchemy expires every object) and :meth:`World.reload` rebuilds the
indexes from what was committed, exactly as a restart would.

Only the broker's event loop thread uses a :class:`World` (the broker is
single-threaded: commands never interleave).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..scheduler import UsageRecord
from ..store.models import (
    ACTIVE_STATES,
    Allocation,
    Device,
    HolderKind,
    Intent,
    Lease,
    QuotaRow,
)
from ..store.repository import (
    Repository,
    SessionFactory,
    StoreError,
    loaded_values,
    set_loaded,
)
from ..usage.decayed import add_charge, held_usage
from .inputs import SchedulerInputs


@dataclasses.dataclass(frozen=True)
class OutsideReason:
    """Why the engine takes no new work on a device.

    Attributes:
        text: the sentence anyone who sees the device reads (``"node n1 is
            down: not responding"``, ``"held by Slurm job 41"``).
        owner: whose outside work holds it (``"bob"``, ``"?"``: not known;
            ``""``: none), which only broker admins see, as they alone see
            a device's holders (``GPUBrokerApp.private_queue``).
    """

    text: str
    owner: str = ""

    def describe(self, admin: bool) -> str:
        """``text``, and for an admin ``"… of <owner>"`` where it has one."""
        return f"{self.text} of {self.owner}" if admin and self.owner else self.text


class World:
    """Devices, active leases, usage, quotas and open intents in memory.

    Args:
        factory: the store's session factory (``expire_on_commit=False``,
            :func:`gpubroker.store.db.make_session_factory`).
    """

    def __init__(
        self, factory: SessionFactory, half_life: Callable[[], float] = lambda: 604800.0
    ) -> None:
        self.factory = factory
        #: the fair-share half-life in force, seconds (how usage is charged
        #: and loaded, :mod:`gpubroker.usage`)
        self._half_life = half_life
        #: the one session on the store that holds the objects below
        self.repo = Repository(factory)
        #: pending and granted leases by id
        self.leases: dict[int, Lease] = {}
        #: every device the store knows (present or not) by UUID
        self.devices: dict[str, Device] = {}
        #: devices the engine says take no new work, by UUID, with why (a
        #: node drained or down in Slurm, a Slurm job from outside holds
        #: it); the engine is the truth, so this lives in memory only
        self.outside: dict[str, OutsideReason] = {}
        #: fair-share usage records by user (memory is ahead of the rows:
        #: :mod:`gpubroker.usage`)
        self.usage: dict[str, UsageRecord] = {}
        #: users with a stored usage row, and users whose row is behind memory
        self.usage_stored: set[str] = set()
        self.usage_behind: set[str] = set()
        #: leases granted before this broker started (found granted at the
        #: first load): charged from the ledger's intervals (:meth:`charge`)
        self.adopted: set[int] | None = None
        #: stored quotas (admin API), by (kind, name)
        self.quotas: dict[tuple[str, str], QuotaRow] = {}
        #: open ``stop-server`` intents by lease id
        self.stops: dict[int, Intent] = {}
        #: the scheduler's value of each active lease, rebuilt per change
        self.inputs = SchedulerInputs()
        #: lease event rows of the open transaction, inserted in one
        #: statement before it commits
        self.staged_events: list[dict[str, Any]] = []
        #: bumped whenever the stored quotas change (policy cache key)
        self.quota_version = 0
        self._next_lease_id = 1
        self._depth = 0
        #: called after every reload (the broker asks for a pass)
        self.on_reload: list[Callable[[], None]] = []
        #: called after every commit of an outermost block, and after every
        #: rollback (the command runner publishes or drops the events)
        self.on_commit: list[Callable[[], None]] = []
        self.on_rollback: list[Callable[[], None]] = []
        #: side effects of the open transaction, run once it has committed
        #: (:meth:`after_commit`)
        self._after_commit: list[Callable[[], None]] = []
        #: whether the open read block changed something: a write block
        #: joined it, or a flush wrote (:meth:`read`)
        self._wrote = False
        self.repo.on_flush(self._collect)
        self.reload()

    # -- transactions --------------------------------------------------------------

    @contextlib.contextmanager
    def write(self) -> Iterator[Repository]:
        """One write-through transaction; a block inside another joins it.

        Commits at the end of the outermost block; on an exception, rolls
        back and reloads the indexes from the store (the committed truth),
        then re-raises.
        """
        repo = self.repo
        if self._depth:
            self._wrote = True  # a read block it joins commits a change now
            with self._nested():
                yield repo
            return
        self._end_stray()
        self._depth = 1
        repo.begin()
        try:
            yield repo
            self._insert_events()
            repo.commit()
        except BaseException:
            self._roll_back()
            raise
        finally:
            self._depth = 0
        self._committed()

    @contextlib.contextmanager
    def read(self) -> Iterator[Repository]:
        """Read the in-memory objects (and the store for what is not kept in
        memory, such as released leases and events); joins an open block,
        else ends the transaction its queries began.

        On an exception, a block that changed something (a write block
        joined it, or it staged a note or changed an object) rolls back and
        reloads, as :meth:`write` does: a failed command changes nothing. A
        block that only read ends its transaction; a store error always
        rolls back.
        """
        repo = self.repo
        if self._depth:
            with self._nested():
                yield repo
            return
        self._end_stray()
        self._depth = 1
        self._wrote = False
        try:
            yield repo
        except StoreError:
            self._roll_back()
            raise
        except BaseException:
            if self._wrote or self.staged_events or repo.unflushed():
                self._roll_back()
            raise
        finally:
            try:
                if repo.in_transaction():  # what it read (and any note it staged)
                    self._insert_events()
                    repo.commit()
            except StoreError:
                self._roll_back()
                raise
            finally:
                self._depth = 0
            self._committed()

    @contextlib.contextmanager
    def _nested(self) -> Iterator[None]:
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1

    def after_commit(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once the open transaction has committed; never
        when it rolls back. For side effects on the outside world decided
        in a transaction (destroying a MIG instance, asking the hub to stop
        a server): a change that rolls back must leave the world as the
        store says it is. Outside any block, ``callback`` runs at once."""
        if self._depth:
            self._after_commit.append(callback)
        else:
            callback()

    def _committed(self) -> None:
        """After the commit of an outermost block: the :attr:`on_commit`
        callbacks, then the side effects it held (:meth:`after_commit`), in
        the order they were asked for; each runs even when one before it
        raised, and the first error is raised at the end.

        Raises:
            Exception: what the first callback that failed raised.
        """
        callbacks = [*self.on_commit, *self._after_commit]
        self._after_commit = []
        first: BaseException | None = None
        for callback in callbacks:
            try:
                callback()
            except Exception as err:
                first = first or err
        if first is not None:
            raise first

    def _end_stray(self) -> None:
        """End a transaction the session began outside any block (an
        attribute of an expired object read by a caller that kept it): it
        only read, and a block must never join it unknowingly."""
        if self.repo.in_transaction():
            self.repo.commit()

    def _collect(
        self, new: Sequence[object], dirty: Sequence[object], deleted: Sequence[object]
    ) -> None:
        """After each flush: index what the flush wrote (work proportional
        to what changed). A rollback undoes it through :meth:`reload`."""
        if new or dirty or deleted:
            self._wrote = True  # a read block that fails now rolls this back
        deleted = [o for o in deleted if isinstance(o, QuotaRow)]
        changed = self.inputs.changed
        for obj in [*new, *dirty, *deleted]:
            if isinstance(obj, Allocation):
                if obj.lease_id is not None:
                    changed(obj.lease_id)
            elif isinstance(obj, Lease):
                changed(obj.id)
                if obj.state in ACTIVE_STATES:
                    self.leases[obj.id] = obj
                else:
                    self.leases.pop(obj.id, None)
            elif isinstance(obj, Intent) and obj.kind == "stop-server":
                if obj.state == "open":
                    self.stops[obj.lease_id] = obj
                elif self.stops.get(obj.lease_id) is obj:
                    del self.stops[obj.lease_id]
            elif isinstance(obj, Device):
                self.devices[obj.uuid] = obj
            elif isinstance(obj, QuotaRow):
                self.quota_version += 1
                if obj in deleted:
                    self.quotas.pop((obj.kind, obj.name), None)
                else:
                    self.quotas[(obj.kind, obj.name)] = obj

    def _insert_events(self) -> None:
        """Insert the staged lease events (one statement for them all)."""
        if self.staged_events:
            rows, self.staged_events = self.staged_events, []
            self.repo.insert_events(rows)

    def _roll_back(self) -> None:
        """Roll the open transaction back and reload, keeping what only
        memory holds (read before the rollback expires it)."""
        kept = {lease_id: _memory_of(x) for lease_id, x in self.leases.items()}
        # a lease the failed command took out of the index (it released it)
        # is pending again after the rollback: its version never goes back,
        # and its wait, which the command changed, comes with the next pass
        for lease in self.repo.loaded(Lease):
            values = _memory_of(lease)
            if lease.id is not None and lease.id not in kept and values:
                kept[lease.id] = {"version": values["version"]}
        self._after_commit = []  # what it decided never happened
        for callback in self.on_rollback:
            callback()
        self.reload(kept)

    def reload(self, kept: dict[int, dict[str, Any]] | None = None) -> None:
        """Rebuild every index from the store (start-up, after a rollback).

        ``kept``: what only memory held before the rollback, by lease id
        (:func:`_memory_of`). That survives: the wait (position, reason,
        message, ETA, earmark) and the version of every pending lease
        (versions never go back, so no long-poll misses a change), and lease
        ids are never handed out twice. The indexes change only once every
        query has answered. Then the ``on_reload`` callbacks run (the broker
        asks for a scheduling pass: the decisions rolled back are made
        again)."""
        repo = self.repo
        kept = kept or {}
        if repo.in_transaction():
            repo.rollback()
        self.staged_events = []
        self.inputs.forget()
        with repo.transaction():
            devices = {d.uuid: d for d in repo.devices()}
            leases = {x.id: x for x in repo.active_leases()}
            usage, stored, behind = repo.usage(self.half_life)
            quotas = {(q.kind, q.name): q for q in repo.quotas()}
            stops = {i.lease_id: i for i in repo.open_stops()}
            top = repo.top_lease_id()
        for lease_id, lease in leases.items():
            if lease_id in kept and lease.state == "pending":
                _restore(lease, kept[lease_id])
        self.devices, self.leases, self.usage = devices, leases, usage
        if self.adopted is None:
            self.adopted = {i for i, x in leases.items() if x.state == "granted"}
        self.usage_stored, self.usage_behind = stored, behind
        self.quotas, self.stops = quotas, stops
        self._next_lease_id = max(self._next_lease_id, top + 1)
        self.quota_version += 1
        for callback in self.on_reload:
            callback()

    def add_lease(self, lease: Lease) -> None:
        """Give a new lease its id and keep it in memory (in the open
        transaction; it is written at the commit). The broker is the one
        writer of its database (:mod:`gpubroker.store.lock`), so it numbers
        leases itself and nothing has to be written to learn the id."""
        lease.id = self._next_lease_id
        self._next_lease_id += 1
        self.repo.add(lease)
        self.leases[lease.id] = lease
        self.inputs.changed(lease.id)

    def refresh_inputs(self) -> SchedulerInputs:
        """The scheduler's values of the active leases, with every change
        so far built in (the open transaction's too, flushed or not)."""
        dirty = [
            o.lease_id if isinstance(o, Allocation) else o.id
            for o in self.repo.unflushed()
            if isinstance(o, (Lease, Allocation))
        ]
        dirty = [i for i in dirty if i is not None]
        self.inputs.refresh(self.leases, dirty)
        return self.inputs

    def charge(self, lease: Lease, now: Any) -> None:
        """Add the use of granted ``lease``, released at ``now`` (aware UTC),
        to its user's record, in memory (written at the next
        :meth:`write_usage`; a reload charges it again, by the same rule:
        :mod:`gpubroker.usage.decayed`). A lease granted before this broker
        started is charged from the usage ledger's intervals of it (one
        query), so the time the broker was down is left out."""
        assert lease.granted_at is not None
        user = lease.user
        adopted = self.adopted is not None and lease.id in self.adopted
        used = self.repo.lease_charge(lease, now, self.half_life, from_ledger=adopted)
        # what the ledger held it for stays until the release commits (a
        # rollback keeps the lease running; only memory holds this)
        lease_id = lease.id

        def forget_held() -> None:
            self.inputs.held.pop(lease_id, None)

        self.after_commit(forget_held)
        self.usage[user] = add_charge(self.usage.get(user), used, now, self.half_life)
        self.usage_behind.add(user)

    def load_held(self) -> int:
        """Read, from the usage ledger, what each lease held across the
        broker's restart was held for before it (closed intervals) and when
        its open interval began, so fair share charges a running lease as
        the ledger counts it (the time the broker was down left out). Call
        it once the ledger has reopened its intervals (``Ledger.start``).
        Returns how many leases it found."""
        granted = [i for i in self.adopted or () if i in self.leases]
        with Repository.fresh(self.factory) as repo:
            ledger = repo.ledger_segments(granted)
        found = 0
        for lease_id, segments in ledger.items():
            closed = [(w, s, e) for w, s, e in segments if e is not None]
            opened = [s for _w, s, e in segments if e is None]
            if not closed or not opened:
                continue
            end = max(e for _w, _s, e in closed)
            before = UsageRecord(held_usage(closed, end, self.half_life), _utc(end))
            self.inputs.held[lease_id] = (before, _utc(max(opened)))
            self.inputs.changed(lease_id)
            found += 1
        return found

    @property
    def half_life(self) -> float:
        """The fair-share half-life in force, seconds."""
        return self._half_life()

    def write_usage(self) -> int:
        """Write the usage records that are ahead of their rows (a
        checkpoint), in the open transaction. Returns how many."""
        behind, self.usage_behind = self.usage_behind, set()
        self.repo.write_usage(self.usage, behind, self.usage_stored)
        return len(behind)

    # -- queries on memory ---------------------------------------------------------

    def active(self) -> list[Lease]:
        """Pending and granted leases, oldest first (a lease released in the
        open transaction, not flushed yet, is left out)."""
        leases = self.leases
        return [leases[i] for i in sorted(leases) if leases[i].state in ACTIVE_STATES]

    def server_lease(self, user: str, server_name: str, other_than: int = 0) -> Lease | None:
        """The active lease of hub server ``user``/``server_name`` (other
        than lease ``other_than``), if any."""
        for lease in self.leases.values():
            if (
                lease.user == user
                and lease.server_name == server_name
                and lease.holder_kind == HolderKind.server.value
                and lease.id != other_than
                and lease.state in ACTIVE_STATES
            ):
                return lease
        return None

    def present_devices(self) -> list[Device]:
        """Devices the backend reports now, in store order."""
        return [d for d in self.devices.values() if d.present]

    def close(self) -> None:
        """Release the session's connection."""
        self.repo.close()


#: what a pending lease keeps in memory only (see :func:`gpubroker.passes.set_wait`)
_MEMORY_ONLY = ("queue_position", "queue_reason", "queue_message", "queue_eta", "earmarked")

#: the wait reason of a request no pass has covered yet (a new one, or one a
#: rolled-back command had changed: the pass a reload asks for gives it again)
QUEUED = "Queued"
QUEUED_MESSAGE = "in the queue: its place and reason come with the next scheduling pass"


def _memory_of(lease: Lease) -> dict[str, Any]:
    """The memory-only values of ``lease`` (read before a rollback expires them)."""
    return loaded_values(lease, (*_MEMORY_ONLY, "version"))


def _restore(lease: Lease, kept: dict[str, Any]) -> None:
    """Put memory-only values back on ``lease`` (reloaded from the store),
    never lowering its version. Where ``kept`` has only the version (the
    failed command had changed the lease's wait), the wait is
    :data:`QUEUED` until the next pass, and the stored earmark stays."""
    if not kept or kept.get("version") is None:
        return
    if "queue_reason" in kept:
        for name in _MEMORY_ONLY:
            set_loaded(lease, name, kept[name])
    else:
        for name, value in (
            ("queue_position", None),
            ("queue_reason", QUEUED),
            ("queue_message", QUEUED_MESSAGE),
            ("queue_eta", None),
        ):
            set_loaded(lease, name, value)
    set_loaded(lease, "version", max(lease.version, kept["version"]) + 1)


def _utc(epoch_s: float) -> dt.datetime:
    """UTC epoch seconds as an aware datetime."""
    return dt.datetime.fromtimestamp(epoch_s, dt.timezone.utc)
