"""The collect step: read results in bulk and record each once per ``(batch_id, custom_id)``
with a compare-and-set on state and lease token (a late or duplicate result is refused), updating
``request_counts`` and ``usage``; then acknowledge them, which also deletes them from the result
stream (they are in Postgres now, so the stream stays as short as what is not yet collected). The
mapping itself is pure (:mod:`workers.lifecycle.outcomes`); an answer over
``max_response_bytes`` is recorded as ``response_too_large``.

A result the collector cannot place (unreadable, or without ``batch_id``, ``custom_id`` or
``lease_token``) is never dropped silently: it is logged (``action=result_unplaced``) and counted
(``backfill_worker_results_unplaced_total{reason}``), then acknowledged.
"""

from __future__ import annotations

import logging
from collections import Counter

from batch_gateway.store import queries
from common.contracts.queue import ResultMessage
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
        for entry_id, result in entries:
            if result is None:
                _unplaced(ctx, entry_id, "unreadable", None)
                continue
            meta = result.metadata
            batch_id, custom_id, token = meta.get("batch_id"), meta.get("custom_id"), meta.get("lease_token")
            if not (batch_id and custom_id and token):
                _unplaced(ctx, entry_id, "no_request", result)
                continue
            attempt = int(meta.get("attempt", "1") or 1)
            change = outcome_of(result, attempt, ctx.settings.max_attempts, ctx.settings.max_response_bytes)
            recorded = queries.record_outcome(session, batch_id, custom_id, token, **change.columns())
            accepted += recorded
            if recorded:
                ctx.metrics.tokens_collected(meta.get("tenant"), change.usage.prompt_tokens, change.usage.completion_tokens)
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


def _unplaced(ctx: WorkerContext, entry_id: bytes, reason: str, result: ResultMessage | None) -> None:
    """Log and count a result that names no request row (``reason``: ``unreadable`` or
    ``no_request``)."""
    ctx.metrics.unplaced.labels(reason).inc()
    meta = result.metadata if result is not None else {}
    log.warning("result not placed", extra={
        "action": "result_unplaced", "reason": reason, "entry_id": entry_id.decode(errors="replace"),
        "result_id": result.id if result is not None else None, "batch_id": meta.get("batch_id"),
        "custom_id": meta.get("custom_id"), "tenant": meta.get("tenant")})
