"""The Celery app of the batch lifecycle: :func:`create_celery`.

Reliability settings follow RELIABILITY.md: ``acks_late`` with ``task_reject_on_worker_lost`` (a
killed worker's task is redelivered, not lost), prefetch of one, a Redis visibility timeout from the
settings. Every task is safe to run twice: its effects are guarded by a state transition in
Postgres.
"""

from __future__ import annotations

import os
from functools import cached_property

import httpx
from celery import Celery
from celery.signals import worker_ready
from sqlalchemy.orm import Session, sessionmaker

from batch_gateway.store.db import make_engine, make_sessionmaker
from batch_gateway.store.outbox import TaskPublisher, celery_broker_url
from batch_gateway.store.storage import FileStore, build_file_store
from workers.metrics import WorkerMetrics, install_task_hooks
from workers.queue import BatchQueue
from workers.settings import WorkerSettings


class WorkerContext:
    """The clients a task uses, opened lazily in the process that runs the task (after the
    prefork pool forked, never before)."""

    def __init__(self, settings: WorkerSettings, celery: Celery):
        self.settings = settings
        self.celery = celery
        self.metrics = WorkerMetrics()
        self._pid = os.getpid()

    def _check_fork(self) -> None:
        if os.getpid() != self._pid:  # inherited from the parent: start afresh
            self.__dict__.pop("sessionmaker", None)
            self.__dict__.pop("queue", None)
            self._pid = os.getpid()

    @cached_property
    def sessionmaker(self) -> sessionmaker[Session]:
        """Sessions on a small pool (2 connections) of this process."""
        return make_sessionmaker(make_engine(self.settings.database_url, pool_size=2))

    def session(self) -> Session:
        """A new session (the caller commits)."""
        self._check_fork()
        return self.sessionmaker()

    @cached_property
    def store(self) -> FileStore:
        """The file store the settings select (``DATA_DIR/files`` by default)."""
        return build_file_store(self.settings)

    @cached_property
    def queue(self) -> BatchQueue:
        """Redis Streams I/O of the batch lane and its results."""
        return BatchQueue(self.settings.redis_url, pool=self.settings.pool,
                          result_stream=self.settings.result_stream, consumer=f"collector-{os.getpid()}")

    def webhook_client(self, timeout_seconds: float) -> httpx.Client:
        """One HTTP client for webhook deliveries, kept for the life of the process."""
        if getattr(self, "_webhook_client", None) is None:
            self._webhook_client = httpx.Client(timeout=timeout_seconds, follow_redirects=False)
        return self._webhook_client

    @cached_property
    def publisher(self) -> TaskPublisher:
        """Outbox publisher sending on this app's broker and queue."""
        return TaskPublisher(self.celery, self.settings.task_queue)


def create_celery(settings: WorkerSettings) -> Celery:
    """The Celery app with every lifecycle task registered and the beat schedule set."""
    app = Celery("backfill", broker=celery_broker_url(settings.redis_url), set_as_current=False)
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
                "task": "backfill.relay_outbox",
                "schedule": settings.relay_interval_seconds,
                "options": {"queue": settings.task_queue},
            },
            "resend-stale-validations": {
                "task": "backfill.resend_stale_validations",
                "schedule": settings.relay_interval_seconds,
                "options": {"queue": settings.task_queue},
            },
            **{
                name: {"task": f"backfill.{name}", "schedule": interval,
                       "options": {"queue": settings.task_queue, "expires": interval * 4}}
                for name, interval in (("feed", settings.feed_interval_seconds),
                                       ("collect", settings.collect_interval_seconds),
                                       ("sweep", settings.sweep_interval_seconds),
                                       ("finalize_due", settings.finalize_interval_seconds),
                                       ("deliver_webhooks", settings.webhook_interval_seconds))
            },
            "purge-files": {
                "task": "backfill.purge_files",
                "schedule": settings.purge_interval_seconds,
                "options": {"queue": settings.task_queue},
            },
        },
    )
    app.backfill = WorkerContext(settings, app)
    from workers import tasks

    tasks.register(app)
    install_task_hooks(app, app.backfill.metrics)

    @worker_ready.connect(weak=False)
    def resend_on_start(sender=None, **_) -> None:
        # A validation killed with its worker is not redelivered before the visibility timeout:
        # resend every batch still validating (validation is idempotent).
        if getattr(sender, "app", None) is app:
            tasks.resend_stale_validations(app.backfill, older_than_seconds=0)

    return app
