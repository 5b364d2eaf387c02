"""Hand-off of outbox events to the Celery broker.

A status change and its event row commit in one transaction (``queries.transition``,
``queries.insert_batch``); then :meth:`TaskPublisher.publish_pending` sends the event's task and
marks it published. If the broker is down the event stays in the outbox and the beat's relay task
sends it later, so a 2xx never loses its follow-up work. Tasks are idempotent, so a double send is
harmless.
"""

from __future__ import annotations

import logging

from celery import Celery
from sqlalchemy.orm import Session

from batch_gateway.store import queries

log = logging.getLogger(__name__)


def celery_broker_url(redis_url: str) -> str:
    """kombu's spelling of a redis-py URL: ``unix:///p/redis.sock`` → ``redis+socket:///p/redis.sock``."""
    if redis_url.startswith("unix://"):
        return "redis+socket://" + redis_url[len("unix://"):]
    return redis_url


class TaskPublisher:
    """Sends outbox events' tasks (by name; the gateway never imports ``workers``)."""

    def __init__(self, celery: Celery, queue: str):
        self.celery = celery
        self.queue = queue

    @classmethod
    def for_redis(cls, redis_url: str, queue: str) -> TaskPublisher:
        """A publisher to ``queue`` on the Redis broker at ``redis_url`` (redis-py form)."""
        app = Celery("backfill-publisher", broker=celery_broker_url(redis_url), set_as_current=False)
        app.conf.broker_connection_retry_on_startup = False
        return cls(app, queue)

    def publish_pending(self, session: Session, older_than_seconds: float = 0.0) -> int:
        """Send every unpublished outbox event older than ``older_than_seconds``; returns how many
        were sent. Broker errors are logged and leave the events for a later call."""
        sent: list[int] = []
        try:
            for event in queries.unpublished_events(session, older_than_seconds):
                self.celery.send_task(
                    event.payload["task"], args=[event.batch_id], queue=self.queue,
                    retry=True, retry_policy={"max_retries": 1, "interval_start": 0.1},
                )
                sent.append(event.id)
        except Exception as exc:  # broker down: the relay resends later
            log.warning("outbox publish failed", extra={"action": "outbox_publish_failed", "error": str(exc)})
        queries.mark_published(session, sent)
        session.commit()
        return len(sent)

    def close(self) -> None:
        """Release broker connections."""
        self.celery.close()
