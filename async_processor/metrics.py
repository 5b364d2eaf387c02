"""The processor's observer (:class:`~async_processor.observer.ProcessorObserver`): Prometheus
metrics, served at ``/metrics`` (and ``/health``) on ``BACKFILL_PROCESSOR_METRICS_PORT`` /
``BACKFILL_METRICS_PORT`` by :func:`start_metrics_server`, the outcome tally ``counts`` and the
per-request debug lines (``dispatch``, ``result``; logger ``async_processor.processor``).

Series (docs/observability.md has the full list; tenant ids are never labels):

- ``backfill_processor_held_requests{lane}`` (gauge): admitted requests held in the lane buffer,
  waiting for a gate or a retry backoff (the lane depth the processor sees, at most the lane's
  buffer share; the stream backlog before it is Redis' ``XLEN``, outside the processor).
- ``backfill_processor_in_flight_requests{lane}`` (gauge): HTTP attempts running now (the
  concurrency slots the lane holds).
- ``backfill_processor_dispatched_total{lane}``: requests sent to the router, each once (its first
  POST; a request taken over from another processor counts again there).
- ``backfill_processor_resent_total{lane}``: POSTs of a request after its first: retries after a
  retryable answer and re-sends after the router's fast refusal (dispatched + resent = every POST).
- ``backfill_processor_queue_wait_seconds{lane}`` (histogram): a request's first dispatch, seconds
  since its message was put on the lane (:func:`enqueued_at`): the wait a lane's priority buys
  (``async`` before ``batch``).
- ``backfill_processor_router_request_duration_seconds{lane, status}``: one attempt, from the POST
  to the whole answer read; ``status`` the class (``2xx``, ``4xx``, ``5xx``) or ``none`` (no answer).
- ``backfill_processor_results_total{lane, error_code}``: terminal results published;
  ``error_code`` is the result's code or ``none`` (an HTTP answer of any status).
- ``backfill_processor_retries_total{lane, reason}``: attempts put back with a backoff; ``reason``
  the retryable HTTP status (``429``, ``503``, …), ``no_answer``, or ``rejected_saturated`` (the
  router's fast refusal, held for its ``Retry-After`` and not counted as an attempt).
- ``backfill_processor_shed_total{lane, reason}``: requests ended without (another) dispatch:
  ``deadline_exceeded``, ``cancelled``, ``dead_lettered``, ``invalid``.
- ``backfill_processor_taken_over_total{lane, stage}``: held requests dropped because another
  processor took them over after this one's lease lapsed (``stage``: ``held``, ``in_flight``,
  ``result``).
- ``backfill_processor_gate_decisions_total{gate, decision}``: ``deny`` once per held request each
  time a gate (``concurrency``, ``tenant_quota``, ``saturation``) starts holding it back,
  ``admit`` once per request every gate let through (see :class:`~async_processor.gates.AllGates`).

Hot-path updates go to label children bound once per label set; the gauges and gate counts are
read from the processor at scrape time. Every counter's known label values (lanes read, error
codes, shed reasons, retryable statuses) start at 0 when a processor is watched, so each series
exists before its first event.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Iterator
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from async_processor.gates import AllGates
from async_processor.lanes import Work
from async_processor.observer import Observed, Shed, outcome_of
from async_processor.retry import RETRYABLE_STATUSES
from common.contracts.queue import ErrorCode, RequestMessage, ResultMessage
from common.metrics import service_registry

log = logging.getLogger("async_processor.processor")
"""The per-request lines keep the logger name they always had (the pump's)."""

ROUTER_BUCKETS_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
"""10 ms (a quick 429) to 600 s (``request_timeout_s``' default): a long generation takes minutes."""
QUEUE_WAIT_BUCKETS_SECONDS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0,
                              4 * 3600.0, 24 * 3600.0)
"""50 ms (an idle fleet) to 24 h (a batch's completion window)."""

SHED_REASONS = tuple(str(reason) for reason in Shed)
RETRY_REASONS = (*(str(s) for s in sorted(RETRYABLE_STATUSES)), "no_answer", "rejected_saturated")
RESULT_CODES = ("none", *(str(code) for code in ErrorCode))
TAKEN_OVER_STAGES = ("held", "in_flight", "result")


def status_class(status: int) -> str:
    """``2xx`` … ``5xx`` for an HTTP status, ``none`` for 0 (no answer)."""
    return f"{status // 100}xx" if status else "none"


