"""Background responses, the workers' side: :func:`tick_responses`, run by beat every collect
interval. Each step is one guarded change per response (:mod:`batch_gateway.store.queries.
responses`), so running it twice, or in two workers at once, changes nothing twice.

1. **collect**: read the pool's response result stream (consumer group
   :data:`~common.contracts.background.RESPONSE_COLLECTOR_GROUP`), end each response by its result
   (:func:`~common.contracts.background.result_outcome`; one already ended, by a cancel or an
   expiry, keeps its status and the result is discarded), then acknowledge the entries;
2. **check**: where each open response's message is (the queue's read-only whereabouts, as the
   batch sweeper asks): ``queued`` ones a processor holds (or has answered) become ``in_progress``;
   one whose message is gone (Redis lost it) is published again, or ``failed`` past its deadline;
3. **publish**: ``queued`` responses whose publish was never recorded (the gateway's failed) are
   published on the async lane;
4. **expire**: ``queued`` responses past their deadline become ``failed``
   (:func:`~common.contracts.background.expired_error`) and their message is dropped (cancel marker).
"""

from __future__ import annotations

import logging
import os

from async_processor.backends.base import Whereabouts
from async_processor.backends.redis_producer import RedisResultQueue
from batch_gateway.store.queries import responses as response_queries
from batch_gateway.store.response_queue import publish_responses
from batch_gateway.store.states import ResponseStatus
from common.contracts.background import (
    ASYNC_LANE,
    RESPONSE_COLLECTOR_GROUP,
    expired_error,
    response_result_stream,
    result_outcome,
)
from workers.context import WorkerContext

log = logging.getLogger(__name__)

REPUBLISH_AFTER_SECONDS = 30.0
"""A ``queued`` response without a recorded publish this old is published by the workers (the
gateway publishes right after its commit; this leaves it time to record the entry id)."""
CANCEL_MARKER_SECONDS = 7 * 24 * 3600
LOST_ERROR = {"code": "server_error", "message": "The request of this background response was lost by the queue "
                                                "after its deadline; create it again."}
"""``error`` of a response whose message the queue lost (Redis emptied) past its deadline."""


def collect_responses(ctx: WorkerContext, count: int = 500) -> int:
    """Step 1 (module docstring): how many responses a result ended."""
    results = RedisResultQueue(ctx.queue.redis, response_result_stream(ctx.settings.pool),
                               group=RESPONSE_COLLECTOR_GROUP, consumer=f"responses-{os.getpid()}",
                               delete_acked=True)
    entries = results.read(count)
    ended = 0
    with ctx.session() as session:
        for _entry_id, result in entries:
            if result is None:
                continue
            outcome = result_outcome(result)
            row = response_queries.finish_response(
                session, result.metadata.get("response_id") or result.id, outcome.status, output=outcome.output,
                usage=outcome.usage, error=outcome.error, incomplete_details=outcome.incomplete_details)
            if row is not None:
                ended += 1
                log.info("background response ended", extra={"action": "response_ended", "response_id": row.id,
                                                             "status": row.status, "tenant": row.tenant_id})
        session.commit()
    results.ack([entry_id for entry_id, _ in entries])
    return ended


def check_published(ctx: WorkerContext) -> int:
    """Step 2: how many open responses changed (started, published again, or failed as lost)."""
    with ctx.session() as session:
        published = response_queries.published_open_responses(session)
        if not published:
            return 0
        places = ctx.queue.lanes.whereabouts(ASYNC_LANE, ctx.settings.processor_group,
                                             [(row.queue_entry_id, row.id) for row in published])
        taken = [row.id for row, place in zip(published, places)
                 if row.status == ResponseStatus.QUEUED and place in (Whereabouts.HELD, Whereabouts.ANSWERED)]
        lost = [row for row, place in zip(published, places) if place == Whereabouts.GONE]
        changed = len(response_queries.start_responses(session, taken))
        for row in lost:
            if row.overdue and response_queries.finish_response(session, row.id, ResponseStatus.FAILED,
                                                                error=LOST_ERROR) is not None:
                changed += 1
        again = response_queries.responses_by_id(session, [row.id for row in lost if not row.overdue])
        for row, entry_id in zip(again, publish_responses(ctx.queue.lanes, again, ctx.settings.pool)):
            response_queries.record_published(session, row.id, entry_id)
            log.warning("background response lost, published again", extra={
                "action": "response_republished", "response_id": row.id, "tenant": row.tenant_id})
        session.commit()
        return changed + len(again)


def publish_unpublished(ctx: WorkerContext) -> int:
    """Step 3: how many responses were published."""
    with ctx.session() as session:
        rows = response_queries.unpublished_responses(session, REPUBLISH_AFTER_SECONDS)
        if not rows:
            return 0
        entry_ids = publish_responses(ctx.queue.lanes, rows, ctx.settings.pool)
        for row, entry_id in zip(rows, entry_ids):
            response_queries.record_published(session, row.id, entry_id)
        session.commit()
        return len(rows)


def expire_responses(ctx: WorkerContext) -> int:
    """Step 4: how many ``queued`` responses expired."""
    with ctx.session() as session:
        expired = [row for response_id in response_queries.overdue_responses(session)
                   if (row := response_queries.finish_response(session, response_id, ResponseStatus.FAILED,
                                                               error=expired_error())) is not None]
        session.commit()
    for row in expired:
        ctx.queue.lanes.mark_cancelled(row.id, CANCEL_MARKER_SECONDS)
        log.info("background response expired", extra={"action": "response_expired", "response_id": row.id,
                                                       "tenant": row.tenant_id})
    return len(expired)


def tick_responses(ctx: WorkerContext) -> int:
    """Steps 1 to 4 in order; how many responses they acted on (ended, started, published, failed, expired)."""
    return collect_responses(ctx) + check_published(ctx) + publish_unpublished(ctx) + expire_responses(ctx)
