"""Prometheus metrics of the processor, served at ``/metrics`` (and ``/health``) on
``BACKFILL_PROCESSOR_METRICS_PORT`` / ``BACKFILL_METRICS_PORT`` by :func:`start_metrics_server`.

Series (docs/observability.md has the full list; tenant ids are never labels):

- ``backfill_processor_held_requests{lane}`` (gauge): admitted requests held in the lane buffer,
  waiting for a gate or a retry backoff (the lane depth the processor sees; the stream backlog
  before it is Redis' ``XLEN``, outside the processor).
- ``backfill_processor_in_flight_requests{lane}`` (gauge): HTTP attempts running now.
- ``backfill_processor_dispatched_total{lane}``: HTTP attempts started (retries included).
- ``backfill_processor_router_request_duration_seconds{lane, status}``: one attempt, from the POST
  to the whole answer read; ``status`` the class (``2xx``, ``4xx``, ``5xx``) or ``none`` (no answer).
- ``backfill_processor_results_total{lane, error_code}``: terminal results published;
  ``error_code`` is the result's code or ``none`` (an HTTP answer of any status).
- ``backfill_processor_retries_total{lane, reason}``: attempts put back with a backoff; ``reason``
  the retryable HTTP status (``429``, ``503``, …) or ``no_answer``.
- ``backfill_processor_shed_total{lane, reason}``: requests ended without (another) dispatch:
  ``deadline_exceeded``, ``cancelled``, ``dead_lettered``, ``invalid``.
- ``backfill_processor_gate_decisions_total{gate, decision}``: ``deny`` once per held request each
  time a gate (``concurrency``, ``tenant_quota``, ``saturation``) starts holding it back,
  ``admit`` once per request every gate let through (see :class:`~async_processor.gates.AllGates`).

Hot-path updates go to label children bound once per label set; the gauges and gate counts are
read from the processor at scrape time. Every counter's known label values (lanes read, error
codes, shed reasons, retryable statuses) start at 0 when a processor is watched, so each series
exists before its first event.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from common.contracts.queue import ErrorCode, ResultMessage
from async_processor.retry import RETRYABLE_STATUSES

if TYPE_CHECKING:
    from async_processor.processor import Processor

ROUTER_BUCKETS_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
"""10 ms (a quick 429) to 600 s (``request_timeout_s``' default): a long generation takes minutes."""

SHED_REASONS = ("deadline_exceeded", "cancelled", "dead_lettered", "invalid")
RETRY_REASONS = (*(str(s) for s in sorted(RETRYABLE_STATUSES)), "no_answer")
RESULT_CODES = ("none", *(str(code) for code in ErrorCode))


def status_class(status: int) -> str:
    """``2xx`` … ``5xx`` for an HTTP status, ``none`` for 0 (no answer)."""
    return f"{status // 100}xx" if status else "none"


class _ProcessorCollector(Collector):
    """Reads the lane buffer, in-flight attempts and gate counts of one processor at scrape time."""

    def __init__(self, processor: Processor):
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
        if hasattr(gate, "denied"):
            decisions = CounterMetricFamily("backfill_processor_gate_decisions", "Gate decisions: deny when a "
                                            "gate starts holding a request back, admit when every gate let it "
                                            "through.", labels=["gate", "decision"])
            for kind in gate.kinds:
                decisions.add_metric([kind, "admit"], gate.admitted)
                decisions.add_metric([kind, "deny"], gate.denied[kind])
            yield decisions

    def describe(self) -> list:
        return []


class ProcessorMetrics:
    """The processor's series on ``registry`` (a new one by default); :meth:`watch` adds the
    scrape-time series of one :class:`~async_processor.processor.Processor`."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        self._dispatched = Counter("backfill_processor_dispatched", "HTTP attempts started (retries included).",
                                   ["lane"], registry=r)
        self._latency = Histogram("backfill_processor_router_request_duration_seconds", "One HTTP attempt to "
                                  "the router, until its whole answer is read.", ["lane", "status"],
                                  buckets=ROUTER_BUCKETS_SECONDS, registry=r)
        self._results = Counter("backfill_processor_results", "Terminal results published, by error code "
                                "(none: an HTTP answer).", ["lane", "error_code"], registry=r)
        self._retries = Counter("backfill_processor_retries", "Attempts put back with a backoff, by the "
                                "retryable answer.", ["lane", "reason"], registry=r)
        self._shed = Counter("backfill_processor_shed", "Requests ended without (another) dispatch.",
                             ["lane", "reason"], registry=r)
        self._children: dict[tuple, object] = {}
        self._watched: _ProcessorCollector | None = None

    def _child(self, metric, *labels: str):
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def watch(self, processor: Processor) -> None:
        """Export ``processor``'s held and in-flight requests and gate decisions (replacing a
        processor watched before)."""
        if self._watched is not None:
            self.registry.unregister(self._watched)
        self._watched = _ProcessorCollector(processor)
        self.registry.register(self._watched)
        for lane in processor.buffer.order:
            self._child(self._dispatched, lane)
            for values, metric in ((SHED_REASONS, self._shed), (RETRY_REASONS, self._retries),
                                   (RESULT_CODES, self._results)):
                for value in values:
                    self._child(metric, lane, value)

    def dispatched(self, lane: str) -> None:
        """An HTTP attempt started."""
        self._child(self._dispatched, lane).inc()

    def answered(self, lane: str, status: int, seconds: float) -> None:
        """An attempt ended after ``seconds`` with HTTP ``status`` (0: no answer)."""
        self._child(self._latency, lane, status_class(status)).observe(seconds)

    def retried(self, lane: str, status: int) -> None:
        """An attempt answered ``status`` (0: none) goes back with a backoff."""
        self._child(self._retries, lane, str(status) if status else "no_answer").inc()

    def shed(self, lane: str, reason: str, count: int = 1) -> None:
        """``count`` requests end without (another) dispatch for ``reason``."""
        self._child(self._shed, lane, reason).inc(count)

    def result(self, lane: str, result: ResultMessage) -> None:
        """A terminal result is handed to the settler."""
        self._child(self._results, lane, result.error_code or "none").inc()

    def exposition(self) -> bytes:
        """The registry in Prometheus' text format."""
        return generate_latest(self.registry)


async def start_metrics_server(metrics: ProcessorMetrics, port: int, host: str = "0.0.0.0") -> web.AppRunner:
    """Serve ``GET /metrics`` (Prometheus text format) and ``GET /health`` (``{"status": "ok"}``)
    on ``host:port`` in the running event loop; ``await runner.cleanup()`` stops it. Raises
    ``OSError`` when the port is taken."""

    async def prometheus_metrics(request: web.Request) -> web.Response:
        return web.Response(body=metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def health(request: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps({"status": "ok"}), content_type="application/json")

    app = web.Application()
    app.router.add_get("/metrics", prometheus_metrics)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
