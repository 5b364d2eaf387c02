"""The operator's JSON over every tenant, for the holder of the admin key (``Authorization: Bearer
ADMIN_KEY``, checked as the dashboard checks it: :func:`batch_gateway.admin.auth.require_admin`),
under ``/admin/api/operator``; errors in OpenAI's envelope (the dashboard's handler for
``/admin/api``). What ``backfill batches list --all-tenants``, ``batches show --admin-key``,
``files list --all-tenants`` and ``tenants list`` print.

- ``GET /batches?limit&after&status&tenant``: a list of OpenAI Batch objects with ``tenant_name``,
  newest first; ``next`` (the cursor to send as ``after``) and ``total`` (of the filter).
- ``GET /batches/{batch_id}``: one Batch object of any tenant, with ``tenant_name``.
- ``GET /files?limit&after&purpose``: File objects of every tenant with ``tenant_name``; ``next``, ``total``.
- ``GET /tenants?limit&after``: tenants by name with their active batches, reserved tokens and
  limit; ``next``, ``total``.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query

from batch_gateway.admin.auth import require_admin
from batch_gateway.deps import SessionDep, SettingsDep
from batch_gateway.errors import InvalidRequestError, NotFoundError
from batch_gateway.schemas import batch_object, file_object
from batch_gateway.store import queries
from batch_gateway.store.states import BatchStatus

router = APIRouter(prefix="/admin/api/operator", dependencies=[Depends(require_admin)])

Limit = Annotated[int, Query(ge=1, le=1000)]
Text = Annotated[str | None, Query(max_length=256)]


def _text(value: str | None, param: str) -> str | None:
    if value is not None and not queries.can_exist(value):
        raise InvalidRequestError(f"Invalid value for '{param}': it contains a NUL byte.", param=param)
    return value


def _batch_cursor(after: str | None) -> queries.BatchCursor | None:
    """``CREATED_AT~BATCH_ID`` (what ``next`` gave) as a keyset position; 400 otherwise."""
    if after is None:
        return None
    created, _, batch_id = after.partition("~")
    if not (created.isascii() and created.isdigit() and len(created) < 19 and batch_id
            and queries.can_exist(batch_id)):
        raise InvalidRequestError(f"Invalid cursor {after[:80]!r}; use the 'next' of the previous page.",
                                  param="after")
    return int(created), batch_id


def _page(data: list[dict], more: bool, next_cursor: str | None, total: int) -> dict[str, Any]:
    return {"object": "list", "data": data, "has_more": more, "next": next_cursor if more else None,
            "total": total}


@router.get("/batches")
def all_batches(session: SessionDep, limit: Limit = 20, after: Text = None, status: Text = None,
                tenant: Text = None) -> dict:
    """A page of every tenant's batches (module docstring)."""
    if status is not None and status not in {s.value for s in BatchStatus}:
        raise InvalidRequestError(f"Unknown status '{status[:40]}'.", param="status")
    tenant_id = None
    if tenant is not None and _text(tenant, "tenant"):
        found = queries.tenant_by_name(session, tenant)
        if found is None:
            return _page([], False, None, 0)
        tenant_id = found.id
    rows, more = queries.admin_list_batches(session, limit=limit, after=_batch_cursor(after), status=status,
                                            tenant_id=tenant_id)
    last = rows[-1][0] if rows else None
    return _page([{**batch_object(batch), "tenant_name": name} for batch, name in rows], more,
                 f"{last.created_at}~{last.id}" if last else None,
                 queries.count_all_batches(session, status=status, tenant_id=tenant_id))


@router.get("/batches/{batch_id}")
def any_batch(batch_id: str, session: SessionDep) -> dict:
    """One batch of any tenant (404 ``No such Batch object``)."""
    row = queries.admin_get_batch(session, batch_id)
    if row is None:
        raise NotFoundError(f"No such Batch object: {batch_id[:100]}", param="batch_id")
    return {**batch_object(row[0]), "tenant_name": row[1]}


@router.get("/files")
def all_files(session: SessionDep, limit: Limit = 20, after: Text = None, purpose: Text = None) -> dict:
    """A page of every tenant's files (module docstring)."""
    page = queries.all_files_page(session, limit=limit, after=_text(after, "after"), purpose=_text(purpose, "purpose"))
    if page is None:
        raise InvalidRequestError(f"No such File object for 'after': {after}", param="after")
    rows, more = page
    return _page([{**file_object(row), "tenant_name": name} for row, name in rows], more,
                 rows[-1][0].id if rows else None, queries.count_all_files(session, purpose=purpose))


@router.get("/tenants")
def all_tenants(session: SessionDep, settings: SettingsDep, limit: Limit = 20, after: Text = None) -> dict:
    """A page of tenants by name (module docstring); ``enqueued_token_limit`` is the tenant's own
    or the default."""
    rows, more = queries.tenant_usage(session, limit=limit, after=_text(after, "after"))
    data = [{"name": row.name, "active_batches": int(row.active_batches), "reserved_tokens": int(row.reserved_tokens),
             "enqueued_token_limit": row.enqueued_token_limit or settings.default_enqueued_token_limit}
            for row in rows]
    return _page(data, more, rows[-1].name if rows else None, queries.count_tenants(session))
