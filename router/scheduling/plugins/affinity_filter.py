"""``prefix-cache-affinity-filter``: "sticky until saturated" (llm-d's newest default composition).

Keeps only the endpoints whose prefix score for this request is at least ``affinityThreshold``
(the *sticky* set) — unless

* no endpoint, or every endpoint, is sticky (nothing to narrow: all kept);
* an exploration draw fires (probability ``explorationProbability``, default 0), to seed the cache
  elsewhere over time;
* the sticky set is overloaded: the best estimated wait among sticky endpoints exceeds the best
  among the others by more than ``maxTTFTPenaltyMs``. The scorers then choose among all endpoints.

Estimated wait of an endpoint for this request, in ms — every kind of wait the router can see::

    wait = prefill_wait + slot_wait

    prefill_wait = (in-flight uncached tokens + this request's tokens it has not cached)
                   / peakPrefillThroughput × 1000
    slot_wait    = effective_waiting × slot_interval
    slot_interval = mean_request_duration / max(1, waiting + running + unseen) × 1000

* ``prefill_wait``: the queued prefill work. llm-d's gate counts in-flight tokens only; adding the
  request's own uncached tokens charges a cold endpoint for the prefill it would have to do.
* ``slot_wait``: the time until a sequence slot frees for this request. ``effective_waiting`` is
  the requests ahead of it for a slot: the engine's ``num_requests_waiting`` plus the router's
  in-flight requests the last scrape does not show beyond the engine's free slots (``peak_running``
  is the router's estimate of its ``max_num_seqs``;
  :func:`router.scheduling.saturation.effective_waiting`, the same count the saturation detector
  uses), counted only while the engine itself reports waiting requests: ``peak_running`` is only
  a lower bound of the slot count, so unseen requests alone do not prove a slot wait (counting
  them, with the same count in ``queue-scorer``, cost ``backfill bench prefix`` reuse on engines
  that are never slot-bound: precise 0.992 → 0.956, TTFT p50 0.119 → 0.153 s). Slots free at the engine's completion rate, which by Little's law is requests in the
  engine ÷ time a request spends there: ``mean_request_duration`` is the per-endpoint EWMA of the
  durations the router measures (forward → end of response, :meth:`router.pool.state.PoolState.
  finished`), ``waiting + running + unseen`` the requests in the engine now. Until the router has
  measured a duration on the endpoint, ``defaultRequestDurationMs`` stands in.
* Decode load is not modelled separately: a busy decode batch lengthens the measured durations,
  so it shows in ``slot_interval``.

The two terms add up (a conservative estimate: a request waiting for a slot also waits for the
prefills ahead of it). So an engine with free slots gets the work whenever the sticky ones have
requests waiting for slots — the shared-prefix batch that would otherwise pile onto one engine.

Each decision's outcome (:class:`AffinityOutcome`) goes into the CycleState under
``affinity-outcome/<name>``, for metrics (llm-d counts ``outcome="load_override"`` the same way).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import Field

from router.scheduling.interfaces import PluginHandle
from router.scheduling.plugins.params import PluginParams, parse_params
from router.scheduling.plugins.prefix import APPROX_PRODUCER_TYPE
from router.scheduling.saturation import effective_waiting, unseen_requests
from router.scheduling.types import CycleState, Endpoint, LLMRequest, PrefixMatchInfo, prefix_match_key

AFFINITY_FILTER_TYPE = "prefix-cache-affinity-filter"


class AffinityOutcome(enum.StrEnum):
    """What the filter did for one decision (doubles as a metric label)."""

    STICKY = "sticky"
    NO_STICKY = "no_sticky"
    ALL_STICKY = "all_sticky"
    EXPLORE = "explore"
    LOAD_OVERRIDE = "load_override"


class AffinityFilterParams(PluginParams):
    """Parameters, llm-d names and defaults.

    ``peakPrefillThroughput`` (tokens/s, default 15928): llm-d's calibration for Qwen 32B on
    2× H100 (TP=2), vLLM 0.19 — measure your own. ``maxTTFTPenaltyMs`` 0 means always stick.
    ``defaultRequestDurationMs`` (ms, default 2000; ours): the request duration assumed on an
    endpoint before the router has measured one there, about a 100-token answer at vLLM's typical
    20 ms inter-token latency; 0 leaves the slot wait out until measured.
    """

    prefix_match_info_producer_name: str = APPROX_PRODUCER_TYPE
    affinity_threshold: float = Field(0.80, ge=0.0, le=1.0)
    exploration_probability: float = Field(0.0, ge=0.0, le=1.0)
    max_ttft_penalty_ms: float = Field(18000.0, alias="maxTTFTPenaltyMs", ge=0.0)
    peak_prefill_throughput: float = Field(15928.0, gt=0.0)
    default_request_duration_ms: float = Field(2000.0, ge=0.0)


class PrefixCacheAffinityFilter:
    """See the module docstring."""

    plugin_type = AFFINITY_FILTER_TYPE

    def __init__(self, name: str, params: AffinityFilterParams, handle: PluginHandle) -> None:
        self.name = name
        self.params = params
        self.requires = {params.prefix_match_info_producer_name: APPROX_PRODUCER_TYPE}
        self._rng = handle.rng
        self._match_key = prefix_match_key(params.prefix_match_info_producer_name)
        self._outcome_key = f"affinity-outcome/{name}"

    def estimated_wait_ms(self, endpoint: Endpoint, info: PrefixMatchInfo, prompt_tokens: int) -> float:
        """Estimated wait on ``endpoint`` for this request, in ms: prefill plus slot wait (module
        docstring)."""
        tokens = endpoint.in_flight_uncached_tokens + info.uncached_tokens(endpoint.name, prompt_tokens)
        return tokens / self.params.peak_prefill_throughput * 1000.0 + self.slot_wait_ms(endpoint)

    def slot_wait_ms(self, endpoint: Endpoint) -> float:
        """Estimated wait for a sequence slot on ``endpoint``, in ms: requests ahead for a slot ×
        the interval at which slots free (Little's law; module docstring)."""
        if endpoint.num_requests_waiting <= 0:
            return 0.0  # the engine queued nothing at the last scrape: it had free slots
        ahead = effective_waiting(endpoint)
        mean_s = endpoint.mean_request_duration_s
        duration_ms = mean_s * 1000.0 if mean_s is not None else self.params.default_request_duration_ms
        in_engine = endpoint.num_requests_waiting + endpoint.num_requests_running + unseen_requests(endpoint)
        return ahead * duration_ms / max(1, in_engine)

    def filter(self, state: CycleState, request: LLMRequest, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        """The sticky endpoints, or all of them (module docstring)."""
        outcome, kept = self._decide(state, request, endpoints)
        state.write(self._outcome_key, outcome)
        return kept

    def _decide(self, state: CycleState, request: LLMRequest, endpoints: Sequence[Endpoint]) -> tuple[AffinityOutcome, list[Endpoint]]:
        p = self.params
        info: PrefixMatchInfo | None = state.read(self._match_key)
        if info is None:
            return AffinityOutcome.NO_STICKY, list(endpoints)
        sticky = [ep for ep in endpoints if info.ratio(ep.name) >= p.affinity_threshold and info.matched.get(ep.name)]
        if not sticky:
            return AffinityOutcome.NO_STICKY, list(endpoints)
        if len(sticky) == len(endpoints):
            return AffinityOutcome.ALL_STICKY, list(endpoints)
        if p.exploration_probability > 0.0 and self._rng.random() < p.exploration_probability:
            return AffinityOutcome.EXPLORE, list(endpoints)
        if p.max_ttft_penalty_ms > 0.0:
            n = request.prompt_tokens
            sticky_ids = {id(ep) for ep in sticky}
            best_sticky = min(self.estimated_wait_ms(ep, info, n) for ep in sticky)
            best_other = min(self.estimated_wait_ms(ep, info, n) for ep in endpoints if id(ep) not in sticky_ids)
            if best_sticky - best_other > p.max_ttft_penalty_ms:
                return AffinityOutcome.LOAD_OVERRIDE, list(endpoints)
        return AffinityOutcome.STICKY, sticky


def build_affinity_filter(name: str, raw: Mapping[str, Any] | None, handle: PluginHandle) -> PrefixCacheAffinityFilter:
    """Factory of ``prefix-cache-affinity-filter``."""
    return PrefixCacheAffinityFilter(name, parse_params(AffinityFilterParams, name, raw), handle)
