"""culler_tracks: whether the culler has read the server's kernels

``culler_tracks.kernels_seen`` keeps, across a broker restart, whether a
check has read the server's kernels: then a later check that cannot read
them withdraws no warning on the hub's activity (which an open idle tab
keeps fresh), and the warning's deadline holds. Existing tracks start at
false (as a restarted broker of the release before assumed).

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-07 16:20:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("culler_tracks") as batch:
        batch.add_column(
            sa.Column("kernels_seen", sa.Boolean(), nullable=False, server_default=sa.false())
        )


def downgrade() -> None:
    with op.batch_alter_table("culler_tracks") as batch:
        batch.drop_column("kernels_seen")
