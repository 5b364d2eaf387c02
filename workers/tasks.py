"""Lifecycle tasks, registered on an app by :func:`register`.

- ``backfill.validate_batch(batch_id)``: stream the input file once through
  :func:`workers.validation.validate_batch_file`; on success write one request row per
  ``custom_id`` (one COPY) and move the batch ``validating → in_progress`` in the same transaction;
  otherwise move it to ``failed`` with ``errors.data[]``. Re-running it is harmless: it acts only on
  a batch still ``validating``, and the rows and the transition commit together.
  An unexpected error is retried three times, then the batch fails with ``validation_error``.
- ``backfill.resend_stale_validations()``: resend the validate task of batches ``validating`` for
  too long (a task lost with its worker).
- ``backfill.relay_outbox()``: resend outbox events that never reached the broker.
- ``backfill.feed``, ``collect``, ``sweep``, ``finalize_due``, ``cancel_batch``: the lifecycle
  (``workers.lifecycle``).
- ``backfill.deliver_webhooks()``: signed terminal-state events (``workers.webhooks``).
- ``backfill.purge_files()``: remove the bytes of deleted or expired files once no running batch
  reads them.
"""

from __future__ import annotations

import logging

from celery import Celery

from batch_gateway.store import queries
from batch_gateway.store.models import Batch, File
from batch_gateway.store.quota import token_limit_message
from batch_gateway.store.task_names import (
    CANCEL_BATCH_TASK,
    COLLECT_TASK,
    DELIVER_WEBHOOKS_TASK,
    FEED_TASK,
    FINALIZE_DUE_TASK,
    PURGE_FILES_TASK,
    RELAY_OUTBOX_TASK,
    RESEND_STALE_VALIDATIONS_TASK,
    SWEEP_TASK,
    VALIDATE_BATCH_TASK,
)
from workers import lifecycle, webhooks
from workers.app import WorkerContext
from workers.validation import LineError, ValidationReport, validate_batch_file

log = logging.getLogger(__name__)

VALIDATE_RETRIES = 3
"""Retries (1 s, 2 s, 4 s apart) of a validation that raised before the batch is failed."""


def _error_rows(errors: list[LineError]) -> list[dict]:
    # PostgreSQL JSONB cannot hold \u0000; a message quoting a custom_id or model may contain one.
    return [{"code": e.code, "message": e.message.replace("\x00", "\\u0000"), "param": e.param,
             "line": e.line} for e in errors]


def validate_batch(ctx: WorkerContext, batch_id: str) -> str:
    """Validate batch ``batch_id``; returns its status afterwards (or ``"missing"``)."""
    with ctx.session() as session:
        batch = session.get(Batch, batch_id)
        if batch is None:
            return "missing"
        if batch.status != "validating":
            return batch.status
        source = session.get(File, batch.input_file_id)
        endpoint, tenant_id, key = batch.endpoint, batch.tenant_id, source.storage_key

    try:
        report = validate_batch_file(
            ctx.store.read(key, chunk_bytes=ctx.settings.read_chunk_bytes),
            endpoint=endpoint, max_requests=ctx.settings.max_requests_per_batch,
        )
    except FileNotFoundError:
        report = ValidationReport(requests=[], model=None, bytes_read=0, est_tokens=0, errors=[
            LineError("invalid_request", "The input file's content could not be read.", None, "input_file_id")
        ])

    with ctx.session() as session:
        if not report.ok:
            return _fail(ctx, session, batch_id, report.errors)

        tenant = queries.lock_tenant(session, tenant_id)
        limit = tenant.enqueued_token_limit or ctx.settings.default_enqueued_token_limit
        if queries.enqueued_tokens(session, tenant_id, exclude=batch_id) + report.est_tokens > limit:
            error = LineError("token_limit_exceeded", token_limit_message(tenant.name, limit, report.model), None, None)
            return _fail(ctx, session, batch_id, [error])

        queries.replace_requests(session, batch_id, (
            (r.custom_id, r.line, r.offset, r.length, r.prefix_key, r.est_tokens) for r in report.requests))
        moved = queries.transition(
            session, batch_id, ("validating",), "in_progress",
            model=report.model, request_total=len(report.requests), enqueued_tokens=report.est_tokens,
        )
        if moved is None:  # cancelled while we validated: keep nothing
            session.rollback()
            return _status(session, batch_id)
        session.commit()
        ctx.metrics.validated.labels(moved.status).inc()
        log.info("batch validated", extra={"action": "batch_in_progress", "batch_id": batch_id,
                                           "tenant": tenant_id, "requests": len(report.requests)})
        return moved.status


