"""The router's Prometheus series (ROUTING.md "Metrics"), in a registry owned by the app.

Tenant (fairness) ids are never labels. Endpoint labels are engine base URLs (a bounded set).

=====================================================  =========  ===============================
series                                                 type       labels
=====================================================  =========  ===============================
``backfill_router_requests_total``                     counter    ``objective``, ``code`` (HTTP
                                                                  status the client got)
``backfill_router_decision_duration_seconds``          histogram  ``plugin`` (``total`` for the
                                                                  whole decision)
``backfill_router_dispatched_total``                   counter    ``band``
``backfill_router_refused_total``                      counter    ``band``, ``reason``
                                                                  (backpressure: refused at once
                                                                  with ``Retry-After``, sent again
                                                                  by the caller:
                                                                  ``rejected_saturated``,
                                                                  ``rejected_capacity``,
                                                                  ``rejected_quota``)
``backfill_router_shed_total``                         counter    ``band``, ``reason`` (work dropped
                                                                  after it waited or ran:
                                                                  ``rejected_ttl_expired``,
                                                                  ``evicted``,
                                                                  ``rejected_context_cancelled``)
``backfill_router_make_room_evictions_total``         counter    ``endpoint`` (sheddable requests
                                                                  evicted for non-sheddable ones)
``backfill_router_evictions_total``                    counter    ``endpoint``, ``reason`` (sheddable
                                                                  requests evicted for non-sheddable
                                                                  ones: ``no_free_slot``,
                                                                  ``batch_prefill``, ``engine_queue``)
``backfill_router_evicted_tokens_total``               counter    ``endpoint`` (estimated tokens
                                                                  wasted by those evictions)
``backfill_router_endpoint_slot_reserve``              gauge      ``endpoint`` (slots kept for
                                                                  non-sheddable work)
``backfill_router_endpoint_reserve_in_use``            gauge      ``endpoint``
``backfill_router_endpoint_batch_prefill_tokens``      gauge      ``endpoint`` (sheddable prompt
                                                                  tokens in prefill)
``backfill_router_flow_queue_requests``                gauge      ``band``
``backfill_router_flow_queue_bytes``                   gauge      ``band``
``backfill_router_flow_wait_seconds``                  histogram  ``band``
``backfill_router_pool_saturation``                    gauge      — (mean over the endpoints)
``backfill_router_gate_saturation``                    gauge      — (the least saturated endpoint:
                                                                  < 1.0 lets sheddable work go)
``backfill_router_endpoint_healthy``                   gauge      ``endpoint``
``backfill_router_endpoint_saturation``                gauge      ``endpoint`` (healthy ones; with
                                                                  the scrape-lag credit)
``backfill_router_endpoint_gate_open``                 gauge      ``endpoint`` (1: takes sheddable
                                                                  work now)
``backfill_router_endpoint_in_flight_requests``        gauge      ``endpoint``
``backfill_router_endpoint_in_flight_tokens``          gauge      ``endpoint`` (uncached prompt
                                                                  tokens)
``backfill_router_prefix_index_blocks``                gauge      ``tier``
``backfill_router_kv_events_total``                    counter    ``kind``: ``messages``, ``gaps``
                                                                  (batches missed), ``replays``,
                                                                  ``replayed_batches``,
                                                                  ``replay_failures``, ``drops``
                                                                  (an engine's entries dropped),
                                                                  ``restarts`` (KV-event index only)
``backfill_router_prefix_lookups_total``               counter    —
``backfill_router_prefix_hits_total``                  counter    — (a lookup with ≥ 1 block
                                                                  matched somewhere)
``backfill_router_time_to_first_byte_seconds``         histogram  ``band``
``backfill_router_upstream_errors_total``              counter    ``kind`` (connect, stream, timeout)
``backfill_router_pd_decisions_total``                 counter    ``decision`` (``disaggregated``,
                                                                  ``aggregated``), ``reason``
                                                                  (``disaggregated``,
                                                                  ``below_threshold``,
                                                                  ``no_prefill_endpoint``,
                                                                  ``not_generation``,
                                                                  ``multiple_outputs``); with a P/D
                                                                  profile handler only
``backfill_router_pd_prefill_failures_total``          counter    ``endpoint``, ``reason`` (prefill
                                                                  legs that failed: ``connect``,
                                                                  ``timeout``, ``status``,
                                                                  ``client_error``,
                                                                  ``no_kv_transfer_params``,
                                                                  ``stream``, ``endpoint_down``)
``backfill_router_pd_prefill_retries_total``           counter    — (prefill legs tried again on
                                                                  another prefill engine)
``backfill_router_pd_fallbacks_total``                 counter    ``reason`` (disaggregated requests
                                                                  run aggregated on their decode
                                                                  engine: no prefill engine answered)
``backfill_router_endpoints``                          gauge      ``role`` (``prefill``, ``decode``,
                                                                  ``both``), ``state`` (``healthy``,
                                                                  ``known``)
``backfill_router_endpoint_role``                      gauge      ``endpoint``, ``role`` (1)
``backfill_router_pool_gate_saturation``               gauge      ``pool`` (``prefill``,
                                                                  ``decode``: each pool's least
                                                                  saturated endpoint)
=====================================================  =========  ===============================
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from common.contracts.router_state import RouterState, is_backpressure, reason_label
from common.metrics import service_registry

#: Decision-time buckets, seconds: 10 µs … 50 ms (llm-d's scheduler runs at 0.1–0.2 ms p50).
DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2)
#: Waiting/first-byte buckets, seconds: 1 ms … 10 min.
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


#: The ``kind`` label values of ``backfill_router_kv_events_total`` (keys of the subscriber's stats).
KV_EVENT_KINDS = ("messages", "gaps", "replays", "replayed_batches", "replay_failures", "drops", "restarts")


class RouterMetrics:
    """The :class:`router.observer.RouterObserver` of the request path as Prometheus series,
    plus a collector of live gauges read from the admin state.

    Args:
        state: a callable returning the admin state (:class:`common.contracts.router_state.RouterState`);
            read at every scrape for the gauges.
    """

    def __init__(self, state: Callable[[], RouterState]) -> None:
        self.registry = service_registry()
        reg = self.registry
        self.requests = Counter("backfill_router_requests", "Requests answered, by objective and HTTP status.",
                                ["objective", "code"], registry=reg)
        self.decision = Histogram("backfill_router_decision_duration_seconds",
                                  "Scheduling decision time (plugin=total: the whole decision).",
                                  ["plugin"], buckets=DECISION_BUCKETS, registry=reg)
        self.decision_total = self.decision.labels("total")
        self.dispatched = Counter("backfill_router_dispatched", "Requests released by flow control, by band.",
                                  ["band"], registry=reg)
        self.refused_total = Counter("backfill_router_refused",
                                     "Requests refused at once by flow control with Retry-After (backpressure: "
                                     "the caller sends them again), by band and reason.",
                                     ["band", "reason"], registry=reg)
        self.shed_total = Counter("backfill_router_shed",
                                  "Requests dropped by flow control after they waited or ran (work lost), by band "
                                  "and reason.", ["band", "reason"], registry=reg)
        self.make_room_evictions = Counter(
            "backfill_router_make_room_evictions",
            "Sheddable requests evicted to make room for non-sheddable ones on an endpoint with no free slot.",
            ["endpoint"], registry=reg)
        self.evictions = Counter("backfill_router_evictions",
                                 "Sheddable requests evicted for non-sheddable ones, by endpoint and reason.",
                                 ["endpoint", "reason"], registry=reg)
        self.evicted_tokens = Counter("backfill_router_evicted_tokens",
                                      "Estimated tokens wasted by evictions (uncached prompt tokens at dispatch plus "
                                      "stream chunks relayed; router/director.py Director.make_room).",
                                      ["endpoint"], registry=reg)
        self._evictions: dict[str, dict[str, int]] = {}
        self._evicted_tokens: dict[str, int] = {}
        self.flow_wait = Histogram("backfill_router_flow_wait_seconds", "Time waiting in flow control.",
                                   ["band"], buckets=WAIT_BUCKETS, registry=reg)
        self.first_byte_seconds = Histogram("backfill_router_time_to_first_byte_seconds",
                                    "From request received to the first response byte from the engine.",
                                    ["band"], buckets=WAIT_BUCKETS, registry=reg)
        self.prefix_lookups = Counter("backfill_router_prefix_lookups", "Prefix lookups (one per decision).",
                                      registry=reg)
        self.prefix_hits = Counter("backfill_router_prefix_hits",
                                   "Prefix lookups that matched at least one block on some endpoint.", registry=reg)
        self.upstream_errors = Counter("backfill_router_upstream_errors", "Failures talking to an engine.",
                                       ["kind"], registry=reg)
        self.untrusted_headers = Counter("backfill_router_untrusted_headers",
                                         "Identity headers (fairness id, objective) ignored because the caller "
                                         "is not trusted (router/trust.py).", ["header"], registry=reg)
        self.pd_decisions = Counter("backfill_router_pd_decisions",
                                    "Prefill/decode decisions of the P/D profile handler, by decision and reason.",
                                    ["decision", "reason"], registry=reg)
        self.pd_prefill_failures = Counter("backfill_router_pd_prefill_failures",
                                           "Prefill legs of disaggregated requests that failed, by endpoint and reason.",
                                           ["endpoint", "reason"], registry=reg)
        self.pd_prefill_retries = Counter("backfill_router_pd_prefill_retries",
                                          "Failed prefill legs tried again on another prefill engine.", registry=reg)
        self.pd_fallbacks = Counter("backfill_router_pd_fallbacks",
                                    "Disaggregated requests run aggregated on their decode engine because no "
                                    "prefill engine answered, by the last failure's reason.", ["reason"], registry=reg)
        self._pd: dict[str, Any] = {"decisions": {}, "prefill_failures": {}, "prefill_retries": 0, "fallbacks": {}}
        reg.register(_LiveCollector(state))
        self._per_plugin: dict[str, Histogram] = {}

    # ---- RouterObserver ------------------------------------------------------------------------
    def answered(self, objective: str, status: int) -> None:
        """One request answered with HTTP ``status``."""
        self.requests.labels(objective, str(status)).inc()

    def shed(self, objective: str, reason: str) -> None:
        """One request refused, dropped or evicted by flow control (``reason``: a
        :class:`~router.flow_control.errors.DropReason` value, labelled by :func:`reason_label`):
        counted in ``backfill_router_refused_total`` when it is backpressure
        (:func:`~common.contracts.router_state.is_backpressure`), else in ``backfill_router_shed_total``."""
        counter = self.refused_total if is_backpressure(reason) else self.shed_total
        counter.labels(objective, reason_label(reason)).inc()

    def made_room(self, endpoint: str) -> None:
        """One sheddable request evicted on ``endpoint`` for a non-sheddable one."""
        self.make_room_evictions.labels(endpoint).inc()

    def evicted(self, endpoint: str, reason: str, wasted_tokens: int) -> None:
        """One sheddable request evicted on ``endpoint`` for a non-sheddable one."""
        self.evictions.labels(endpoint, reason).inc()
        self.evicted_tokens.labels(endpoint).inc(wasted_tokens)
        by_reason = self._evictions.setdefault(endpoint, {})
        by_reason[reason] = by_reason.get(reason, 0) + 1
        self._evicted_tokens[endpoint] = self._evicted_tokens.get(endpoint, 0) + wasted_tokens

    def evictions_of(self, endpoint: str) -> tuple[dict[str, int], int]:
        """``(evictions by reason, estimated wasted tokens)`` on ``endpoint`` since start (for /admin/state)."""
        return dict(self._evictions.get(endpoint, {})), self._evicted_tokens.get(endpoint, 0)

    def admitted(self, objective: str, waited_s: float) -> None:
        """One request released by flow control after ``waited_s`` seconds."""
        self.dispatched.labels(objective).inc()
        self.flow_wait.labels(objective).observe(waited_s)

    def scheduled(self, seconds: float, prefix_hit: bool) -> None:
        """One scheduling decision (and its prefix lookup)."""
        self.decision_total.observe(seconds)
        self.prefix_lookups.inc()
        if prefix_hit:
            self.prefix_hits.inc()

    def plugin_timing(self, plugin: str, seconds: float) -> None:
        """Record one plugin's share of a decision (``plugin`` = its instance name)."""
        child = self._per_plugin.get(plugin)
        if child is None:
            child = self._per_plugin[plugin] = self.decision.labels(plugin)
        child.observe(seconds)

    def first_byte(self, objective: str, seconds: float) -> None:
        """The engine answered ``seconds`` after the request was received."""
        self.first_byte_seconds.labels(objective).observe(seconds)

    def upstream_error(self, kind: str) -> None:
        """One failure talking to an engine."""
        self.upstream_errors.labels(kind).inc()

    def untrusted_header(self, header: str) -> None:
        """One identity header ignored from an untrusted caller."""
        self.untrusted_headers.labels(header).inc()

    def pd_decision(self, reason: str) -> None:
        """One decision of the P/D profile handler."""
        self.pd_decisions.labels("disaggregated" if reason == "disaggregated" else "aggregated", reason).inc()
        _bump(self._pd["decisions"], reason)

    def prefill_failed(self, endpoint: str, reason: str) -> None:
        """One failed prefill leg."""
        self.pd_prefill_failures.labels(endpoint, reason).inc()
        _bump(self._pd["prefill_failures"], reason)

    def prefill_retried(self) -> None:
        """One prefill leg tried again elsewhere."""
        self.pd_prefill_retries.inc()
        self._pd["prefill_retries"] += 1

    def pd_fallback(self, reason: str) -> None:
        """One disaggregated request run aggregated after its prefill legs failed."""
        self.pd_fallbacks.labels(reason).inc()
        _bump(self._pd["fallbacks"], reason)

    def disaggregation_stats(self) -> dict[str, Any]:
        """The P/D counters since start, for ``/admin/state``'s ``disaggregation``:
        ``{"decisions": {reason: n}, "prefill_failures": {reason: n}, "prefill_retries": n,
        "fallbacks": {reason: n}}``."""
        return {k: dict(v) if isinstance(v, dict) else v for k, v in self._pd.items()}

    # ---- exposition ----------------------------------------------------------------------------

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)


