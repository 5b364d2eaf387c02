"""Prometheus metrics of the gateway, served at ``GET /metrics`` on the gateway's own port.

Series (docs/observability.md has the full list; no tenant id is ever a label):

- ``backfill_gateway_http_requests_total{method, handler, status}`` and
  ``backfill_gateway_http_request_duration_seconds{method, handler, status}``: every request but
  ``/metrics``; ``handler`` is the route template (``/v1/batches/{batch_id}``; ``none`` for a path
  no route matches) and ``status`` the class (``2xx``, ``4xx``, …). Recorded by
  ``prometheus-fastapi-instrumentator``'s middleware.
- ``backfill_gateway_batches{status}``: batches in each OpenAI status, from one grouped count run
  at scrape time and cached for :data:`BATCH_COUNT_TTL_SECONDS`.
- ``backfill_gateway_background_responses{status}`` and
  ``backfill_gateway_background_responses_oldest_queued_seconds``: background responses in each
  status, and how long the oldest still ``queued`` has waited (0: none), from one read of the
  database at scrape time cached as the batch count (:class:`ResponseStatusCollector`).
- ``backfill_gateway_background_responses_created_total``: background responses accepted by
  ``POST /v1/responses``.
- ``backfill_gateway_file_uploaded_bytes_total{purpose}`` / ``backfill_gateway_files_uploaded_total{purpose}``:
  bytes and files accepted by ``POST /v1/files``.
- ``backfill_gateway_lane_backlog_messages{lane}``, ``backfill_gateway_lane_pending_messages{lane}``,
  ``backfill_gateway_lane_dead_letter_messages{lane}``, ``backfill_gateway_lane_oldest_age_seconds{lane}``:
  each request lane's Redis stream (pool ``queue_pool``, group ``queue_consumer_group``) read at
  scrape time (:class:`LaneBacklogCollector`), cached for :data:`LANE_READ_TTL_SECONDS`.
- the runtime series of :func:`common.metrics.service_registry` (``process_*``, ``python_*``).

``/metrics`` is not behind tenant auth. When the admin key is configured (``BACKFILL_ADMIN_KEY``)
it answers only ``Authorization: Bearer <admin key>`` (Prometheus: ``authorization.credentials``
in the scrape config); without one it is open, so keep the port off the public internet.
"""

from __future__ import annotations

import hmac
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import redis
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from prometheus_fastapi_instrumentator import Instrumentator
from prometheus_fastapi_instrumentator import metrics as http_metrics
from sqlalchemy.orm import Session

from batch_gateway.errors import AuthenticationError
from batch_gateway.schemas import UPLOAD_PURPOSES
from batch_gateway.store import queries
from batch_gateway.store.queries import responses as response_queries
from batch_gateway.store.states import ACTIVE_BATCH_STATUSES, TERMINAL_BATCH_STATUSES, ResponseStatus
from common.contracts.queue import LANE_PRIORITIES
from common.metrics import service_registry

BATCH_COUNT_TTL_SECONDS = 5.0
"""How long one grouped count of batches by status is reused (a scrape every 15 s, Prometheus's
default interval, or several replicas scraping at once cost one query per window)."""

HTTP_BUCKETS_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
"""Prometheus' default buckets (5 ms to 10 s) plus 30, 60 and 120 s for uploads of large batch files."""

BATCH_STATUSES = (*ACTIVE_BATCH_STATUSES, *TERMINAL_BATCH_STATUSES)

LANE_READ_TTL_SECONDS = 5.0
"""How long one read of the lanes' streams is reused (as :data:`BATCH_COUNT_TTL_SECONDS`)."""


@dataclass(frozen=True)
class LaneBacklog:
    """One request lane's stream as the processors' consumer group sees it: ``backlog`` messages not
    yet acknowledged (``XLEN``: the processors delete what they acknowledge), ``pending`` of them
    delivered to a processor (``XPENDING``), ``dead`` in its dead-letter stream, and
    ``oldest_age_seconds`` since the oldest of the backlog was added (0 when the stream is empty)."""

    lane: str
    backlog: int
    pending: int
    dead: int
    oldest_age_seconds: float


