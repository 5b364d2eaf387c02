"""The feed step: keep at most ``feed_window`` requests of each ``in_progress`` batch queued,
earliest deadline first across batches, in prefix order (``prefix_key``, then line) within one.
The window is kept no larger than the processor's batch-lane buffer
(:attr:`~workers.settings.WorkerSettings.feed_window`), so what is queued sits in the processor,
where tenants share fairly, rather than in the stream in publishing order.

The lease is committed first, then the message is published, then its stream entry id is recorded
on the request (the sweeper asks the queue about that entry when the lease lapses), so a crash in
between only delays the request until the sweeper hands it back.
"""

from __future__ import annotations

import logging

from batch_gateway.store import queries
from common.contracts.queue import BATCH_LANE, RequestMessage
from workers.context import WorkerContext
from workers.validation import loads_line

log = logging.getLogger(__name__)


def _request_body(ctx: WorkerContext, key: str, offset: int, length: int) -> dict:
    line = b"".join(ctx.store.read(key, offset, length))
    return loads_line(line)["body"]  # parsed as validation parsed it (lone surrogates → U+FFFD)


def message_id(batch_id: str, custom_id: str, attempt: int) -> str:
    """The request message's id of one delivery attempt (also the processors' id claim)."""
    return f"{batch_id}:{custom_id}:{attempt}"


def feed(ctx: WorkerContext) -> int:
    """Queue pending requests up to the window of each batch; returns how many were published."""
    published = 0
    window = ctx.settings.feed_window
    with ctx.session() as session:
        batches = queries.feedable_batches(session)
        traceparents = queries.batch_traceparents(session, [b.id for b in batches if b.queued < window])
        for batch in batches:
            room = window - batch.queued
            if room <= 0:
                continue
            rows = queries.claim_pending(session, batch.id, room, ctx.settings.lease_seconds)
            if not rows:
                continue
            trace = {"traceparent": traceparents[batch.id]} if batch.id in traceparents else {}
            messages = [
                RequestMessage(
                    id=message_id(batch.id, row.custom_id, row.attempts),
                    created=0, deadline=batch.expires_at,
                    payload=_request_body(ctx, batch.storage_key, row.byte_offset, row.byte_length),
                    endpoint=batch.endpoint, result_queue_name=ctx.queue.result_stream,
                    metadata={"tenant": batch.tenant_id, "objective": BATCH_LANE, "batch_id": batch.id,
                              "custom_id": row.custom_id, "lease_token": str(row.lease_token),
                              "attempt": str(row.attempts), **trace},
                )
                for row in rows
            ]
            session.commit()  # leases first: a crash before the publish only delays these requests
            entry_ids = ctx.queue.publish(messages)
            queries.record_queue_entries(session, batch.id, [
                (row.custom_id, str(row.lease_token), entry_id) for row, entry_id in zip(rows, entry_ids)])
            session.commit()
            published += len(messages)
            ctx.metrics.fed.inc(len(messages))
            log.info("batch fed", extra={"action": "feed", "batch_id": batch.id, "tenant": batch.tenant_id,
                                         "requests": len(messages)})
    return published
