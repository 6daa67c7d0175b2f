"""usage ledger and audit entries

``usage_intervals`` holds the usage ledger: one row per slot a lease held
(and per wait in the queue), with start and end in UTC epoch seconds, the
slot's weight and the GPU use sampled over it. ``ledger_mark`` says which
transition-log entry the ledger has folded in last and when the broker
last showed a sign of life. ``audit_entries`` records admin actions that
are not on a lease (quotas, devices).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02 01:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "usage_intervals",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("lease_id", sa.Integer(), nullable=False),
        sa.Column("user", sa.String(length=255), nullable=False),
        sa.Column("group_name", sa.String(length=255), nullable=False),
        sa.Column("holder_kind", sa.String(length=16), nullable=False),
        sa.Column("holder", sa.String(length=255), nullable=False),
        sa.Column("priority_class", sa.String(length=64), nullable=False),
        sa.Column("pool", sa.String(length=64), nullable=False),
        sa.Column("slot_kind", sa.String(length=8), nullable=False),
        sa.Column("device_uuid", sa.String(length=64), nullable=False),
        sa.Column("slot_uuid", sa.String(length=64), nullable=False),
        sa.Column("profile", sa.String(length=32), nullable=False),
        sa.Column("model", sa.String(length=255), nullable=False),
        sa.Column("node", sa.String(length=255), nullable=False),
        sa.Column("weight", sa.Float(), nullable=False),
        sa.Column("start_s", sa.Float(), nullable=False),
        sa.Column("end_s", sa.Float(), nullable=True),
        sa.Column("end_cause", sa.String(length=16), nullable=False),
        sa.Column("used_gpu_seconds", sa.Float(), nullable=False),
        sa.Column("sampled_s", sa.Float(), nullable=False),
        sa.Column("idle_s", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_usage_intervals_lease_id", "usage_intervals", ["lease_id"])
    op.create_index("ix_usage_intervals_start_s", "usage_intervals", ["start_s"])
    op.create_index("ix_usage_intervals_end_s", "usage_intervals", ["end_s"])
    op.create_table(
        "ledger_mark",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("event_id", sa.Integer(), nullable=False),
        sa.Column("heartbeat_s", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_table(
        "audit_entries",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("at", sa.DateTime(), nullable=False),
        sa.Column("actor", sa.String(length=255), nullable=False),
        sa.Column("action", sa.String(length=32), nullable=False),
        sa.Column("target", sa.String(length=255), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("stimulus", sa.String(length=64), nullable=False),
        sa.Column("detail", sa.JSON(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_audit_entries_at", "audit_entries", ["at"])


def downgrade() -> None:
    op.drop_index("ix_audit_entries_at", table_name="audit_entries")
    op.drop_table("audit_entries")
    op.drop_table("ledger_mark")
    op.drop_index("ix_usage_intervals_end_s", table_name="usage_intervals")
    op.drop_index("ix_usage_intervals_start_s", table_name="usage_intervals")
    op.drop_index("ix_usage_intervals_lease_id", table_name="usage_intervals")
    op.drop_table("usage_intervals")
