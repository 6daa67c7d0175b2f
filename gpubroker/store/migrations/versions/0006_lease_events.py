"""lease events: the durable transition log

Every change of a lease's state, and what happens to it meanwhile (waits,
preemption notices, server stops, notices), is one row, appended in the
transaction of the change. Leases older than the log get one ``adopted``
event with their state at the upgrade, so every lease's log replays to its
state.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 11:10:00
"""

import datetime as dt

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    events = op.create_table(
        "lease_events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("lease_id", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("from_state", sa.String(length=16), nullable=True),
        sa.Column("to_state", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("actor", sa.String(length=255), nullable=False),
        sa.Column("stimulus", sa.String(length=64), nullable=False),
        sa.Column("at", sa.DateTime(), nullable=False),
        sa.Column("detail", sa.JSON(), nullable=True),
        sa.ForeignKeyConstraint(["lease_id"], ["leases.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_lease_events_lease_id", "lease_events", ["lease_id"])
    op.create_index("ix_lease_events_stimulus", "lease_events", ["stimulus"])
    leases = sa.table("leases", sa.column("id", sa.Integer), sa.column("state", sa.String))
    now = dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)
    rows = op.get_bind().execute(sa.select(leases.c.id, leases.c.state)).all()
    if rows:
        op.bulk_insert(
            events,
            [
                {
                    "lease_id": lease_id,
                    "kind": "adopted",
                    "from_state": None,
                    "to_state": state,
                    "reason": "lease older than the transition log (migration 0006)",
                    "actor": "broker",
                    "stimulus": "migration-0006",
                    "at": now,
                    "detail": None,
                }
                for lease_id, state in rows
            ],
        )


def downgrade() -> None:
    op.drop_index("ix_lease_events_stimulus", table_name="lease_events")
    op.drop_index("ix_lease_events_lease_id", table_name="lease_events")
    op.drop_table("lease_events")
