"""The culler's memory, kept in the store (``culler_tracks``): when each
lease last used its GPUs, its warning's deadline, whether admins were
told, whether it was culled and whether its kernels were read. A restarted
broker reads it back, so a warned server is culled at its original
deadline, not a full timeout later.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session, sessionmaker

from .models import CullerTrack

#: the fields of a track, as stored
FIELDS = ("gpu_active", "busy_since_gpu_idle", "warned_until", "flagged", "culled", "kernels_seen")


def load_tracks(factory: sessionmaker[Session]) -> dict[int, dict[str, Any]]:
    """Every stored track: lease id → its fields (times aware UTC)."""
    with factory() as session:
        return {
            row.lease_id: {name: getattr(row, name) for name in FIELDS}
            for row in session.scalars(select(CullerTrack))
        }


def save_tracks(factory: sessionmaker[Session], tracks: Mapping[int, Mapping[str, Any]]) -> None:
    """Make the stored tracks exactly ``tracks`` (lease id → fields), in one
    transaction; tracks of leases no longer listed are deleted."""
    with factory() as session, session.begin():
        stored = {row.lease_id: row for row in session.scalars(select(CullerTrack))}
        gone = set(stored) - set(tracks)
        if gone:
            session.execute(delete(CullerTrack).where(CullerTrack.lease_id.in_(gone)))
        for lease_id, fields in tracks.items():
            row = stored.get(lease_id) or CullerTrack(lease_id=lease_id)
            for name in FIELDS:
                setattr(row, name, fields[name])
            session.add(row)
