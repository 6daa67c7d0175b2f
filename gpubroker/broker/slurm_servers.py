"""Reconciliation of notebook servers that run as Slurm jobs.

``SlurmGPUSpawner`` submits each server from the hub and tells the broker
its job id with the server's URL (``PATCH /leases/{id}``, ``slurm_job``).
The broker then, every ``GPUBrokerApp.reconcile_interval``:

* counts those jobs as its own, so their GPUs are the lease's, not held
  from *outside* (:meth:`SlurmEngine.adopt`, also before each inventory);
* asks Slurm about all of them in one ``squeue``
  (:meth:`SlurmEngine.poll_many`): a job that has ended or is gone
  (``scancel`` from outside, a node failure, the time limit) releases its
  lease with what Slurm said; a running job bound to other GPU indices
  than the lease's records Slurm's (``Broker.rebind_lease``);
* cancels a running job whose server the hub no longer lists, in two
  reconciliations in a row (a stop that failed, e.g. while slurmctld did
  not answer: JupyterHub forgets the server all the same), then releases
  its lease: until then the job holds the GPUs, so the lease does too and
  the hub's reconciliation leaves it alone (``Broker.reconcile``'s
  ``followed``);
* does nothing when Slurm cannot be asked (``squeue`` failed or timed
  out): the state is unknown, and no lease is ended on it (batchspawner
  issue #315 is a server orphaned by one failed status command).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Collection
from typing import TYPE_CHECKING

from gpubroker.engines.base import EngineError, Handle, Status
from gpubroker.engines.slurm import JOB_NAME_PREFIX, SlurmEngine

from .rebind import Rebinder

ORPHAN_GRACE = 10.0
"""Seconds an orphaned server job gets between SIGTERM and ``scancel``."""

if TYPE_CHECKING:
    from gpubroker.core import Broker
    from gpubroker.model.holdings import LeaseRef


def said(status: Status) -> str:
    """What Slurm's answer says of an ended job, for a release reason."""
    if status.state == "lost":
        return "is gone from Slurm"
    if status.timed_out:
        return "reached its time limit"
    if status.signal is not None:
        return f"was ended by signal {status.signal}"
    return f"exited with status {status.exit_code}"


