"""Helpers every query module shares: object ids, the NUL guard, keyset pages ordered by ``seq``.

None commits: the caller owns the transaction."""

from __future__ import annotations

import secrets
from typing import Any, cast

from sqlalchemy import CursorResult, Result, Select, select
from sqlalchemy.orm import Session


def rowcount(result: Result[Any]) -> int:
    """Rows an ``UPDATE`` or ``DELETE`` touched (``session.execute`` types every result as a plain
    ``Result``; a DML statement's is a ``CursorResult``)."""
    return cast(CursorResult[Any], result).rowcount


def new_id(prefix: str) -> str:
    """A new object id: ``prefix`` + 24 random hex characters (96 bits), e.g. ``batch_9f…``."""
    return prefix + secrets.token_hex(12)


def can_exist(object_id: str) -> bool:
    """Whether ``object_id`` could name a stored object. PostgreSQL text cannot hold NUL, so an id
    with one names nothing (and must not reach a query, which would fail with a 500)."""
    return "\x00" not in object_id


def page(session: Session, stmt: Select, model, tenant_id: str, after: str | None, limit: int,
          descending: bool, extra=()) -> tuple[list, bool] | None:
    """One page of ``stmt`` ordered by ``seq``; None when ``after`` names no visible object."""
    if after is not None:
        if not can_exist(after):
            return None
        cursor = session.execute(
            select(model.seq).where(model.id == after, model.tenant_id == tenant_id, *extra)
        ).scalar_one_or_none()
        if cursor is None:
            return None
        stmt = stmt.where(model.seq < cursor if descending else model.seq > cursor)
    stmt = stmt.order_by(model.seq.desc() if descending else model.seq.asc()).limit(limit + 1)
    rows = list(session.execute(stmt).scalars())
    return rows[:limit], len(rows) > limit