def enqueued_at(work: Work) -> float:
    """Unix seconds ``work``'s message was put on its lane: the time in its Redis stream entry id
    (``<milliseconds>-<seq>``, Redis' own clock), else the message's ``created`` (whole seconds,
    the producer's clock: Pub/Sub and the sorted-set transport)."""
    head, sep, _ = work.delivery.transport_id.partition("-")
    if sep and head.isdigit():
        return int(head) / 1000
    return float(work.request.created)


class _ProcessorCollector(Collector):
    """Reads the lane buffer, in-flight attempts and gate counts of one processor at scrape time."""

    def __init__(self, processor: Observed):
        self.processor = processor

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        p = self.processor
        held = GaugeMetricFamily("backfill_processor_held_requests", "Admitted requests held in the lane "
                                 "buffer (waiting for a gate or a retry backoff).", labels=["lane"])
        in_flight = GaugeMetricFamily("backfill_processor_in_flight_requests", "HTTP attempts running now.",
                                      labels=["lane"])
        running = [w.lane for w in list(p.in_flight)]
        for lane in p.buffer.order:
            held.add_metric([lane], p.buffer.depth(lane))
            in_flight.add_metric([lane], running.count(lane))
        yield held
        yield in_flight
        gate = p.gate
        if isinstance(gate, AllGates):
            decisions = CounterMetricFamily("backfill_processor_gate_decisions", "Gate decisions: deny when a "
                                            "gate starts holding a request back, admit when every gate let it "
                                            "through.", labels=["gate", "decision"])
            for kind in gate.kinds:
                decisions.add_metric([kind, "admit"], gate.admitted)
                decisions.add_metric([kind, "deny"], gate.denied[kind])
            yield decisions

    def describe(self) -> list:
        return []


def log_fields(action: str, message: RequestMessage | ResultMessage, **fields: Any) -> dict[str, Any]:
    """``extra`` of a per-request log record: the action, the request id and the ids in metadata."""
    meta = message.metadata
    return {"action": action, "request_id": message.id, "batch_id": meta.get("batch_id"),
            "custom_id": meta.get("custom_id"), "tenant": meta.get("tenant"),
            "traceparent": meta.get("traceparent"), **fields}


