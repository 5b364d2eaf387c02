"""Data the scheduler works on: endpoints, the request being placed, and per-decision state.

* :class:`Endpoint` — one engine (its base URL), its scraped metrics and the router's own in-flight
  counters. Mutable: the pool updates it in place (scrapes, in-flight counters); plugins only read it.
* :class:`LLMRequest` — what the scheduler knows about one request (model, prompt tokens or bytes,
  session, objective). Carries a memo of its prompt block keys so the prompt is hashed once per
  request, whichever plugins ask (see :mod:`router.scheduling.hashing`).
* :class:`CycleState` — a scratch map for one scheduling decision: producers write, filters,
  scorers and post-decision hooks read (llm-d's ``CycleState``).
* :class:`PrefixMatchInfo` — what a prefix producer writes into the cycle state for its consumers
  (llm-d's ``PrefixCacheMatchInfo``).
* :class:`SchedulingResult` — one decision: the chosen endpoint, the candidates and their scores.

Metric names follow vLLM's ``/metrics`` (``vllm:num_requests_waiting`` → ``num_requests_waiting``),
see ``shared/contracts/vllm-engine.md``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

#: Engine roles (llm-d's pod label ``llm-d.ai/role``, ``pkg/plugins/filter/pd_role.go``): a ``prefill``
#: engine computes prompts and hands their KV to a decode engine; a ``decode`` engine generates (and
#: computes a prompt itself when the request is not disaggregated); ``both`` does either (an engine
#: with no role: every engine before prefill/decode disaggregation).
ROLE_PREFILL = "prefill"
ROLE_DECODE = "decode"
ROLE_BOTH = "both"
ROLES = (ROLE_PREFILL, ROLE_DECODE, ROLE_BOTH)

#: Bytes of prompt text per pseudo-token in the ``estimate`` tokenizer backend (ROUTING.md: "about
#: 4 bytes per token"; llm-d's estimate backend uses the same figure).
ESTIMATE_BYTES_PER_TOKEN = 4

T = TypeVar("T")


@dataclass(slots=True, eq=False)
class Endpoint:
    """One engine endpoint as the scheduler sees it.

    Attributes:
        name: the engine's base URL (``http://10.0.0.7:8000``); unique in the pool, used as key in
            every per-endpoint index.
        num_requests_waiting: ``vllm:num_requests_waiting`` (requests).
        num_requests_running: ``vllm:num_requests_running`` (requests).
        kv_cache_usage_perc: ``vllm:kv_cache_usage_perc``, a fraction 0..1 (despite the name).
        block_size: engine KV block size in tokens (``vllm:cache_config_info{block_size}``); None
            until scraped.
        num_gpu_blocks: GPU KV blocks of the engine (``vllm:cache_config_info{num_gpu_blocks}``);
            None until scraped.
        num_cpu_blocks: blocks of the engine's CPU offload tier, in engine blocks (from the
            endpoint's config or ``cache_config_info{num_cpu_blocks}``); 0 when there is none.
        metrics_updated_at: time of the last successful scrape, in seconds on the router's
            monotonic clock; None before the first scrape (counts as stale).
        in_flight_requests: requests the router has forwarded and not yet seen finish.
        in_flight_uncached_tokens: prompt tokens of those requests that the router expected the
            engine to compute (not served from its prefix cache) and whose prefill has not ended
            yet (no first streamed chunk), in tokens: the endpoint's queued prefill work.
        peak_running: the most requests the endpoint has been seen running at once (scraped);
            a lower bound of its batch size (``max_num_seqs``), which the router uses to tell how
            many requests it sent since the last scrape will have started rather than queued.
        learned_max_num_seqs: the endpoint's sequence slots (vLLM's ``max_num_seqs``) as learned
            from scrapes: None until scrapes showed it full (running ``peak_running`` with others
            waiting, :data:`router.pool.slots.FULL_SCRAPES` in a row); then ``peak_running``
            (:func:`router.pool.slots.learn_slots`).
        full_scrapes: scrapes in a row that showed the endpoint full (the learning's count).
        slots_confirmed_at: when scrapes last confirmed ``learned_max_num_seqs`` (router's
            monotonic clock, seconds); None before.
        probe_since: while the learned count is probed upward, when the probe started or last
            found a slot (same clock); None otherwise.
        stated_max_num_seqs: the endpoint's sequence slots as the engine states them (requests,
            summed over its data-parallel ranks): ``backfill:engine_config_info{max_num_seqs}`` in
            its ``/metrics`` (backfill's vLLM plugin, the engine twin), else vLLM's
            ``/server_info`` (:mod:`router.pool.slots`); None while it states none. Overrides
            the learned figure.
        max_num_seqs: a configured slot count (router setting ``max_num_seqs``); overrides the
            stated and learned ones. None: take the engine's.
        in_flight_sheddable: of ``in_flight_requests``, those of sheddable bands
            (:attr:`LLMRequest.sheddable`), requests; the slot reserve counts them.
        mean_request_duration_s: exponentially weighted mean of the durations, in seconds, of
            the requests the router forwarded there that completed (forward → end of the
            response, so engine queueing included); None before the first. The pool keeps it
            (:meth:`router.pool.state.PoolState.finished`).
        in_flight_sheddable_prefill_tokens: uncached prompt tokens of the sheddable requests forwarded
            there whose prefill the router counts as in progress (no first chunk, not answered, sent
            within the pool's ``batch_prefill_window_s``), tokens; the batch prefill share bounds them.
        interactive_rate_per_s: non-sheddable requests forwarded there per second, an exponentially
            weighted rate as of ``interactive_rate_at`` (:meth:`interactive_rate`; the pool keeps it).
        interactive_rate_at: time of the last update of that rate (router's monotonic clock); None
            before the first non-sheddable request.
        mean_interactive_duration_s: EWMA of the durations of the completed non-sheddable requests
            there (seconds, as ``mean_request_duration_s``); None before the first.
        num_preemptions: ``vllm:num_preemptions_total`` at the last scrape (requests).
        role: :data:`ROLE_PREFILL`, :data:`ROLE_DECODE` or :data:`ROLE_BOTH` (default): what the
            ``prefill-filter`` / ``decode-filter`` keep (``--prefill-engine``, ``--decode-engine``,
            ``--engine``; the pod label ``llm-d.ai/role`` with discovery).
    """

    name: str
    num_requests_waiting: int = 0
    num_requests_running: int = 0
    kv_cache_usage_perc: float = 0.0
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    num_cpu_blocks: int = 0
    metrics_updated_at: float | None = None
    in_flight_requests: int = 0
    in_flight_uncached_tokens: int = 0
    peak_running: int = 0
    learned_max_num_seqs: int | None = None
    full_scrapes: int = 0
    slots_confirmed_at: float | None = None
    probe_since: float | None = None
    stated_max_num_seqs: int | None = None
    max_num_seqs: int | None = None
    in_flight_sheddable: int = 0
    mean_request_duration_s: float | None = None
    in_flight_sheddable_prefill_tokens: int = 0
    interactive_rate_per_s: float = 0.0
    interactive_rate_at: float | None = None
    mean_interactive_duration_s: float | None = None
    num_preemptions: int = 0
    role: str = ROLE_BOTH

    @property
    def can_prefill(self) -> bool:
        """The engine may run a disaggregated prefill (role ``prefill`` or ``both``)."""
        return self.role != ROLE_DECODE

    @property
    def can_decode(self) -> bool:
        """The engine may decode, and run whole requests (role ``decode`` or ``both``)."""
        return self.role != ROLE_PREFILL

    def interactive_rate(self, now: float, tau_s: float = 10.0) -> float:
        """The non-sheddable arrival rate at ``now`` (requests/s): :attr:`interactive_rate_per_s`
        decayed by ``exp(−(now − interactive_rate_at) / tau_s)`` (the pool's time constant)."""
        if self.interactive_rate_at is None:
            return 0.0
        return self.interactive_rate_per_s * math.exp(-max(0.0, now - self.interactive_rate_at) / tau_s)

    @property
    def probing(self) -> bool:
        """The learned slot count is being probed upward (:func:`router.pool.slots.learn_slots`):
        neither configured nor stated, and unconfirmed for a while."""
        return self.probe_since is not None and self.max_num_seqs is None and self.stated_max_num_seqs is None

    @property
    def slots(self) -> int | None:
        """The sequence slots the router assumes (requests): the configured ``max_num_seqs``,
        else the one the engine states, else the learned one; None while unknown (no slot
        reserve applies then)."""
        if self.max_num_seqs is not None:
            return self.max_num_seqs
        if self.stated_max_num_seqs is not None:
            return self.stated_max_num_seqs
        return self.learned_max_num_seqs


@dataclass(slots=True, eq=False)
class LLMRequest:
    """The request being placed.

    Attributes:
        request_id: unique id (the ``x-request-id`` header or one the router made).
        model: the ``model`` field of the OpenAI body; also seeds the prefix hash chain.
        prompt_token_ids: the prompt as token ids (``hf`` / ``engine`` tokenizer backends), or None
            with the ``estimate`` backend.
        prompt_bytes: the prompt text as UTF-8 bytes, used by the ``estimate`` backend
            (:data:`ESTIMATE_BYTES_PER_TOKEN` bytes per pseudo-token) when token ids are None.
        session_id: the session the request belongs to (a session header), or None.
        objective: the objective name (``interactive``, ``async``, ``batch``…) or None.
        priority: the objective's priority, llm-d's convention (higher is more important).
        sheddable: the objective's flow-control band is sheddable (runs on spare capacity only;
            ``router/flow_control/config.py``); set by the director.
        cache_salt: vLLM's ``cache_salt``: requests with different salts never share cache blocks,
            so the salt is mixed into the hash seed.
        block_key_cache: memo of hashed block keys, keyed by (block size in tokens, block cap);
            filled by :func:`router.scheduling.hashing.request_block_keys`, never by callers.
    """

    request_id: str
    model: str
    prompt_token_ids: Sequence[int] | None = None
    prompt_bytes: bytes | None = None
    session_id: str | None = None
    objective: str | None = None
    priority: int = 0
    sheddable: bool = False
    cache_salt: str | None = None
    block_key_cache: dict[tuple[int, int], list[int]] = field(default_factory=dict, repr=False)

    @property
    def prompt_tokens(self) -> int:
        """Prompt length in tokens: the token count, or bytes / 4 with the ``estimate`` backend."""
        if self.prompt_token_ids is not None:
            return len(self.prompt_token_ids)
        if self.prompt_bytes is not None:
            return len(self.prompt_bytes) // ESTIMATE_BYTES_PER_TOKEN
        return 0


@dataclass(slots=True)
class PrefixMatchInfo:
    """Per-endpoint prefix matches of one request, written by a prefix producer.

    Attributes:
        total_blocks: full blocks in the request's prompt (capped by the producer's block cap).
        block_size_tokens: tokens per block.
        matched: endpoint name → matched blocks from block 0, weighted by cache tier (a run found
            in the CPU tier counts 0.8 per block, etc.); endpoints with no match are absent.
        held: endpoint name → the same runs in blocks, every tier counted whole (a CPU-tier block
            is loaded, not recomputed); None when no tier weighs less than 1 (then ``matched``).
    """

    total_blocks: int
    block_size_tokens: int
    matched: dict[str, float]
    held: dict[str, int] | None = None

    def held_blocks(self, endpoint_name: str) -> float:
        """Blocks of the prompt the endpoint holds from block 0 in any tier (``held``, else
        ``matched``)."""
        source: Mapping[str, float] = self.matched if self.held is None else self.held
        return source.get(endpoint_name, 0)

    def prefill_tokens(self, endpoint_name: str, prompt_tokens: int) -> int:
        """Prompt tokens the endpoint would compute, in tokens: prompt − tokens held in any tier."""
        return max(0, prompt_tokens - int(self.held_blocks(endpoint_name) * self.block_size_tokens))

    def ratio(self, endpoint_name: str) -> float:
        """Matched fraction of the prompt's blocks on ``endpoint_name``, 0..1 (0 with no blocks)."""
        if self.total_blocks <= 0:
            return 0.0
        return self.matched.get(endpoint_name, 0.0) / self.total_blocks

    def ratio_of(self, matched_blocks: float) -> float:
        """``matched_blocks`` as a fraction of the prompt's blocks, 0..1 (0 with no blocks)."""
        return matched_blocks / self.total_blocks if self.total_blocks > 0 else 0.0

    def uncached_tokens(self, endpoint_name: str, prompt_tokens: int) -> int:
        """Prompt tokens the endpoint would have to compute, in tokens (prompt − matched tokens)."""
        cached = int(self.matched.get(endpoint_name, 0.0) * self.block_size_tokens)
        return max(0, prompt_tokens - cached)


class CycleState:
    """Scratch state of one scheduling decision (llm-d's ``CycleState``).

    Keys are strings chosen by the writer, by convention ``"<kind>/<plugin instance name>"`` (see
    :func:`prefix_match_key`). A new CycleState is made for every decision and kept on the
    decision's result so post-decision hooks can read what producers and scorers wrote.
    """

    __slots__ = ("_data",)

    def __init__(self) -> None:
        self._data: dict[str, Any] = {}

    def write(self, key: str, value: Any) -> None:
        """Store ``value`` under ``key`` (overwrites)."""
        self._data[key] = value

    def read(self, key: str, default: Any = None) -> Any:
        """The value under ``key``, or ``default`` when nothing was written."""
        return self._data.get(key, default)

    def first(self, kind: type[T]) -> T | None:
        """The first value written that is a ``kind`` (e.g. the :class:`PrefixMatchInfo` of
        whichever producer ran), or None."""
        return next((v for v in self._data.values() if isinstance(v, kind)), None)


def prefix_match_key(producer_name: str) -> str:
    """The CycleState key under which the producer named ``producer_name`` stores its
    :class:`PrefixMatchInfo`."""
    return f"prefix-match/{producer_name}"


@dataclass(slots=True)
class SchedulingResult:
    """One decision.

    Attributes:
        profile: the profile's name.
        endpoint: the chosen endpoint.
        candidates: the endpoints left after the filters (scores below are aligned with these).
        totals: weighted total score per candidate.
        scores: scorer instance name → its clamped scores (0..1, before weighting) per candidate.
        state: the decision's CycleState (producers' data, filter outcomes) for hooks and metrics.
    """

    profile: str
    endpoint: Endpoint
    candidates: list[Endpoint]
    totals: list[float]
    scores: dict[str, list[float]]
    state: CycleState

    def breakdown(self) -> dict[str, dict[str, float]]:
        """Per-scorer scores keyed by endpoint name, plus ``"total"`` (for debug logs and tests)."""
        names = [ep.name for ep in self.candidates]
        out = {scorer: dict(zip(names, values)) for scorer, values in self.scores.items()}
        out["total"] = dict(zip(names, self.totals))
        return out


@dataclass(slots=True)
class PDDecision:
    """Where one request goes with prefill/decode disaggregation
    (:meth:`router.scheduling.scheduler.Scheduler.decide`).

    Attributes:
        decode: the decode profile's decision: the endpoint that answers the client (llm-d's
            primary profile). Without a P/D profile handler: the only decision.
        prefill: the prefill profile's decision when the request is disaggregated, else None
            (the decode endpoint computes the prompt too).
        reason: ``disaggregated`` or why not (``below_threshold``, ``no_prefill_endpoint``, …:
            :class:`router.scheduling.plugins.disagg.PDReason`); ``single_profile`` when no P/D
            profile handler decided.
        uncached_tokens: prompt tokens the decode endpoint would compute itself (prompt minus its
            prefix match), tokens.
    """

    decode: SchedulingResult
    prefill: SchedulingResult | None
    reason: str
    uncached_tokens: int

    @property
    def disaggregated(self) -> bool:
        """A prefill engine computes the prompt and hands its KV to the decode engine."""
        return self.prefill is not None