def _fail(ctx: WorkerContext, session, batch_id: str, errors: list[LineError]) -> str:
    """Move a ``validating`` batch to ``failed`` with ``errors``; returns its status afterwards."""
    moved = queries.transition(session, batch_id, ("validating",), "failed", errors=_error_rows(errors))
    session.commit()
    if moved is not None:
        ctx.metrics.validated.labels(moved.status).inc()
    log.info("batch failed validation", extra={"action": "batch_failed", "batch_id": batch_id,
                                               "errors": len(errors), "codes": sorted({e.code for e in errors})})
    return moved.status if moved else _status(session, batch_id)


def give_up_validation(ctx: WorkerContext, batch_id: str) -> str:
    """Fail a batch whose validation kept raising (database or store trouble), so it never stays
    ``validating`` for good; returns its status afterwards."""
    error = LineError("validation_error", "The input file could not be validated because of an internal "
                      "error; please create the batch again.", None, None)
    with ctx.session() as session:
        return _fail(ctx, session, batch_id, [error])


def resend_stale_validations(ctx: WorkerContext, older_than_seconds: float | None = None) -> int:
    """Send the validate task again for batches ``validating`` longer than ``older_than_seconds``
    (default ``validation_stale_seconds``: a lost task); returns how many. Validation is idempotent."""
    age = ctx.settings.validation_stale_seconds if older_than_seconds is None else older_than_seconds
    with ctx.session() as session:
        stale = queries.stale_validating_batches(session, age)
    for batch_id in stale:
        ctx.celery.send_task(VALIDATE_BATCH_TASK, args=[batch_id], queue=ctx.settings.task_queue)
    return len(stale)


def _status(session, batch_id: str) -> str:
    return queries.batch_status(session, batch_id) or "missing"


def relay_outbox(ctx: WorkerContext) -> int:
    """Resend outbox events older than ``relay_after_seconds``; returns how many were sent."""
    with ctx.session() as session:
        return ctx.publisher.publish_pending(session, ctx.settings.relay_after_seconds)


def purge_files(ctx: WorkerContext) -> int:
    """Remove the bytes of deleted or expired files no running batch reads; returns how many.
    The row is kept (batches refer to it) with ``purged_at`` set."""
    with ctx.session() as session:
        files = queries.purgeable_files(session)
        for row in files:
            ctx.store.delete(row.storage_key)
        queries.mark_purged(session, [row.id for row in files])
        session.commit()
        return len(files)


def register(app: Celery) -> None:
    """Register the lifecycle tasks on ``app`` (names are the wire contract with the gateway)."""
    ctx: WorkerContext = app.backfill

    @app.task(name=VALIDATE_BATCH_TASK, shared=False, bind=True, max_retries=VALIDATE_RETRIES)
    def validate_batch_task(self, batch_id: str) -> str:
        try:
            return validate_batch(ctx, batch_id)
        except Exception as exc:
            if self.request.retries < VALIDATE_RETRIES:
                raise self.retry(exc=exc, countdown=2 ** self.request.retries) from None
            log.exception("validation kept failing", extra={"action": "validation_gave_up", "batch_id": batch_id})
            return give_up_validation(ctx, batch_id)

    @app.task(name=RESEND_STALE_VALIDATIONS_TASK, shared=False)
    def resend_stale_validations_task() -> int:
        return resend_stale_validations(ctx)

    @app.task(name=RELAY_OUTBOX_TASK, shared=False)
    def relay_outbox_task() -> int:
        return relay_outbox(ctx)

    @app.task(name=CANCEL_BATCH_TASK, shared=False)
    def cancel_batch_task(batch_id: str) -> str:
        return lifecycle.cancel(ctx, batch_id)

    @app.task(name=FEED_TASK, shared=False)
    def feed_task() -> int:
        return lifecycle.feed(ctx)

    @app.task(name=COLLECT_TASK, shared=False)
    def collect_task() -> int:
        return lifecycle.collect(ctx)

    @app.task(name=SWEEP_TASK, shared=False)
    def sweep_task() -> int:
        return lifecycle.sweep(ctx)

    @app.task(name=FINALIZE_DUE_TASK, shared=False)
    def finalize_due_task() -> list[str]:
        return lifecycle.finalize_due(ctx)

    @app.task(name=DELIVER_WEBHOOKS_TASK, shared=False)
    def deliver_webhooks_task() -> int:
        return webhooks.deliver_webhooks(ctx)

    @app.task(name=PURGE_FILES_TASK, shared=False)
    def purge_files_task() -> int:
        return purge_files(ctx)
