"""Reports of the admin dashboard over every tenant (only the admin-key-protected ``/admin``
pages and the gateway's metrics call these).

None commits: the caller owns the transaction."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from sqlalchemy import and_, case, func, select, tuple_
from sqlalchemy.orm import Session

from batch_gateway.store.models import (
    Batch,
    BatchRequest,
    Event,
    Tenant,
)
from batch_gateway.store.queries._shared import can_exist
from batch_gateway.store.states import ACTIVE_BATCH_STATUSES, OPEN_REQUEST_STATES, BatchStatus, RequestState

BatchCursor = tuple[int, str]
"""A keyset position in the admin job list: ``(created_at, id)`` of the last batch shown."""


@dataclass(frozen=True)
class BatchFilter:
    """What the admin job list is narrowed to: one ``status``, one tenant (``tenant_id``), batch ids
    starting with ``id_prefix``, and ``metadata`` pairs the batch's metadata must all hold (exact
    string values). Empty fields do not narrow."""

    status: str | None = None
    tenant_id: str | None = None
    id_prefix: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)

    def apply(self, stmt):
        """``stmt`` with this filter's ``WHERE`` clauses on ``Batch``."""
        if self.status is not None:
            stmt = stmt.where(Batch.status == self.status)
        if self.tenant_id is not None:
            stmt = stmt.where(Batch.tenant_id == self.tenant_id)
        if self.id_prefix:
            escaped = self.id_prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
            stmt = stmt.where(Batch.id.like(escaped + "%", escape="\\"))
        if self.metadata:
            stmt = stmt.where(Batch.metadata_.contains(self.metadata))  # JSONB @>
        return stmt


def admin_list_batches(session: Session, *, limit: int, after: BatchCursor | None = None,
                       status: str | None = None, tenant_id: str | None = None,
                       where: BatchFilter | None = None) -> tuple[list, bool]:
    """A page of batches of every tenant, newest first (``created_at`` then ``id``, descending),
    after the keyset position ``after``, optionally of one ``status`` and/or one tenant, or narrowed
    by ``where`` (a :class:`BatchFilter`, which then also holds status and tenant): rows
    ``(Batch, tenant name)`` and whether more follow. Served by ``ix_batches_created_at_id`` (or its
    status / tenant twin), so a page reads ``limit + 1`` index entries whatever the table's size
    (an id or metadata search reads on until it has found them); counts come from the batch row,
    never from its requests."""
    where = where or BatchFilter(status=status, tenant_id=tenant_id)
    stmt = where.apply(select(Batch, Tenant.name).join(Tenant, Tenant.id == Batch.tenant_id))
    if after is not None:
        stmt = stmt.where(tuple_(Batch.created_at, Batch.id) < tuple_(after[0], after[1]))
    rows = list(session.execute(
        stmt.order_by(Batch.created_at.desc(), Batch.id.desc()).limit(limit + 1)
    ).all())
    return rows[:limit], len(rows) > limit


def admin_count_batches(session: Session, where: BatchFilter) -> int:
    """How many batches of every tenant ``where`` selects (the job list's total)."""
    return session.execute(where.apply(select(func.count()).select_from(Batch))).scalar_one()


def ended_unrun_counts(session: Session, batch_ids: Sequence[str]) -> dict[str, dict[str, int]]:
    """``{batch_id: {state: requests}}`` of the requests of ``batch_ids`` that ended without
    running: ``cancelled`` and ``expired`` (the batch row counts them as failed, as the API's
    ``request_counts`` does); an index-only count on ``ix_batch_requests_batch_id_state``."""
    if not batch_ids:
        return {}
    rows = session.execute(
        select(BatchRequest.batch_id, BatchRequest.state, func.count())
        .where(BatchRequest.batch_id.in_(list(batch_ids)),
               BatchRequest.state.in_((RequestState.CANCELLED, RequestState.EXPIRED)))
        .group_by(BatchRequest.batch_id, BatchRequest.state)
    ).all()
    out: dict[str, dict[str, int]] = {}
    for batch_id, state, count in rows:
        out.setdefault(batch_id, {})[state] = count
    return out


def admin_get_batch(session: Session, batch_id: str):
    """Row ``(Batch, tenant name)`` of any tenant's batch ``batch_id``, or None."""
    if not can_exist(batch_id):
        return None
    return session.execute(
        select(Batch, Tenant.name).join(Tenant, Tenant.id == Batch.tenant_id).where(Batch.id == batch_id)
    ).one_or_none()


def batch_events(session: Session, batch_id: str, limit: int = 200) -> list[Event]:
    """The batch's timeline: its first ``limit`` events, oldest first (``ix_events_batch_id_id``)."""
    return list(session.execute(
        select(Event).where(Event.batch_id == batch_id).order_by(Event.id).limit(limit)
    ).scalars())


