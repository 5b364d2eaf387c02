"""Queries on ``background_responses``: create, read, the queued-count quota, publishing records,
the guarded status changes (start, finish, cancel, expire) and their webhook events.

Every status change is one compare-and-set UPDATE from an open status (``queued`` /
``in_progress``), so a result, a cancel and an expiry racing on one response end it once, and a
result that arrives for a cancelled response is discarded. None commits: the caller owns the
transaction."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, func, select, text, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

from batch_gateway.store.models import EPOCH_NOW, BackgroundResponse, Event, Tenant
from batch_gateway.store.queries._shared import can_exist
from batch_gateway.store.states import OPEN_RESPONSE_STATUSES, ResponseStatus

RESPONSE_WEBHOOK_EVENTS = ("response.completed", "response.failed", "response.cancelled", "response.incomplete")
"""Events sent to a tenant's webhook when a background response ends (OpenAI's event names)."""


def insert_response(session: Session, *, response_id: str, tenant_id: str, model: str,
                    previous_response_id: str | None, request: dict[str, Any], input: list[dict[str, Any]],
                    queue_seconds: int) -> BackgroundResponse:
    """Insert a ``queued`` background response; ``deadline`` = database now + ``queue_seconds``
    (still queued then, it expires)."""
    return session.execute(
        pg_insert(BackgroundResponse)
        .values(id=response_id, tenant_id=tenant_id, model=model, previous_response_id=previous_response_id,
                request=request, input=input,
                deadline=text(f"now() + interval '{int(queue_seconds)} seconds'"))
        .returning(BackgroundResponse)
    ).scalar_one()


def _get(session: Session, response_id: str) -> BackgroundResponse:
    return session.execute(select(BackgroundResponse).where(BackgroundResponse.id == response_id)
                           .execution_options(populate_existing=True)).scalar_one()


def get_response(session: Session, tenant_id: str, response_id: str) -> BackgroundResponse | None:
    """The tenant's background response ``response_id``, or None (another tenant's is None too)."""
    if not can_exist(response_id):
        return None
    return session.execute(
        select(BackgroundResponse).where(BackgroundResponse.id == response_id,
                                         BackgroundResponse.tenant_id == tenant_id)
        .execution_options(populate_existing=True)
    ).scalar_one_or_none()


def queued_responses(session: Session, tenant_id: str) -> int:
    """How many of the tenant's background responses are ``queued`` (the quota counts these)."""
    return session.execute(
        select(func.count()).select_from(BackgroundResponse)
        .where(BackgroundResponse.tenant_id == tenant_id, BackgroundResponse.status == ResponseStatus.QUEUED)
    ).scalar_one()


def lock_tenant_response_limit(session: Session, tenant_id: str) -> int | None:
    """The tenant's ``queued_response_limit`` (None: the default), its row locked until the
    transaction ends (serialises quota checks of concurrent creates)."""
    return session.execute(
        select(Tenant.queued_response_limit).where(Tenant.id == tenant_id).with_for_update()
    ).scalar_one()


def record_published(session: Session, response_id: str, entry_id: str) -> None:
    """Remember the async-lane stream entry id of the response's request message."""
    session.execute(update(BackgroundResponse).where(BackgroundResponse.id == response_id)
                    .values(queue_entry_id=entry_id))


def unpublished_responses(session: Session, older_than_seconds: float, limit: int = 100) -> list[BackgroundResponse]:
    """``queued`` responses not yet before their deadline whose publish was never recorded,
    created more than ``older_than_seconds`` ago (the gateway's own publish failed), oldest first."""
    return list(session.execute(
        select(BackgroundResponse)
        .where(BackgroundResponse.status == ResponseStatus.QUEUED, BackgroundResponse.queue_entry_id.is_(None),
               BackgroundResponse.deadline > func.now(),
               BackgroundResponse.created_at <= text(f"extract(epoch from now())::bigint - {float(older_than_seconds)}"))
        .order_by(BackgroundResponse.seq).limit(limit)
        .with_for_update(skip_locked=True)
    ).scalars())


def published_open_responses(session: Session, limit: int = 500) -> list:
    """Open (``queued`` / ``in_progress``) responses whose message was published, oldest first:
    rows ``(queue_entry_id, id, status, overdue)``, ``overdue`` true at or past the deadline (asked
    where their message is, to see which a processor has taken and which were lost)."""
    return list(session.execute(
        select(BackgroundResponse.queue_entry_id, BackgroundResponse.id, BackgroundResponse.status,
               (BackgroundResponse.deadline <= func.now()).label("overdue"))
        .where(BackgroundResponse.status.in_(OPEN_RESPONSE_STATUSES), BackgroundResponse.queue_entry_id.is_not(None))
        .order_by(BackgroundResponse.seq).limit(limit)
    ).all())


def responses_by_id(session: Session, response_ids: Sequence[str]) -> list[BackgroundResponse]:
    """The responses of these ids (any tenant), oldest first."""
    return list(session.execute(select(BackgroundResponse).where(BackgroundResponse.id.in_(list(response_ids)))
                                .order_by(BackgroundResponse.seq)).scalars())


def start_responses(session: Session, response_ids: Sequence[str]) -> list[str]:
    """``queued`` → ``in_progress`` (``in_progress_at`` = now) for these ids; the ids moved."""
    if not response_ids:
        return []
    return list(session.execute(
        update(BackgroundResponse)
        .where(BackgroundResponse.id.in_(list(response_ids)), BackgroundResponse.status == ResponseStatus.QUEUED)
        .values(status=ResponseStatus.IN_PROGRESS, in_progress_at=EPOCH_NOW)
        .returning(BackgroundResponse.id)
    ).scalars())


