"""Whether the batch lifecycle (or a background response) has anything to do: :func:`lifecycle_work_pending`, the probe beat
asks before it sends a frequent lifecycle task (``workers.schedule``).

None commits: the caller owns the transaction."""

from __future__ import annotations

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from batch_gateway.store.models import BackgroundResponse, Batch, Event
from batch_gateway.store.states import ACTIVE_BATCH_STATUSES, OPEN_RESPONSE_STATUSES


def lifecycle_work_pending(session: Session) -> bool:
    """True when a batch has not ended (``validating``, ``in_progress``, ``finalizing``,
    ``cancelling``), a background response has not ended (``queued``, ``in_progress``), an outbox
    event waits to be handed to the broker, or a webhook delivery is not done; False on an idle
    deployment. Four ``EXISTS`` probes in one round trip (the outbox and webhook ones on their
    partial indexes, the responses one on ``(status, deadline)``)."""
    active = select(Batch.id).where(Batch.status.in_([s.value for s in ACTIVE_BATCH_STATUSES])).exists()
    outbox = select(Event.id).where(Event.needs_publish, Event.published_at.is_(None)).exists()
    webhooks = select(Event.id).where(Event.webhook_next_at.is_not(None), Event.webhook_done_at.is_(None)).exists()
    responses = select(BackgroundResponse.id).where(
        BackgroundResponse.status.in_([s.value for s in OPEN_RESPONSE_STATUSES])).exists()
    return bool(session.scalar(select(or_(active, responses, outbox, webhooks))))
