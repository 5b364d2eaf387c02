"""The batch lifecycle after validation: feed, collect, sweep, finalize (with expiry and cancel).

Every function is safe to run twice and concurrently: each effect is a compare-and-set in Postgres.

- :func:`feed` keeps at most ``feed_window`` requests of each ``in_progress`` batch queued, earliest
  deadline first across batches, in prefix order (``prefix_key``, then line) within one: the lease
  is committed first, then the message is published, so a crash in between only delays the request
  until the sweeper hands it back.
- :func:`collect` reads results in bulk and records each once per ``(batch_id, custom_id)`` with a
  compare-and-set on state and lease token (a late or duplicate result is refused), updating
  ``request_counts`` and ``usage``; then acknowledges them.
- :func:`sweep` hands back requests whose lease lapsed (lost message, killed processor, Redis
  emptied); after ``max_attempts`` a request ends as ``request_timeout``. It also (re)sets the
  cancel marker of ``cancelling`` batches, which :func:`cancel` sets as soon as the API accepts a
  cancel.
- :func:`finalize` ends a batch: ``completed`` when every request is terminal, ``cancelled`` after a
  cancel, ``expired`` past the deadline (unfinished requests become ``batch_expired`` /
  ``batch_cancelled`` lines). Files are built from the rows, checked against the counts and
  published with one state change; ids are derived from the batch id, so a re-run after a crash
  writes the same files.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter

import orjson

from batch_gateway.store import queries
from batch_gateway.store.models import TERMINAL_BATCH_STATUSES, Batch
from batch_gateway.store.storage import storage_key
from common.contracts.queue import BATCH_LANE, ErrorCode, RequestMessage, ResultMessage
from workers.app import WorkerContext
from workers.output import RequestOutcome, json_body, render_line

log = logging.getLogger(__name__)

RETRYABLE = {ErrorCode.GATE_DROPPED, ErrorCode.GATE_ERROR, ErrorCode.INFERENCE_ERROR}
"""Result codes after which the request is fed again (up to ``max_attempts``)."""


# --- feed -------------------------------------------------------------------------------------


def _request_body(ctx: WorkerContext, key: str, offset: int, length: int) -> dict:
    line = b"".join(ctx.store.read(key, offset, length))
    return orjson.loads(line)["body"]


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
                    id=f"{batch.id}:{row.custom_id}:{row.attempts}",
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
            ctx.queue.publish(messages)
            published += len(messages)
            ctx.metrics.fed.inc(len(messages))
            log.info("batch fed", extra={"action": "feed", "batch_id": batch.id, "tenant": batch.tenant_id,
                                         "requests": len(messages)})
    return published


# --- collect ----------------------------------------------------------------------------------


def _usage(body: bytes) -> dict[str, int]:
    try:
        usage = orjson.loads(body).get("usage") or {}
    except (orjson.JSONDecodeError, AttributeError):
        return {}
    if not isinstance(usage, dict):
        return {}
    prompt = usage.get("prompt_tokens", usage.get("input_tokens", 0)) or 0
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    out_details = usage.get("completion_tokens_details") or usage.get("output_tokens_details") or {}
    return {
        "prompt_tokens": int(prompt),
        "cached_tokens": int(details.get("cached_tokens", 0) or 0) if isinstance(details, dict) else 0,
        "completion_tokens": int(usage.get("completion_tokens", usage.get("output_tokens", 0)) or 0),
        "reasoning_tokens": int(out_details.get("reasoning_tokens", 0) or 0) if isinstance(out_details, dict) else 0,
    }


def outcome_of(result: ResultMessage, attempt: int, max_attempts: int) -> dict:
    """How a result changes its request row: keyword arguments of :func:`queries.record_outcome`."""
    if not result.error_code and result.status_code:
        body = json_body(result.payload, result.status_code)
        usage = _usage(body) if 200 <= result.status_code < 300 else {}
        try:
            request_id = orjson.loads(body).get("id")
        except (orjson.JSONDecodeError, AttributeError):
            request_id = None
        return {"state": "succeeded" if 200 <= result.status_code < 300 else "failed",
                "status_code": result.status_code, "request_id": request_id if isinstance(request_id, str) else result.id,
                "response_body": body, **usage}
    if result.error_code == ErrorCode.DEADLINE_EXCEEDED:
        return {"state": "expired", "error_code": "batch_expired"}
    if result.error_code == ErrorCode.CANCELLED:
        return {"state": "cancelled", "error_code": "batch_cancelled"}
    if result.error_code in RETRYABLE and attempt < max_attempts:
        return {"state": "pending"}
    return {"state": "failed", "error_code": "request_timeout" if result.error_code in RETRYABLE else "batch_failed",
            "error_message": result.error_message or None}


def collect(ctx: WorkerContext, count: int = 2000) -> int:
    """Record up to ``count`` results from the result stream; returns how many were accepted."""
    entries = ctx.queue.read_results(count)
    accepted = 0
    states: Counter[str] = Counter()
    debug = log.isEnabledFor(logging.DEBUG)
    with ctx.session() as session:
        for _, result in entries:
            meta = result.metadata if result else {}
            batch_id, custom_id, token = meta.get("batch_id"), meta.get("custom_id"), meta.get("lease_token")
            if not (batch_id and custom_id and token):
                continue  # not one of ours, or unreadable: nothing to record
            attempt = int(meta.get("attempt", "1") or 1)
            change = outcome_of(result, attempt, ctx.settings.max_attempts)
            recorded = queries.record_outcome(session, batch_id, custom_id, token, **change)
            accepted += recorded
            states[change["state"] if recorded else "stale"] += 1
            if debug:
                log.debug("result collected", extra={"action": "collect", "batch_id": batch_id, "custom_id": custom_id,
                                                     "tenant": meta.get("tenant"), "state": change["state"],
                                                     "accepted": bool(recorded), "error_code": result.error_code})
        session.commit()
    ctx.queue.ack([entry_id for entry_id, _ in entries])
    for state, count in states.items():
        ctx.metrics.collected.labels(state).inc(count)
    if entries:
        log.info("results collected", extra={"action": "collect", "results": len(entries), "accepted": accepted,
                                             "states": dict(states)})
    return accepted


# --- sweep ------------------------------------------------------------------------------------


def sweep(ctx: WorkerContext) -> int:
    """Hand back requests whose lease lapsed (or end them after ``max_attempts``); mark cancelling
    batches for the processors. Returns how many requests were handed back or ended."""
    with ctx.session() as session:
        lapsed = queries.lapsed_leases(session)
        cancelling = queries.cancelling_batch_ids(session)
        for row in lapsed:
            if row.batch_id in cancelling:
                change = {"state": "cancelled", "error_code": "batch_cancelled"}
            elif row.attempts >= ctx.settings.max_attempts:
                change = {"state": "failed", "error_code": "request_timeout"}
            else:
                change = {"state": "pending"}
            queries.record_outcome(session, row.batch_id, row.custom_id, str(row.lease_token), **change)
            ctx.metrics.swept.labels(change["state"]).inc()
        session.commit()
    for batch_id in cancelling:
        ctx.queue.mark_cancelled(batch_id)
    return len(lapsed)


# --- finalize ---------------------------------------------------------------------------------


def output_file_id(batch_id: str, kind: str) -> str:
    """The id of a batch's ``output`` or ``errors`` file, derived from the batch id."""
    return "file-" + hashlib.sha256(f"{batch_id}:{kind}".encode()).hexdigest()[:24]


