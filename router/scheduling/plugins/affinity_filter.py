"""``prefix-cache-affinity-filter``: keep the engines holding the prompt's prefix unless a move pays
for what it costs the fleet.

The *sticky* set (the holders) is the endpoints with the longest prefix match for this request,
when that match is at least ``affinityThreshold`` of the prompt's blocks. Every other endpoint —
one holding a shorter part of the prefix too — is a move: it recomputes what it lacks. The filter
keeps the holders — unless

* no endpoint holds ``affinityThreshold`` of the prompt, or every endpoint holds the longest match
  (nothing to narrow: all kept);
* an exploration draw fires (probability ``explorationProbability``, default 0), to seed the cache
  elsewhere over time;
* **a move pays**: some other endpoint ``e`` saves this request more time than moving costs the
  fleet. Then the filter keeps the endpoints where it does (the load scorers pick among them).

The move rule (all in ms; ``h`` ranges over the sticky endpoints)::

    saving(e)     = min_h wait(h) − wait(e)                          this request's TTFT gain
    recompute(e)  = (prefill(e) − min_h prefill(h)) / peakPrefillThroughput × 1000
    move_cost(e)  = recompute(e) × (reuseLossWeight + queueImpactWeight × in_engine(e))
    e pays        ⇔ saving(e) > max(maxTTFTPenaltyMs, move_cost(e))

* ``recompute(e)``: the prefix tokens ``e`` would compute again that a holder has cached
  (``prefill(x)``: the prompt tokens ``x`` does not hold in any tier; prefill time at the
  calibrated rate; the request's own share of it is already in ``wait(e)``).
* **Reuse lost** (``reuseLossWeight``, default 16): the recomputed tokens are cache the fleet had
  and throws away — GPU time spent twice — and the cost goes on: the holder's copy goes cold in its
  cache, and the duplicate on ``e`` evicts as many tokens of other cached prefixes there, which
  later requests then recompute. Weight 1 would count the recompute once; the default was chosen
  by simulation (:class:`AffinityFilterParams`).
* **Queue impact** (``queueImpactWeight``, default 1): every request in ``e``'s engine
  (``in_engine = waiting + running + unseen``) waits behind the recompute — a waiting request's
  prefill waits for it, a running request's next tokens share steps with its prefill chunks — and
  on a busy engine the queue refills as fast as it drains, so the count now stands for those that
  will stand behind it. So on a busy fleet (every engine holds requests) a move costs a multiple of
  its recompute, and a request leaves its prefix holder only when the holder is much worse off
  than the target; on an idle target a move costs 16 × the recompute (the default weights). This
  is the case the issue-27 measurements showed: moving a long prompt off its holder when every
  engine is busy adds a long recompute to a full queue (the peers' cache_aware policy stays, and
  kept 0.97 reuse at 2× load where the old rule fell to 0.37–0.46).
* ``maxTTFTPenaltyMs`` (default 150 in the shipped configs): the smallest saving worth a move
  (below it the estimate's noise — scrape lag, duration EWMA — decides); 0 means never move.

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
requests waiting for slots long enough to pay for the move — the shared-prefix batch that would
otherwise pile onto one engine.

Sources: the sticky set and the wait estimate are llm-d's "sticky until saturated" composition; the
decision to stay unless the imbalance is large is what sglang-router's and vllm-router's
``cache_aware`` policies do (a prefix-tree match above ``cache_threshold`` stays on its worker
unless the fleet is imbalanced by both an absolute and a relative margin); pricing the move in
predicted latency follows llm-d's predicted-latency scorer (router/README.md, "Placement").
``reuseLossWeight`` 0 and ``queueImpactWeight`` 0 leave the old rule's test (move when the saving
exceeds ``maxTTFTPenaltyMs`` alone; the old rule then let the load scorers choose among all
endpoints, this one among those the move pays for).

Blocks count whole in every cache tier here (:meth:`PrefixMatchInfo.prefill_tokens`): a block in
the CPU tier is loaded (the twin: 0.08 ms per block), not recomputed, so the precise producer's
tier weights (CPU 0.8, for the prefix scorer) would make a holder's offloaded history look 20 %
uncached and a shorter GPU-only match elsewhere the longest — what put precise below approximate
on the conversation shape (docs/benchmarks.md, issue 27).

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

_SAME_MATCH = 1e-9
"""Matched blocks (tier-weighted floats) closer than this are the same match."""


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
    2× H100 (TP=2), vLLM 0.19 — measure your own. ``maxTTFTPenaltyMs`` (ms, default 18000, llm-d's;
    the shipped configs set 150): the smallest saving a move must bring; 0 means always stick.
    ``defaultRequestDurationMs`` (ms, default 2000; ours): the request duration assumed on an
    endpoint before the router has measured one there, about a 100-token answer at vLLM's typical
    20 ms inter-token latency; 0 leaves the slot wait out until measured.
    ``reuseLossWeight`` (default 16, ours) and ``queueImpactWeight`` (default 1.0, ours): the move
    cost's terms (module docstring). ``queueImpactWeight`` 1 counts the recompute once for every
    request in the target's engine (an accounting). ``reuseLossWeight`` was chosen by
    ``backfill simulate --sweep`` over 1, 2, 4, 8, 16 and never moving (docs/benchmarks.md,
    issue 27): the smallest weight within 0.015 of never moving's captured reuse on the
    long-context shape at 1× and 2× load, while keeping the moves shared-prefix needs at 2×
    (never moving: TTFT p50 0.35 s against 0.017 s); 1 lost 0.05–0.06 of long-context reuse for
    no TTFT gain. 0 and 0 leave only the ``maxTTFTPenaltyMs`` floor.
    """

    prefix_match_info_producer_name: str = APPROX_PRODUCER_TYPE
    affinity_threshold: float = Field(0.80, ge=0.0, le=1.0)
    exploration_probability: float = Field(0.0, ge=0.0, le=1.0)
    max_ttft_penalty_ms: float = Field(18000.0, alias="maxTTFTPenaltyMs", ge=0.0)
    peak_prefill_throughput: float = Field(15928.0, gt=0.0)
    default_request_duration_ms: float = Field(2000.0, ge=0.0)
    reuse_loss_weight: float = Field(16.0, ge=0.0)
    queue_impact_weight: float = Field(1.0, ge=0.0)


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
        tokens = endpoint.in_flight_uncached_tokens + info.prefill_tokens(endpoint.name, prompt_tokens)
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
        """The sticky endpoints, the endpoints a move to which pays, or all of them (module docstring)."""
        outcome, kept = self._decide(state, request, endpoints)
        state.write(self._outcome_key, outcome)
        return kept

    def _decide(self, state: CycleState, request: LLMRequest, endpoints: Sequence[Endpoint]) -> tuple[AffinityOutcome, list[Endpoint]]:
        p = self.params
        info: PrefixMatchInfo | None = state.read(self._match_key)
        if info is None:
            return AffinityOutcome.NO_STICKY, list(endpoints)
        best = max((info.held_blocks(ep.name) for ep in endpoints), default=0.0)
        if best <= 0.0 or info.ratio_of(best) < p.affinity_threshold:
            return AffinityOutcome.NO_STICKY, list(endpoints)
        # the holders: the endpoints with the longest match; any other endpoint, a partial holder
        # too, is a move that recomputes the difference and must pay for it
        sticky = [ep for ep in endpoints if info.held_blocks(ep.name) >= best - _SAME_MATCH]
        if len(sticky) == len(endpoints):
            return AffinityOutcome.ALL_STICKY, list(endpoints)
        if p.exploration_probability > 0.0 and self._rng.random() < p.exploration_probability:
            return AffinityOutcome.EXPLORE, list(endpoints)
        if p.max_ttft_penalty_ms > 0.0:
            movers = self.paying_moves(info, request.prompt_tokens, sticky, endpoints)
            if movers:
                return AffinityOutcome.LOAD_OVERRIDE, movers
        return AffinityOutcome.STICKY, sticky

    def move_cost_ms(self, endpoint: Endpoint, recompute_tokens: int) -> float:
        """What moving this request to ``endpoint`` costs the fleet, in ms: the recomputed prefix's
        prefill time × (``reuseLossWeight`` + ``queueImpactWeight`` × requests in the engine)
        (module docstring). ``recompute_tokens``: prefix tokens a holder has cached that
        ``endpoint`` has not (≥ 0)."""
        p = self.params
        recompute_ms = max(0, recompute_tokens) / p.peak_prefill_throughput * 1000.0
        in_engine = endpoint.num_requests_waiting + endpoint.num_requests_running + unseen_requests(endpoint)
        return recompute_ms * (p.reuse_loss_weight + p.queue_impact_weight * in_engine)

    def paying_moves(self, info: PrefixMatchInfo, prompt_tokens: int, sticky: Sequence[Endpoint],
                     endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        """The non-sticky endpoints a move to which pays: saving > max(``maxTTFTPenaltyMs``, move
        cost) (module docstring); empty when none does (the request stays on its holders)."""
        best_wait = min(self.estimated_wait_ms(ep, info, prompt_tokens) for ep in sticky)
        held = min(info.prefill_tokens(ep.name, prompt_tokens) for ep in sticky)
        sticky_ids = {id(ep) for ep in sticky}
        floor = self.params.max_ttft_penalty_ms
        movers = []
        for ep in endpoints:
            if id(ep) in sticky_ids:
                continue
            uncached = info.prefill_tokens(ep.name, prompt_tokens)
            saving = best_wait - self.estimated_wait_ms(ep, info, prompt_tokens)
            if saving > floor and saving > self.move_cost_ms(ep, uncached - held):
                movers.append(ep)
        return movers


def build_affinity_filter(name: str, raw: Mapping[str, Any] | None, handle: PluginHandle) -> PrefixCacheAffinityFilter:
    """Factory of ``prefix-cache-affinity-filter``."""
    return PrefixCacheAffinityFilter(name, parse_params(AffinityFilterParams, name, raw), handle)
