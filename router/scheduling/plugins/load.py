"""Load scorers: spread requests by the engines' scraped metrics and the router's own counters.

* ``queue-scorer``: min-max normalised ``vllm:num_requests_waiting`` — ``(max − w) / (max − min)``
  over the candidates, 1.0 for all when they are equal (llm-d).
* ``kv-cache-utilization-scorer``: ``1 − vllm:kv_cache_usage_perc`` (llm-d).
* ``token-load-scorer``: ``1 − min(1, in-flight uncached prompt tokens / queueThresholdTokens)``
  (llm-d; the in-flight count is the router's :attr:`Endpoint.in_flight_uncached_tokens`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import Field

from router.scheduling.interfaces import PluginHandle
from router.scheduling.plugins.params import PluginParams, parse_params
from router.scheduling.types import CycleState, Endpoint, LLMRequest

QUEUE_SCORER_TYPE = "queue-scorer"
KV_CACHE_SCORER_TYPE = "kv-cache-utilization-scorer"
TOKEN_LOAD_SCORER_TYPE = "token-load-scorer"


class NoParams(PluginParams):
    """A plugin without parameters (any key is an error)."""


class QueueScorer:
    """Fewer waiting requests, higher score; min-max normalised over the candidates."""

    plugin_type = QUEUE_SCORER_TYPE

    def __init__(self, name: str) -> None:
        self.name = name

    def score(self, state: CycleState, request: LLMRequest, endpoints: Sequence[Endpoint]) -> list[float]:
        """``(max − waiting) / (max − min)`` per endpoint; 1.0 for every endpoint when all are equal."""
        waiting = [ep.num_requests_waiting for ep in endpoints]
        lo, hi = min(waiting, default=0), max(waiting, default=0)
        if hi == lo:
            return [1.0] * len(endpoints)
        span = hi - lo
        return [(hi - w) / span for w in waiting]


class KVCacheUtilizationScorer:
    """More free KV cache, higher score."""

    plugin_type = KV_CACHE_SCORER_TYPE

    def __init__(self, name: str) -> None:
        self.name = name

    def score(self, state: CycleState, request: LLMRequest, endpoints: Sequence[Endpoint]) -> list[float]:
        """``1 − kv_cache_usage_perc`` per endpoint (the scheduler clamps values outside [0, 1])."""
        return [1.0 - ep.kv_cache_usage_perc for ep in endpoints]


class TokenLoadParams(PluginParams):
    """``queueThresholdTokens`` (tokens, default 4194304 = 128 requests × 32k tokens: llm-d's)."""

    queue_threshold_tokens: int = Field(4194304, ge=1)


class TokenLoadScorer:
    """Fewer in-flight uncached prompt tokens, higher score; 0 at or past the threshold."""

    plugin_type = TOKEN_LOAD_SCORER_TYPE

    def __init__(self, name: str, params: TokenLoadParams) -> None:
        self.name = name
        self.params = params

    def score(self, state: CycleState, request: LLMRequest, endpoints: Sequence[Endpoint]) -> list[float]:
        """``1 − min(1, in_flight_uncached_tokens / queueThresholdTokens)`` per endpoint."""
        threshold = self.params.queue_threshold_tokens
        return [1.0 - min(1.0, ep.in_flight_uncached_tokens / threshold) for ep in endpoints]


def build_queue_scorer(name: str, raw: Mapping[str, Any] | None, handle: PluginHandle) -> QueueScorer:
    """Factory of ``queue-scorer`` (no parameters)."""
    parse_params(NoParams, name, raw)
    return QueueScorer(name)


def build_kv_cache_scorer(name: str, raw: Mapping[str, Any] | None, handle: PluginHandle) -> KVCacheUtilizationScorer:
    """Factory of ``kv-cache-utilization-scorer`` (no parameters)."""
    parse_params(NoParams, name, raw)
    return KVCacheUtilizationScorer(name)


def build_token_load_scorer(name: str, raw: Mapping[str, Any] | None, handle: PluginHandle) -> TokenLoadScorer:
    """Factory of ``token-load-scorer``."""
    return TokenLoadScorer(name, parse_params(TokenLoadParams, name, raw))
