"""The lease lifecycle: its states, the transitions allowed between them,
and the typed event every change emits.

A lease is ``pending`` (a request waiting in the queue) until the scheduler
grants it slots (``granted``), and ``released`` at its end, whoever ends it:

=============  ============  ===============================================
from           to            by (actor) and why
=============  ============  ===============================================
(none)         ``pending``   a request (the user, an admin, the spawner)
``pending``    ``granted``   ``scheduler``: slots placed and made real
``pending``    ``released``  a cancel, a queue time-out, ``reconcile``
                             (server gone), a restart replacing it
``granted``    ``released``  a release, a cull (``culler``), a preemption or
                             time limit (``scheduler``), ``reconcile``
=============  ============  ===============================================

Besides transitions, events record what happens to a lease without changing
its state, so that its log reads like a story: ``waiting`` (the wait reason
changed), ``preempting`` (a grace period started, or was withdrawn),
``stopping`` (its hub server is being stopped before the slots are
released), ``priority-changed``, notices (``cull-warning``, ``culled``,
...); ``adopted`` begins the log of a lease older than the log.

Where the rules come from: Slurm's job states (PENDING → RUNNING →
COMPLETED/CANCELLED), dask.distributed's explicit transition table with a
stimulus id per change.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

PENDING = "pending"
GRANTED = "granted"
RELEASED = "released"

#: every state a lease can be in
STATES = (PENDING, GRANTED, RELEASED)

#: (from, to) → the event kind of that transition; ``None``: no lease yet
TRANSITIONS: Mapping[tuple[str | None, str], str] = {
    (None, PENDING): "requested",
    (PENDING, GRANTED): "granted",
    (PENDING, RELEASED): "released",
    (GRANTED, RELEASED): "released",
}

#: event kinds that record something without a change of state
NOTES = frozenset(
    {
        "waiting",
        "preempting",
        "preemption-withdrawn",
        "stopping",
        "priority-changed",
        "adopted",
        "preparing",
        "grant-failed",
        "server-recorded",
        "rebound",
    }
)

#: who may cause a change, besides a user's or an admin's name
SYSTEM_ACTORS = frozenset({"scheduler", "culler", "reconcile", "watchdog", "broker"})


def caller_actor(name: str, kind: str = "user") -> str:
    """The actor a caller (a JupyterHub user or service) is recorded as:
    its name, except a name that is one of :data:`SYSTEM_ACTORS`, which
    becomes ``<kind>/<name>`` (``user/scheduler``). JupyterHub allows no
    ``/`` in user or service names, so a recorded actor is either the
    broker itself or a caller, never read as the other: a hub user named
    ``culler`` releasing her own lease is not a cull, nor shown as one in
    the audit log."""
    return f"{kind}/{name}" if name in SYSTEM_ACTORS else name


class IllegalTransition(ValueError):
    """A change the lifecycle table does not allow (a bug, never user input)."""


def transition_kind(from_state: str | None, to_state: str) -> str:
    """The event kind of the change ``from_state`` → ``to_state``.

    Raises:
        IllegalTransition: the table has no such transition.
    """
    try:
        return TRANSITIONS[(from_state, to_state)]
    except KeyError:
        raise IllegalTransition(f"lease cannot go from {from_state!r} to {to_state!r}") from None


@dataclass(frozen=True)
class Event:
    """One change of a lease, or one thing that happened to it.

    Attributes:
        lease_id: the lease.
        kind: ``requested``, ``granted``, ``released`` (transitions) or a
            note kind (:data:`NOTES`, notice kinds).
        from_state: state before (``None`` for ``requested``); for a note,
            the state it happened in.
        to_state: state after; for a note, the same as ``from_state``.
        reason: why, in words (the release reason, the wait message).
        actor: who caused it: a user or admin name, or a system actor
            (:data:`SYSTEM_ACTORS`).
        stimulus: id shared by everything one command caused.
        at: when, aware UTC.
        detail: what else a reader needs (devices granted, wait reason code).
    """

    lease_id: int
    kind: str
    from_state: str | None
    to_state: str
    reason: str
    actor: str
    stimulus: str
    at: dt.datetime
    detail: Mapping[str, Any] = field(default_factory=dict)

    @property
    def is_transition(self) -> bool:
        """Whether the event changed the lease's state (or created it)."""
        return self.from_state != self.to_state or self.from_state is None


def replay(events: Iterable[Event]) -> str | None:
    """The state a lease's log leads to, checking that it has no gap.

    Args:
        events: one lease's events, oldest first.

    Returns:
        the final state; ``None`` for an empty log.

    Raises:
        IllegalTransition: a transition the table does not allow, an event
            that starts from another state than the previous one ended in,
            or a log that does not begin with ``requested`` (or ``adopted``,
            for leases older than the log).
    """
    state: str | None = None
    first = True
    for event in events:
        if first and event.kind == "adopted":
            state = event.to_state
        elif event.from_state != state:
            raise IllegalTransition(
                f"lease {event.lease_id}: {event.kind} from {event.from_state!r}, "
                f"but the log was at {state!r}"
            )
        elif event.is_transition:
            transition_kind(event.from_state, event.to_state)
            state = event.to_state
        first = False
    return state
