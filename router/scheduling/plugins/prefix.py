"""Prefix-cache plugins: two producers of per-endpoint prefix matches, and the scorer reading them.

llm-d splits prefix routing the same way (``approx-prefix-cache-producer`` /
``precise-prefix-cache-producer`` write ``PrefixCacheMatchInfo``; ``prefix-cache-scorer``,
``prefix-cache-affinity-filter`` and ``no-hit-lru-scorer`` read it):

* :class:`ApproxPrefixCacheProducer` — remembers which endpoint each prompt block was routed to
  (per-endpoint LRU of block keys, sized like the engine's cache) and learns from every decision.
* :class:`PrecisePrefixCacheProducer` — asks an injected :class:`PrefixIndex` (fed by the engines'
  KV events) and weights each endpoint's matched run by the tier it sits in.
* :class:`PrefixCacheScorer` — score = matched blocks / total blocks (optionally mixed with the
  absolute matched length).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import Field, field_validator

from router.scheduling.errors import ConfigError
from router.scheduling.hashing import MIN_BLOCK_SIZE_TOKENS, request_block_keys
from router.scheduling.interfaces import TIER_CPU, TIER_DISK, TIER_GPU, PluginHandle, PrefixIndex
from router.scheduling.plugins.params import PluginParams, parse_params
from router.scheduling.types import CycleState, Endpoint, LLMRequest, PrefixMatchInfo, prefix_match_key

if TYPE_CHECKING:
    from router.scheduling.types import SchedulingResult

APPROX_PRODUCER_TYPE = "approx-prefix-cache-producer"
PRECISE_PRODUCER_TYPE = "precise-prefix-cache-producer"
PREFIX_SCORER_TYPE = "prefix-cache-scorer"

#: llm-d's default per-server LRU capacity when the engine's cache size is unknown (blocks); from
#: the gateway-api-inference-extension prefix plugin (sized for an H100 80 GB serving an 8B model).
DEFAULT_LRU_CAPACITY_PER_SERVER = 31250
#: llm-d's default cap on matched prefix length: 128k tokens (the context window of large models).
DEFAULT_MAX_PREFIX_TOKENS = 131072
#: Tier weights: GPU 1.0 and CPU 0.8 from ROUTING.md (llm-d's KV indexer defaults); disk 0.5 is
#: ours ("lower": a disk load costs more than a CPU load, still far less than recomputing).
DEFAULT_TIER_WEIGHTS = {TIER_GPU: 1.0, TIER_CPU: 0.8, TIER_DISK: 0.5}


class _BlockParams(PluginParams):
    block_size_tokens: int = Field(MIN_BLOCK_SIZE_TOKENS, ge=1)
    max_prefix_blocks_to_match: int = Field(0, ge=0)
    max_prefix_tokens_to_match: int = Field(DEFAULT_MAX_PREFIX_TOKENS, ge=0)

    def effective_block_size(self) -> int:
        """Block size in tokens, raised to :data:`MIN_BLOCK_SIZE_TOKENS` as llm-d does."""
        return max(self.block_size_tokens, MIN_BLOCK_SIZE_TOKENS)

    def max_blocks(self) -> int:
        """Block cap per request (0 = none): the token cap wins when set, as in llm-d."""
        if self.max_prefix_tokens_to_match > 0:
            return max(1, self.max_prefix_tokens_to_match // self.effective_block_size())
        return self.max_prefix_blocks_to_match


class ApproxProducerParams(_BlockParams):
    """``approx-prefix-cache-producer`` parameters (llm-d names and defaults).

    ``autoTune``: size each endpoint's LRU from its scraped cache size, ``(num_gpu_blocks +
    num_cpu_blocks) × engine block_size / blockSizeTokens`` blocks; ``lruCapacityPerServer`` is used
    when that is off or the metrics are not known yet.
    """

    auto_tune: bool = True
    lru_capacity_per_server: int = Field(DEFAULT_LRU_CAPACITY_PER_SERVER, ge=1)


class ApproxPrefixCacheProducer:
    """Approximate prefix index: which endpoint was each prompt block last routed to.

    State: ``key → set of endpoint names`` plus, per endpoint, an LRU (``OrderedDict``) of the keys
    routed to it, capped at the endpoint's capacity in our blocks. About 200 bytes per (key,
    endpoint) entry in CPython.

    * :meth:`produce` writes a :class:`PrefixMatchInfo`: per endpoint, the consecutive blocks from
      block 0 it holds. Cost O(matched blocks × holders per block).
    * :meth:`pre_request` records every block of the prompt on the chosen endpoint (the engine
      will cache them once it has run the prefill) and evicts that endpoint's oldest blocks past
      its capacity.
    """

    plugin_type = APPROX_PRODUCER_TYPE

    def __init__(self, name: str, params: ApproxProducerParams) -> None:
        self.name = name
        self.params = params
        self.block_size_tokens = params.effective_block_size()
        self.max_blocks = params.max_blocks()
        self._key = prefix_match_key(name)
        self._holders: dict[int, set[str]] = {}
        self._lru: dict[str, OrderedDict[int, None]] = {}

    def capacity(self, endpoint: Endpoint) -> int:
        """LRU capacity for ``endpoint`` in our blocks (see :class:`ApproxProducerParams`)."""
        p = self.params
        if p.auto_tune and endpoint.num_gpu_blocks and endpoint.block_size:
            engine_tokens = (endpoint.num_gpu_blocks + endpoint.num_cpu_blocks) * endpoint.block_size
            return max(1, engine_tokens // self.block_size_tokens)
        return p.lru_capacity_per_server

    def produce(self, state: CycleState, request: LLMRequest, endpoints: Sequence[Endpoint]) -> None:
        """Write this request's matches under ``prefix-match/<name>``."""
        keys = request_block_keys(request, self.block_size_tokens, self.max_blocks)
        matched: dict[str, float] = {}
        holders_of = self._holders
        for i, key in enumerate(keys):
            holders = holders_of.get(key)
            if not holders:
                break
            advanced = False
            for ep in holders:
                if matched.get(ep, 0) == i:
                    matched[ep] = i + 1
                    advanced = True
            if not advanced:
                break
        state.write(self._key, PrefixMatchInfo(len(keys), self.block_size_tokens, matched))

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        """Learn the decision: the chosen endpoint now holds every block of the prompt."""
        keys = request_block_keys(request, self.block_size_tokens, self.max_blocks)
        if keys:
            self.record(result.endpoint, keys)

    def record(self, endpoint: Endpoint, keys: Sequence[int]) -> None:
        """Mark ``keys`` (block keys, block 0 first) as cached on ``endpoint``, most recent last."""
        name = endpoint.name
        lru = self._lru.get(name)
        if lru is None:
            lru = self._lru[name] = OrderedDict()
        holders_of = self._holders
        for key in keys:
            if key in lru:
                lru.move_to_end(key)
            else:
                lru[key] = None
                holders = holders_of.get(key)
                if holders is None:
                    holders_of[key] = {name}
                else:
                    holders.add(name)
        cap = self.capacity(endpoint)
        while len(lru) > cap:
            old, _ = lru.popitem(last=False)
            self._drop_holder(old, name)

    def forget_endpoint(self, name: str) -> None:
        """Drop every entry of endpoint ``name`` (it left the pool or restarted empty)."""
        lru = self._lru.pop(name, None)
        for key in lru or ():
            self._drop_holder(key, name)

    def blocks_held(self, name: str) -> int:
        """Blocks currently recorded for endpoint ``name`` (for the admin page and tests)."""
        lru = self._lru.get(name)
        return len(lru) if lru is not None else 0

    def _drop_holder(self, key: int, name: str) -> None:
        holders = self._holders.get(key)
        if holders is not None:
            holders.discard(name)
            if not holders:
                del self._holders[key]


