"""Alembic environment and revisions: the only way the schema changes (``backfill migrate``)."""
