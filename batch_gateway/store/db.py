"""Database engine and sessions. The app's lifespan (or a worker's start-up) owns the engine;
nothing here runs at import."""

from __future__ import annotations

import psycopg
from sqlalchemy import Engine, create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

CONNECT_TIMEOUT_SECONDS = 10
"""libpq's ``connect_timeout`` of every new connection: a Postgres host that drops packets fails a
request after this long instead of the operating system's TCP timeout (minutes). Connecting to a
healthy server takes milliseconds; 10 s also covers a server busy starting up."""


def make_engine(url: str, *, pool_size: int = 10, connect_timeout_seconds: int = CONNECT_TIMEOUT_SECONDS) -> Engine:
    """A pooled engine for ``url`` (``postgresql+psycopg://``); connections are checked before use
    so a restarted Postgres is reconnected to without a restart of ours (RELIABILITY.md F8), and a
    new connection gives up after ``connect_timeout_seconds`` (unless the URL sets its own
    ``connect_timeout``)."""
    given = "connect_timeout" in make_url(url).query
    return create_engine(url, pool_size=pool_size, max_overflow=pool_size, pool_pre_ping=True,
                         connect_args={} if given else {"connect_timeout": connect_timeout_seconds})


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    """Sessions that never expire loaded objects on commit (we render them after commit)."""
    return sessionmaker(engine, expire_on_commit=False)


def ensure_database(admin_url: str, name: str) -> None:
    """Create database ``name`` through ``admin_url`` (a libpq URL of a database that exists, e.g.
    ``postgres``) unless it exists. Raises ``psycopg.Error`` when the server refuses."""
    with psycopg.connect(admin_url, autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
        if not exists:
            conn.execute(f'CREATE DATABASE "{name}"')
