"""The sweep step: hand back requests whose lease lapsed (lost message, killed processor, Redis
emptied); after ``max_attempts`` a request ends as ``request_timeout``. It also (re)sets the cancel
marker of ``cancelling`` batches, which :func:`workers.lifecycle.finalizer.cancel` sets as soon as
the API accepts a cancel.
"""

from __future__ import annotations

from batch_gateway.store import queries
from workers.context import WorkerContext
from workers.lifecycle.outcomes import CANCELLED, HANDED_BACK, TIMED_OUT


def sweep(ctx: WorkerContext) -> int:
    """Hand back requests whose lease lapsed (or end them after ``max_attempts``); mark cancelling
    batches for the processors. Returns how many requests were handed back or ended."""
    with ctx.session() as session:
        lapsed = queries.lapsed_leases(session)
        cancelling = queries.cancelling_batch_ids(session)
        for row in lapsed:
            if row.batch_id in cancelling:
                change = CANCELLED
            elif row.attempts >= ctx.settings.max_attempts:
                change = TIMED_OUT
            else:
                change = HANDED_BACK
            queries.record_outcome(session, row.batch_id, row.custom_id, str(row.lease_token), **change.columns())
            ctx.metrics.swept.labels(change.state.value).inc()
        session.commit()
    for batch_id in cancelling:
        ctx.queue.mark_cancelled(batch_id)
    return len(lapsed)
