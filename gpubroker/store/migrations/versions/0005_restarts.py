"""restarts: a lease remembers the server restart it was made for

A server that died and was started again at once asks for a new lease with
``restart_of`` (its previous lease): the new lease counts the restart and
prefers the devices the previous one held.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 10:20:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.add_column(sa.Column("restarts", sa.Integer(), server_default="0", nullable=False))
        batch_op.add_column(sa.Column("restart_of", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("prefer_devices", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("leases", schema=None) as batch_op:
        for column in ("prefer_devices", "restart_of", "restarts"):
            batch_op.drop_column(column)
