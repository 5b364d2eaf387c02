"""One engine twin driven in model time: the driver the fleet simulator and the engine-level
benchmarks (frontier, pollution, interference) share.

A :class:`ModelTimeEngine` owns the twin's pure :class:`~engine_twin.core.EngineCore` over its
own :class:`~engine_twin.kv_cache.TieredPrefixCache` (GPU, CPU and disk tiers sized from the
:class:`~engine_twin.settings.EngineSimSettings`), the classes the ``engine-sim`` server drives in
real time. Nothing here reads a clock: a step that starts at model time ``now`` lasts
``StepOutcome.duration`` model seconds (:mod:`engine_twin.step_model`: Llama-3.1-8B bf16 on one
H100 SXM, published figures), whatever ``--time-scale`` says.

Two ways to drive it:

* **an outer event loop** (the simulator): :meth:`ModelTimeEngine.step` at the loop's ``now``;
  the loop keeps the time and the engine counts steps, busy seconds and sampled tokens;
* **its own clock** (the benchmarks): :attr:`ModelTimeEngine.now` advances by each step's
  duration (:meth:`~ModelTimeEngine.advance`), and :meth:`~ModelTimeEngine.run_until_idle` runs a
  closed set of requests to completion with per-token and per-request callbacks.

Requests get their KV retention from the one rule,
:func:`engine_twin.retention.request_retention`, as the twin's server gives it.
"""

from __future__ import annotations

from collections.abc import Callable

from engine_twin import kv_events as twin
from engine_twin.core import CoreRequest, EngineCore, StepOutcome
from engine_twin.kv_cache import TieredPrefixCache, block_hashes, none_hash
from engine_twin.retention import request_retention
from engine_twin.settings import EngineSimSettings
from router.pool import EngineMetrics

TokenCallback = Callable[[str, float], None]
"""Called with a request id and the model time (seconds) at the end of the step concerned."""