def read_lane_backlogs(client: redis.Redis, pool: str, group: str, now: Callable[[], float] = time.time,
                       ) -> list[LaneBacklog]:
    """Every lane of :data:`~common.contracts.queue.LANE_PRIORITIES`, highest priority first:
    depths from :meth:`~async_processor.backends.redis_producer.RedisLaneProducer.lane_depths`
    and the age from the id of each stream's first entry (``XRANGE - + COUNT 1``: a Redis stream id
    starts with the Unix time in milliseconds it was added). Two round trips. Raises
    ``BackendError`` or ``redis.RedisError`` when Redis cannot be read."""
    from async_processor.backends.redis_producer import RedisLaneProducer

    producer = RedisLaneProducer(client, pool=pool)
    lanes = sorted(LANE_PRIORITIES, key=lambda lane: -LANE_PRIORITIES[lane])
    depths = producer.lane_depths(lanes, group)
    with client.pipeline(transaction=False) as pipe:
        for lane in lanes:
            pipe.xrange(producer.stream(lane), count=1)
        firsts = pipe.execute()
    now_ms = now() * 1000
    out = []
    for depth, first in zip(depths, firsts):
        age = 0.0
        if first:
            entry_id = first[0][0]
            added_ms = int((entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)).split("-")[0])
            age = max(0.0, (now_ms - added_ms) / 1000)
        out.append(LaneBacklog(depth.lane, depth.length, depth.pending, depth.dead, age))
    return out


LaneSource = tuple[redis.Redis, str, str]
"""A Redis client, the pool and the processors' consumer group of the lanes to read."""


def _lane_source(app: FastAPI) -> LaneSource | None:
    client, settings = getattr(app.state, "admin_redis", None), getattr(app.state, "settings", None)
    if client is None or settings is None:  # the app has not started
        return None
    return client, settings.queue_pool, settings.queue_consumer_group


class LaneBacklogCollector(Collector):
    """The ``backfill_gateway_lane_*`` gauges (module docstring) from :func:`read_lane_backlogs`.
    ``source``: returns what to read (None before the app started: no samples); a failed read
    yields no sample rather than a failed scrape."""

    def __init__(self, source: Callable[[], LaneSource | None], ttl_seconds: float = LANE_READ_TTL_SECONDS,
                 clock: Callable[[], float] = time.monotonic):
        self.source = source
        self.ttl_seconds = ttl_seconds
        self.clock = clock
        self._lock = threading.Lock()
        self._lanes: list[LaneBacklog] | None = None
        self._read_at = -float("inf")

    def lanes(self) -> list[LaneBacklog] | None:
        """The lanes, re-read when older than the TTL; None when Redis could not be read."""
        with self._lock:
            if self.clock() - self._read_at >= self.ttl_seconds:
                source = self.source()
                try:
                    self._lanes = None if source is None else read_lane_backlogs(*source)
                except Exception:  # Redis is down: this scrape has no lane gauges
                    self._lanes = None
                self._read_at = self.clock()
            return self._lanes

    def collect(self) -> Iterator[GaugeMetricFamily]:
        lanes = self.lanes()
        if lanes is None:
            return
        for name, doc, attribute in LANE_GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["lane"])
            for lane in lanes:
                family.add_metric([lane.lane], getattr(lane, attribute))
            yield family

    def describe(self) -> list:
        return []  # collected lazily: registering must not read Redis


LANE_GAUGES = (
    ("backfill_gateway_lane_backlog_messages", "Messages on the lane's stream not yet acknowledged.", "backlog"),
    ("backfill_gateway_lane_pending_messages", "Of those, messages delivered to a processor.", "pending"),
    ("backfill_gateway_lane_dead_letter_messages", "Messages in the lane's dead-letter stream.", "dead"),
    ("backfill_gateway_lane_oldest_age_seconds", "Seconds since the oldest unacknowledged message of the "
     "lane was added (0: none).", "oldest_age_seconds"),
)


class _CachedDatabaseRead(Collector):
    """A collector whose samples come from one database read (``read(session)``), reused for
    ``ttl_seconds``. ``sessions``: returns a new session (the caller's sessionmaker); a failed read
    yields no sample rather than a failed scrape."""

    def __init__(self, sessions: Callable[[], Session], read: Callable[[Session], Any],
                 ttl_seconds: float = BATCH_COUNT_TTL_SECONDS, clock: Callable[[], float] = time.monotonic):
        self.sessions = sessions
        self.read = read
        self.ttl_seconds = ttl_seconds
        self.clock = clock
        self._lock = threading.Lock()
        self._value: Any = None
        self._read_at = -float("inf")

    def value(self) -> Any:
        """What ``read`` returned, re-read when older than the TTL; None when the read failed."""
        with self._lock:
            if self.clock() - self._read_at >= self.ttl_seconds:
                try:
                    with self.sessions() as session:
                        self._value = self.read(session)
                except Exception:  # the database is down: this scrape has no such samples
                    self._value = None
                self._read_at = self.clock()
            return self._value

    def describe(self) -> list:
        return []  # collected lazily: registering must not query the database


