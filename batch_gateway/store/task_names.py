"""Celery task names: the contract between whoever sends a task (the gateway's outbox, beat, the
workers themselves) and ``workers.tasks``, which registers them. The gateway sends tasks by name
only and never imports ``workers``."""

from __future__ import annotations

VALIDATE_BATCH_TASK = "backfill.validate_batch"
"""Validate a new batch's input file (argument: the batch id); the outbox carries it."""
CANCEL_BATCH_TASK = "backfill.cancel_batch"
"""Tell the processors to drop a cancelled batch's queued messages at once (argument: the batch id)."""
RESEND_STALE_VALIDATIONS_TASK = "backfill.resend_stale_validations"
RELAY_OUTBOX_TASK = "backfill.relay_outbox"
FEED_TASK = "backfill.feed"
COLLECT_TASK = "backfill.collect"
SWEEP_TASK = "backfill.sweep"
FINALIZE_DUE_TASK = "backfill.finalize_due"
DELIVER_WEBHOOKS_TASK = "backfill.deliver_webhooks"
PURGE_FILES_TASK = "backfill.purge_files"
SWEEP_TEMP_FILES_TASK = "backfill.sweep_temp_files"
"""Remove what dead writers left in the file store (temporary files, multipart uploads)."""
TICK_RESPONSES_TASK = "backfill.tick_responses"
"""Collect, start, publish and expire background responses (``workers.responses``)."""
CATCH_UP_TASK = "backfill.catch_up"
"""Run every lifecycle step once (beat's slow safety net on an idle stack, ``workers.schedule``)."""