class ModelTimeEngine:
    """One engine core and its cache in model time (module docstring).

    ``collect_events``: keep the cache's KV events (vLLM's ``BlockStored`` / ``BlockRemoved`` /
    ``AllBlocksCleared``) in :attr:`pending` until :meth:`take_events`. ``root``: the parent hash
    of block 0 (vLLM's ``NONE_HASH``) for prompts hashed by :meth:`request`; default
    ``none_hash`` of the settings' ``--hash-seed``, ``"0"`` when it has none, so model-time runs
    hash the same in every process."""

    def __init__(self, settings: EngineSimSettings, *, collect_events: bool = False, root: bytes | None = None):
        self.settings = settings
        self.pending: list[twin.KVEvent] = []
        """KV events of the steps since the last :meth:`take_events` (empty unless ``collect_events``)."""
        self.cache = TieredPrefixCache(settings.num_gpu_blocks, settings.block_size, settings.cpu_offload_blocks,
                                       settings.disk_offload_blocks,
                                       sink=self.pending.extend if collect_events else None)
        self.core = EngineCore(settings, self.cache)
        self.root = root if root is not None else none_hash(settings.hash_seed if settings.hash_seed is not None
                                                           else "0")
        self.now = 0.0
        """Model seconds: the engine's own clock (:meth:`advance`); an outer loop keeps its own."""
        self.steps = 0
        """Steps that ran (scheduled something: a nonzero duration)."""
        self.busy_s = 0.0
        """Model seconds spent in those steps."""
        self.generated = 0
        """Output tokens sampled (a P/D prefill engine's: one per prefill leg)."""
        self._ids = 0

    # ---- requests --------------------------------------------------------------------------
    def request(self, prompt: list[int], max_tokens: int, priority: int = 0, *, request_id: str | None = None,
                hashes: list[bytes] | None = None, kv_retention_priority: int | None = None) -> CoreRequest:
        """A core request for ``prompt`` (token ids) and ``max_tokens`` output tokens, vLLM
        ``priority`` (lower runs first), its retention from the one rule (module docstring).
        ``request_id`` defaults to ``r1``, ``r2``, …; ``hashes`` (the prompt's full-block hashes)
        to :func:`~engine_twin.kv_cache.block_hashes` of ``prompt`` chained on :attr:`root`."""
        if request_id is None:
            self._ids += 1
            request_id = f"r{self._ids}"
        if hashes is None:
            hashes = block_hashes(prompt, self.settings.block_size, self.root)
        retention = request_retention(priority, self.settings.retention_priority_threshold, kv_retention_priority)
        return CoreRequest(request_id, prompt, max_tokens, hashes, priority, retention)

    def submit(self, req: CoreRequest, at: float | None = None) -> CoreRequest:
        """Queue ``req`` arriving at model time ``at`` (default :attr:`now`); returns it. Raises
        ValueError when it can never fit in the GPU cache or its id is in use
        (:meth:`EngineCore.add <engine_twin.core.EngineCore.add>`)."""
        self.core.add(req, self.now if at is None else at)
        return req

    # ---- steps -----------------------------------------------------------------------------
    def step(self, now: float) -> StepOutcome:
        """One core step starting at model time ``now``; its KV events land in :attr:`pending`.
        Counts :attr:`steps`, :attr:`busy_s` and :attr:`generated` (the simulator's hot path: keep
        it lean)."""
        outcome = self.core.step(now)
        if outcome.duration:
            self.steps += 1
            self.busy_s += outcome.duration
            self.generated += len(outcome.sampled)
        return outcome

    def advance(self) -> StepOutcome:
        """One step at :attr:`now`; :attr:`now` moves to its end."""
        outcome = self.step(self.now)
        self.now += outcome.duration
        return outcome

    def run_until_idle(self, on_sampled: TokenCallback | None = None, on_finished: TokenCallback | None = None,
                       *, max_steps: int | None = None) -> None:
        """Step from :attr:`now` until no request is left. After each step ``on_sampled`` gets every
        request that sampled a token and ``on_finished`` every request that ended, with the step's end
        (model seconds); callbacks may :meth:`submit` more (a closed loop). Raises RuntimeError when a
        step schedules nothing while requests remain (they could never run) or after ``max_steps``
        steps."""
        core = self.core
        taken = 0
        while core.has_work():
            out = self.advance()
            if not out.scheduled:
                raise RuntimeError("the engine has work but scheduled nothing")
            if on_sampled is not None:
                for rid in out.sampled:
                    on_sampled(rid, self.now)
            if on_finished is not None:
                for rid in out.finished:
                    on_finished(rid, self.now)
            taken += 1
            if max_steps is not None and taken > max_steps:
                raise RuntimeError(f"the engine was not idle after {max_steps:,} steps")

    def serve_alone(self, req: CoreRequest) -> float:
        """Submit ``req`` at :attr:`now` and run until idle (alone, when nothing else is queued);
        returns its TTFT in model seconds: the end of the step that sampled its first token − arrival."""
        start = self.now
        first: list[float] = []
        rid = req.request_id

        def sampled(sampled_id: str, t: float) -> None:
            if sampled_id == rid and not first:
                first.append(t)

        self.submit(req, start)
        self.run_until_idle(on_sampled=sampled)
        return first[0] - start

    # ---- what the engine publishes -----------------------------------------------------------
    def take_events(self) -> list[twin.KVEvent]:
        """The KV events collected since the last call (oldest first), as one step batch."""
        if not self.pending:
            return []
        out = list(self.pending)
        self.pending.clear()
        return out

    def metrics(self) -> EngineMetrics:
        """What a scrape of this engine's ``/metrics`` would parse to (vLLM's ``vllm:`` series as
        :class:`router.pool.EngineMetrics` reads them; counters as floats, usage 0 … 1)."""
        core, cache = self.core, self.cache
        stats = cache.stats
        return EngineMetrics(num_requests_waiting=core.num_waiting, num_requests_running=core.num_running,
                             kv_cache_usage_perc=cache.usage, block_size=cache.block_size,
                             num_gpu_blocks=cache.num_gpu_blocks, num_cpu_blocks=cache.cpu_capacity,
                             prefix_cache_queries=float(stats.queries_tokens), prefix_cache_hits=float(stats.hits_tokens),
                             external_prefix_cache_hits=float(stats.external_hits_tokens),
                             num_preemptions=float(core.num_preemptions))