class SpeculativePrefixIndex(PrefixIndex, Protocol):
    """A :class:`PrefixIndex` that can hold speculative entries: blocks a decision has just sent to
    an endpoint, visible for ``ttl_s`` seconds until the engine's own KV events confirm them."""

    def add_speculative(self, model: str, endpoint_name: str, block_keys: Sequence[int], ttl_s: float) -> None: ...


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m)?\s*$")


def _seconds(value: Any) -> float:
    """A duration in seconds from a number of seconds or a Go-style string (``2s``, ``500ms``)."""
    if isinstance(value, int | float):
        return float(value)
    match = _DURATION.match(str(value))
    if not match:
        raise ValueError(f"not a duration: {value!r} (use seconds or '500ms' / '2s' / '1m')")
    number, unit = float(match.group(1)), match.group(2) or "s"
    return number * {"ms": 0.001, "s": 1.0, "m": 60.0}[unit]


class PreciseProducerParams(_BlockParams):
    """``precise-prefix-cache-producer`` parameters.

    ``tierWeights``: weight per tier of a matched block (defaults :data:`DEFAULT_TIER_WEIGHTS`).
    ``speculativeIndexing`` / ``speculativeTTL`` (llm-d names; default off / 2 s): on a decision,
    tell the index the blocks are on the chosen endpoint until its KV events arrive. The entries
    last while the request runs (an engine announces a prompt's blocks only once it has admitted
    the request — vLLM: once each prefill chunk is computed — which for a queued or long prompt is
    well past 2 s) and ``speculativeTTL`` after its response completes; ``speculativeMaxHold``
    (default 10 min, the bench's and most clients' upper bound on one request) bounds a hold whose
    completion the router never sees.
    """

    tier_weights: dict[str, float] = Field(default_factory=lambda: dict(DEFAULT_TIER_WEIGHTS))
    speculative_indexing: bool = False
    speculative_ttl: float = Field(2.0, alias="speculativeTTL", gt=0)
    speculative_max_hold: float = Field(600.0, gt=0)

    @field_validator("speculative_ttl", "speculative_max_hold", mode="before")
    @classmethod
    def _parse_ttl(cls, value: Any) -> float:
        return _seconds(value)

    @field_validator("tier_weights")
    @classmethod
    def _check_weights(cls, value: dict[str, float]) -> dict[str, float]:
        for tier, weight in value.items():
            if not 0.0 <= weight <= 1.0:
                raise ValueError(f"tier weight {tier}={weight} outside [0, 1]")
        return {tier.lower(): weight for tier, weight in value.items()}


