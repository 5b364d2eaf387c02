"""Prometheus metrics of the Celery worker (docs/observability.md lists every series).

- ``backfill_worker_tasks_total{task, outcome}`` and ``backfill_worker_task_duration_seconds{task, outcome}``:
  one per task run, ``outcome`` ``success`` / ``retry`` / ``failure``, recorded by Celery's
  ``task_prerun`` / ``task_postrun`` signals (:func:`install_task_hooks`), not inside the tasks.
- ``backfill_worker_requests_fed_total``, ``backfill_worker_requests_collected_total{state}``,
  ``backfill_worker_requests_swept_total{state}``, ``backfill_worker_requests_finalized_total{file}``,
  ``backfill_worker_batches_validated_total{status}``, ``backfill_worker_batches_finalized_total{status}``,
  ``backfill_worker_webhook_deliveries_total{outcome}``: what the lifecycle functions did;
  ``backfill_worker_results_unplaced_total{reason}``: results the collector could not match to a
  request (``unreadable``, ``no_request``), each also logged as ``result_unplaced``.
- ``backfill_worker_tenant_tokens_total{tenant, kind}``: tokens of the results collected, by tenant
  id and ``kind`` (``prompt``, ``completion``), the one per-tenant series (:meth:`WorkerMetrics.tokens_collected`;
  bounded: :data:`TENANT_LABEL_LIMIT`).
- the runtime series of :func:`common.metrics.service_registry` (``process_*``, ``python_*``; with
  the prefork pool, the parent process's).

``backfill worker`` runs tasks in a prefork pool: the counters live in the pool's child processes.
So with the prefork pool the values go through prometheus-client's multiprocess mode (files under
``PROMETHEUS_MULTIPROC_DIR``, set by the command before anything imports prometheus-client) and the
parent process serves them all (:func:`serve_metrics`, :func:`multiprocess_registry`); with the
``threads`` or ``solo`` pool the context's own registry is served.

``/health`` follows the broker (:func:`broker_health`): 503 while Redis does not answer a ``PING``
within ``health_broker_timeout_seconds``, as the processor's turns 503 while its receives fail.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import orjson
from celery import Celery
from celery.signals import task_postrun, task_prerun
from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app, multiprocess

from batch_gateway.store.states import BatchStatus, RequestState
from common.metrics import service_registry

TASK_BUCKETS_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
"""Prometheus' default buckets (5 ms to 10 s) plus 30, 60 and 300 s: validating a 200 MB input file
or finalizing 50,000 requests takes tens of seconds."""

TASK_OUTCOMES = {"SUCCESS": "success", "RETRY": "retry", "FAILURE": "failure"}
"""Celery's end state of a task run -> the ``outcome`` label."""

TENANT_LABEL_LIMIT = 100
"""Distinct tenant ids one process labels ``backfill_worker_tenant_tokens_total`` with; tokens of
any later tenant count under :data:`OTHER_TENANT`. So one worker process adds at most
2 × (100 + 1) series; with the prefork pool each child keeps its own set (the parent adds their
values up per label set), so a worker pod exports at most 2 × (min(tenants, 100 × children) + 1)."""
OTHER_TENANT = "other"
"""The ``tenant`` label of tokens past :data:`TENANT_LABEL_LIMIT` (and of results without a tenant);
tenant ids start with ``tenant_``, so it names no tenant."""
TOKEN_KINDS = ("prompt", "completion")

KNOWN_LABELS = {
    "collected": (RequestState.SUCCEEDED, RequestState.FAILED, RequestState.EXPIRED, RequestState.CANCELLED,
                  RequestState.PENDING, "stale"),
    "swept": (RequestState.QUEUED, RequestState.PENDING, RequestState.FAILED, RequestState.CANCELLED),
    "finalized_requests": ("output", "errors"),
    "validated": (BatchStatus.IN_PROGRESS, BatchStatus.FAILED),
    "finalized": (BatchStatus.COMPLETED, BatchStatus.EXPIRED, BatchStatus.CANCELLED),
    "webhooks": ("delivered", "failed"),
    "unplaced": ("unreadable", "no_request"),
}
"""Label values each counter starts with at 0 (so every series exists before its first event)."""


