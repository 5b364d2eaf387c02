"""The dashboard's view of every service's health, each with the age of its last answer.

:class:`HealthSampler` reads each service's ``GET /health`` every ``interval_s`` seconds (the
router's on ``BACKFILL_ROUTER_URL``; the worker's and the processor's on their metrics ports,
``BACKFILL_METRICS_HOST`` : ``BACKFILL_WORKER_METRICS_PORT`` / ``BACKFILL_PROCESSOR_METRICS_PORT``,
as ``backfill up`` sets them) and keeps, per service, the last answer and when it came. Celery
beat serves no HTTP: its evidence is the modification time of its schedule file
(``DATA_DIR/celerybeat-schedule*``), which beat rewrites at least every
:data:`BEAT_SYNC_SECONDS` while it sends tasks.

:func:`freshness` is the one rule every figure of the dashboard follows: a reading older than its
refresh (``stale_after_s``) is *unknown*, never shown as live. A service that keeps not answering
(a frozen process: SIGSTOP, a hung event loop) does not stay unknown: once its last answer is
:data:`DOWN_AFTER_READS` refreshes old and the reads since have failed, it is *down*. With the
default 5-s poll and the 2-s read bound that is unknown after 7 s and down after 21 s; for beat
(a schedule file not rewritten) unknown after 210 s and down after 420 s.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from batch_gateway.admin.polling import Poller

BEAT_SYNC_SECONDS = 180.0
"""How often Celery beat writes its schedule file while it sends tasks (``Scheduler.sync_every``,
celery/beat.py)."""
BEAT_SLACK_SECONDS = 30.0
"""Beat writes at its first tick after :data:`BEAT_SYNC_SECONDS`; its file counts as fresh this
much longer (a tick comes within a task interval, under 30 s with the stack's schedule)."""
TIMEOUT_S = 2.0
"""Bound of one ``/health`` read (s)."""
NO_ANSWER = "no answer"
"""How :attr:`ServiceHealth.error` starts when a read got no answer at all."""
DOWN_AFTER_READS = 3
"""Refreshes (``stale_after_s`` each) without an answer after which a service is down, not unknown:
one missed read is a slow answer or a busy machine, three in a row is a service that does not
answer."""
BEAT_DOWN_AFTER_SYNCS = 2
"""Beat's refreshes (its schedule file's ``BEAT_SYNC_SECONDS + BEAT_SLACK_SECONDS``) without a write
after which it is down."""


def freshness(at: float | None, stale_after_s: float, now: float) -> str:
    """``"live"`` when a reading taken at ``at`` (Unix s) is at most ``stale_after_s`` old at
    ``now``, else ``"unknown"`` (also when there is none)."""
    return "live" if at is not None and now - at <= stale_after_s else "unknown"


@dataclass
class ServiceHealth:
    """One service as last seen: ``url`` (or the file read), the last answer's HTTP ``status``
    (None: none yet or none came), ``answered_at`` (Unix s of the last answer of any status),
    ``error`` (why the last read failed, None when it answered), ``stale_after_s`` (its refresh:
    a reading older than this is unknown), ``down_after_s`` (no answer for this long, the reads
    since failing: down; ``DOWN_AFTER_READS × stale_after_s`` unless given) and ``watched_since``
    (Unix s of the first read: the age of a service that never answered)."""

    name: str
    url: str
    stale_after_s: float
    status: int | None = None
    answered_at: float | None = None
    error: str | None = None
    down_after_s: float = 0.0
    watched_since: float | None = None

    def __post_init__(self) -> None:
        if not self.down_after_s:
            self.down_after_s = DOWN_AFTER_READS * self.stale_after_s

    def state(self, now: float) -> str:
        """``up`` (the last read answered 200, fresh), ``down`` (the last read answered another
        status, fresh; or no read has answered for ``down_after_s``, the last one failing),
        ``unknown`` otherwise: the last answer older than ``stale_after_s``, or the last read got
        no answer and ``down_after_s`` has not passed yet (a frozen process looks like a slow one
        at first)."""
        fresh = freshness(self.answered_at, self.stale_after_s, now) == "live"
        if not self.no_answer:
            if not fresh:
                return "unknown"
            return "up" if self.status == 200 and self.error is None else "down"
        since = self.answered_at if self.answered_at is not None else self.watched_since
        return "down" if since is not None and now - since >= self.down_after_s else "unknown"

    @property
    def no_answer(self) -> bool:
        """Whether the last read got no answer at all (``error`` set, no answer since)."""
        return self.error is not None and self.error.startswith(NO_ANSWER)


def health_urls(settings) -> dict[str, str]:
    """``{service: /health URL}`` the gateway's settings name: the router's (``router_url``), the
    worker's and the processor's (``metrics_host`` and their metrics ports, when set)."""
    urls = {}
    if settings.router_url:
        urls["router"] = settings.router_url.rstrip("/") + "/health"
    for service, port in (("processor", settings.processor_metrics_port), ("worker", settings.worker_metrics_port)):
        if port:
            urls[service] = f"http://{settings.metrics_host}:{port}/health"
    return urls


class HealthSampler(Poller):
    """Reads every service's ``/health`` (:func:`health_urls`) and beat's schedule file every
    ``interval_s`` seconds; :attr:`services` holds the last reading of each. :meth:`start` and
    :meth:`stop` run it as an asyncio task; :meth:`poll_once` reads once."""

    name = "admin-health-sampler"

    def __init__(self, urls: dict[str, str], data_dir: Path, interval_s: float,
                 transport: httpx.AsyncBaseTransport | None = None):
        super().__init__(interval_s, TIMEOUT_S, transport)
        stale = interval_s + TIMEOUT_S
        self.services = {name: ServiceHealth(name, url, stale) for name, url in urls.items()}
        beat_stale = BEAT_SYNC_SECONDS + BEAT_SLACK_SECONDS
        self.beat = ServiceHealth("beat", str(data_dir / "celerybeat-schedule"), beat_stale,
                                  down_after_s=BEAT_DOWN_AFTER_SYNCS * beat_stale)
        self._data_dir = data_dir

    async def _read(self, service: ServiceHealth) -> None:
        if service.watched_since is None:
            service.watched_since = time.time()
        try:
            response = await self._client.get(service.url)
        except httpx.HTTPError as exc:
            service.error = f"{NO_ANSWER} ({type(exc).__name__})"
            return
        service.status, service.answered_at = response.status_code, time.time()
        service.error = None if response.status_code == 200 else f"answered HTTP {response.status_code}"

    def _read_beat(self) -> None:
        """Beat's evidence: the newest modification time of its schedule file(s) (dbm may add
        ``.db`` / ``.dat`` / ``.dir``)."""
        now = time.time()
        if self.beat.watched_since is None:
            self.beat.watched_since = now
        times = [path.stat().st_mtime for path in self._data_dir.glob("celerybeat-schedule*") if path.is_file()]
        if not times:
            self.beat.error = f"{NO_ANSWER}: no schedule file written yet"
            return
        self.beat.status, self.beat.answered_at = 200, max(times)
        age = now - self.beat.answered_at
        self.beat.error = None if age <= self.beat.stale_after_s else f"{NO_ANSWER}: schedule file not rewritten for {age:.0f} s"

    async def poll_once(self) -> None:
        """Read every service once: beat's file first (instant), so a view that shows this round's
        HTTP answers shows beat's reading too."""
        self._read_beat()
        await asyncio.gather(*(self._read(service) for service in self.services.values()))

    def rows(self, now: float, gateway_at: float) -> list[dict]:
        """The health view: one row per service, the gateway first (``gateway_at``: when it
        answered, i.e. now for the page it serves), then router, processor, worker, beat; each
        ``{"name", "url", "state", "age_s", "error", "stale_after_s", "down_after_s"}``."""
        gateway = ServiceHealth("gateway", "this page", self.interval_s + TIMEOUT_S, 200, gateway_at)
        order = [gateway, *(self.services[n] for n in ("router", "processor", "worker") if n in self.services),
                 self.beat]
        return [{"name": s.name, "url": s.url, "state": s.state(now),
                 "age_s": None if s.answered_at is None else max(0.0, now - s.answered_at), "error": s.error,
                 "stale_after_s": s.stale_after_s, "down_after_s": s.down_after_s}
                for s in order]


def health_bounds(sampler: HealthSampler | None) -> dict[str, float]:
    """The health view's bounds (s), shown under its table: ``stale_after_s`` and ``down_after_s``
    of the HTTP services, ``beat_stale_after_s`` and ``beat_down_after_s`` of beat (the defaults'
    when there is no sampler, at the default 5-s poll)."""
    stale = (sampler.interval_s if sampler else 5.0) + TIMEOUT_S
    beat = BEAT_SYNC_SECONDS + BEAT_SLACK_SECONDS
    return {"stale_after_s": stale, "down_after_s": DOWN_AFTER_READS * stale,
            "beat_stale_after_s": beat, "beat_down_after_s": BEAT_DOWN_AFTER_SYNCS * beat}
