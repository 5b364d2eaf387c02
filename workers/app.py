"""The Celery app of the batch lifecycle: :func:`create_celery`, the workers' composition root.

Reliability settings follow RELIABILITY.md: ``acks_late`` with ``task_reject_on_worker_lost`` (a
killed worker's task is redelivered, not lost), prefetch of one, a Redis visibility timeout from the
settings. Every task is safe to run twice: its effects are guarded by a state transition in
Postgres.
"""

from __future__ import annotations

from typing import Any

from celery import Celery
from celery.signals import worker_ready

from batch_gateway.store.outbox import celery_broker_url
from batch_gateway.store.task_names import (
    COLLECT_TASK,
    DELIVER_WEBHOOKS_TASK,
    FEED_TASK,
    FINALIZE_DUE_TASK,
    PURGE_FILES_TASK,
    RELAY_OUTBOX_TASK,
    RESEND_STALE_VALIDATIONS_TASK,
    SWEEP_TASK,
    SWEEP_TEMP_FILES_TASK,
)
from workers import tasks
from workers.context import WorkerContext
from workers.lifecycle.validator import resend_stale_validations
from workers.metrics import install_task_hooks
from workers.settings import WorkerSettings


class WorkerCelery(Celery):
    """A Celery app carrying its :class:`WorkerContext` as ``backfill`` (what a started worker's
    ``worker_ready`` signal and the tests reach the clients through)."""

    backfill: WorkerContext

    def __init__(self, settings: WorkerSettings, **kwargs: Any):
        super().__init__("backfill", broker=celery_broker_url(settings.redis_url), set_as_current=False, **kwargs)
        self.backfill = WorkerContext(settings, self)


def _resend_on_start(sender: Any = None, **_: Any) -> None:
    # A validation killed with its worker is not redelivered before the visibility timeout:
    # resend every batch still validating (validation is idempotent). Connected once per process;
    # it acts for the app of the worker that started.
    app = getattr(sender, "app", None)
    if isinstance(app, WorkerCelery):
        resend_stale_validations(app.backfill, older_than_seconds=0)


worker_ready.connect(_resend_on_start, weak=False, dispatch_uid="backfill.resend_on_start")


def create_celery(settings: WorkerSettings) -> WorkerCelery:
    """The Celery app with every lifecycle task registered and the beat schedule set."""
    app = WorkerCelery(settings)
    app.conf.update(
        task_default_queue=settings.task_queue,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_ignore_result=True,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        broker_transport_options={"visibility_timeout": settings.visibility_timeout_seconds},
        worker_hijack_root_logger=False,
        beat_schedule={
            "relay-outbox": {
                "task": RELAY_OUTBOX_TASK,
                "schedule": settings.relay_interval_seconds,
                "options": {"queue": settings.task_queue},
            },
            "resend-stale-validations": {
                "task": RESEND_STALE_VALIDATIONS_TASK,
                "schedule": settings.relay_interval_seconds,
                "options": {"queue": settings.task_queue},
            },
            **{
                name: {"task": task, "schedule": interval,
                       "options": {"queue": settings.task_queue, "expires": interval * 4}}
                for name, task, interval in (("feed", FEED_TASK, settings.feed_interval_seconds),
                                             ("collect", COLLECT_TASK, settings.collect_interval_seconds),
                                             ("sweep", SWEEP_TASK, settings.sweep_interval_seconds),
                                             ("finalize_due", FINALIZE_DUE_TASK, settings.finalize_interval_seconds),
                                             ("deliver_webhooks", DELIVER_WEBHOOKS_TASK,
                                              settings.webhook_interval_seconds))
            },
            "purge-files": {
                "task": PURGE_FILES_TASK,
                "schedule": settings.purge_interval_seconds,
                "options": {"queue": settings.task_queue},
            },
            "sweep-temp-files": {
                "task": SWEEP_TEMP_FILES_TASK,
                "schedule": settings.purge_interval_seconds,
                "options": {"queue": settings.task_queue, "expires": settings.purge_interval_seconds},
            },
        },
    )
    tasks.register(app, app.backfill)
    install_task_hooks(app, app.backfill.metrics)
    return app
