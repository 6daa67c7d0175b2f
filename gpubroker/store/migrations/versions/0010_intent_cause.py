"""the cause of a stop intent

``intents.cause`` records why the broker stops a server (``cull``,
``preemption``, ``time-limit``, ...), so the release that follows records
its cause from the broker's decision, never from a reason's words.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02 02:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("intents") as batch:
        batch.add_column(
            sa.Column("cause", sa.String(length=16), nullable=False, server_default="")
        )


def downgrade() -> None:
    with op.batch_alter_table("intents") as batch:
        batch.drop_column("cause")
