"""The validate step: stream the input file once through
:func:`workers.validation.validate_batch_file`, then ask the fleet whether it serves the file's
model (:class:`workers.fleet.FleetModels`; a batch for a model no engine serves fails with
``model_not_found`` at the model's first line, and when the fleet cannot be asked the batch runs
and its lines end with the engines' 404s), then check the tenant's enqueued-token quota; on
success write one request row per ``custom_id`` (one COPY) and move the batch ``validating →
in_progress`` in the same transaction; otherwise move it to ``failed`` with ``errors.data[]``. Re-running it is harmless: it acts only on a
batch still ``validating``, and the rows and the transition commit together.
"""

from __future__ import annotations

import logging

from sqlalchemy.orm import Session

from batch_gateway.store import queries
from batch_gateway.store.models import Batch, File
from batch_gateway.store.quota import token_limit_message
from batch_gateway.store.states import BatchStatus
from batch_gateway.store.task_names import VALIDATE_BATCH_TASK
from workers.context import WorkerContext
from workers.validation import LineError, ValidationReport, model_not_found, validate_batch_file

log = logging.getLogger(__name__)


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
        if batch.status != BatchStatus.VALIDATING:
            return batch.status
        source = session.get(File, batch.input_file_id)
        assert source is not None  # file rows are never deleted (a purge keeps them)
        endpoint, tenant_id, key = batch.endpoint, batch.tenant_id, source.storage_key

    try:
        report = validate_batch_file(
            ctx.store.read(key, chunk_bytes=ctx.settings.read_chunk_bytes),
            endpoint=endpoint, max_requests=ctx.settings.max_requests_per_batch,
            max_output_tokens=ctx.settings.max_output_tokens_per_request,
        )
    except FileNotFoundError:
        report = ValidationReport(requests=[], model=None, bytes_read=0, est_tokens=0, errors=[
            LineError("invalid_request", "The input file's content could not be read.", None, "input_file_id")
        ])

    if report.ok and report.model is not None and (served := ctx.fleet.served()) is not None \
            and report.model not in served:
        report.errors = [model_not_found(report.model, report.model_line, served)]

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
            session, batch_id, (BatchStatus.VALIDATING,), BatchStatus.IN_PROGRESS,
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


def _fail(ctx: WorkerContext, session: Session, batch_id: str, errors: list[LineError]) -> str:
    """Move a ``validating`` batch to ``failed`` with ``errors``; returns its status afterwards."""
    moved = queries.transition(session, batch_id, (BatchStatus.VALIDATING,), BatchStatus.FAILED,
                              errors=_error_rows(errors))
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


def _status(session: Session, batch_id: str) -> str:
    return queries.batch_status(session, batch_id) or "missing"
