"""Running commands: the one piece every part of the broker shares.

A command (:func:`gpubroker.commands.command`) runs with a
:class:`~gpubroker.transitions.Stimulus` (who caused it, and an id shared by
everything it causes); its changes go through one write-through transaction
of the :class:`~gpubroker.broker.world.World` and its lease changes through
a :class:`~gpubroker.transitions.Recorder`. After the outermost command the
staged events are published on the :class:`~gpubroker.transitions.EventBus`
and, when asked, the state is checked.

The :class:`~gpubroker.core.Broker` facade and its parts (admission, admin
operations, notices, sharing operations) each hold the same
:class:`CommandRunner`, passed in explicitly: none reaches into another's
attributes.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import NotFound
from ..store import audit_repo
from ..store.models import Lease
from ..store.repository import Repository
from ..transitions import EventBus, Recorder, Stimulus
from .world import World


class CommandRunner:
    """Stimulus, transaction and recorder of the command running now.

    Args:
        world: the broker's state in memory (its transactions).
        bus: where the events go after each command.
        after: called with the ids of the leases a command changed, after
            its events are published (the state check), or ``None``.
        clock: the commands' clock, aware UTC (default: the system's).
    """

    def __init__(
        self,
        world: World,
        bus: EventBus,
        after: Callable[[set[int]], Any] | None = None,
        clock: Callable[[], dt.datetime] | None = None,
    ) -> None:
        self.world = world
        self.bus = bus
        self.after = after
        self.clock = clock or (lambda: dt.datetime.now(dt.timezone.utc))
        self.stimulus: Stimulus | None = None
        self._touched: set[int] = set()
        world.on_commit.append(self._committed)
        world.on_rollback.append(bus.discard)

    @contextlib.contextmanager
    def command(self, actor: str) -> Iterator[Stimulus]:
        """Run one command as ``actor``: the events its transactions
        committed are published after it, then :attr:`after` runs; a command
        inside a command shares its stimulus. The events of a transaction
        that rolled back are never published; those of its transactions
        that committed are, even when a later part of it raises."""
        if self.stimulus is not None:
            yield self.stimulus
            return
        self.stimulus = Stimulus(actor)
        self._touched = set()
        try:
            yield self.stimulus
        finally:
            self.stimulus = None
            self.bus.publish()
        if self.after is not None:
            self.after(self._touched)

    def _committed(self) -> None:
        """A transaction committed: its events are to be published (now,
        when no command runs; else at the end of the command)."""
        self.bus.commit()
        if self.stimulus is None:
            self.bus.publish()

    def now(self) -> dt.datetime:
        """The current time of the commands (aware UTC): the time a lease's
        changes and a pass are stamped with."""
        return self.clock()

    @property
    def actor(self) -> str:
        """Who runs the current command (``admin`` outside one)."""
        return self.stimulus.actor if self.stimulus is not None else "admin"

    def write(self) -> contextlib.AbstractContextManager[Repository]:
        """A write-through transaction on the state in memory (:meth:`World.write`)."""
        return self.world.write()

    def read(self) -> contextlib.AbstractContextManager[Repository]:
        """Read the state in memory (:meth:`World.read`)."""
        return self.world.read()

    def rec(self, repo: Repository, now: dt.datetime, actor: str | None = None) -> Recorder:
        """A recorder of the current command's lease changes in ``repo``
        (``actor``: who decided, when not the command's)."""
        stimulus = self.stimulus or Stimulus("broker")
        return Recorder(
            repo, stimulus, now, self.bus, actor, self._touched, self.world.staged_events
        )

    def audit(
        self,
        repo: Repository,
        action: str,
        target: str,
        detail: dict[str, Any],
        reason: str = "",
    ) -> None:
        """Record an admin action in the audit log, in the open transaction
        (``repo``), as the current command's actor and stimulus; ``reason``:
        the admin's own words, where the action takes them."""
        now = self.now()
        stimulus_id = self.stimulus.id if self.stimulus is not None else ""
        audit_repo.record(repo, now, self.actor, action, target, detail, stimulus_id, reason)


def lease_or_404(repo: Repository, lease_id: int) -> Lease:
    """Lease ``lease_id`` of ``repo``.

    Raises:
        NotFound: no such lease.
    """
    lease = repo.lease(lease_id)
    if lease is None:
        raise NotFound(f"lease {lease_id}: no such lease")
    return lease