class WorkerMetrics:
    """The worker's series on ``registry`` (a new one by default). Every method only counts."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = service_registry(registry)
        self.tasks = Counter("backfill_worker_tasks", "Task runs by task name and outcome.",
                             ["task", "outcome"], registry=r)
        self.task_duration = Histogram("backfill_worker_task_duration_seconds", "Wall time of one task run.",
                                       ["task", "outcome"], buckets=TASK_BUCKETS_SECONDS, registry=r)
        self.fed = Counter("backfill_worker_requests_fed", "Request messages published to the batch lane.",
                           registry=r)
        self.collected = Counter("backfill_worker_requests_collected", "Results read from the result stream, "
                                 "by the state they moved their request to (stale: refused as late or duplicate).",
                                 ["state"], registry=r)
        self.swept = Counter("backfill_worker_requests_swept", "Requests whose lease lapsed, by what the "
                             "sweeper made of them (queued: message still on its way, lease renewed).",
                             ["state"], registry=r)
        self.finalized_requests = Counter("backfill_worker_requests_finalized", "Lines written to batch output "
                                          "and error files.", ["file"], registry=r)
        self.validated = Counter("backfill_worker_batches_validated", "Validations that ended, by the batch's "
                                 "status after them.", ["status"], registry=r)
        self.finalized = Counter("backfill_worker_batches_finalized", "Batches that reached a terminal status "
                                 "through finalize.", ["status"], registry=r)
        self.webhooks = Counter("backfill_worker_webhook_deliveries", "Webhook delivery attempts by outcome "
                                "(delivered: 2xx; failed: another status or no answer).", ["outcome"], registry=r)
        self.unplaced = Counter("backfill_worker_results_unplaced", "Results read from the result stream that "
                                "name no request (unreadable, or without batch_id, custom_id or lease token), by "
                                "reason; each is logged as result_unplaced.", ["reason"], registry=r)
        self.tenant_tokens = Counter("backfill_worker_tenant_tokens", "Tokens of the results collected, by tenant "
                                     "id (at most TENANT_LABEL_LIMIT per process, then 'other') and kind.",
                                     ["tenant", "kind"], registry=r)
        self._tenant_children: dict[str, tuple[Counter, ...]] = {}
        self._started: dict[str, float] = {}
        for attribute, values in KNOWN_LABELS.items():
            for value in values:
                getattr(self, attribute).labels(value)

    def tokens_collected(self, tenant: str | None, prompt_tokens: int, completion_tokens: int) -> None:
        """Count the prompt and completion tokens of one collected result of ``tenant`` (its id)."""
        children = self._tenant_children.get(tenant or OTHER_TENANT)
        if children is None:  # a tenant not labelled yet: its own label while under the limit
            labelled = len(self._tenant_children) - (OTHER_TENANT in self._tenant_children)
            label = tenant if tenant and labelled < TENANT_LABEL_LIMIT else OTHER_TENANT
            found = self._tenant_children.get(label)
            children = found if found is not None else tuple(
                self.tenant_tokens.labels(label, kind) for kind in TOKEN_KINDS)
            self._tenant_children[label] = children
        if prompt_tokens:
            children[0].inc(prompt_tokens)
        if completion_tokens:
            children[1].inc(completion_tokens)

    def known_tasks(self, names: list[str]) -> None:
        """Start ``tasks_total`` of every task in ``names`` and every outcome at 0."""
        for name in names:
            for outcome in TASK_OUTCOMES.values():
                self.tasks.labels(name, outcome)

    def task_started(self, task_id: str) -> None:
        """Remember when task run ``task_id`` started (monotonic clock)."""
        self._started[task_id] = time.monotonic()

    def task_ended(self, task_id: str, task: str, state: str | None) -> None:
        """Count the run of ``task`` that ended in Celery state ``state`` and observe its duration."""
        outcome = TASK_OUTCOMES.get(state or "", (state or "unknown").lower())
        self.tasks.labels(task, outcome).inc()
        started = self._started.pop(task_id, None)
        if started is not None:
            self.task_duration.labels(task, outcome).observe(time.monotonic() - started)


def install_task_hooks(app: Celery, metrics: WorkerMetrics) -> None:
    """Count every task of ``app`` through Celery's ``task_prerun`` / ``task_postrun`` signals
    (they run where the task runs: the pool's child with prefork)."""

    def started(sender=None, task_id=None, **_) -> None:
        if getattr(sender, "app", None) is app:
            metrics.task_started(task_id)

    def ended(sender=None, task_id=None, state=None, **_) -> None:
        if getattr(sender, "app", None) is app:
            metrics.task_ended(task_id, sender.name, state)

    task_prerun.connect(started, weak=False)
    task_postrun.connect(ended, weak=False)
    metrics.known_tasks(sorted(name for name in app.tasks if name.startswith("backfill.")))


def multiprocess_registry(path: str) -> CollectorRegistry:
    """A registry that reads every process's values from ``path`` (prometheus-client multiprocess
    mode; ``PROMETHEUS_MULTIPROC_DIR`` must have been set to ``path`` before prometheus-client was
    imported)."""
    registry = service_registry()
    multiprocess.MultiProcessCollector(registry, path)
    return registry


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # scrapes every 15 s would flood the log
        return None


Health = Callable[[], tuple[bool, str]]
"""``() -> (healthy, why not)``, as :meth:`async_processor.processor.Processor.health`."""


def always_healthy() -> tuple[bool, str]:
    """A :data:`Health` that is always healthy (a metrics server with nothing to watch)."""
    return True, ""


def broker_health(redis_url: str, timeout_s: float) -> Health:
    """A :data:`Health` that ``PING``s the Redis at ``redis_url`` (the Celery broker) on each call:
    unhealthy, with the error, when it does not answer within ``timeout_s`` seconds (stopped,
    unreachable, or frozen: a SIGSTOPped Redis accepts connections but never answers)."""
    import redis

    client = redis.Redis.from_url(redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)

    def health() -> tuple[bool, str]:
        try:
            client.ping()
        except (redis.RedisError, OSError) as exc:
            return False, f"broker not answering: {type(exc).__name__}: {exc}"
        return True, ""

    return health


def metrics_app(registry: CollectorRegistry, health: Health = always_healthy):
    """WSGI app: ``/metrics`` in Prometheus' text format; ``/health``: 200 ``{"status": "ok"}``
    while ``health()`` says healthy, else 503 ``{"status": "unhealthy", "reason": …}`` (the
    processor's shape); anything else 404."""
    exposition = make_wsgi_app(registry)

    def app(environ, start_response) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/health":
            healthy, reason = health()
            if not healthy:
                start_response("503 Service Unavailable", [("Content-Type", "application/json")])
                return [orjson.dumps({"status": "unhealthy", "reason": reason})]
            start_response("200 OK", [("Content-Type", "application/json")])
            return [b'{"status": "ok"}']
        if path != "/metrics":
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found\n"]
        return exposition(environ, start_response)

    return app


def serve_metrics(registry: CollectorRegistry, port: int, host: str = "0.0.0.0",
                  health: Health = always_healthy) -> WSGIServer:
    """Serve :func:`metrics_app` (``/health`` from ``health``) on ``host:port`` from a daemon
    thread; returns the server (its ``server_address`` holds the bound port; ``shutdown()`` stops
    it). Raises ``OSError`` when the port is taken."""
    server = make_server(host, port, metrics_app(registry, health), server_class=_Server,
                         handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics-server", daemon=True).start()
    return server
