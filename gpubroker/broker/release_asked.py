"""A release asked for by a person or a tool: a running holder is stopped first.

One rule for every way to release a lease other than its holder's own stop
(``DELETE /leases/{id}`` of a user, an admin or a service, and the admin
panel's **Release**), so they cannot drift apart:

- a granted job lease's process is stopped first (the job service releases
  the lease once it has ended);
- a granted server lease whose server the hub still runs, or whose Docker
  container or Slurm job an engine follows, is stopped first (the hub or
  the engine stops it; then the lease is released), unless the caller says
  the server is stopped already (``holder_stopped``: the spawner's release
  after its own stop);
- anything else is released at once;
- with ``tell`` (a human admin's release of another user's lease), the
  lease's user gets one ``admin-release`` notice; a release asked while a
  stop of its holder is under way (by anyone: a repeat, the culler, a
  preemption) asks nothing more and tells no one.

Where the rule comes from: a server keeps no GPU it gave back (the GPU
would go to the next user while the server still has it in
``CUDA_VISIBLE_DEVICES``), the same as an eviction (:mod:`.stops`).
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..store.models import HolderKind, LeaseState

if TYPE_CHECKING:
    from ..core import Broker

#: ``async (user, server_name) -> bool``: whether the hub runs that server
#: (``True`` when it cannot tell: :meth:`gpubroker.hub.Hub.server_running`)
ServerRunning = Callable[[str, str], Awaitable[bool]]


class Outcome(str, enum.Enum):
    """What a release asked for did."""

    #: released now
    released = "released"
    #: its holder (``server`` or ``job``) is being stopped; released once it ended
    stopping = "stopping"
    #: a stop of its holder was under way already: nothing more asked, no notice
    stopping_already = "stopping-already"
    #: pending or granted no more (released before): nothing done
    ended_already = "ended-already"


@dataclass(frozen=True)
class AskedRelease:
    """The answer to :func:`release_asked`.

    Attributes:
        lease: the lease's view after the command (:func:`gpubroker.views.lease_view`).
        outcome: what was done.
        holder: the lease's holder kind (``server``, ``job``, ``external``).
    """

    lease: dict[str, Any]
    outcome: Outcome
    holder: str


async def release_asked(
    broker: Broker,
    lease_id: int,
    reason: str,
    actor: str | None,
    *,
    server_running: ServerRunning,
    holder_stopped: bool = False,
    tell: bool = False,
) -> AskedRelease:
    """Release lease ``lease_id`` as asked by ``actor``, by the module's rule.

    Args:
        broker: the broker core.
        reason: recorded with the stop or the release, and told to the user.
        actor: who asks (a user or admin name; ``None``: the broker).
        server_running: asks the hub whether a granted server lease's
            server runs (not asked when ``holder_stopped``).
        holder_stopped: the caller stopped the lease's server itself (the
            spawner); callers check that only a broker admin says so.
        tell: send the lease's user one ``admin-release`` notice.

    Returns:
        the lease after the command and what was done.

    Raises:
        NotFound: no such lease.
    """
    lease = broker.get_lease(lease_id)
    holder = lease["holder_kind"]
    if lease["state"] not in (LeaseState.pending.value, LeaseState.granted.value):
        return AskedRelease(lease, Outcome.ended_already, holder)
    granted = lease["state"] == LeaseState.granted.value
    if granted and not holder_stopped and broker.stops.open_stop(lease_id) is not None:
        # asked again while its stop is under way: nothing more, no notice
        return AskedRelease(lease, Outcome.stopping_already, holder)
    stop_first = False
    if granted and holder == HolderKind.job.value:
        stop_first = True
    elif granted and holder == HolderKind.server.value and not holder_stopped:
        # a server an engine follows (its Docker container, its Slurm job) is
        # stopped first whatever the hub says: after a failed stop the hub
        # forgets a server whose container still runs on the devices
        stop_first = _followed(broker, lease) or await server_running(
            lease["user"], lease["server_name"]
        )
        lease = broker.get_lease(lease_id)  # other commands ran meanwhile
        if lease["state"] != LeaseState.granted.value:
            return AskedRelease(lease, Outcome.ended_already, holder)
        if broker.stops.open_stop(lease_id) is not None:
            return AskedRelease(lease, Outcome.stopping_already, holder)
    if stop_first:
        broker.stop_lease(lease_id, reason, actor=actor)
        outcome, view = Outcome.stopping, None
    else:
        view = broker.release_lease(lease_id, reason, actor=actor)
        outcome = Outcome.released
    if tell:
        broker.note_lease(lease_id, "admin-release", reason, notify=True, actor=actor)
        view = None  # the note changed the lease's version
    return AskedRelease(view or broker.get_lease(lease_id), outcome, holder)


def _followed(broker: Broker, lease: dict[str, Any]) -> bool:
    """Whether an engine follows ``lease``'s server: a Docker container or a
    Slurm job recorded on it, or a lease the service's engines watch
    (:attr:`~gpubroker.broker.stops.ServerStops.followed`)."""
    if lease.get("container_id") or lease.get("slurm_job"):
        return True
    return lease["id"] in broker.stops.followed()