class PrecisePrefixCacheProducer:
    """Per-endpoint prefix matches from an injected KV-event index, weighted by tier.

    ``matched[endpoint] = Σ over the run's blocks of tierWeights[the block's fastest tier]`` (a tier
    missing from the weights counts 0), so a run found only in the CPU tier scores 0.8 of the same
    run on GPU, and a run on GPU but for its last block scores ``n − 0.2``. With an index that only
    answers :meth:`~router.scheduling.interfaces.PrefixIndex.longest_prefix` (no
    ``longest_prefix_tiers``), the whole run is weighted by its slowest tier.
    """

    plugin_type = PRECISE_PRODUCER_TYPE

    def __init__(self, name: str, params: PreciseProducerParams, index: PrefixIndex) -> None:
        self.name = name
        self.params = params
        self.index = index
        self.block_size_tokens = params.effective_block_size()
        self.max_blocks = params.max_blocks()
        self._key = prefix_match_key(name)
        self._weights = params.tier_weights
        self._by_tier = getattr(index, "longest_prefix_tiers", None)

    def produce(self, state: CycleState, request: LLMRequest, endpoints: Sequence[Endpoint]) -> None:
        """Write this request's tier-weighted matches (and the blocks held in any tier) under
        ``prefix-match/<name>``."""
        keys = request_block_keys(request, self.block_size_tokens, self.max_blocks)
        matched: dict[str, float] = {}
        held: dict[str, int] = {}
        if keys:
            weights = self._weights
            if self._by_tier is not None:
                wg, wc, wd = (weights.get(t, 0.0) for t in (TIER_GPU, TIER_CPU, TIER_DISK))
                tiers: Mapping[str, tuple[int, int, int]] = self._by_tier(request.model, keys)
                for ep, (g, c, d) in tiers.items():
                    weighted = g * wg + c * wc + d * wd
                    if weighted > 0:
                        matched[ep] = weighted
                        held[ep] = g + c + d
            else:
                found: Mapping[str, tuple[int, str]] = self.index.longest_prefix(request.model, keys)
                for ep, (blocks, tier) in found.items():
                    weighted = blocks * weights.get(tier.lower(), 0.0)
                    if weighted > 0:
                        matched[ep] = weighted
                        held[ep] = blocks
        state.write(self._key, PrefixMatchInfo(len(keys), self.block_size_tokens, matched, held))

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        """With ``speculativeIndexing``, seed the index with the blocks just routed, held until the
        response completes (at most ``speculativeMaxHold``)."""
        self._speculate(request, result.endpoint.name, self.params.speculative_max_hold)

    def response_complete(self, request: LLMRequest, endpoint: Endpoint, cached_tokens: int | None) -> None:
        """With ``speculativeIndexing``: the blocks still unconfirmed by KV events stay
        speculative for ``speculativeTTL`` more seconds (the last events' delivery)."""
        self._speculate(request, endpoint.name, self.params.speculative_ttl)

    def _speculate(self, request: LLMRequest, endpoint_name: str, ttl_s: float) -> None:
        if not self.params.speculative_indexing:
            return
        keys = request_block_keys(request, self.block_size_tokens, self.max_blocks)
        if keys:
            self.index.add_speculative(  # type: ignore[attr-defined]  # checked at build time
                request.model, endpoint_name, keys, ttl_s
            )