class _LiveCollector(Collector):
    def __init__(self, state: Callable[[], RouterState]) -> None:
        self._state = state

    def collect(self) -> Iterator[Metric]:
        state = self._state()
        yield _gauge("backfill_router_pool_saturation", "Pool saturation (1.0 = at the thresholds).", {},
                     [((), state.pool_saturation)])
        yield _gauge("backfill_router_gate_saturation",
                     "The least saturated healthy endpoint's saturation (< 1.0: sheddable work may dispatch).", {},
                     [((), state.gate_saturation)])
        eps = state.endpoints
        if state.pool_gate_saturation:
            yield _gauge("backfill_router_pool_gate_saturation",
                         "Each pool's least saturated healthy endpoint (prefill: roles prefill and both; "
                         "decode: decode and both).", ("pool",),
                         [((pool,), value) for pool, value in sorted(state.pool_gate_saturation.items())])
        roles = ("prefill", "decode", "both")
        yield _gauge("backfill_router_endpoints", "Endpoints by role: known to the pool, and healthy.",
                     ("role", "state"),
                     [((role, "known"), float(sum(e.role == role for e in eps))) for role in roles]
                     + [((role, "healthy"), float(sum(e.role == role and e.healthy for e in eps))) for role in roles])
        yield _gauge("backfill_router_endpoint_role", "1 for the endpoint's role (prefill, decode, both).",
                     ("endpoint", "role"), [((e.name, e.role), 1.0) for e in eps])
        yield _gauge("backfill_router_endpoint_healthy", "1 when the endpoint is a candidate.", ("endpoint",),
                     [((e.name,), 1.0 if e.healthy else 0.0) for e in eps])
        yield _gauge("backfill_router_endpoint_saturation", "The endpoint's saturation (1.0 = at a threshold).",
                     ("endpoint",), [((e.name,), e.saturation) for e in eps if e.saturation is not None])
        yield _gauge("backfill_router_endpoint_gate_open", "1 when the endpoint takes sheddable work now.",
                     ("endpoint",), [((e.name,), 1.0 if e.gate_open else 0.0) for e in eps])
        yield _gauge("backfill_router_endpoint_in_flight_requests", "Requests forwarded and not finished.",
                     ("endpoint",), [((e.name,), e.in_flight_requests) for e in eps])
        yield _gauge("backfill_router_endpoint_in_flight_tokens", "Uncached prompt tokens of in-flight requests.",
                     ("endpoint",), [((e.name,), e.in_flight_uncached_tokens) for e in eps])
        yield _gauge("backfill_router_endpoint_slot_reserve", "Sequence slots kept for non-sheddable work.",
                     ("endpoint",), [((e.name,), e.slot_reserve) for e in eps if e.slot_reserve is not None])
        yield _gauge("backfill_router_endpoint_reserve_in_use", "Reserved slots held by non-sheddable requests.",
                     ("endpoint",), [((e.name,), e.reserve_in_use) for e in eps])
        yield _gauge("backfill_router_endpoint_batch_prefill_tokens",
                     "Sheddable prompt tokens the router counts as in prefill there.",
                     ("endpoint",), [((e.name,), e.batch_prefill_tokens) for e in eps])
        bands = state.bands
        yield _gauge("backfill_router_flow_queue_requests", "Requests waiting in flow control.", ("band",),
                     [((b.objective,), b.queued_requests) for b in bands])
        yield _gauge("backfill_router_flow_queue_bytes", "Body bytes waiting in flow control.", ("band",),
                     [((b.objective,), b.queued_bytes) for b in bands])
        tiers = state.index.get("tiers", {})
        yield _gauge("backfill_router_prefix_index_blocks", "Blocks in the prefix index, by tier.", ("tier",),
                     [((tier,), n) for tier, n in tiers.items()])
        events = state.index.get("events")
        if events:
            family = CounterMetricFamily("backfill_router_kv_events", "KV-event stream: messages, batches missed "
                                         "(gaps), replays, replayed batches, replay failures, drops, restarts.",
                                         labels=["kind"])
            for kind in KV_EVENT_KINDS:
                family.add_metric([kind], events.get(kind, 0))
            yield family


def _bump(counts: dict[str, int], key: str) -> None:
    counts[key] = counts.get(key, 0) + 1


def _gauge(name: str, doc: str, labels: tuple[str, ...] | dict,
           values: Sequence[tuple[tuple[str, ...], float | int]]) -> Metric:
    family = GaugeMetricFamily(name, doc, labels=list(labels))
    for label_values, value in values:
        family.add_metric(list(label_values), value)
    return family
