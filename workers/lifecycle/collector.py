"""The collect step: read results in bulk and record each once per ``(batch_id, custom_id)``
with a compare-and-set on state and lease token (a late or duplicate result is refused), updating
``request_counts`` and ``usage``; then acknowledge them. The mapping itself is pure
(:mod:`workers.lifecycle.outcomes`).
"""

from __future__ import annotations

import logging
from collections import Counter

from batch_gateway.store import queries
from workers.context import WorkerContext
from workers.lifecycle.outcomes import outcome_of

log = logging.getLogger(__name__)


def collect(ctx: WorkerContext, count: int = 2000) -> int:
    """Record up to ``count`` results from the result stream; returns how many were accepted."""
    entries = ctx.queue.read_results(count)
    accepted = 0
    states: Counter[str] = Counter()
    debug = log.isEnabledFor(logging.DEBUG)
    with ctx.session() as session:
        for _, result in entries:
            if result is None:
                continue  # unreadable: nothing to record
            meta = result.metadata
            batch_id, custom_id, token = meta.get("batch_id"), meta.get("custom_id"), meta.get("lease_token")
            if not (batch_id and custom_id and token):
                continue  # not one of ours, or unreadable: nothing to record
            attempt = int(meta.get("attempt", "1") or 1)
            change = outcome_of(result, attempt, ctx.settings.max_attempts)
            recorded = queries.record_outcome(session, batch_id, custom_id, token, **change.columns())
            accepted += recorded
            states[change.state.value if recorded else "stale"] += 1
            if debug:
                log.debug("result collected", extra={"action": "collect", "batch_id": batch_id, "custom_id": custom_id,
                                                     "tenant": meta.get("tenant"), "state": change.state.value,
                                                     "accepted": bool(recorded), "error_code": result.error_code})
        session.commit()
    ctx.queue.ack([entry_id for entry_id, _ in entries])
    for state, count in states.items():
        ctx.metrics.collected.labels(state).inc(count)
    if entries:
        log.info("results collected", extra={"action": "collect", "results": len(entries), "accepted": accepted,
                                             "states": dict(states)})
    return accepted
