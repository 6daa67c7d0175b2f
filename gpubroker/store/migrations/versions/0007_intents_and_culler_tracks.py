"""intents and culler tracks: what the broker is waiting for survives a restart

``intents`` holds side effects decided on and not yet seen through (the
stop of a hub server before its lease's slots are released); a restarted
broker carries them out again. ``culler_tracks`` holds the culler's clocks
and warnings per lease, so a warning's deadline holds across a restart.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01 11:30:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "intents",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("lease_id", sa.Integer(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("created", sa.DateTime(), nullable=False),
        sa.Column("state", sa.String(length=8), nullable=False),
        sa.Column("done_at", sa.DateTime(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(["lease_id"], ["leases.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_intents_lease_id", "intents", ["lease_id"])
    op.create_index("ix_intents_state", "intents", ["state"])
    op.create_table(
        "culler_tracks",
        sa.Column("lease_id", sa.Integer(), nullable=False),
        sa.Column("gpu_active", sa.DateTime(), nullable=False),
        sa.Column("busy_since_gpu_idle", sa.DateTime(), nullable=True),
        sa.Column("warned_until", sa.DateTime(), nullable=True),
        sa.Column("flagged", sa.Boolean(), nullable=False),
        sa.Column("culled", sa.Boolean(), nullable=False),
        sa.ForeignKeyConstraint(["lease_id"], ["leases.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("lease_id"),
    )


def downgrade() -> None:
    op.drop_table("culler_tracks")
    op.drop_index("ix_intents_state", table_name="intents")
    op.drop_index("ix_intents_lease_id", table_name="intents")
    op.drop_table("intents")