def request_state_counts(session: Session, batch_id: str) -> dict[str, int]:
    """``{state: requests}`` of one batch (an index-only count on ``ix_batch_requests_batch_id_state``)."""
    return dict(session.execute(
        select(BatchRequest.state, func.count()).where(BatchRequest.batch_id == batch_id)
        .group_by(BatchRequest.state)
    ).all())


ERROR_BODY_BYTES = 65536
"""How much of a failed request's response body the job page reads for its error message (bytes;
an API error body is a few hundred)."""


def admin_request_page(session: Session, batch_id: str, *, limit: int, after: int | None = None,
                       state: str | None = None) -> tuple[list, bool]:
    """A page of the batch's requests in input order (``line``), after the line ``after``, optionally
    in one ``state``: rows ``(custom_id, line, state, attempts, status_code, error_code,
    error_message, error_body, prompt_tokens, completion_tokens, finished_at)`` and whether more
    follow. ``error_body`` is the first :data:`ERROR_BODY_BYTES` of the response body of a request
    answered with HTTP ≥ 400 and no ``error_message`` (else None); other bodies are not read."""
    error_body = case((and_(BatchRequest.status_code >= 400, BatchRequest.error_message.is_(None)),
                       func.substring(BatchRequest.response_body, 1, ERROR_BODY_BYTES)))
    stmt = select(BatchRequest.custom_id, BatchRequest.line, BatchRequest.state, BatchRequest.attempts,
                  BatchRequest.status_code, BatchRequest.error_code, BatchRequest.error_message,
                  error_body.label("error_body"), BatchRequest.prompt_tokens, BatchRequest.completion_tokens,
                  BatchRequest.finished_at).where(BatchRequest.batch_id == batch_id)
    if state is not None:
        stmt = stmt.where(BatchRequest.state == state)
    if after is not None:
        stmt = stmt.where(BatchRequest.line > after)
    rows = list(session.execute(stmt.order_by(BatchRequest.line).limit(limit + 1)).all())
    return rows[:limit], len(rows) > limit


def tenant_usage(session: Session, *, limit: int, after: str | None = None) -> tuple[list, bool]:
    """A page of tenants by name, after the name ``after``: rows ``(id, name, enqueued_token_limit,
    reserved_tokens, active_batches)`` (reserved = enqueued tokens of the tenant's batches that have
    not ended, read through ``ix_batches_status_deadline``) and whether more follow."""
    active = (select(Batch.tenant_id, func.sum(Batch.enqueued_tokens).label("reserved"),
                     func.count().label("batches"))
              .where(Batch.status.in_(ACTIVE_BATCH_STATUSES)).group_by(Batch.tenant_id).subquery())
    stmt = (select(Tenant.id, Tenant.name, Tenant.enqueued_token_limit,
                   func.coalesce(active.c.reserved, 0).label("reserved_tokens"),
                   func.coalesce(active.c.batches, 0).label("active_batches"))
            .outerjoin(active, active.c.tenant_id == Tenant.id))
    if after is not None:
        stmt = stmt.where(Tenant.name > after)
    rows = list(session.execute(stmt.order_by(Tenant.name).limit(limit + 1)).all())
    return rows[:limit], len(rows) > limit


def open_requests_by_tenant(session: Session, tenant_ids: Sequence[str]) -> dict[str, dict[str, int]]:
    """``{tenant_id: {"pending" | "queued": requests}}`` of requests not yet ended. Only batches
    ``in_progress`` or ``cancelling`` can hold such requests, so the count starts from those
    (``ix_batches_status_deadline``) and reaches their requests through
    ``ix_batch_requests_batch_id_state``: ended batches' requests are never scanned."""
    if not tenant_ids:
        return {}
    rows = session.execute(
        select(Batch.tenant_id, BatchRequest.state, func.count())
        .join(BatchRequest, BatchRequest.batch_id == Batch.id)
        .where(Batch.status.in_((BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING)), Batch.tenant_id.in_(list(tenant_ids)),
               BatchRequest.state.in_(OPEN_REQUEST_STATES))
        .group_by(Batch.tenant_id, BatchRequest.state)
    ).all()
    out: dict[str, dict[str, int]] = {}
    for tenant_id, state, count in rows:
        out.setdefault(tenant_id, {})[state] = count
    return out


def batch_status_counts(session: Session) -> dict[str, int]:
    """``{status: batches}`` over every tenant (one grouped count; the gateway's metrics cache it)."""
    return dict(session.execute(select(Batch.status, func.count()).group_by(Batch.status)).all())
