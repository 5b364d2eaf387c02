"""The schema comes from Alembic only: upgrade from empty must equal the models, and one
downgrade/upgrade round trip must work."""

from __future__ import annotations

import secrets

import psycopg
import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect

from batch_gateway.store.models import Base
from batch_gateway.store.settings import sqlalchemy_url
from migrations.config import downgrade, upgrade
from tests.conftest import _admin_url, with_database


@pytest.fixture
def empty_database(stores):
    name = f"bf_mig_{secrets.token_hex(6)}"
    with psycopg.connect(_admin_url(stores.database_url), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield sqlalchemy_url(with_database(stores.database_url, name))
    with psycopg.connect(_admin_url(stores.database_url), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _diff(url: str) -> list:
    engine = create_engine(url)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
    engine.dispose()
    return diff


def _tables(url: str) -> set[str]:
    engine = create_engine(url)
    tables = set(inspect(engine).get_table_names())
    engine.dispose()
    return tables


def test_upgrade_from_empty_matches_models(empty_database):
    upgrade(empty_database)
    assert _diff(empty_database) == []
    assert {"tenants", "api_keys", "files", "batches", "batch_requests", "events"} <= _tables(empty_database)


def test_downgrade_then_upgrade_round_trip(empty_database):
    upgrade(empty_database)
    downgrade(empty_database, "base")
    assert _tables(empty_database) == {"alembic_version"}
    upgrade(empty_database)
    assert _diff(empty_database) == []
