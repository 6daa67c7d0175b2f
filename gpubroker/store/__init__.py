"""Durable state: the SQLAlchemy ORM, engine set-up and Alembic migrations."""
