"""Webhooks on terminal batch states: OpenAI's event names, Standard-Webhooks HMAC-SHA256
signature, retried until the receiver answers 2xx (at least once)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import threading

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response
from sqlalchemy import update

from batch_gateway.store import queries
from batch_gateway.store.models import Event
from tests.conftest import SHARED_BATCHES, free_port, serve
from workers.webhooks import deliver_webhooks, new_secret


def _receiver(answers: list[int], seen: list):
    app = FastAPI()
    lock = threading.Lock()

    @app.post("/hook")
    async def hook(request: Request):
        body = await request.body()
        with lock:
            seen.append((dict(request.headers), body))
            status = answers.pop(0) if answers else 200
        return Response(status_code=status)

    return app


def test_cancelled_batch_is_announced_signed_and_retried(gateway):
    seen: list = []
    port = free_port()
    secret = new_secret()
    with gateway.session() as session:
        queries.set_webhook(session, "default", f"http://127.0.0.1:{port}/hook", secret)
        session.commit()
    client = gateway.client()
    uploaded = client.files.create(file=(SHARED_BATCHES / "litellm-batch-small.jsonl").open("rb"), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    gateway.wait_status(batch.id, ("in_progress",))
    client.batches.cancel(batch.id)
    ctx = gateway.celery.backfill
    with serve(_receiver([500], seen), port):
        assert deliver_webhooks(ctx) == 0  # the receiver fails once
        with gateway.session() as session:  # skip the backoff
            session.execute(update(Event).where(Event.batch_id == batch.id, Event.webhook_next_at.is_not(None))
                            .values(webhook_next_at=Event.created_at))
            session.commit()
        assert deliver_webhooks(ctx) == 1
        assert deliver_webhooks(ctx) == 0  # delivered: not again
    assert len(seen) == 2
    headers, body = seen[-1]
    event = orjson.loads(body)
    assert event["type"] == "batch.cancelled" and event["data"] == {"id": batch.id} and event["object"] == "event"
    assert headers["webhook-id"] == event["id"] == seen[0][0]["webhook-id"]
    signed = f"{headers['webhook-id']}.{headers['webhook-timestamp']}.".encode() + body
    key = base64.b64decode(secret.removeprefix("whsec_"))
    expected = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
    assert headers["webhook-signature"] == f"v1,{expected}"


def test_tenants_without_a_webhook_get_nothing_queued(gateway):
    client = gateway.client()
    uploaded = client.files.create(file=("in.jsonl", b"not json\n"), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    gateway.wait_status(batch.id, ("failed",))
    with gateway.session() as session:
        events = session.query(Event).filter(Event.batch_id == batch.id, Event.type == "batch.failed").all()
    assert len(events) == 1 and events[0].webhook_next_at is None
    assert deliver_webhooks(gateway.celery.backfill) == 0
