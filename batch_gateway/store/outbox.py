"""Hand-off of outbox events to the Celery broker.

A status change and its event row commit in one transaction (``queries.transition``,
``queries.insert_batch``); then :meth:`TaskPublisher.publish_pending` sends the event's task and
marks it published. If the broker is down the event stays in the outbox and the beat's relay task
sends it later, so a 2xx never loses its follow-up work. Tasks are idempotent, so a double send is
harmless.

The gateway never talks to the broker inside a request: after its commit a request only wakes the
:class:`OutboxSender` thread, which publishes with the publisher's bounded timeouts
(:meth:`TaskPublisher.for_redis`). A frozen or unreachable broker therefore costs the client
nothing; the relay carries what the thread could not send (docs/reliability.md, "Broker and
database outages").
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery import Celery
from sqlalchemy.orm import Session, sessionmaker

from batch_gateway.store import queries

log = logging.getLogger(__name__)

DEFAULT_BROKER_TIMEOUT_SECONDS = 2.0
"""Bound of one broker operation (connect, one command's reply) of a publisher built by
:meth:`TaskPublisher.for_redis`. A healthy Redis answers an ``LPUSH`` in well under a
millisecond; 2 s is over a thousand times that and still short next to any client's timeout."""


def celery_broker_url(redis_url: str) -> str:
    """kombu's spelling of a redis-py URL: ``unix:///p/redis.sock`` → ``redis+socket:///p/redis.sock``."""
    if redis_url.startswith("unix://"):
        return "redis+socket://" + redis_url[len("unix://"):]
    return redis_url


def broker_timeouts(timeout_seconds: float) -> dict[str, Any]:
    """Celery settings bounding every broker call of a sending app by ``timeout_seconds``: the
    connection timeout, redis-py's socket timeouts (kombu's ``broker_transport_options``; without
    them a command on a frozen Redis waits forever)."""
    return {
        "broker_connection_timeout": timeout_seconds,
        "broker_transport_options": {"socket_timeout": timeout_seconds,
                                     "socket_connect_timeout": timeout_seconds},
    }


class TaskPublisher:
    """Sends outbox events' tasks (by name; the gateway never imports ``workers``).

    ``retry_policy`` is kombu's bounded retry of one send (default: one retry after 0.1 s);
    ``None`` sends once.
    """

    def __init__(self, celery: Celery, queue: str, *,
                 retry_policy: dict[str, Any] | None = None):
        self.celery = celery
        self.queue = queue
        self.retry_policy = {"max_retries": 1, "interval_start": 0.1} if retry_policy is None else retry_policy

    @classmethod
    def for_redis(cls, redis_url: str, queue: str, *,
                  timeout_seconds: float = DEFAULT_BROKER_TIMEOUT_SECONDS) -> TaskPublisher:
        """A publisher to ``queue`` on the Redis broker at ``redis_url`` (redis-py form) whose
        every broker call gives up after ``timeout_seconds`` (:func:`broker_timeouts`), each send
        tried once: a send takes at most about twice ``timeout_seconds`` (reconnect, command)."""
        app = Celery("backfill-publisher", broker=celery_broker_url(redis_url), set_as_current=False)
        app.conf.broker_connection_retry_on_startup = False
        app.conf.update(broker_timeouts(timeout_seconds))
        return cls(app, queue, retry_policy={"max_retries": 0})

    def publish_pending(self, session: Session, older_than_seconds: float = 0.0) -> int:
        """Send every unpublished outbox event older than ``older_than_seconds``; returns how many
        were sent. Broker errors are logged and leave the events for a later call (the first
        failure ends the call: the others would wait on the same broker)."""
        sent: list[int] = []
        try:
            for event in queries.unpublished_events(session, older_than_seconds):
                self.celery.send_task(
                    event.payload["task"], args=[event.batch_id], queue=self.queue,
                    retry=bool(self.retry_policy.get("max_retries")), retry_policy=self.retry_policy,
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


class OutboxSender:
    """A thread running :meth:`TaskPublisher.publish_pending` whenever :meth:`wake` is called.

    Requests call :meth:`wake` after their commit and answer at once; wakes that arrive while a
    pass runs are folded into one more pass. A pass that fails (broker or database down) leaves
    its events to the workers' relay.
    """

    def __init__(self, publisher: TaskPublisher, sessions: sessionmaker[Session]):
        self.publisher = publisher
        self.sessions = sessions
        self._wanted = threading.Event()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="outbox-sender", daemon=True)

    def start(self) -> OutboxSender:
        """Start the thread; returns self."""
        self._thread.start()
        return self

    def wake(self) -> None:
        """Ask for a pass over the outbox soon; never blocks."""
        self._wanted.set()

    def close(self, timeout_seconds: float = 10.0) -> None:
        """Stop the thread after its current pass (waiting at most ``timeout_seconds``; a pass
        blocked on the broker ends by its own timeouts, and the thread is a daemon)."""
        self._closing = True
        self._wanted.set()
        self._thread.join(timeout_seconds)

    def _run(self) -> None:
        while True:
            self._wanted.wait()
            if self._closing:
                return
            self._wanted.clear()
            try:
                with self.sessions() as session:
                    self.publisher.publish_pending(session)
            except Exception as exc:  # the database went away: the relay sends it later
                log.warning("outbox pass failed", extra={"action": "outbox_publish_failed", "error": str(exc)})
