"""The Celery app of the batch lifecycle: :func:`create_celery`, the workers' composition root.

Reliability settings follow RELIABILITY.md: ``acks_late`` with ``task_reject_on_worker_lost`` (a
killed worker's task is redelivered, not lost), prefetch of one, a Redis visibility timeout from the
settings. Every task is safe to run twice: its effects are guarded by a state transition in
Postgres.

Logging (docs/observability.md "Logs"): the worker and beat log through
:func:`common.logging.configure_logging` (a ``setup_logging`` receiver, so Celery leaves the root
logger alone); beat's ``Scheduler: Sending due task …`` line, several a second at INFO while there is
work, is demoted to DEBUG (:class:`DemoteFilter`; beat's errors keep their level);
Celery's start-up banners, which it prints to stdout as plain text, are one JSON line each
(``action`` ``worker_started`` / ``beat_started``) instead.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from celery import Celery
from celery.apps.beat import Beat
from celery.apps.worker import Worker, install_worker_term_handler, install_worker_term_hard_handler
from celery.signals import setup_logging, worker_ready
from kombu.utils.objects import cached_property

from batch_gateway.store.outbox import celery_broker_url
from common.logging import configure_logging
from workers import tasks
from workers.context import WorkerContext
from workers.lifecycle.validator import resend_stale_validations
from workers.metrics import install_task_hooks
from workers.schedule import beat_schedule
from workers.settings import WorkerSettings

log = logging.getLogger(__name__)

BEAT_LOGGER = "celery.beat"
DUE_TASK_PREFIX = "Scheduler: Sending due task"
"""The start of the line Celery's scheduler logs at INFO for every task it sends (celery/beat.py)."""
QUIET_CELERY_LOGGERS = ("celery.worker.strategy", "celery.app.trace")
"""Celery's per-task "received" / "succeeded" INFO lines: our tasks log what they did (``action``)."""
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class DemoteFilter(logging.Filter):
    """A logger filter that turns records whose message format starts with ``prefix`` from INFO
    into DEBUG: they are written only when the logger is enabled for DEBUG. Records of other
    levels and messages pass unchanged."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO or not str(record.msg).startswith(self.prefix):
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def quiet_celery_loggers() -> None:
    """Demote beat's due-task line (:class:`DemoteFilter`, added once) and set Celery's per-task
    loggers (:data:`QUIET_CELERY_LOGGERS`) to WARNING."""
    beat = logging.getLogger(BEAT_LOGGER)
    if not any(isinstance(f, DemoteFilter) for f in beat.filters):
        beat.addFilter(DemoteFilter(DUE_TASK_PREFIX))
    for name in QUIET_CELERY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def _setup_logging(loglevel: Any = None, **_: Any) -> None:
    # Celery sends setup_logging when a worker or beat starts; with a receiver it configures
    # nothing itself. The root handler is ours (configure_logging) unless a command set one up.
    if not logging.getLogger().handlers:
        configure_logging(loglevel or logging.WARNING)
    quiet_celery_loggers()


setup_logging.connect(_setup_logging, weak=False, dispatch_uid="backfill.setup_logging")


def _plain(text: str) -> str:
    return _ANSI.sub("", text).strip()


class JsonBannerWorker(Worker):
    """Celery's worker application with its start-up banner as one log record (``action``
    ``worker_started``, the banner's text without colours in ``banner``) instead of text on stdout,
    and its ``worker: Warm shutdown`` / ``Cold shutdown`` text (written to stdout from the signal
    handler) replaced by a ``worker_stopped`` record once it has stopped. The Ctrl+C hints Celery
    writes at a terminal stay text."""

    def install_platform_tweaks(self, worker: Any) -> None:
        super().install_platform_tweaks(worker)
        install_worker_term_handler(worker, verbose=False)  # the same handlers, without the text line
        install_worker_term_hard_handler(worker, verbose=False)

    def on_stopped(self) -> None:
        super().on_stopped()
        log.info("celery worker stopped", extra={"action": "worker_stopped", "hostname": self.hostname})

    def emit_banner(self) -> None:
        log.info("celery worker started", extra={
            "action": "worker_started", "hostname": self.hostname,
            "banner": _plain(self.startup_info(artlines=False) + (self.extra_info() or ""))})


class JsonBannerBeat(Beat):
    """Celery's beat application, quiet (no text banners on stdout), logging its start as one
    record (``action`` ``beat_started``) once logging is set up."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs["quiet"] = True
        super().__init__(*args, **kwargs)

    def setup_logging(self, colorize: bool | None = None) -> None:
        super().setup_logging(colorize)
        log.info("celery beat started", extra={
            "action": "beat_started", "scheduler": str(self.scheduler_cls), "schedule": str(self.schedule),
            "max_interval": self.max_interval, "loglevel": logging.getLevelName(self.loglevel)})


class WorkerCelery(Celery):
    """A Celery app carrying its :class:`WorkerContext` as ``backfill`` (what a started worker's
    ``worker_ready`` signal and the tests reach the clients through)."""

    backfill: WorkerContext

    def __init__(self, settings: WorkerSettings, **kwargs: Any):
        super().__init__("backfill", broker=celery_broker_url(settings.redis_url), set_as_current=False, **kwargs)
        self.backfill = WorkerContext(settings, self)

    @cached_property
    def Worker(self) -> Any:
        """The worker application: :class:`JsonBannerWorker`."""
        return self.subclass_with_self(JsonBannerWorker)

    @cached_property
    def Beat(self) -> Any:
        """The beat application: :class:`JsonBannerBeat`."""
        return self.subclass_with_self(JsonBannerBeat)


def _resend_on_start(sender: Any = None, **_: Any) -> None:
    # A validation killed with its worker is not redelivered before the visibility timeout:
    # resend every batch still validating (validation is idempotent). Connected once per process;
    # it acts for the app of the worker that started.
    app = getattr(sender, "app", None)
    if isinstance(app, WorkerCelery):
        resend_stale_validations(app.backfill, older_than_seconds=0)


worker_ready.connect(_resend_on_start, weak=False, dispatch_uid="backfill.resend_on_start")


def create_celery(settings: WorkerSettings) -> WorkerCelery:
    """The Celery app with every lifecycle task registered and the beat schedule set
    (:func:`workers.schedule.beat_schedule`, sent by :class:`workers.schedule.QuietScheduler`: the
    frequent lifecycle tasks only while there is work)."""
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
        beat_schedule=beat_schedule(settings),
        beat_scheduler="workers.schedule:QuietScheduler",
    )
    tasks.register(app, app.backfill)
    install_task_hooks(app, app.backfill.metrics)
    return app
