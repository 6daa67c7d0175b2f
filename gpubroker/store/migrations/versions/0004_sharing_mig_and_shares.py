"""sharing: MIG instances and time-sliced shares

Leases say what kind of slot they ask for (whole devices, a MIG profile, or
shares of a memory size, optionally in a pool) and what they weigh;
allocations record the MIG instance or share they hold. The unique index on
active allocations now covers whole-device allocations only, and a second
one makes a MIG instance UUID held at most once.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30 03:20:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("kind", sa.String(length=8), server_default="gpus", nullable=False)
        )
        batch_op.add_column(sa.Column("mig_profile", sa.String(length=32), nullable=True))
        batch_op.add_column(sa.Column("memory_mib", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("pool", sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column("weight", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("grant_env", sa.JSON(), nullable=True))

    with op.batch_alter_table("devices", schema=None) as batch_op:
        batch_op.add_column(sa.Column("mig_target", sa.Boolean(), nullable=True))

    with op.batch_alter_table("allocations", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("kind", sa.String(length=8), server_default="device", nullable=False)
        )
        batch_op.add_column(sa.Column("instance_uuid", sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column("profile", sa.String(length=32), nullable=True))
        batch_op.add_column(sa.Column("placement_start", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("placement_size", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("memory_mib", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("weight", sa.Float(), server_default="1.0", nullable=False))
        batch_op.drop_index("uq_allocations_active_device")
        batch_op.create_index(
            "uq_allocations_active_device",
            ["device_uuid"],
            unique=True,
            sqlite_where=sa.text("active = 1 AND kind = 'device'"),
            postgresql_where=sa.text("active AND kind = 'device'"),
        )
        batch_op.create_index(
            "uq_allocations_active_instance",
            ["instance_uuid"],
            unique=True,
            sqlite_where=sa.text("active = 1 AND instance_uuid IS NOT NULL"),
            postgresql_where=sa.text("active AND instance_uuid IS NOT NULL"),
        )


def downgrade() -> None:
    with op.batch_alter_table("allocations", schema=None) as batch_op:
        batch_op.drop_index("uq_allocations_active_instance")
        batch_op.drop_index("uq_allocations_active_device")
        batch_op.create_index(
            "uq_allocations_active_device",
            ["device_uuid"],
            unique=True,
            sqlite_where=sa.text("active = 1"),
            postgresql_where=sa.text("active"),
        )
        for column in (
            "weight",
            "memory_mib",
            "placement_size",
            "placement_start",
            "profile",
            "instance_uuid",
            "kind",
        ):
            batch_op.drop_column(column)

    with op.batch_alter_table("devices", schema=None) as batch_op:
        batch_op.drop_column("mig_target")

    with op.batch_alter_table("leases", schema=None) as batch_op:
        for column in ("grant_env", "weight", "pool", "memory_mib", "mig_profile", "kind"):
            batch_op.drop_column(column)
