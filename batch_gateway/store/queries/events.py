"""Queries on ``events``: timeline entries, the outbox, webhook deliveries, trace contexts.

None commits: the caller owns the transaction."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import func, select, text, update
from sqlalchemy.orm import Session

from batch_gateway.store.models import (
    Batch,
    Event,
    Tenant,
)

WEBHOOK_EVENTS = ("batch.completed", "batch.failed", "batch.expired", "batch.cancelled")
"""Events sent to a tenant's webhook (OpenAI's batch event names)."""


def add_event(session: Session, batch: Batch | None, type_: str, payload: dict | None = None,
              *, publish: bool = False) -> Event:
    """Append an event (timeline entry; an outbox entry when ``publish``)."""
    event = Event(batch_id=batch.id if batch else None, tenant_id=batch.tenant_id if batch else None,
                  type=type_, payload=payload or {}, needs_publish=publish)
    if batch is not None and type_ in WEBHOOK_EVENTS:  # due now when the tenant has a webhook
        event.webhook_next_at = (select(func.now()).where(Tenant.id == batch.tenant_id,
                                                          Tenant.webhook_url.is_not(None))
                                 .scalar_subquery())
    session.add(event)
    session.flush()
    return event


def due_webhooks(session: Session, limit: int = 50) -> list:
    """Webhook deliveries due now, locked (``SKIP LOCKED``): rows ``(event, url, secret)``."""
    return list(session.execute(
        select(Event, Tenant.webhook_url, Tenant.webhook_secret)
        .join(Tenant, Tenant.id == Event.tenant_id)
        .where(Event.webhook_next_at <= func.now(), Event.webhook_done_at.is_(None))
        .order_by(Event.webhook_next_at)
        .limit(limit)
        .with_for_update(of=Event, skip_locked=True)
    ).all())


def webhook_attempted(session: Session, event_id: int, delivered: bool, retry_in_seconds: float | None) -> None:
    """Record one delivery attempt: done when ``delivered`` or when ``retry_in_seconds`` is None
    (given up), else due again after ``retry_in_seconds``."""
    values: dict = {"webhook_attempts": Event.webhook_attempts + 1}
    if delivered or retry_in_seconds is None:
        values["webhook_done_at"] = func.now()
    else:
        values["webhook_next_at"] = func.now() + text(f"interval '{float(retry_in_seconds)} seconds'")
    session.execute(update(Event).where(Event.id == event_id).values(**values))


def unpublished_events(session: Session, older_than_seconds: float, limit: int = 100) -> list[Event]:
    """Outbox entries not yet handed to the broker and older than ``older_than_seconds``, locked
    (``SKIP LOCKED``) so that concurrent relays take different ones."""
    return list(session.execute(
        select(Event)
        .where(Event.needs_publish, Event.published_at.is_(None),
               Event.created_at < func.now() - text(f"interval '{float(older_than_seconds)} seconds'"))
        .order_by(Event.id)
        .limit(limit)
        .with_for_update(skip_locked=True)
    ).scalars())


def mark_published(session: Session, event_ids: Sequence[int]) -> None:
    """Record that these outbox entries reached the broker."""
    if event_ids:
        session.execute(update(Event).where(Event.id.in_(list(event_ids))).values(published_at=func.now()))


def batch_traceparents(session: Session, batch_ids: Sequence[str]) -> dict[str, str]:
    """``{batch_id: traceparent}`` of the given batches created with a trace context (the
    ``batch.created`` event's payload, found through ``ix_events_batch_id_id``)."""
    if not batch_ids:
        return {}
    value = Event.payload["traceparent"].astext
    return dict(session.execute(
        select(Event.batch_id, value)
        .where(Event.batch_id.in_(list(batch_ids)), Event.type == "batch.created", value.is_not(None))
    ).all())
