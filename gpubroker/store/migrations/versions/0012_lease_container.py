"""leases: the Docker container of a server

``leases.container_id`` is the id of the Docker container a
``DockerGPUSpawner`` server runs in and ``leases.docker_engine`` the ID of
the Docker engine that runs it (both told by the spawner with the server's
URL); the broker's reconciliation asks that engine about the container.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-02 08:30:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("leases") as batch:
        batch.add_column(sa.Column("container_id", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("docker_engine", sa.String(length=128), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("leases") as batch:
        batch.drop_column("docker_engine")
        batch.drop_column("container_id")
