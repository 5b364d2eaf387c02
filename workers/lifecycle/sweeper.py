"""The sweep step: look after queued requests whose lease lapsed (docs/reliability.md, "Request
leases"). For each, the queue says where its message is
(:meth:`~workers.queue.BatchQueue.whereabouts`): still waiting in the stream, held by a processor
or answered, the lease is renewed (no attempt counted, nothing published again: waiting for
capacity is not loss); gone (Redis emptied, the entry deleted), the request is handed back to the
feeder, or after ``max_attempts`` ends as ``request_timeout``. Requests of ``cancelling`` batches
end ``cancelled``. It also (re)sets the cancel marker of ``cancelling`` batches, which
:func:`workers.lifecycle.finalizer.cancel` sets as soon as the API accepts a cancel.
"""

from __future__ import annotations

from async_processor.backends.base import Whereabouts
from batch_gateway.store import queries
from batch_gateway.store.states import RequestState
from workers.context import WorkerContext
from workers.lifecycle.feeder import message_id
from workers.lifecycle.outcomes import CANCELLED, HANDED_BACK, TIMED_OUT

SWEEP_CHUNK = 1000
"""Lapsed requests looked at per transaction (one Redis round trip, one renewal UPDATE)."""
MAX_CHUNKS = 20
"""Chunks per sweep at most, so one sweep of a huge backlog stays within seconds; the rest wait
for the next sweep (their leases only lapse a little longer)."""


def sweep(ctx: WorkerContext) -> int:
    """Renew the leases of lapsed requests whose message is still on its way; hand back (or end
    after ``max_attempts``) those whose message is gone; mark cancelling batches for the
    processors. Returns how many requests were handed back or ended (renewed ones not counted)."""
    ended = 0
    cancelling: set[str] = set()
    for _ in range(MAX_CHUNKS):
        looked_at, chunk_ended, cancelling = _sweep_chunk(ctx)
        ended += chunk_ended
        if looked_at < SWEEP_CHUNK:
            break
    for batch_id in cancelling:
        ctx.queue.mark_cancelled(batch_id)
    return ended


def _sweep_chunk(ctx: WorkerContext) -> tuple[int, int, set[str]]:
    """One transaction over up to :data:`SWEEP_CHUNK` lapsed requests: ``(looked at, handed back or
    ended, cancelling batch ids)``."""
    ended = 0
    with ctx.session() as session:
        lapsed = queries.lapsed_leases(session, limit=SWEEP_CHUNK)
        cancelling = set(queries.cancelling_batch_ids(session))
        asked = [row for row in lapsed if row.batch_id not in cancelling]
        places = ctx.queue.whereabouts([(row.queue_entry_id or "", message_id(row.batch_id, row.custom_id,
                                                                              row.attempts)) for row in asked])
        gone = {(row.batch_id, row.custom_id) for row, place in zip(asked, places) if place is Whereabouts.GONE}
        renew = [(row.batch_id, row.custom_id, str(row.lease_token)) for row, place in zip(asked, places)
                 if place is not Whereabouts.GONE]
        for row in lapsed:
            if row.batch_id in cancelling:
                change = CANCELLED
            elif (row.batch_id, row.custom_id) not in gone:
                continue
            elif row.attempts >= ctx.settings.max_attempts:
                change = TIMED_OUT
            else:
                change = HANDED_BACK
            queries.record_outcome(session, row.batch_id, row.custom_id, str(row.lease_token), **change.columns())
            ctx.metrics.swept.labels(change.state.value).inc()
            ended += 1
        if renew:
            queries.renew_leases(session, renew, ctx.settings.lease_seconds)
            ctx.metrics.swept.labels(RequestState.QUEUED.value).inc(len(renew))
        session.commit()
    return len(lapsed), ended, cancelling
