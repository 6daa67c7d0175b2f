"""devices, leases and allocations

Revision ID: 0001
Revises: (none)
Create Date: 2026-11-30 00:04:41.025632
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:

    op.create_table(
        "devices",
        sa.Column("uuid", sa.String(length=64), nullable=False),
        sa.Column("node", sa.String(length=255), nullable=False),
        sa.Column("index", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("memory_total_mib", sa.Integer(), nullable=False),
        sa.Column("pci_bus_id", sa.String(length=32), nullable=False),
        sa.Column("mig_enabled", sa.Boolean(), nullable=False),
        sa.Column("present", sa.Boolean(), nullable=False),
        sa.Column("drained", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("uuid"),
    )
    op.create_table(
        "leases",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("user", sa.String(length=255), nullable=False),
        sa.Column("server_name", sa.String(length=255), nullable=False),
        sa.Column("holder_kind", sa.String(length=16), nullable=False),
        sa.Column("gpus", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("created", sa.DateTime(), nullable=False),
        sa.Column("granted_at", sa.DateTime(), nullable=True),
        sa.Column("released_at", sa.DateTime(), nullable=True),
        sa.Column("release_reason", sa.Text(), nullable=True),
        sa.Column("queue_position", sa.Integer(), nullable=True),
        sa.Column("queue_reason", sa.String(length=32), nullable=True),
        sa.Column("queue_message", sa.Text(), nullable=True),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_leases_state"), ["state"], unique=False)
        batch_op.create_index(batch_op.f("ix_leases_user"), ["user"], unique=False)
        batch_op.create_index(
            "uq_leases_active_server",
            ["user", "server_name"],
            unique=True,
            sqlite_where=sa.text("state IN ('pending', 'granted') AND holder_kind = 'server'"),
            postgresql_where=sa.text("state IN ('pending', 'granted') AND holder_kind = 'server'"),
        )

    op.create_table(
        "allocations",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("lease_id", sa.Integer(), nullable=False),
        sa.Column("device_uuid", sa.String(length=64), nullable=False),
        sa.Column("active", sa.Boolean(), nullable=False),
        sa.ForeignKeyConstraint(
            ["device_uuid"],
            ["devices.uuid"],
        ),
        sa.ForeignKeyConstraint(["lease_id"], ["leases.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("allocations", schema=None) as batch_op:
        batch_op.create_index(
            "uq_allocations_active_device",
            ["device_uuid"],
            unique=True,
            sqlite_where=sa.text("active = 1"),
            postgresql_where=sa.text("active"),
        )


def downgrade() -> None:

    with op.batch_alter_table("allocations", schema=None) as batch_op:
        batch_op.drop_index(
            "uq_allocations_active_device",
            sqlite_where=sa.text("active = 1"),
            postgresql_where=sa.text("active"),
        )

    op.drop_table("allocations")
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.drop_index(
            "uq_leases_active_server",
            sqlite_where=sa.text("state IN ('pending', 'granted') AND holder_kind = 'server'"),
            postgresql_where=sa.text("state IN ('pending', 'granted') AND holder_kind = 'server'"),
        )
        batch_op.drop_index(batch_op.f("ix_leases_user"))
        batch_op.drop_index(batch_op.f("ix_leases_state"))

    op.drop_table("leases")
    op.drop_table("devices")
