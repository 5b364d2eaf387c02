"""Whether the batch lifecycle has anything to do: :func:`lifecycle_work_pending`, the probe beat
asks before it sends a frequent lifecycle task (``workers.schedule``).

None commits: the caller owns the transaction."""

from __future__ import annotations

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from batch_gateway.store.models import Batch, Event
from batch_gateway.store.states import ACTIVE_BATCH_STATUSES


def lifecycle_work_pending(session: Session) -> bool:
    """True when a batch has not ended (``validating``, ``in_progress``, ``finalizing``,
    ``cancelling``), an outbox event waits to be handed to the broker, or a webhook delivery is not
    done; False on an idle deployment. Three ``EXISTS`` probes in one round trip (the outbox and
    webhook ones on their partial indexes)."""
    active = select(Batch.id).where(Batch.status.in_([s.value for s in ACTIVE_BATCH_STATUSES])).exists()
    outbox = select(Event.id).where(Event.needs_publish, Event.published_at.is_(None)).exists()
    webhooks = select(Event.id).where(Event.webhook_next_at.is_not(None), Event.webhook_done_at.is_(None)).exists()
    return bool(session.scalar(select(or_(active, outbox, webhooks))))
