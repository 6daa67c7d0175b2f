"""priorities, quotas, fair share, preemption

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 00:30:24.148326
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "quotas",
        sa.Column("kind", sa.String(length=8), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("guaranteed", sa.Float(), nullable=False),
        sa.Column("limit", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("kind", "name"),
    )
    op.create_table(
        "usage",
        sa.Column("user", sa.String(length=255), nullable=False),
        sa.Column("gpu_seconds", sa.Float(), nullable=False),
        sa.Column("as_of", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("user"),
    )
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column(
                "priority_class",
                sa.String(length=64),
                nullable=False,
                server_default="interactive",
            )
        )
        batch_op.add_column(sa.Column("group_name", sa.String(length=255), nullable=True))
        batch_op.add_column(sa.Column("time_limit", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("ends_at", sa.DateTime(), nullable=True))
        batch_op.add_column(sa.Column("queue_eta", sa.DateTime(), nullable=True))
        batch_op.add_column(sa.Column("earmarked", sa.JSON(), nullable=True))
        batch_op.add_column(
            sa.Column("reclaimable", sa.Boolean(), nullable=False, server_default=sa.false())
        )
        batch_op.add_column(sa.Column("preempted_for", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("preempt_deadline", sa.DateTime(), nullable=True))
        batch_op.add_column(sa.Column("preempt_reason", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.drop_column("preempt_reason")
        batch_op.drop_column("preempt_deadline")
        batch_op.drop_column("preempted_for")
        batch_op.drop_column("reclaimable")
        batch_op.drop_column("earmarked")
        batch_op.drop_column("queue_eta")
        batch_op.drop_column("ends_at")
        batch_op.drop_column("time_limit")
        batch_op.drop_column("group_name")
        batch_op.drop_column("priority_class")

    op.drop_table("usage")
    op.drop_table("quotas")