class BatchStatusCollector(_CachedDatabaseRead):
    """``backfill_gateway_batches{status}``, every OpenAI status present (0 when none)."""

    def __init__(self, sessions: Callable[[], Session], **kwargs: Any):
        super().__init__(sessions, queries.batch_status_counts, **kwargs)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        counts: dict[str, int] | None = self.value()
        if counts is None:
            return
        family = GaugeMetricFamily("backfill_gateway_batches", "Batches in each OpenAI status.", labels=["status"])
        for status in dict.fromkeys((*BATCH_STATUSES, *counts)):
            family.add_metric([status], counts.get(status, 0))
        yield family


class ResponseStatusCollector(_CachedDatabaseRead):
    """``backfill_gateway_background_responses{status}`` (every OpenAI status, 0 when none) and
    ``backfill_gateway_background_responses_oldest_queued_seconds``
    (:func:`~batch_gateway.store.queries.responses.response_status_counts`)."""

    def __init__(self, sessions: Callable[[], Session], **kwargs: Any):
        super().__init__(sessions, response_queries.response_status_counts, **kwargs)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        read: tuple[dict[str, int], int] | None = self.value()
        if read is None:
            return
        counts, oldest = read
        family = GaugeMetricFamily("backfill_gateway_background_responses", "Background responses in each OpenAI "
                                   "status.", labels=["status"])
        for status in dict.fromkeys((*(str(s) for s in ResponseStatus), *counts)):
            family.add_metric([status], counts.get(status, 0))
        yield family
        yield GaugeMetricFamily("backfill_gateway_background_responses_oldest_queued_seconds", "Seconds the oldest "
                                "queued background response has waited (0: none queued).", value=oldest)


class GatewayMetrics:
    """The gateway's registry and the series it updates by hand (:meth:`file_uploaded`)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = service_registry(registry)
        self.uploaded_bytes = Counter("backfill_gateway_file_uploaded_bytes", "Bytes of files accepted by "
                                      "POST /v1/files.", ["purpose"], registry=self.registry)
        self.uploaded_files = Counter("backfill_gateway_files_uploaded", "Files accepted by POST /v1/files.",
                                      ["purpose"], registry=self.registry)
        for purpose in UPLOAD_PURPOSES:  # every series exists from the start, at 0
            self.uploaded_bytes.labels(purpose)
            self.uploaded_files.labels(purpose)
        self.responses_created = Counter("backfill_gateway_background_responses_created", "Background responses "
                                         "accepted by POST /v1/responses.", registry=self.registry)

    def file_uploaded(self, purpose: str, size_bytes: int) -> None:
        """Count one stored upload of ``size_bytes`` bytes."""
        self.uploaded_files.labels(purpose).inc()
        self.uploaded_bytes.labels(purpose).inc(size_bytes)

    def exposition(self) -> bytes:
        """The registry in Prometheus' text format."""
        return generate_latest(self.registry)


def _check_admin_key(request: Request, admin_key: str | None) -> None:
    if not admin_key:
        return
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), admin_key.encode()):
        raise AuthenticationError("/metrics needs the admin key: Authorization: Bearer <admin key>.")


def install_metrics(app: FastAPI, admin_key: str | None = None) -> GatewayMetrics:
    """Instrument ``app`` (HTTP middleware), register the batch and background-response gauges (reading
    ``app.state.sessionmaker`` at scrape time) and the lane gauges (reading the streams of pool
    ``settings.queue_pool`` as group ``settings.queue_consumer_group`` sees them, through
    ``app.state.admin_redis``, the dashboard's client) and add ``GET /metrics``, guarded by
    ``admin_key`` when given. Puts the :class:`GatewayMetrics` on ``app.state.metrics`` and returns it. Call
    before the app starts (middleware cannot be added later)."""
    metrics = GatewayMetrics()
    labels: dict[str, Any] = {"metric_namespace": "backfill", "metric_subsystem": "gateway", "registry": metrics.registry}
    Instrumentator(should_group_status_codes=True, should_ignore_untemplated=False, should_group_untemplated=True,
                   excluded_handlers=["^/metrics$"], registry=metrics.registry).add(
        http_metrics.requests(**labels),
        http_metrics.latency(buckets=HTTP_BUCKETS_SECONDS, **labels),
    ).instrument(app)
    metrics.registry.register(BatchStatusCollector(lambda: app.state.sessionmaker()))
    metrics.registry.register(ResponseStatusCollector(lambda: app.state.sessionmaker()))
    metrics.registry.register(LaneBacklogCollector(lambda: _lane_source(app)))
    app.state.metrics = metrics

    @app.get("/metrics", include_in_schema=False)
    def prometheus_metrics(request: Request) -> Response:
        """The gateway's series in Prometheus' text format (see the module docstring)."""
        _check_admin_key(request, admin_key)
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return metrics
