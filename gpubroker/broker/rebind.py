"""Rebinder: record on a lease the devices its engine bound (Slurm picks the
GPU indices itself), warning once per refusal rather than at every check."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from gpubroker.errors import BrokerError

if TYPE_CHECKING:
    from gpubroker.core import Broker


class Rebinder:
    """Moves leases onto the devices their engine bound (``Broker.rebind_lease``).

    Args:
        broker: the broker whose leases move.
        log: where a refusal is told (once per lease and binding).
    """

    def __init__(self, broker: Broker, log: logging.Logger) -> None:
        self.broker = broker
        self.log = log
        #: lease id -> the binding refused last (told once)
        self._refused: dict[int, tuple[str, ...]] = {}

    def apply(self, lease_id: int, held: Sequence[str], bound: Sequence[str], what: str) -> bool:
        """Move lease ``lease_id`` from ``held`` onto ``bound`` (device UUIDs)
        when they differ; nothing when ``bound`` is empty (not known yet).

        Args:
            what: the holder, for the log ("job 7", "server ann/").

        Returns:
            whether the lease moved. A refusal (the devices are held
            otherwise, the lease ended) is logged as a warning the first
            time for that binding, then at debug level.
        """
        key = tuple(sorted(bound))
        if not key or key == tuple(sorted(held)):
            self._refused.pop(lease_id, None)
            return False
        try:
            self.broker.rebind_lease(lease_id, list(bound))
        except BrokerError as err:
            told = self._refused.get(lease_id) == key
            self._refused[lease_id] = key
            level = logging.DEBUG if told else logging.WARNING
            self.log.log(
                level, "%s: its lease %s cannot take the GPUs bound: %s", what, lease_id, err
            )
            return False
        self._refused.pop(lease_id, None)
        return True