def finish_response(session: Session, response_id: str, status: str, *, output: list | None = None,
                    usage: dict | None = None, error: dict | None = None,
                    incomplete_details: dict | None = None) -> BackgroundResponse | None:
    """End an open response with ``status`` (``completed``, ``incomplete``, ``failed`` or
    ``cancelled``) and OpenAI's fields, ``finished_at`` = now, writing its ``response.{status}``
    event (a webhook delivery when the tenant has one). None when it had ended already (a cancel or
    an expiry won: the result is discarded)."""
    row = session.execute(
        update(BackgroundResponse)
        .where(BackgroundResponse.id == response_id, BackgroundResponse.status.in_(OPEN_RESPONSE_STATUSES))
        .values(status=status, finished_at=EPOCH_NOW, output=output, usage=usage, error=error,
                incomplete_details=incomplete_details)
        .returning(BackgroundResponse)
        .execution_options(synchronize_session=False, populate_existing=True)
    ).scalar_one_or_none()
    if row is not None:
        add_response_event(session, row, f"response.{status}")
    return row


@dataclass(frozen=True)
class ResponseCancel:
    """What :func:`cancel_response` did: ``response`` after the call and ``found``, the status it
    had when the cancel reached it."""

    response: BackgroundResponse
    found: str


def cancel_response(session: Session, tenant_id: str, response_id: str) -> ResponseCancel | None:
    """Cancel the tenant's response: an open one becomes ``cancelled`` (with its event); any other
    is returned unchanged. None when there is no such response."""
    row = get_response(session, tenant_id, response_id)
    if row is None:
        return None
    found = str(row.status)
    if found in OPEN_RESPONSE_STATUSES:
        row = finish_response(session, response_id, ResponseStatus.CANCELLED) or _get(session, response_id)
    return ResponseCancel(row, found)


def delete_response(session: Session, tenant_id: str, response_id: str) -> str | None:
    """Delete the tenant's response; the status it had, or None when there was none."""
    if not can_exist(response_id):
        return None
    return session.execute(
        delete(BackgroundResponse).where(BackgroundResponse.id == response_id,
                                         BackgroundResponse.tenant_id == tenant_id)
        .returning(BackgroundResponse.status)
    ).scalar_one_or_none()


def overdue_responses(session: Session, limit: int = 100) -> list[str]:
    """Ids of ``queued`` responses at or past their deadline, oldest first."""
    return list(session.execute(
        select(BackgroundResponse.id)
        .where(BackgroundResponse.status == ResponseStatus.QUEUED, BackgroundResponse.deadline <= func.now())
        .order_by(BackgroundResponse.seq).limit(limit)
    ).scalars())


def add_response_event(session: Session, row: BackgroundResponse, type_: str) -> Event:
    """Append a timeline event of a background response (payload ``{"id": response id}``); one of
    :data:`RESPONSE_WEBHOOK_EVENTS` is due at once as a webhook when the tenant has one."""
    event = Event(batch_id=None, tenant_id=row.tenant_id, type=type_, payload={"id": row.id})
    if type_ in RESPONSE_WEBHOOK_EVENTS:
        event.webhook_next_at = (select(func.now()).where(Tenant.id == row.tenant_id, Tenant.webhook_url.is_not(None))
                                 .scalar_subquery())
    session.add(event)
    session.flush()
    return event


def admin_list_responses(session: Session, *, status: str | None, limit: int,
                         after: str | None = None) -> tuple[list, bool]:
    """The dashboard's page of background responses over every tenant, newest first, after the
    response ``after`` (an unknown one starts from the newest): rows ``(id, tenant, status, model,
    created_at, in_progress_at, finished_at, error)`` and whether more follow."""
    stmt = (select(BackgroundResponse.id, Tenant.name.label("tenant"), BackgroundResponse.status,
                   BackgroundResponse.model, BackgroundResponse.created_at, BackgroundResponse.in_progress_at,
                   BackgroundResponse.finished_at, BackgroundResponse.error)
            .join(Tenant, Tenant.id == BackgroundResponse.tenant_id))
    if status:
        stmt = stmt.where(BackgroundResponse.status == status)
    if after and can_exist(after):
        cursor = select(BackgroundResponse.seq).where(BackgroundResponse.id == after).scalar_subquery()
        stmt = stmt.where(BackgroundResponse.seq < func.coalesce(cursor, BackgroundResponse.seq + 1))
    rows = list(session.execute(stmt.order_by(BackgroundResponse.seq.desc()).limit(limit + 1)).all())
    return rows[:limit], len(rows) > limit


def response_status_counts(session: Session) -> tuple[dict[str, int], int]:
    """``({status: background responses}, seconds the oldest ``queued`` one has waited)`` over every
    tenant (0 when none is queued; the database's clock, as ``created_at``): three short queries,
    the gateway's metrics cache them."""
    counts = dict(session.execute(select(BackgroundResponse.status, func.count())
                                  .group_by(BackgroundResponse.status)).all())
    oldest = session.execute(
        select(func.min(BackgroundResponse.created_at)).where(BackgroundResponse.status == ResponseStatus.QUEUED)
    ).scalar_one()
    now = session.execute(select(EPOCH_NOW)).scalar_one()
    return counts, max(0, int(now) - int(oldest)) if oldest is not None else 0