class ProcessorMetrics:
    """The processor's observer: its series on ``registry`` (a new one by default), the tally
    ``counts`` and the debug lines; :meth:`watch` adds the scrape-time series of one
    :class:`~async_processor.processor.Processor`."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = service_registry(registry)
        self._dispatched = Counter("backfill_processor_dispatched", "Requests sent to the router, each once "
                                   "(its first POST).", ["lane"], registry=r)
        self._resent = Counter("backfill_processor_resent", "POSTs of a request after its first (retries, and "
                               "re-sends after the router's fast refusal).", ["lane"], registry=r)
        self._queue_wait = Histogram("backfill_processor_queue_wait_seconds", "A request's first dispatch: "
                                     "seconds since its message was put on the lane.", ["lane"],
                                     buckets=QUEUE_WAIT_BUCKETS_SECONDS, registry=r)
        self._latency = Histogram("backfill_processor_router_request_duration_seconds", "One HTTP attempt to "
                                  "the router, until its whole answer is read.", ["lane", "status"],
                                  buckets=ROUTER_BUCKETS_SECONDS, registry=r)
        self._results = Counter("backfill_processor_results", "Terminal results published, by error code "
                                "(none: an HTTP answer).", ["lane", "error_code"], registry=r)
        self._retries = Counter("backfill_processor_retries", "Attempts put back with a backoff, by the "
                                "retryable answer.", ["lane", "reason"], registry=r)
        self._shed = Counter("backfill_processor_shed", "Requests ended without (another) dispatch.",
                             ["lane", "reason"], registry=r)
        self._taken_over = Counter("backfill_processor_taken_over", "Held requests dropped because another "
                                   "processor took them over after this one's lease lapsed.", ["lane", "stage"],
                                   registry=r)
        self._children: dict[tuple, Any] = {}
        self._watched: _ProcessorCollector | None = None
        self.counts: collections.Counter[str] = collections.Counter()

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def watch(self, processor: Observed) -> None:
        """Export ``processor``'s held and in-flight requests and gate decisions (replacing a
        processor watched before)."""
        if self._watched is not None:
            self.registry.unregister(self._watched)
        self._watched = _ProcessorCollector(processor)
        self.registry.register(self._watched)
        for lane in processor.buffer.order:
            self._child(self._dispatched, lane)
            self._child(self._resent, lane)
            self._child(self._queue_wait, lane)
            for stage in TAKEN_OVER_STAGES:
                self._child(self._taken_over, lane, stage)
            for values, metric in ((SHED_REASONS, self._shed), (RETRY_REASONS, self._retries),
                                   (RESULT_CODES, self._results)):
                for value in values:
                    self._child(metric, lane, value)

    def dispatched(self, work: Work) -> None:
        """A POST started: counted in ``dispatched`` the first time (``work.sends`` 1), in ``resent``
        after; the first dispatch's wait since the message was enqueued is observed."""
        self._child(self._dispatched if work.sends <= 1 else self._resent, work.lane).inc()
        if not work.started:
            self._child(self._queue_wait, work.lane).observe(max(0.0, time.time() - enqueued_at(work)))
        if log.isEnabledFor(logging.DEBUG):
            log.debug("dispatch", extra=log_fields("dispatch", work.request, lane=work.lane,
                                                   attempt=work.attempts + 1))

    def attempt_finished(self, lane: str, status: int, seconds: float) -> None:
        """An attempt ended after ``seconds`` with HTTP ``status`` (0: no answer)."""
        self._child(self._latency, lane, status_class(status)).observe(seconds)

    def answered(self, lane: str, status: int) -> None:
        """A request ends with its last answer: tallied as ``success``, ``http_error`` or
        ``inference_error``."""
        self.counts[outcome_of(status)] += 1

    def retried(self, lane: str, status: int) -> None:
        """An attempt answered ``status`` (0: none) goes back with a backoff."""
        self.counts["retried"] += 1
        self._child(self._retries, lane, str(status) if status else "no_answer").inc()

    def held_saturated(self, lane: str) -> None:
        """An attempt refused at once as saturated goes back for its ``Retry-After``."""
        self.counts["held_saturated"] += 1
        self._child(self._retries, lane, "rejected_saturated").inc()

    def shed(self, lane: str, reason: Shed) -> None:
        """A request ends without (another) dispatch for ``reason``."""
        self.counts[str(reason)] += 1
        self._child(self._shed, lane, str(reason)).inc()

    def duplicate(self, lane: str) -> None:
        """A duplicate of a finished id is acknowledged (tallied only)."""
        self.counts["duplicate"] += 1

    def handed_back(self, count: int) -> None:
        """``count`` messages go back to the queue (tallied only)."""
        self.counts["handed_back"] += count

    def result(self, lane: str, result: ResultMessage) -> None:
        """A terminal result is handed to the settler."""
        self._child(self._results, lane, result.error_code or "none").inc()
        if log.isEnabledFor(logging.DEBUG):
            log.debug("result", extra=log_fields("result", result, lane=lane, status=result.status_code,
                                                 error_code=result.error_code or None))

    def taken_over(self, work: Work, stage: str) -> None:
        """Held work dropped, its claim lost to another processor (counted and logged)."""
        self.counts["taken_over"] += 1
        self._child(self._taken_over, work.lane, stage).inc()
        log.warning("taken over by another processor; dropped",
                    extra=log_fields("taken_over", work.request, lane=work.lane, stage=stage))

    def health(self) -> tuple[bool, str]:
        """The watched processor's :meth:`~async_processor.processor.Processor.health`;
        ``(False, "starting")`` before one is watched."""
        if self._watched is None:
            return False, "starting"
        return self._watched.processor.health()

    def exposition(self) -> bytes:
        """The registry in Prometheus' text format."""
        return generate_latest(self.registry)


async def start_metrics_server(metrics: ProcessorMetrics, port: int, host: str = "0.0.0.0") -> web.AppRunner:
    """Serve ``GET /metrics`` (Prometheus text format) and ``GET /health`` on ``host:port`` in the
    running event loop; ``await runner.cleanup()`` stops it. ``/health`` answers 200
    ``{"status": "ok"}`` while the processor consumes, else 503 ``{"status": "unhealthy", "reason":
    …}`` (starting, stopping, its queue receive failing or stalled: :meth:`ProcessorMetrics.health`).
    Raises ``OSError`` when the port is taken."""

    async def prometheus_metrics(request: web.Request) -> web.Response:
        return web.Response(body=metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def health(request: web.Request) -> web.Response:
        healthy, reason = metrics.health()
        if healthy:
            return web.Response(body=orjson.dumps({"status": "ok"}), content_type="application/json")
        return web.Response(status=503, body=orjson.dumps({"status": "unhealthy", "reason": reason}),
                            content_type="application/json")

    app = web.Application()
    app.router.add_get("/metrics", prometheus_metrics)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
