"""audit entries: targets of any length

``audit_entries.target`` was ``VARCHAR(255)`` and the store cut targets to
255 characters, but a target is ``user:NAME`` or ``group:NAME`` with a name
of up to 255 characters: the longest names were cut, and the audit log's
``?user=`` filter, which compares the whole target, missed their entries.
The column becomes ``TEXT``; existing rows keep their values (targets cut
before this revision stay cut). A downgrade cuts longer targets to 255
characters again.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-06 05:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("audit_entries") as batch:
        batch.alter_column(
            "target",
            existing_type=sa.String(length=255),
            type_=sa.Text(),
            existing_nullable=False,
        )


def downgrade() -> None:
    op.execute(
        "UPDATE audit_entries SET target = substr(target, 1, 255) WHERE length(target) > 255"
    )
    with op.batch_alter_table("audit_entries") as batch:
        batch.alter_column(
            "target",
            existing_type=sa.Text(),
            type_=sa.String(length=255),
            existing_nullable=False,
        )
