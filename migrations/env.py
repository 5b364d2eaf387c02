"""Alembic environment: runs revisions online against ``sqlalchemy.url`` from the config, or
``DATABASE_URL`` when the config has none."""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy import create_engine, pool

from batch_gateway.store.models import Base
from batch_gateway.store.settings import sqlalchemy_url

config = context.config
target_metadata = Base.metadata


def run_migrations_online() -> None:
    url = config.get_main_option("sqlalchemy.url") or os.environ.get("DATABASE_URL")
    if not url:
        raise SystemExit("DATABASE_URL is not set")
    engine = create_engine(sqlalchemy_url(url), poolclass=pool.NullPool)
    with engine.connect() as connection:
        context.configure(connection=connection, target_metadata=target_metadata, compare_type=True)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


run_migrations_online()
