"""Lifecycle tasks, registered on an app by :func:`register`.

- ``backfill.validate_batch(batch_id)``: :func:`workers.lifecycle.validator.validate_batch`.
  An unexpected error is retried three times, then the batch fails with ``validation_error``.
- ``backfill.resend_stale_validations()``: resend the validate task of batches ``validating`` for
  too long (a task lost with its worker).
- ``backfill.relay_outbox()``: resend outbox events that never reached the broker.
- ``backfill.feed``, ``collect``, ``sweep``, ``finalize_due``, ``cancel_batch``: the lifecycle
  (``workers.lifecycle``: feeder, collector, sweeper, finalizer).
- ``backfill.tick_responses()``: background responses (``workers.responses``).
- ``backfill.deliver_webhooks()``: signed terminal-state events (``workers.webhooks``).
- ``backfill.catch_up()``: every periodic step above once (:func:`catch_up`), beat's slow safety
  net while the frequent ones are not sent (an idle stack, ``workers.schedule``).
- ``backfill.purge_files()``: remove the bytes of deleted or expired files once no running batch
  reads them.
- ``backfill.sweep_temp_files()``: remove the file store's temporary files (multipart uploads on
  S3) untouched for ``temp_file_max_age_seconds``: writes whose process was killed.
"""

from __future__ import annotations

import logging

from celery import Celery

from batch_gateway.store import queries
from batch_gateway.store.task_names import (
    CANCEL_BATCH_TASK,
    CATCH_UP_TASK,
    COLLECT_TASK,
    DELIVER_WEBHOOKS_TASK,
    FEED_TASK,
    FINALIZE_DUE_TASK,
    PURGE_FILES_TASK,
    RELAY_OUTBOX_TASK,
    RESEND_STALE_VALIDATIONS_TASK,
    SWEEP_TASK,
    SWEEP_TEMP_FILES_TASK,
    TICK_RESPONSES_TASK,
    VALIDATE_BATCH_TASK,
)
from workers import lifecycle, responses, webhooks
from workers.context import WorkerContext
from workers.lifecycle.validator import give_up_validation, resend_stale_validations, validate_batch

__all__ = ["VALIDATE_RETRIES", "catch_up", "give_up_validation", "purge_files", "register", "relay_outbox",
           "resend_stale_validations", "sweep_temp_files", "validate_batch"]
"""The validation step's functions are re-exported: the task bodies look them up in this module."""

log = logging.getLogger(__name__)

VALIDATE_RETRIES = 3
"""Retries (1 s, 2 s, 4 s apart) of a validation that raised before the batch is failed."""


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


def sweep_temp_files(ctx: WorkerContext) -> int:
    """Remove the file store's leftovers of killed writes older than ``temp_file_max_age_seconds``;
    returns how many."""
    return ctx.store.sweep_temp(ctx.settings.temp_file_max_age_seconds)


def catch_up(ctx: WorkerContext) -> list[str]:
    """Run each periodic lifecycle step once, in the order a request travels (relay the outbox,
    resend stale validations, feed, collect, sweep, finalize, the background responses' tick, deliver
    webhooks); a step that raises
    is logged and the next one still runs. Returns the names of the steps that raised."""
    steps = (("relay_outbox", relay_outbox), ("resend_stale_validations", resend_stale_validations),
             ("feed", lifecycle.feed), ("collect", lifecycle.collect), ("sweep", lifecycle.sweep),
             ("finalize_due", lifecycle.finalize_due), ("tick_responses", responses.tick_responses),
             ("deliver_webhooks", webhooks.deliver_webhooks))
    failed = []
    for name, step in steps:
        try:
            step(ctx)
        except Exception:
            log.exception("catch-up step failed", extra={"action": "catch_up_failed", "step": name})
            failed.append(name)
    return failed


def register(app: Celery, ctx: WorkerContext) -> None:
    """Register the lifecycle tasks on ``app``, each running with ``ctx`` (names are the wire
    contract with the gateway, :mod:`batch_gateway.store.task_names`)."""

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

    @app.task(name=TICK_RESPONSES_TASK, shared=False)
    def tick_responses_task() -> int:
        return responses.tick_responses(ctx)

    @app.task(name=DELIVER_WEBHOOKS_TASK, shared=False)
    def deliver_webhooks_task() -> int:
        return webhooks.deliver_webhooks(ctx)

    @app.task(name=CATCH_UP_TASK, shared=False)
    def catch_up_task() -> list[str]:
        return catch_up(ctx)

    @app.task(name=PURGE_FILES_TASK, shared=False)
    def purge_files_task() -> int:
        return purge_files(ctx)

    @app.task(name=SWEEP_TEMP_FILES_TASK, shared=False)
    def sweep_temp_files_task() -> int:
        return sweep_temp_files(ctx)
