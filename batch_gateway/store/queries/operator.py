"""The operator command line's reads over every tenant (``backfill batches list --all-tenants``,
``files list --all-tenants``, ``tenants list``): pages of files and totals of batches, files and
tenants. The batch pages and the tenants' usage are the dashboard's (:mod:`.admin`).

None commits: the caller owns the transaction."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from batch_gateway.store.models import Batch, File, Tenant
from batch_gateway.store.queries._shared import can_exist


def count_all_batches(session: Session, *, status: str | None = None, tenant_id: str | None = None) -> int:
    """How many batches every tenant has (optionally of one ``status`` and/or one tenant): the total
    behind a page of :func:`~.admin.admin_list_batches`."""
    stmt = select(func.count()).select_from(Batch)
    if status is not None:
        stmt = stmt.where(Batch.status == status)
    if tenant_id is not None:
        stmt = stmt.where(Batch.tenant_id == tenant_id)
    return int(session.scalar(stmt) or 0)


def all_files_page(session: Session, *, limit: int, after: str | None = None,
                   purpose: str | None = None) -> tuple[list, bool] | None:
    """A page of every tenant's files not deleted, newest first (upload order, ``seq``), after the
    file ``after``: rows ``(File, tenant name)`` and whether more follow; None when ``after`` names
    no file."""
    stmt = select(File, Tenant.name).join(Tenant, Tenant.id == File.tenant_id).where(File.deleted_at.is_(None))
    if purpose is not None:
        stmt = stmt.where(File.purpose == purpose)
    if after is not None:
        seq = session.scalar(select(File.seq).where(File.id == after)) if can_exist(after) else None
        if seq is None:
            return None
        stmt = stmt.where(File.seq < seq)
    rows = list(session.execute(stmt.order_by(File.seq.desc()).limit(limit + 1)).all())
    return rows[:limit], len(rows) > limit


def count_all_files(session: Session, *, purpose: str | None = None) -> int:
    """How many files not deleted every tenant has (optionally of one ``purpose``)."""
    stmt = select(func.count()).select_from(File).where(File.deleted_at.is_(None))
    if purpose is not None:
        stmt = stmt.where(File.purpose == purpose)
    return int(session.scalar(stmt) or 0)


def count_tenants(session: Session) -> int:
    """How many tenants there are."""
    return int(session.scalar(select(func.count()).select_from(Tenant)) or 0)
