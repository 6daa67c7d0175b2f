"""leases: the Slurm job of a server

``leases.slurm_job`` is the id of the Slurm job a ``SlurmGPUSpawner``
server runs as (told by the spawner with the server's URL); the broker's
reconciliation asks Slurm about that job and counts its GPUs as its own.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-03 12:20:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("leases") as batch:
        batch.add_column(sa.Column("slurm_job", sa.String(length=20), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("leases") as batch:
        batch.drop_column("slurm_job")
