"""Webhook delivery of terminal batch events (``batch.completed``, ``batch.failed``,
``batch.expired``, ``batch.cancelled``) and background response events (``response.completed``,
``response.failed``, ``response.cancelled``, ``response.incomplete``; ``data.id`` the response id),
at least once, signed as OpenAI signs its webhooks (the
Standard Webhooks scheme):

- body ``{"id": "evt_…", "object": "event", "created_at": <Unix s>, "type": "batch.completed",
  "data": {"id": "batch_…"}}``;
- headers ``webhook-id`` (the event id), ``webhook-timestamp`` (Unix s) and ``webhook-signature``
  ``v1,<base64 HMAC-SHA256 of "{webhook-id}.{webhook-timestamp}.{body}">``, keyed with the
  base64-decoded part of the tenant's ``whsec_…`` secret.

A non-2xx answer or a network error is retried with exponential backoff (10 s doubling, at most
1 hour apart) for up to :data:`MAX_ATTEMPTS` attempts (about 3 days). Receivers dedup by
``webhook-id``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import secrets
import time

import httpx
import orjson

from batch_gateway.store import queries
from workers.context import WorkerContext

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 80
BACKOFF_START_SECONDS = 10.0
BACKOFF_CAP_SECONDS = 3600.0


def new_secret() -> str:
    """A signing secret: ``whsec_`` + base64 of 32 random bytes."""
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


def sign(secret: str, message_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` header value for ``body``."""
    key = base64.b64decode(secret.removeprefix("whsec_"))
    mac = hmac.new(key, f"{message_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def event_body(event) -> tuple[str, bytes]:
    """``(event id, JSON body)`` of an events-table row."""
    event_id = f"evt_{event.id:024x}"
    return event_id, orjson.dumps({"id": event_id, "object": "event",
                                   "created_at": int(event.created_at.timestamp()), "type": event.type,
                                   "data": {"id": event.batch_id or event.payload.get("id")}})


def retry_delay(attempts: int) -> float | None:
    """Seconds before the next try after ``attempts`` failed ones, or None to give up."""
    if attempts >= MAX_ATTEMPTS:
        return None
    return min(BACKOFF_CAP_SECONDS, BACKOFF_START_SECONDS * 2 ** (attempts - 1))


def deliver_webhooks(ctx: WorkerContext, timeout_seconds: float = 10.0) -> int:
    """Try every due delivery once; returns how many were delivered (2xx)."""
    delivered = 0
    with ctx.session() as session:
        due = queries.due_webhooks(session)
        if not due:
            return 0
        http = ctx.webhook_client(timeout_seconds)
        for event, url, secret in due:
            event_id, body = event_body(event)
            timestamp = int(time.time())
            ok = False
            if url and secret:
                try:
                    answer = http.post(url, content=body, headers={
                        "content-type": "application/json", "webhook-id": event_id,
                        "webhook-timestamp": str(timestamp), "webhook-signature": sign(secret, event_id, timestamp, body),
                    })
                    ok = 200 <= answer.status_code < 300
                except httpx.HTTPError as exc:
                    log.warning("webhook failed", extra={"action": "webhook_failed", "batch_id": event.batch_id,
                                                         "error": str(exc)})
            queries.webhook_attempted(session, event.id, ok, retry_delay(event.webhook_attempts + 1) if url else None)
            session.commit()
            delivered += ok
            if url:
                ctx.metrics.webhooks.labels("delivered" if ok else "failed").inc()
    return delivered
