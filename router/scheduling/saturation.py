"""Saturation: the numbers flow control gates dispatch on (llm-d's ``utilization-detector``).

Per endpoint ``max(waiting / queue_threshold, kv_usage / kv_threshold)`` — the most constrained of
its waiting queue and its KV cache (ROUTING.md). 1.0 means the endpoint is at a threshold; above
1.0, past it. An endpoint whose metrics are older than ``max_metrics_age_s`` (or never scraped)
counts as 1.0, saturated: fail closed, as llm-d does.

Defaults (queue 5 requests, KV 0.8, 200 ms) are llm-d's ``queueDepthThreshold``,
``kvCacheUtilThreshold`` and ``metricsStalenessThreshold``.

**Scrape-lag credit** (``in_flight_credit``, on in the router; llm-d has the same idea, off by
default there). Between scrapes the engine's counts lag the router's dispatches: ``unseen =
max(0, in_flight − (waiting + running))`` requests the router forwarded do not show yet. Not all of
them will queue: an endpoint seen running ``peak_running`` requests at once (the router's lower
bound of its ``max_num_seqs``) has about ``free = max(0, peak_running − running)`` free slots.
Only the unseen requests beyond those free slots count as waiting::

    effective_waiting = waiting + max(0, unseen − free)

Without the free-slot allowance a fast engine is capped at ``queue_threshold`` new requests per
scrape interval; without the credit a burst overshoots by everything released within one scrape
interval. Sound only with one router replica (the in-flight counts are this router's).

**Per-engine gate.** :func:`fleet_saturation` gives every endpoint's saturation with the credit,
and places the requests flow control released but the scheduler has not yet forwarded
(``pending``) one at a time on the least saturated endpoint, a free slot first — where the
``spare-capacity-filter`` sends sheddable work. :func:`gate_saturation` is the least saturated
endpoint's value: sheddable work may dispatch while some engine has room (< 1.0), not while the
pool's mean does (one full engine at 2.0 and one idle at 0.0 average 1.0 while half the fleet is
idle). :func:`pool_saturation`, the mean, stays for the metric and the dashboard.

The router computes these in one place (``RouterRuntime.endpoint_saturations`` in
``router/app.py``) for flow control and ``/admin/state``, so the dashboard shows exactly what the
gate does; the ``spare-capacity-filter`` reads :func:`endpoint_saturation` with the same thresholds.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from router.scheduling.types import Endpoint

#: Saturation at or above which an endpoint takes no sheddable work (the contract's
#: ``common.contracts.router_state.SATURATION_THRESHOLD``; repeated here because the scheduling
#: package imports nothing outside the router).
SATURATED = 1.0


@dataclass(frozen=True, slots=True)
class SaturationThresholds:
    """Thresholds of the detector.

    Attributes:
        queue_threshold: waiting requests that count as full (> 0; llm-d default 5).
        kv_threshold: KV cache use, 0..1, that counts as full (> 0; llm-d default 0.8).
        max_metrics_age_s: metrics older than this, in seconds, count as saturated (llm-d: 200 ms).
        in_flight_credit: count the requests the last scrape does not show yet (module docstring).

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


def unseen_requests(endpoint: Endpoint) -> int:
    """Requests the router forwarded that the last scrape does not show: ``max(0, in_flight −
    (waiting + running))``, requests."""
    return max(0, endpoint.in_flight_requests - (endpoint.num_requests_waiting + endpoint.num_requests_running))


def free_slots(endpoint: Endpoint) -> int:
    """Sequence slots the endpoint had free at the last scrape, by the router's estimate of its
    slot count: ``max(0, peak_running − running)``, requests (0 before it was seen running)."""
    return max(0, endpoint.peak_running - endpoint.num_requests_running)


def effective_waiting(endpoint: Endpoint) -> int:
    """Requests waiting for a sequence slot on the endpoint, counting the router's unseen ones
    beyond its free slots: ``waiting + max(0, unseen − free)`` (module docstring), requests."""
    return endpoint.num_requests_waiting + max(0, unseen_requests(endpoint) - free_slots(endpoint))


def _is_stale(endpoint: Endpoint, now: float, t: SaturationThresholds) -> bool:
    updated = endpoint.metrics_updated_at
    return updated is None or now - updated > t.max_metrics_age_s


def endpoint_saturation(endpoint: Endpoint, now: float, thresholds: SaturationThresholds | None = None,
                        extra_waiting: int = 0) -> float:
    """One endpoint's saturation (≥ 0; 1.0 at a threshold; 1.0 when its metrics are stale).

    Args:
        endpoint: the endpoint (its ``metrics_updated_at`` on the same clock as ``now``).
        now: current time, seconds (the router's monotonic clock).
        thresholds: the detector's thresholds; llm-d's defaults when None.
        extra_waiting: requests to count as waiting on top (requests; :func:`fleet_saturation`'s
            placement of pending ones).
    """
    t = thresholds or SaturationThresholds()
    if _is_stale(endpoint, now, t):
        return 1.0
    waiting = effective_waiting(endpoint) if t.in_flight_credit else endpoint.num_requests_waiting
    return max((waiting + extra_waiting) / t.queue_threshold, endpoint.kv_cache_usage_perc / t.kv_threshold)


def fleet_saturation(endpoints: Sequence[Endpoint], now: float, thresholds: SaturationThresholds | None = None,
                     pending: int = 0) -> list[float]:
    """Every endpoint's saturation, aligned with ``endpoints``, with ``pending`` requests placed.

    Args:
        endpoints: the healthy endpoints.
        now: current time, seconds.
        thresholds: the detector's thresholds; llm-d's defaults when None.
        pending: requests released by flow control and not yet forwarded (≥ 0). Each goes to the
            least saturated fresh endpoint (ties: the one with more free slots left), taking a
            free slot there when one is left (``free − unseen``, with the credit on), else
            counting as waiting. Stale endpoints take none (they read 1.0 regardless).

    Returns:
        Saturations (≥ 0), one per endpoint; empty for no endpoints.
    """
    t = thresholds or SaturationThresholds()
    values = [endpoint_saturation(ep, now, t) for ep in endpoints]
    if pending <= 0 or not endpoints:
        return values
    heap: list[tuple[float, int, int]] = []  # (saturation, −spare slots, index)
    for i, ep in enumerate(endpoints):
        if not _is_stale(ep, now, t):
            spare = max(0, free_slots(ep) - unseen_requests(ep)) if t.in_flight_credit else 0
            heap.append((values[i], -spare, i))
    heapq.heapify(heap)
    extra = [0] * len(endpoints)
    for _ in range(pending):
        if not heap:
            break
        value, neg_spare, i = heapq.heappop(heap)
        if neg_spare < 0:
            heapq.heappush(heap, (value, neg_spare + 1, i))
            continue
        extra[i] += 1
        values[i] = endpoint_saturation(endpoints[i], now, t, extra_waiting=extra[i])
        heapq.heappush(heap, (values[i], 0, i))
    return values


def gate_saturation(saturations: Sequence[float]) -> float:
    """The least saturated endpoint's value (the per-engine gate); 1.0 when there is none."""
    return min(saturations, default=1.0)


def pool_saturation(endpoints: Sequence[Endpoint], now: float, thresholds: SaturationThresholds | None = None,
                    pending: int = 0) -> float:
    """Mean of :func:`fleet_saturation` over ``endpoints`` (the metric and the display; the gate is
    :func:`gate_saturation`); 1.0 for an empty pool."""
    if not endpoints:
        return 1.0
    values = fleet_saturation(endpoints, now, thresholds, pending)
    return sum(values) / len(values)
