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

**Slot reserve for non-sheddable work.** On an engine whose batch is bound by its sequence slots
(vLLM's ``max_num_seqs``) and scheduled first come first served, a sheddable request that takes
the last slot, or waits in the engine's queue, makes the next interactive request wait for a
whole sheddable request to finish. So once the endpoint's slot count is known
(:attr:`Endpoint.slots`: configured, or learned from scrapes, ``router/pool/slots.py``), two more terms
apply (this module's values are what sheddable work is gated on)::

    sheddable_slots = slots − reserve
    saturation = max(queue term, KV term,
                     in_flight_sheddable / sheddable_slots,      # ≥ 1.0 with the batch slots taken
                     1.0 if effective_waiting > 0 else 0)        # never queue ahead of interactive

``in_flight_sheddable`` is the router's own count of sheddable requests forwarded there (exact,
no scrape lag). ``reserve = max(min_slot_reserve, ⌈slot_reserve_fraction × slots⌉)``, at most
``slots − 1`` (a one-slot engine keeps no reserve, or sheddable work could never run there).
Default 10 %, at least 1: by Little's law the slots interactive work occupies on an engine are
its arrival rate there × its request duration: in the ``mixed`` benchmark (two 4-slot engines)
the interactive parts, about 1.6 req/s of ~0.7 s each, hold about 1.1 slots, so one per engine;
raise ``slot_reserve_fraction`` when interactive traffic is heavier. Interactive work still uses every slot: its band bypasses
the gate (flow control's ``bypass_saturation``) and the ``spare-capacity-filter`` leaves it
alone. Before the slot count is known no reserve applies (the values are llm-d's detector's).

**Reserve sized from the interactive arrivals** (``reserve_from_arrivals``, off by default). The
fixed fraction above knows nothing of the load. With it on, an endpoint's reserve is the larger of
the fixed one and :func:`little_reserve` of the non-sheddable arrival rate the router measures
there (:meth:`Endpoint.interactive_rate`, an exponentially weighted rate, time constant 10 s) and
their mean duration there (:attr:`Endpoint.mean_interactive_duration_s`)::

    R = max(fixed reserve, ⌈L + 2.326 √L⌉),  L = λ_interactive × W_interactive   (Little's law)

so interactive work finds a free slot 99 % of the time (M/G/∞ occupancy is Poisson(L)).

**Batch prefill share of the step budget** (``batch_prefill_share``, off by default): vLLM V1 puts
every waiting prefill into the next step up to ``max_num_batched_tokens`` (8,192 on an H100-class
GPU, about 270 ms of prefill for an 8B model), so an interactive request that shares a step with
batch prefills waits for all of them. With a share set, the uncached prompt tokens of the sheddable
requests the router has *in prefill* on the endpoint (:attr:`Endpoint.in_flight_sheddable_prefill_tokens`:
forwarded, no first chunk, not answered, sent within the pool's ``batch_prefill_window_s``) count
as a term ``tokens / (share × max_num_batched_tokens)``: sheddable work stops at the bound (at
most one request past it). This is the router's form of the twin's engine-level background budget
(``engine_twin/core.py`` item 4), for engines that have none (real vLLM).

**Idle sessions' working set (sheddable work only).** An agent session between turns holds no
request on its engine, so the engine's books (``kv_cache_usage_perc``) count its KV blocks free,
but its next turn needs them within seconds. The router knows those sessions
(``session-affinity-filter``, ``router/scheduling/plugins/session.py``: per endpoint, the prompt
tokens of the sessions idle for at most ``workingSetWindowSeconds``, default 120 s, the reasoning
there) and counts them as used in the KV term of the value sheddable work is gated on::

    kv_term = (kv_usage + min(1, working_set_tokens / (block_size × num_gpu_blocks))) / kv_threshold

so batch takes only what is spare after the agents come back. Until the endpoint's block size and
GPU block count are scraped the term is left out. The non-sheddable value (``reserve=False``) never
counts it: interactive work is what the room is kept for.

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
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from router.scheduling.types import ROLE_PREFILL, Endpoint

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
        slot_reserve_fraction: fraction 0..1 of a known slot count kept for non-sheddable work
            (module docstring; default 0.1, ours).
        min_slot_reserve: fewest slots kept, requests (≥ 0; default 1, ours). Both 0: no reserve,
            but sheddable work still never waits in an engine's queue once its slots are known.
        reserve_from_arrivals: size each endpoint's reserve from its measured interactive arrivals
            too (:func:`little_reserve`; module docstring). Default off.
        batch_prefill_share: bound of the sheddable prompt tokens in prefill on an endpoint, a
            share (0, 1] of ``max_num_batched_tokens`` (module docstring); None: no bound.
        max_num_batched_tokens: the engines' step token budget (vLLM's flag; it is not exported),
            tokens; default 8,192, vLLM's default on GPUs of 70 GiB or more.

    Raises:
        ValueError: a threshold is not positive, or a reserve parameter is out of range.
    """

    queue_threshold: float = 5
    kv_threshold: float = 0.8
    max_metrics_age_s: float = 0.2
    in_flight_credit: bool = False
    slot_reserve_fraction: float = 0.1
    min_slot_reserve: int = 1
    reserve_from_arrivals: bool = False
    batch_prefill_share: float | None = None
    max_num_batched_tokens: int = 8192

    def __post_init__(self) -> None:
        if self.queue_threshold <= 0 or self.kv_threshold <= 0 or self.max_metrics_age_s <= 0:
            raise ValueError("saturation thresholds must be positive")
        if not 0.0 <= self.slot_reserve_fraction <= 1.0 or self.min_slot_reserve < 0:
            raise ValueError("slot_reserve_fraction must be in [0, 1] and min_slot_reserve ≥ 0")
        if self.batch_prefill_share is not None and not 0.0 < self.batch_prefill_share <= 1.0:
            raise ValueError("batch_prefill_share must be in (0, 1]")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1")


def unseen_requests(endpoint: Endpoint) -> int:
    """Requests the router forwarded that the last scrape does not show: ``max(0, in_flight −
    (waiting + running))``, requests."""
    return max(0, endpoint.in_flight_requests - (endpoint.num_requests_waiting + endpoint.num_requests_running))


def free_slots(endpoint: Endpoint) -> int:
    """Sequence slots the endpoint had free at the last scrape, by the router's estimate of its
    slot count: ``max(0, slots − running)`` with :attr:`Endpoint.slots` when known, else
    ``peak_running``, requests (0 before it was seen running)."""
    slots = endpoint.slots
    return max(0, (endpoint.peak_running if slots is None else slots) - endpoint.num_requests_running)


def slot_reserve(slots: int, thresholds: SaturationThresholds | None = None) -> int:
    """Slots of an engine with ``slots`` sequence slots kept for non-sheddable work, requests:
    ``max(min_slot_reserve, ⌈slot_reserve_fraction × slots⌉)``, at most ``slots − 1``, at least 0."""
    t = thresholds or SaturationThresholds()
    wanted = max(t.min_slot_reserve, math.ceil(t.slot_reserve_fraction * slots - 1e-9))
    return max(0, min(wanted, slots - 1))


#: z-score of the 99th percentile of a normal distribution (the margin of :func:`little_reserve`).
Z_P99 = 2.326


def little_reserve(rate_per_s: float, request_s: float, slots: int | None = None) -> int:
    """Slots to keep for interactive work on one engine so that it finds a free one 99 % of the time.

    ``L = rate_per_s × request_s`` is the mean number of interactive requests on the engine
    (Little's law, L = λW: J. D. C. Little, "A proof for the queuing formula L = λW", Operations
    Research 9(3), 1961). With Poisson arrivals and slots to spare the count in the system is
    Poisson with mean L whatever the service time's distribution (M/G/∞, Palm's theorem), so the
    reserve is its 99th percentile by the normal approximation, ``R = ⌈L + 2.326 × √L⌉``
    (0 when L = 0), at most ``slots − 1`` when ``slots`` is given (sheddable work keeps one).

    Args:
        rate_per_s: interactive arrivals per second on the engine (≥ 0; the router's EWMA).
        request_s: an interactive request's time on the engine, seconds (≥ 0; its mean duration).
        slots: the engine's sequence slots, or None for no cap.
    """
    load = max(0.0, rate_per_s) * max(0.0, request_s)
    wanted = math.ceil(load + Z_P99 * math.sqrt(load) - 1e-9) if load > 0 else 0
    return wanted if slots is None else max(0, min(wanted, slots - 1))


def endpoint_reserve(endpoint: Endpoint, now: float, thresholds: SaturationThresholds | None = None) -> int | None:
    """The endpoint's slot reserve now, requests: :func:`slot_reserve` of its slots, raised to
    :func:`little_reserve` of its interactive arrivals with ``reserve_from_arrivals``; None while
    its slot count is unknown."""
    t = thresholds or SaturationThresholds()
    slots = endpoint.slots
    if slots is None or slots < 1:
        return None
    reserve = slot_reserve(slots, t)
    if t.reserve_from_arrivals and endpoint.mean_interactive_duration_s is not None:
        reserve = max(reserve, little_reserve(endpoint.interactive_rate(now), endpoint.mean_interactive_duration_s,
                                              slots))
    return reserve


def reserve_in_use(endpoint: Endpoint, now: float, thresholds: SaturationThresholds | None = None) -> int:
    """Reserved slots taken now, requests: the router's non-sheddable requests in flight there,
    at most the reserve (0 while the slot count is unknown)."""
    reserve = endpoint_reserve(endpoint, now, thresholds)
    if not reserve:
        return 0
    return min(reserve, max(0, endpoint.in_flight_requests - endpoint.in_flight_sheddable))


def sheddable_slots(endpoint: Endpoint, thresholds: SaturationThresholds | None = None,
                    now: float | None = None) -> int | None:
    """Slots sheddable work may hold on the endpoint (``slots − reserve``, ≥ 1), requests; None
    while its slot count is unknown. While a learned count is probed upward
    (:attr:`Endpoint.probing`), at least ``peak_running + 1``: one request more than the engine
    was ever seen running, which an engine with more slots runs (``router/pool/slots.py``).
    ``now`` (seconds) is needed for ``reserve_from_arrivals``; without it the fixed reserve applies."""
    slots = endpoint.slots
    if slots is None or slots < 1:
        return None
    if now is not None:
        room = slots - (endpoint_reserve(endpoint, now, thresholds) or 0)
    else:
        room = slots - slot_reserve(slots, thresholds)
    return max(room, endpoint.peak_running + 1) if endpoint.probing else room


def effective_waiting(endpoint: Endpoint) -> int:
    """Requests waiting for a sequence slot on the endpoint, counting the router's unseen ones
    beyond its free slots: ``waiting + max(0, unseen − free)`` (module docstring), requests."""
    return endpoint.num_requests_waiting + max(0, unseen_requests(endpoint) - free_slots(endpoint))


def _is_stale(endpoint: Endpoint, now: float, t: SaturationThresholds) -> bool:
    updated = endpoint.metrics_updated_at
    return updated is None or now - updated > t.max_metrics_age_s


def working_set_fraction(endpoint: Endpoint, working_set_tokens: int) -> float:
    """``working_set_tokens`` as a fraction of the endpoint's GPU KV capacity, 0..1:
    ``min(1, tokens / (block_size × num_gpu_blocks))``; 0.0 while either is unknown (not scraped)."""
    if working_set_tokens <= 0 or not endpoint.block_size or not endpoint.num_gpu_blocks:
        return 0.0
    return min(1.0, working_set_tokens / (endpoint.block_size * endpoint.num_gpu_blocks))


def endpoint_saturation(endpoint: Endpoint, now: float, thresholds: SaturationThresholds | None = None,
                        extra_waiting: int = 0, extra_sheddable: int = 0, *, reserve: bool = True,
                        working_set_tokens: int = 0) -> float:
    """One endpoint's saturation for sheddable work (≥ 0; 1.0 at a threshold; 1.0 when its
    metrics are stale), with the slot-reserve terms once its slot count is known (module docstring).

    Args:
        endpoint: the endpoint (its ``metrics_updated_at`` on the same clock as ``now``).
        now: current time, seconds (the router's monotonic clock).
        thresholds: the detector's thresholds; llm-d's defaults when None.
        extra_waiting: requests to count as waiting on top (requests; :func:`fleet_saturation`'s
            placement of pending ones).
        extra_sheddable: sheddable requests to count as in flight on top (requests; the same
            placement).
        reserve: apply the slot-reserve terms (sheddable work); False: the value non-sheddable
            work past its flow-control bypass is gated on (the queue and KV terms only).
        working_set_tokens: idle sessions' tokens on the endpoint to count as used KV (tokens;
            module docstring); only with ``reserve``.
    """
    t = thresholds or SaturationThresholds()
    if _is_stale(endpoint, now, t):
        return 1.0
    waiting = (effective_waiting(endpoint) if t.in_flight_credit else endpoint.num_requests_waiting) + extra_waiting
    kv = endpoint.kv_cache_usage_perc
    if reserve and working_set_tokens > 0:
        kv += working_set_fraction(endpoint, working_set_tokens)
    value = max(waiting / t.queue_threshold, kv / t.kv_threshold)
    if reserve and t.batch_prefill_share is not None:
        value = max(value, endpoint.in_flight_sheddable_prefill_tokens
                    / (t.batch_prefill_share * t.max_num_batched_tokens))
    room = sheddable_slots(endpoint, t, now) if reserve else None
    if room is not None:
        value = max(value, (endpoint.in_flight_sheddable + extra_sheddable) / room)
        if waiting > 0:
            value = max(value, SATURATED)
    return value


def fleet_saturation(endpoints: Sequence[Endpoint], now: float, thresholds: SaturationThresholds | None = None,
                     pending: int = 0, *, reserve: bool = True,
                     working_set: Mapping[str, int] | None = None) -> list[float]:
    """Every endpoint's saturation, aligned with ``endpoints``, with ``pending`` requests placed.

    Args:
        endpoints: the healthy endpoints.
        now: current time, seconds.
        thresholds: the detector's thresholds; llm-d's defaults when None.
        pending: requests released by flow control and not yet forwarded (≥ 0). Each goes to the
            least saturated fresh endpoint (ties: the one with more free slots left), taking a
            free slot there when one is left (``free − unseen``, with the credit on), else
            counting as waiting, and counting as a sheddable request in flight there (the slot
            reserve's term). Stale endpoints take none (they read 1.0 regardless).
        reserve: as :func:`endpoint_saturation`'s.
        working_set: endpoint name → idle sessions' tokens there (:func:`endpoint_saturation`'s
            ``working_set_tokens``); None or absent: 0.

    Returns:
        Saturations (≥ 0), one per endpoint; empty for no endpoints.
    """
    t = thresholds or SaturationThresholds()
    ws = working_set or {}
    values = [endpoint_saturation(ep, now, t, reserve=reserve, working_set_tokens=ws.get(ep.name, 0))
              for ep in endpoints]
    if pending <= 0 or not endpoints:
        return values
    heap: list[tuple[float, int, int]] = []  # (saturation, −spare slots, index)
    for i, ep in enumerate(endpoints):
        if not _is_stale(ep, now, t):
            spare = max(0, free_slots(ep) - unseen_requests(ep)) if t.in_flight_credit else 0
            heap.append((values[i], -spare, i))
    heapq.heapify(heap)
    waiting = [0] * len(endpoints)
    sheddable = [0] * len(endpoints)
    for _ in range(pending):
        if not heap:
            break
        _, neg_spare, i = heapq.heappop(heap)
        if neg_spare < 0:
            neg_spare += 1  # takes a free slot
        else:
            waiting[i] += 1
        sheddable[i] += 1
        values[i] = endpoint_saturation(endpoints[i], now, t, extra_waiting=waiting[i],
                                        extra_sheddable=sheddable[i], reserve=reserve,
                                        working_set_tokens=ws.get(endpoints[i].name, 0))
        heapq.heappush(heap, (values[i], neg_spare, i))
    return values


def gate_saturation(saturations: Sequence[float]) -> float:
    """The least saturated endpoint's value (the per-engine gate); 1.0 when there is none."""
    return min(saturations, default=1.0)


def is_disaggregated(endpoints: Sequence[Endpoint]) -> bool:
    """Some endpoint has the role ``prefill``: the fleet is split into a prefill and a decode pool."""
    return any(ep.role == ROLE_PREFILL for ep in endpoints)


def pd_fleet_saturation(endpoints: Sequence[Endpoint], now: float, thresholds: SaturationThresholds | None = None,
                        pending: int = 0, *, reserve: bool = True,
                        working_set: Mapping[str, int] | None = None) -> list[float]:
    """:func:`fleet_saturation` computed per pool, aligned with ``endpoints``.

    Without a ``prefill`` endpoint it is :func:`fleet_saturation` itself. Otherwise the decode pool
    (roles ``decode`` and ``both``) and the prefill-only pool (role ``prefill``) are computed
    apart, each with the ``pending`` requests placed on it (a released request takes a decode
    slot, and a prefill slot too when it is disaggregated), so each engine's slot reserve and
    Little's-law reserve count what its own pool runs.
    """
    if not is_disaggregated(endpoints):
        return fleet_saturation(endpoints, now, thresholds, pending, reserve=reserve, working_set=working_set)
    values = [0.0] * len(endpoints)
    for prefill_only in (False, True):
        index = [i for i, ep in enumerate(endpoints) if (ep.role == ROLE_PREFILL) is prefill_only]
        part = fleet_saturation([endpoints[i] for i in index], now, thresholds, pending, reserve=reserve,
                                working_set=working_set)
        for i, value in zip(index, part):
            values[i] = value
    return values


def pd_gate_saturation(endpoints: Sequence[Endpoint], saturations: Sequence[float]) -> float:
    """The gate of a fleet that may be split into prefill and decode pools (``saturations``
    aligned with ``endpoints``, from :func:`pd_fleet_saturation`).

    Without a ``prefill`` endpoint: :func:`gate_saturation` (the least saturated endpoint).
    With one, sheddable work has room only when a prefill-capable engine (``prefill`` or
    ``both``) and a decode-capable one (``decode`` or ``both``) both have room: the larger of the
    two pools' least saturated values (1.0 for an empty pool). A request the P/D handler does not
    disaggregate needs only the decode pool; the gate does not know the request, so it holds
    sheddable work while either pool is full (the prefill pool fills only with long prompts,
    which are the ones disaggregated).
    """
    if not is_disaggregated(endpoints):
        return gate_saturation(saturations)
    prefill = [v for ep, v in zip(endpoints, saturations) if ep.can_prefill]
    decode = [v for ep, v in zip(endpoints, saturations) if ep.can_decode]
    return max(gate_saturation(prefill), gate_saturation(decode))


def pool_saturation(endpoints: Sequence[Endpoint], now: float, thresholds: SaturationThresholds | None = None,
                    pending: int = 0) -> float:
    """Mean of :func:`fleet_saturation` over ``endpoints`` (the metric and the display; the gate is
    :func:`gate_saturation`); 1.0 for an empty pool."""
    if not endpoints:
        return 1.0
    values = fleet_saturation(endpoints, now, thresholds, pending)
    return sum(values) / len(values)
