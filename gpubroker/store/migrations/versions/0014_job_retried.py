"""jobs: retries counted apart from preemptions

``jobs.retried`` counts the requeues after a failure (the job's
``retries`` limit them); ``jobs.restarts`` stays the count of all requeues,
and those after a preemption (``restarts - retried``) are what
``JobService.max_restarts`` limits. Existing jobs start at 0: their past
requeues count as preemptions.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-05 14:20:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("retried", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("retried")