class SlurmServers:
    """Follows the Slurm jobs of ``broker``'s server leases (see the module).

    Args:
        broker: the broker whose server leases are followed.
        log: where warnings go.
    """

    def __init__(self, broker: Broker, log: logging.Logger) -> None:
        self.broker = broker
        self.log = log
        self.rebinder = Rebinder(broker, log)
        self._suspects: set[int] = set()

    @property
    def engine(self) -> SlurmEngine | None:
        """The broker's engine when it is Slurm, else ``None``."""
        engine = self.broker.engine
        return engine if isinstance(engine, SlurmEngine) else None

    def watched(self) -> dict[int, LeaseRef]:
        """Granted server leases that name a Slurm job, by lease id."""
        return {x.id: x for x in self.broker.server_leases() if x.slurm_job}

    def followed(self) -> set[int]:
        """Ids of the server leases whose Slurm job this follows (none when
        the engine is not Slurm): the hub's reconciliation leaves them to
        :meth:`reconcile`."""
        return set(self.watched()) if self.engine is not None else set()

    def adopt(self) -> None:
        """Count every recorded server job as the broker's own."""
        engine = self.engine
        if engine is not None:
            engine.adopt(x.slurm_job or "" for x in self.watched().values())

    async def reconcile(
        self, alive: Collection[tuple[str, str]] | None = None, as_of: dt.datetime | None = None
    ) -> list[int]:
        """Ask Slurm about every recorded server job, off the event loop;
        release the leases of those ended, record the GPUs of those bound
        elsewhere, cancel those whose server the hub has lost.

        Args:
            alive: (user, server name) of every server the hub lists, or
                ``None`` when the hub could not be asked (no job is then
                taken for an orphan).
            as_of: aware UTC time the hub listing was requested; a lease
                created after it is not an orphan (its server may be newer).

        Returns:
            ids of the leases released.
        """
        self.adopt()
        watched = self.watched()
        if not watched:
            self._suspects = set()
            return []
        engine = self.engine
        if engine is None:
            self.log.warning(
                "Leases %s name Slurm jobs, but Broker.engine_kind is not 'slurm': not checked",
                sorted(watched),
            )
            return []
        handles = [Handle(engine.name, x.slurm_job or "", "") for x in watched.values()]
        # the hub submitted these jobs, named by their lease: a job Slurm gave
        # the same id later (a reset slurmctld) is another's, not this lease's
        engine.expect({x.slurm_job or "": f"{JOB_NAME_PREFIX}{i}" for i, x in watched.items()})
        try:
            statuses = await asyncio.to_thread(engine.poll_many, handles, False)
        except EngineError as err:
            self.log.warning("Cannot ask Slurm about servers' jobs (nothing ended): %s", err)
            return []
        ended: dict[int, tuple[str, str]] = {}
        running: list[LeaseRef] = []
        for lease_id, lease in watched.items():
            job = lease.slurm_job or ""
            status = statuses.get(job)
            if status is None:
                continue
            if status.running:
                self._rebind(lease, status.devices)
                running.append(lease)
            else:
                ended[lease_id] = (job, said(status))
        ended.update(await self._cancel_orphans(engine, self._orphans(running, alive, as_of)))
        return self.broker.reconcile_slurm_servers(ended) if ended else []

    def _orphans(
        self,
        running: list[LeaseRef],
        alive: Collection[tuple[str, str]] | None,
        as_of: dt.datetime | None,
    ) -> list[LeaseRef]:
        """The leases of ``running`` whose server the hub has not listed in
        this reconciliation nor in the one before (one listing may race a
        stop that is under way); a round without a listing starts over."""
        if alive is None or as_of is None:
            self._suspects = set()
            return []
        lost = {
            x.id: x
            for x in running
            if x.created < as_of and (x.user, x.server_name or "") not in alive
        }
        orphans = [x for lease_id, x in lost.items() if lease_id in self._suspects]
        self._suspects = set(lost)
        return orphans

    async def _cancel_orphans(
        self, engine: SlurmEngine, orphans: list[LeaseRef]
    ) -> dict[int, tuple[str, str]]:
        """Stop the jobs of ``orphans`` (SIGTERM, :data:`ORPHAN_GRACE`
        seconds, ``scancel``), together, off the event loop.

        Returns:
            lease id -> (job id, why it ended) for the jobs stopped; a job
            Slurm could not stop keeps its lease (a warning is logged) and
            is tried again at the next reconciliation.
        """
        if not orphans:
            return {}
        for lease in orphans:
            self.log.warning(
                "Slurm job %s of server %s/%s still runs, but the hub no longer lists the "
                "server (a stop that failed?): cancelling it",
                lease.slurm_job,
                lease.user,
                lease.server_name,
            )
        stops = [
            asyncio.to_thread(engine.stop, Handle(engine.name, x.slurm_job or "", ""), ORPHAN_GRACE)
            for x in orphans
        ]
        results = await asyncio.gather(*stops, return_exceptions=True)
        ended: dict[int, tuple[str, str]] = {}
        for lease, result in zip(orphans, results, strict=True):
            job = lease.slurm_job or ""
            if isinstance(result, BaseException) or result.running:
                self.log.warning(
                    "Could not cancel Slurm job %s of lost server %s/%s (its lease %s is kept): %s",
                    job,
                    lease.user,
                    lease.server_name,
                    lease.id,
                    result if isinstance(result, BaseException) else "it still runs",
                )
                continue
            ended[lease.id] = (job, "was cancelled: its server is gone from the hub")
        return ended

    def _rebind(self, lease: LeaseRef, bound: tuple[str, ...]) -> None:
        held = [slot.device_uuid for slot in lease.slots]
        what = f"Slurm job {lease.slurm_job} of server {lease.user}/{lease.server_name}"
        self.rebinder.apply(lease.id, held, bound, what)
