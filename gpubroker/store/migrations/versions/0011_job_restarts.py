"""jobs: restarts and the warning before a stop

``jobs.restarts`` counts how often a job was requeued (after a preemption,
or a retry after a failure); ``jobs.warned_at`` is when its process got the
warning signal (its time limit or a preemption is near).

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-02 02:10:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("restarts", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("warned_at", sa.DateTime(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("warned_at")
        batch.drop_column("restarts")
