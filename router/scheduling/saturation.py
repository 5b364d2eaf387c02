"""Pool saturation: the number flow control gates dispatch on (llm-d's ``utilization-detector``).

Per endpoint ``max(waiting / queue_threshold, kv_usage / kv_threshold)`` — the most constrained of
its waiting queue and its KV cache — averaged over the pool (ROUTING.md). 1.0 means the pool is on
average at its thresholds; above 1.0, past them. An endpoint whose metrics are older than
``max_metrics_age_s`` (or never scraped) counts as 1.0, saturated: fail closed, as llm-d does. An
empty pool is saturated (1.0).

Defaults (queue 5 requests, KV 0.8, 200 ms) are llm-d's ``queueDepthThreshold``,
``kvCacheUtilThreshold`` and ``metricsStalenessThreshold``.

Optional scrape-lag credit (llm-d's, off by default): between scrapes the waiting count lags the
router's dispatches, so ``max(0, in_flight − (waiting + running))`` requests the scrape does not
show yet are added to the waiting count. Sound only with one router replica.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.scheduling.types import Endpoint

DEFAULT_QUEUE_THRESHOLD = 5
DEFAULT_KV_THRESHOLD = 0.8
DEFAULT_MAX_METRICS_AGE_S = 0.2


def endpoint_saturation(
    endpoint: Endpoint,
    now: float,
    queue_threshold: float = DEFAULT_QUEUE_THRESHOLD,
    kv_threshold: float = DEFAULT_KV_THRESHOLD,
    max_metrics_age_s: float = DEFAULT_MAX_METRICS_AGE_S,
    in_flight_credit: bool = False,
) -> float:
    """One endpoint's saturation (≥ 0; 1.0 at a threshold; 1.0 when its metrics are stale).

    Args:
        endpoint: the endpoint (its ``metrics_updated_at`` on the same clock as ``now``).
        now: current time, seconds (the router's monotonic clock).
        queue_threshold: waiting requests that count as full (> 0).
        kv_threshold: KV cache use, 0..1, that counts as full (> 0).
        max_metrics_age_s: metrics older than this, in seconds, count as saturated.
        in_flight_credit: add the scrape-lag credit to the waiting count (module docstring).
    """
    updated = endpoint.metrics_updated_at
    if updated is None or now - updated > max_metrics_age_s:
        return 1.0
    waiting = endpoint.num_requests_waiting
    if in_flight_credit:
        waiting += max(0, endpoint.in_flight_requests - (endpoint.num_requests_waiting + endpoint.num_requests_running))
    return max(waiting / queue_threshold, endpoint.kv_cache_usage_perc / kv_threshold)


def pool_saturation(
    endpoints: Sequence[Endpoint],
    now: float,
    queue_threshold: float = DEFAULT_QUEUE_THRESHOLD,
    kv_threshold: float = DEFAULT_KV_THRESHOLD,
    max_metrics_age_s: float = DEFAULT_MAX_METRICS_AGE_S,
    in_flight_credit: bool = False,
) -> float:
    """Mean of :func:`endpoint_saturation` over ``endpoints``; 1.0 for an empty pool.

    Raises:
        ValueError: a threshold is not positive.
    """
    if queue_threshold <= 0 or kv_threshold <= 0 or max_metrics_age_s <= 0:
        raise ValueError("saturation thresholds must be positive")
    if not endpoints:
        return 1.0
    total = sum(
        endpoint_saturation(ep, now, queue_threshold, kv_threshold, max_metrics_age_s, in_flight_credit)
        for ep in endpoints
    )
    return total / len(endpoints)
