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
from dataclasses import dataclass

from router.scheduling.types import Endpoint


@dataclass(frozen=True, slots=True)
class SaturationThresholds:
    """Thresholds of the detector.

    Attributes:
        queue_threshold: waiting requests that count as full (> 0; llm-d default 5).
        kv_threshold: KV cache use, 0..1, that counts as full (> 0; llm-d default 0.8).
        max_metrics_age_s: metrics older than this, in seconds, count as saturated (llm-d: 200 ms).
        in_flight_credit: add the scrape-lag credit to the waiting count (module docstring).

    Raises:
        ValueError: a threshold is not positive.
    """

    queue_threshold: float = 5
    kv_threshold: float = 0.8
    max_metrics_age_s: float = 0.2
    in_flight_credit: bool = False

    def __post_init__(self) -> None:
        if self.queue_threshold <= 0 or self.kv_threshold <= 0 or self.max_metrics_age_s <= 0:
            raise ValueError("saturation thresholds must be positive")


def endpoint_saturation(endpoint: Endpoint, now: float, thresholds: SaturationThresholds | None = None) -> float:
    """One endpoint's saturation (≥ 0; 1.0 at a threshold; 1.0 when its metrics are stale).

    Args:
        endpoint: the endpoint (its ``metrics_updated_at`` on the same clock as ``now``).
        now: current time, seconds (the router's monotonic clock).
        thresholds: the detector's thresholds; llm-d's defaults when None.
    """
    t = thresholds or SaturationThresholds()
    updated = endpoint.metrics_updated_at
    if updated is None or now - updated > t.max_metrics_age_s:
        return 1.0
    waiting = endpoint.num_requests_waiting
    if t.in_flight_credit:
        waiting += max(0, endpoint.in_flight_requests - (endpoint.num_requests_waiting + endpoint.num_requests_running))
    return max(waiting / t.queue_threshold, endpoint.kv_cache_usage_perc / t.kv_threshold)


def pool_saturation(endpoints: Sequence[Endpoint], now: float, thresholds: SaturationThresholds | None = None) -> float:
    """Mean of :func:`endpoint_saturation` over ``endpoints``; 1.0 for an empty pool."""
    if not endpoints:
        return 1.0
    t = thresholds or SaturationThresholds()
    return sum(endpoint_saturation(ep, now, t) for ep in endpoints) / len(endpoints)
