"""Alembic environment for gpubroker's packaged migrations.

On SQLite, foreign keys are off while migrations run: a batch operation
rebuilds a table (copy, ``DROP TABLE``, rename), and with foreign keys on
that ``DROP TABLE`` deletes every row that refers to the table through an
``ON DELETE CASCADE`` key (rebuilding ``leases`` emptied ``allocations``,
``lease_events``, ``notices``, ``intents`` and ``culler_tracks``). Every
other connection of :func:`gpubroker.store.db.make_engine` has them on.
"""

from alembic import context
from sqlalchemy import pool

from gpubroker.store.db import make_engine
from gpubroker.store.models import Base

config = context.config
target_metadata = Base.metadata


def run_migrations_offline() -> None:
    """Emit SQL for ``alembic upgrade --sql``."""
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    """Run migrations on a live connection."""
    engine = make_engine(config.get_main_option("sqlalchemy.url"), poolclass=pool.NullPool)
    sqlite = engine.dialect.name == "sqlite"
    with engine.connect() as connection:
        if sqlite:
            # outside any transaction (SQLite ignores the pragma inside one)
            connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
            connection.commit()
        context.configure(
            connection=connection, target_metadata=target_metadata, render_as_batch=True
        )
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
