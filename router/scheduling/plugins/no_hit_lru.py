"""``no-hit-lru-scorer``: spread requests that hit no cache over the endpoints (llm-d's).

A request is *cold* when its prefix producer found no endpoint holding even its first block (or no
producer data is there). Cold requests create the most new KV blocks, so they go to the endpoint
that least recently received a cold request: with ``n`` candidates, candidates never given a cold
request come first (in pool order), then the others from least to most recently used, and the
candidate at rank ``r`` scores ``1 − r / (n − 1)`` (1.0 for a single candidate). Warm requests get a
neutral 0.5 everywhere. After the decision (:meth:`pre_request`) a cold request's endpoint becomes
the most recently used. Ranks are taken among the candidates only (llm-d ranks against every
endpoint it remembers, which can push scores below 0).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pydantic import Field

from router.scheduling.interfaces import PluginHandle
from router.scheduling.plugins.params import PluginParams, parse_params
from router.scheduling.plugins.prefix import APPROX_PRODUCER_TYPE
from router.scheduling.types import CycleState, Endpoint, LLMRequest, PrefixMatchInfo, prefix_match_key

if TYPE_CHECKING:
    from router.scheduling.types import SchedulingResult

NO_HIT_LRU_TYPE = "no-hit-lru-scorer"


class NoHitLRUParams(PluginParams):
    """``prefixMatchInfoProducerName`` (default the approximate producer); ``lruSize`` (endpoints
    remembered, default 1024: llm-d's)."""

    prefix_match_info_producer_name: str = APPROX_PRODUCER_TYPE
    lru_size: int = Field(1024, ge=1)


class NoHitLRUScorer:
    """See the module docstring."""

    plugin_type = NO_HIT_LRU_TYPE

    def __init__(self, name: str, params: NoHitLRUParams) -> None:
        self.name = name
        self.params = params
        self.requires = {params.prefix_match_info_producer_name: APPROX_PRODUCER_TYPE}
        self._match_key = prefix_match_key(params.prefix_match_info_producer_name)
        self._cold_key = f"cold/{name}"
        self._lru: OrderedDict[str, None] = OrderedDict()  # oldest first

    def score(self, state: CycleState, request: LLMRequest, endpoints: Sequence[Endpoint]) -> list[float]:
        """LRU rank scores for a cold request, 0.5 everywhere for a warm one."""
        info: PrefixMatchInfo | None = state.read(self._match_key)
        cold = info is None or not info.matched
        state.write(self._cold_key, cold)
        n = len(endpoints)
        if not cold:
            return [0.5] * n
        if n == 1:
            return [1.0]
        lru = self._lru
        never = [i for i, ep in enumerate(endpoints) if ep.name not in lru]
        position = {name: pos for pos, name in enumerate(lru)}
        used = sorted((i for i, ep in enumerate(endpoints) if ep.name in lru), key=lambda i: position[endpoints[i].name])
        scores = [0.0] * n
        for rank, i in enumerate(never + used):
            scores[i] = 1.0 - rank / (n - 1)
        return scores

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        """A cold request's endpoint becomes the most recently used."""
        if not result.state.read(self._cold_key, False):
            return
        name = result.endpoint.name
        self._lru[name] = None
        self._lru.move_to_end(name)
        while len(self._lru) > self.params.lru_size:
            self._lru.popitem(last=False)


def build_no_hit_lru(name: str, raw: Mapping[str, Any] | None, handle: PluginHandle) -> NoHitLRUScorer:
    """Factory of ``no-hit-lru-scorer``."""
    return NoHitLRUScorer(name, parse_params(NoHitLRUParams, name, raw))