def _write_files(ctx: WorkerContext, batch: Batch) -> dict:
    """Build both files from the rows; returns per kind ``(file_id, key, lines, bytes, sha256)``
    for the non-empty ones. Raises ``RuntimeError`` when a line count disagrees with the rows."""
    kinds = {kind: output_file_id(batch.id, kind) for kind in ("output", "errors")}
    uploads = {kind: ctx.store.begin(storage_key(file_id)) for kind, file_id in kinds.items()}
    stats = {kind: [0, 0, hashlib.sha256()] for kind in kinds}
    succeeded = total = 0
    try:
        with ctx.session() as session:
            for custom_id, _, status_code, request_id, body, error_code, error_message in \
                    queries.request_outcomes(session, batch.id):
                total += 1
                outcome = RequestOutcome(custom_id, status_code, request_id, body, error_code, error_message)
                kind = "output" if outcome.succeeded else "errors"
                succeeded += outcome.succeeded
                line = render_line(batch.id, outcome)
                uploads[kind].write(line)
                stats[kind][0] += 1
                stats[kind][1] += len(line)
                stats[kind][2].update(line)
        if (stats["output"][0], stats["errors"][0]) != (succeeded, total - succeeded) or total != batch.request_total:
            raise RuntimeError(f"batch {batch.id}: line counts do not match its {batch.request_total} requests")
        done = {}
        for kind, upload in uploads.items():
            if stats[kind][0]:
                upload.commit()
                done[kind] = (kinds[kind], storage_key(kinds[kind]), stats[kind][0], stats[kind][1],
                              stats[kind][2].hexdigest())
            else:
                upload.abort()
        return done
    except BaseException:
        for upload in uploads.values():
            upload.abort()
        raise


