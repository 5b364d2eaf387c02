"""Beat's schedule, quiet on an idle deployment: :func:`beat_schedule` and :class:`QuietScheduler`.

The lifecycle's frequent steps (collect and the background responses' tick every 0.5 s, feed
every 1 s, finalize and webhooks every 2 s, the outbox relay and stale validations every 5 s, the
sweep every 10 s) are sent only while there is work (:func:`work_pending`: a batch or a
background response that has not ended, an outbox event or a webhook delivery waiting, a result in
the result stream). Beat asks that probe itself, at most once per
:data:`PROBE_SECONDS`; it sends no task for it. An idle stack so sends only the slow ones:
:data:`CATCH_UP_TASK` every ``catch_up_interval_seconds`` (60 s: every step once, the safety net
should the probe ever be wrong) and the two purges every ``purge_interval_seconds``: about 0.02
task/s instead of 6.4. Nothing is lost by a skipped send: the probe reads state (rows, stream
entries), not events, so work that appears is seen at the next due send; a probe that fails counts
as work (the tasks are sent as before), and beat sends a catch-up as soon as it starts.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from typing import Any

from celery.beat import PersistentScheduler

from batch_gateway.store import queries
from batch_gateway.store.task_names import (
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
)
from workers.context import WorkerContext
from workers.settings import WorkerSettings

log = logging.getLogger(__name__)

CATCH_UP = "catch-up"
"""The schedule entry of :data:`CATCH_UP_TASK`, sent whatever the probe says."""
WHEN_BUSY = frozenset({"relay-outbox", "resend-stale-validations", "feed", "collect", "sweep", "finalize_due",
                       "deliver_webhooks", "tick_responses"})
"""The schedule entries sent only while :func:`work_pending` holds."""
PROBE_SECONDS = 0.25
"""How long one probe answer is reused: the due entries of one tick share it (half the shortest
interval, so work that appears waits at most one collect interval longer)."""


def beat_schedule(settings: WorkerSettings) -> dict[str, dict[str, Any]]:
    """Celery's ``beat_schedule``: every lifecycle task on its interval (seconds, from ``settings``),
    each sent to ``settings.task_queue``; the frequent ones expire after four intervals (a backlog of
    them is useless)."""
    queue = settings.task_queue
    frequent = (("feed", FEED_TASK, settings.feed_interval_seconds),
                ("collect", COLLECT_TASK, settings.collect_interval_seconds),
                ("tick_responses", TICK_RESPONSES_TASK, settings.collect_interval_seconds),
                ("sweep", SWEEP_TASK, settings.sweep_interval_seconds),
                ("finalize_due", FINALIZE_DUE_TASK, settings.finalize_interval_seconds),
                ("deliver_webhooks", DELIVER_WEBHOOKS_TASK, settings.webhook_interval_seconds))
    return {
        "relay-outbox": {"task": RELAY_OUTBOX_TASK, "schedule": settings.relay_interval_seconds,
                         "options": {"queue": queue}},
        "resend-stale-validations": {"task": RESEND_STALE_VALIDATIONS_TASK,
                                     "schedule": settings.relay_interval_seconds, "options": {"queue": queue}},
        **{name: {"task": task, "schedule": interval, "options": {"queue": queue, "expires": interval * 4}}
           for name, task, interval in frequent},
        CATCH_UP: {"task": CATCH_UP_TASK, "schedule": settings.catch_up_interval_seconds,
                   "options": {"queue": queue, "expires": settings.catch_up_interval_seconds}},
        "purge-files": {"task": PURGE_FILES_TASK, "schedule": settings.purge_interval_seconds,
                        "options": {"queue": queue}},
        "sweep-temp-files": {"task": SWEEP_TEMP_FILES_TASK, "schedule": settings.purge_interval_seconds,
                             "options": {"queue": queue, "expires": settings.purge_interval_seconds}},
    }


def work_pending(ctx: WorkerContext) -> bool:
    """True when a lifecycle step may have something to do: a result waits in the result stream or
    :func:`batch_gateway.store.queries.lifecycle_work_pending` holds. An error (Redis or Postgres
    unreachable) counts as work: the tasks are sent, and fail or succeed as they would have."""
    try:
        if ctx.queue.redis.xlen(ctx.queue.result_stream):
            return True
        with ctx.session() as session:
            return queries.lifecycle_work_pending(session)
    except Exception:
        log.warning("lifecycle probe failed; sending the tasks", exc_info=True,
                    extra={"action": "lifecycle_probe_failed"})
        return True


class QuietScheduler(PersistentScheduler):
    """Celery's persistent scheduler that skips the :data:`WHEN_BUSY` entries while
    :func:`work_pending` is false (the entry's next run is booked as if sent) and sends the
    :data:`CATCH_UP` entry as soon as beat starts. The app must be a ``workers.app.WorkerCelery``
    (its ``backfill`` context is probed)."""

    probe_seconds: float = PROBE_SECONDS
    """How long one probe answer is reused (:data:`PROBE_SECONDS`)."""
    _probe: tuple[float, bool] = (float("-inf"), True)

    def setup_schedule(self) -> None:
        """Celery's set-up, then the catch-up booked as last run one interval ago: due at once."""
        super().setup_schedule()
        entry = self.schedule.get(CATCH_UP)
        if entry is not None:
            entry.last_run_at = self.app.now() - dt.timedelta(seconds=entry.schedule.run_every.total_seconds())

    def busy(self) -> bool:
        """:func:`work_pending` of the app's context, reused for :attr:`probe_seconds`."""
        at, answer = self._probe
        now = time.monotonic()
        if now - at >= self.probe_seconds:
            answer = work_pending(self.app.backfill)
            self._probe = (now, answer)
        return answer

    def apply_entry(self, entry: Any, producer: Any = None) -> None:
        """Send ``entry``'s task unless it is a :data:`WHEN_BUSY` one and there is no work."""
        if entry.name in WHEN_BUSY and not self.busy():
            return
        super().apply_entry(entry, producer=producer)