class PrefixScorerParams(PluginParams):
    """``prefix-cache-scorer`` parameters (llm-d names and defaults).

    ``prefixMatchInfoProducerName``: the producer instance to read (default: the approximate
    producer, created with default parameters if the config does not declare it — as llm-d does).
    ``prefixLengthWeight`` (0..1, default 0) and ``maxModelLen`` (tokens, default 8192): mix in the
    absolute matched length, ``min(1, matched tokens / maxModelLen)²``.
    """

    prefix_match_info_producer_name: str = APPROX_PRODUCER_TYPE
    prefix_length_weight: float = Field(0.0, ge=0.0, le=1.0)
    max_model_len: int = Field(8192, ge=1)


class PrefixCacheScorer:
    """``score = w × min(1, matched × block / maxModelLen)² + (1 − w) × matched / total``, with
    ``w = prefixLengthWeight``; 0 for an endpoint without a match or a prompt without full blocks."""

    plugin_type = PREFIX_SCORER_TYPE

    def __init__(self, name: str, params: PrefixScorerParams) -> None:
        self.name = name
        self.params = params
        self.requires = {params.prefix_match_info_producer_name: APPROX_PRODUCER_TYPE}
        self._key = prefix_match_key(params.prefix_match_info_producer_name)

    def score(self, state: CycleState, request: LLMRequest, endpoints: Sequence[Endpoint]) -> list[float]:
        """One score per endpoint, in [0, 1]."""
        info: PrefixMatchInfo | None = state.read(self._key)
        if info is None or info.total_blocks <= 0:
            return [0.0] * len(endpoints)
        matched, total = info.matched, info.total_blocks
        w = self.params.prefix_length_weight
        if w == 0.0:
            return [matched.get(ep.name, 0.0) / total for ep in endpoints]
        scale = info.block_size_tokens / self.params.max_model_len
        out = []
        for ep in endpoints:
            m = matched.get(ep.name, 0.0)
            out.append(w * min(1.0, m * scale) ** 2 + (1.0 - w) * m / total)
        return out


def build_approx_producer(name: str, raw: Mapping[str, Any] | None, handle: PluginHandle) -> ApproxPrefixCacheProducer:
    """Factory of ``approx-prefix-cache-producer``."""
    return ApproxPrefixCacheProducer(name, parse_params(ApproxProducerParams, name, raw))


def build_precise_producer(name: str, raw: Mapping[str, Any] | None, handle: PluginHandle) -> PrecisePrefixCacheProducer:
    """Factory of ``precise-prefix-cache-producer``.

    Raises:
        ConfigError: no index was injected through the handle, or ``speculativeIndexing`` is on
            and the index has no ``add_speculative``.
    """
    params = parse_params(PreciseProducerParams, name, raw)
    if handle.prefix_index is None:
        raise ConfigError(f"plugin {name!r}: {PRECISE_PRODUCER_TYPE} needs a prefix index (PluginHandle.prefix_index)")
    if params.speculative_indexing and not callable(getattr(handle.prefix_index, "add_speculative", None)):
        raise ConfigError(f"plugin {name!r}: speculativeIndexing needs an index with add_speculative()")
    return PrecisePrefixCacheProducer(name, params, handle.prefix_index)


def build_prefix_scorer(name: str, raw: Mapping[str, Any] | None, handle: PluginHandle) -> PrefixCacheScorer:
    """Factory of ``prefix-cache-scorer``."""
    return PrefixCacheScorer(name, parse_params(PrefixScorerParams, name, raw))