def finalize(ctx: WorkerContext, batch_id: str) -> str:
    """End the batch if it is due (see the module docstring); returns its status afterwards."""
    with ctx.session() as session:
        batch = queries.lock_batch(session, batch_id)
        if batch is None:
            return "missing"
        if batch.status in TERMINAL_BATCH_STATUSES:
            return batch.status
        past_deadline = queries.past_deadline(session, batch)
        if past_deadline and batch.status != "finalizing":
            target = "expired"
            queries.end_open_requests(session, batch_id, ("pending", "queued"), "expired", "batch_expired")
        elif batch.status == "cancelling":
            target = "cancelled"
            queries.end_open_requests(session, batch_id, ("pending",), "cancelled", "batch_cancelled")
            if queries.count_requests(session, batch_id, "queued"):
                session.commit()
                return batch.status  # requests in flight: their results or the sweeper end them
        elif batch.status == "in_progress":
            if batch.request_completed + batch.request_failed < batch.request_total:
                return batch.status
            target = "completed"
            queries.transition(session, batch_id, ("in_progress",), "finalizing")
        elif batch.status == "finalizing":
            target = "completed"
        else:  # validating: validation decides
            return batch.status
        session.commit()

    with ctx.session() as session:
        batch = session.get(Batch, batch_id)
        tenant = batch.tenant_id
        files = _write_files(ctx, batch)
        ttl = (batch.output_expires_after or {}).get("seconds", 30 * 24 * 3600)
        for kind, (file_id, key, _, size, sha) in files.items():
            queries.upsert_output_file(session, file_id=file_id, tenant_id=batch.tenant_id, size=size,
                                       filename=f"{batch.id}_{kind}.jsonl", storage_key=key, sha256=sha,
                                       expires_after_seconds=ttl)
        completed = files["output"][2] if "output" in files else 0
        failed = files["errors"][2] if "errors" in files else 0
        moved = queries.transition(
            session, batch_id, ("in_progress", "finalizing", "cancelling", "validating"), target,
            output_file_id=files["output"][0] if "output" in files else None,
            error_file_id=files["errors"][0] if "errors" in files else None,
            request_completed=completed, request_failed=failed,
        )
        session.commit()
        status = moved.status if moved else session.get(Batch, batch_id).status
    if moved is not None:
        ctx.metrics.finalized.labels(status).inc()
        ctx.metrics.finalized_requests.labels("output").inc(completed)
        ctx.metrics.finalized_requests.labels("errors").inc(failed)
    log.info("batch finalized", extra={"action": f"batch_{status}", "batch_id": batch_id, "tenant": tenant,
                                       "completed": completed, "failed": failed})
    return status


def cancel(ctx: WorkerContext, batch_id: str) -> str:
    """Act on a cancel at once: mark the batch for the processors (its queued messages are answered
    ``CANCELLED`` instead of run) and end what is not queued; returns the batch's status."""
    ctx.queue.mark_cancelled(batch_id)
    log.info("batch cancel marked", extra={"action": "cancel", "batch_id": batch_id})
    return finalize(ctx, batch_id)


def finalize_due(ctx: WorkerContext) -> list[str]:
    """Finalize every batch that is due; returns the ids that reached a terminal state."""
    with ctx.session() as session:
        due = queries.batches_to_finalize(session)
    return [batch_id for batch_id in due if finalize(ctx, batch_id) in TERMINAL_BATCH_STATUSES]
