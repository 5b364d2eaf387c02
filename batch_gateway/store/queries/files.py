"""Queries on ``files``: uploads, listing, deletion, output files, purging.

None commits: the caller owns the transaction."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import func, or_, select, text, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

from batch_gateway.store.models import (
    EPOCH_NOW,
    Batch,
    File,
)
from batch_gateway.store.queries._shared import can_exist, page
from batch_gateway.store.states import ACTIVE_BATCH_STATUSES


def insert_file(session: Session, *, file_id: str, tenant_id: str, size: int, filename: str,
                purpose: str, storage_key: str, sha256: str | None,
                expires_after_seconds: int | None) -> File:
    """Insert a file row; ``expires_at`` = the database's now + ``expires_after_seconds``."""
    expires = None if expires_after_seconds is None else text(
        f"extract(epoch from now())::bigint + {int(expires_after_seconds)}"
    )
    return session.execute(
        pg_insert(File)
        .values(id=file_id, tenant_id=tenant_id, bytes=size, filename=filename, purpose=purpose,
                storage_key=storage_key, sha256=sha256, expires_at=expires)
        .returning(File)
    ).scalar_one()


def _visible_file(tenant_id: str):
    return (File.tenant_id == tenant_id, File.deleted_at.is_(None),
            or_(File.expires_at.is_(None), File.expires_at > EPOCH_NOW))


def get_file(session: Session, tenant_id: str, file_id: str) -> File | None:
    """The tenant's live file ``file_id``, or None (another tenant's file is None too)."""
    if not can_exist(file_id):
        return None
    return session.execute(
        select(File).where(File.id == file_id, *_visible_file(tenant_id))
    ).scalar_one_or_none()


def list_files(session: Session, tenant_id: str, *, purpose: str | None, limit: int,
               order: str, after: str | None) -> tuple[list[File], bool] | None:
    """A page of the tenant's live files and whether more follow; None for an unknown cursor."""
    visible = _visible_file(tenant_id)
    stmt = select(File).where(*visible)
    if purpose is not None:
        stmt = stmt.where(File.purpose == purpose)
    return page(session, stmt, File, tenant_id, after, limit, order == "desc", visible)


def delete_file(session: Session, tenant_id: str, file_id: str) -> File | None:
    """Hide the tenant's file from the API; returns it, or None when not found.

    The caller removes the bytes unless :func:`file_in_use` says a running batch still reads them.
    """
    if not can_exist(file_id):
        return None
    return session.execute(
        update(File)
        .where(File.id == file_id, *_visible_file(tenant_id))
        .values(deleted_at=EPOCH_NOW)
        .returning(File)
    ).scalar_one_or_none()


def file_in_use(session: Session, file_id: str) -> bool:
    """Whether a non-terminal batch reads ``file_id`` as its input."""
    return session.execute(
        select(func.count()).select_from(Batch).where(
            Batch.input_file_id == file_id, Batch.status.in_(ACTIVE_BATCH_STATUSES)
        )
    ).scalar_one() > 0


def upsert_output_file(session: Session, *, file_id: str, tenant_id: str, size: int, filename: str,
                       storage_key: str, sha256: str, expires_after_seconds: int) -> None:
    """Register an output or error file (purpose ``batch_output``); a second call with the same id
    (a repeated finalisation) changes nothing."""
    session.execute(
        pg_insert(File)
        .values(id=file_id, tenant_id=tenant_id, bytes=size, filename=filename, purpose="batch_output",
                storage_key=storage_key, sha256=sha256,
                expires_at=text(f"extract(epoch from now())::bigint + {int(expires_after_seconds)}"))
        .on_conflict_do_nothing(index_elements=[File.id])
    )


def purgeable_files(session: Session, limit: int = 500) -> list[File]:
    """Deleted or expired files whose bytes are still stored and that no non-terminal batch reads
    as input, locked (``SKIP LOCKED``) for the caller to purge."""
    in_use = select(Batch.input_file_id).where(Batch.status.in_(ACTIVE_BATCH_STATUSES))
    return list(session.execute(
        select(File)
        .where(File.purged_at.is_(None),
               or_(File.deleted_at.is_not(None), File.expires_at <= EPOCH_NOW),
               File.id.not_in(in_use))
        .limit(limit)
        .with_for_update(skip_locked=True)
    ).scalars())


def mark_purged(session: Session, file_ids: Sequence[str]) -> None:
    """Record that these files' bytes are gone."""
    if file_ids:
        session.execute(update(File).where(File.id.in_(list(file_ids))).values(purged_at=EPOCH_NOW))


def get_any_file(session: Session, file_id: str) -> File | None:
    """Any tenant's file ``file_id`` whose bytes are still stored, or None (admin downloads)."""
    if not can_exist(file_id):
        return None
    return session.execute(select(File).where(File.id == file_id, File.purged_at.is_(None))).scalar_one_or_none()
