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
* does nothing when Slurm cannot be asked (``squeue`` failed or timed
  out): the state is unknown, and no lease is ended on it (batchspawner
  issue #315 is a server orphaned by one failed status command).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from gpubroker.engines.base import EngineError, Handle, Status
from gpubroker.engines.slurm import SlurmEngine

from .rebind import Rebinder

if TYPE_CHECKING:
    from gpubroker.core import Broker
    from gpubroker.store.models import Lease


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

    @property
    def engine(self) -> SlurmEngine | None:
        """The broker's engine when it is Slurm, else ``None``."""
        engine = self.broker.engine
        return engine if isinstance(engine, SlurmEngine) else None

    def watched(self) -> dict[int, Lease]:
        """Granted server leases that name a Slurm job, by lease id."""
        return {x.id: x for x in self.broker.server_leases() if x.slurm_job}

    def adopt(self) -> None:
        """Count every recorded server job as the broker's own."""
        engine = self.engine
        if engine is not None:
            engine.adopt(x.slurm_job or "" for x in self.watched().values())

    async def reconcile(self) -> list[int]:
        """Ask Slurm about every recorded server job, off the event loop;
        release the leases of those ended, record the GPUs of those bound
        elsewhere.

        Returns:
            ids of the leases released.
        """
        self.adopt()
        watched = self.watched()
        if not watched:
            return []
        engine = self.engine
        if engine is None:
            self.log.warning(
                "Leases %s name Slurm jobs, but Broker.engine_kind is not 'slurm': not checked",
                sorted(watched),
            )
            return []
        handles = [Handle(engine.name, x.slurm_job or "", "") for x in watched.values()]
        try:
            statuses = await asyncio.to_thread(engine.poll_many, handles, False)
        except EngineError as err:
            self.log.warning("Cannot ask Slurm about servers' jobs (nothing ended): %s", err)
            return []
        ended: dict[int, tuple[str, str]] = {}
        for lease_id, lease in watched.items():
            job = lease.slurm_job or ""
            status = statuses.get(job)
            if status is None:
                continue
            if status.running:
                self._rebind(lease, status.devices)
            else:
                ended[lease_id] = (job, said(status))
        return self.broker.reconcile_slurm_servers(ended) if ended else []

    def _rebind(self, lease: Lease, bound: tuple[str, ...]) -> None:
        held = [a.device_uuid for a in lease.allocations if a.active]
        what = f"Slurm job {lease.slurm_job} of server {lease.user}/{lease.server_name}"
        self.rebinder.apply(lease.id, held, bound, what)
