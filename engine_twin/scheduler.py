"""Continuous batching and the latency model of the simulated engine.

Up to ``max_num_seqs`` sequences run at once; the rest wait, in arrival order (``fcfs``) or by
``(priority, arrival)`` with the lowest priority value first (``--scheduling-policy priority``, as
vLLM). A waiting request is admitted when a sequence slot is free and the prefix cache can reserve
its blocks (prompt + ``max_tokens`` for each of its ``n`` sequences); the head of the queue blocks
the ones behind it, as in vLLM (no preemption is simulated).

What the engine reports (:attr:`EngineScheduler.num_requests_waiting` and ``…_running``, the
``vllm:`` gauges) follows vLLM's meaning: vLLM moves a request from ``waiting`` to ``running`` in
the step that schedules its first tokens, and one step takes at most ``max_num_batched_tokens``.
So a request queued for the prefill counts as *running* while the uncached prompt tokens of the
queued prefills up to and including it (policy order) fit in that budget, and as *waiting* past it
(as does one waiting for a slot).

Latency model (model seconds; wall-clock = model × ``time_scale``; 0 never sleeps):

* time to first token = queue wait + prefill overhead + uncached prompt tokens / prefill rate
  + CPU-tier blocks × CPU load time + disk-tier blocks × disk load time. Prefills run one after
  another on the engine (the GPU does one prefill batch at a time), so a burst queues on prefill.
  The next prefill to start is the admitted request first in the policy's order (``fcfs``: order of
  admission; ``priority``: lowest ``priority`` value, then admission), as vLLM's scheduler takes
  waiting requests in that order; a started prefill is never interrupted. Each prefill starts at
  the model-time end of the previous one, so timer overshoot on a busy host does not slow the chain;
* inter-token latency = ``itl`` × (1 + (``itl_load_factor`` - 1) × running / ``max_num_seqs``):
  rises linearly to ``itl_load_factor`` × ``itl`` at a full batch (llm-d simulator's
  ``time-factor-under-load``).

Default numbers and their sources are in :mod:`engine_twin.settings`.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from dataclasses import dataclass, field
from typing import Protocol

from engine_twin.kv_cache import Allocation, TieredPrefixCache, block_hashes
from engine_twin.settings import EngineSimSettings


class SchedulerObserver(Protocol):
    """Hooks the metrics module implements. Times in wall-clock seconds, counts in tokens."""

    def admitted(self, queue_seconds: float) -> None: ...

    def first_token(self, ttft_seconds: float) -> None: ...

    def finished(self, prompt_tokens: int, generated_tokens: int, itl_seconds: list[float],
                 reason: str) -> None: ...


@dataclass
class LatencyModel:
    """Model durations in seconds (before ``time_scale``); see the module docstring."""

    prefill_overhead_s: float
    prefill_s_per_token: float
    itl_s: float
    itl_load_factor: float
    cpu_load_s_per_block: float
    disk_load_s_per_block: float
    max_num_seqs: int

    @classmethod
    def from_settings(cls, s: EngineSimSettings) -> LatencyModel:
        return cls(s.prefill_overhead_ms / 1000, 1 / s.prefill_tokens_per_s, s.itl_ms / 1000,
                   s.itl_load_factor, s.cpu_load_ms_per_block / 1000, s.disk_load_ms_per_block / 1000,
                   s.max_num_seqs)

    def prefill_seconds(self, uncached_tokens: int, cpu_blocks: int, disk_blocks: int) -> float:
        """Prefill time of one request: overhead + compute of uncached tokens + tier loads."""
        return (self.prefill_overhead_s + uncached_tokens * self.prefill_s_per_token
                + cpu_blocks * self.cpu_load_s_per_block + disk_blocks * self.disk_load_s_per_block)

    def itl_seconds(self, running: int) -> float:
        """Time between two tokens of one sequence when ``running`` sequences share the engine."""
        load = min(running, self.max_num_seqs) / self.max_num_seqs
        return self.itl_s * (1 + (self.itl_load_factor - 1) * load)


@dataclass(eq=False)
class SimRequest:
    """One request in the engine. ``prompt`` are token ids; ``n`` sequences of ``max_tokens`` each."""

    prompt: list[int]
    max_tokens: int
    n: int = 1
    priority: int = 0
    arrival: float = field(default_factory=time.monotonic)
    hashes: list[bytes] = field(default_factory=list)
    alloc: Allocation | None = None
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished: bool = False
    generated: int = 0
    uncached_tokens: int = 0
    itls: list[float] = field(default_factory=list)
    _admitted: asyncio.Future | None = None

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from cache (any tier), block-granular; 0 before admission."""
        return self.alloc.cached_blocks * self._block_size if self.alloc else 0

    _block_size: int = 16


class EngineScheduler:
    """Admission, waiting queue and timing of requests on one simulated engine."""

    def __init__(self, settings: EngineSimSettings, cache: TieredPrefixCache, root_hash: bytes,
                 observer: SchedulerObserver | None = None):
        self.settings = settings
        self.cache = cache
        self.root_hash = root_hash
        self.model = LatencyModel.from_settings(settings)
        self.observer = observer
        self.running: set[SimRequest] = set()
        self.running_seqs = 0
        self._waiting: list[tuple[tuple[int, int], SimRequest]] = []
        self._waiting_count = 0
        self._order = itertools.count()
        self._prefill_free_at = 0.0
        self._prefill_busy = False
        self._prefill_queue: list[tuple[tuple[int, int], SimRequest, asyncio.Future[float]]] = []
        self.prefill_queued = 0
        """Admitted requests whose prefill has not started (queued behind another prefill)."""
        self.prefill_queued_seqs = 0

    @property
    def waiting(self) -> int:
        """Requests waiting for admission (a sequence slot and KV blocks)."""
        return self._waiting_count

    def _beyond_step_budget(self) -> tuple[int, int]:
        """(requests, sequences) queued for the prefill past one step's token budget."""
        live = sorted((key, req) for key, req, turn in self._prefill_queue if not turn.done())
        budget = self.settings.max_num_batched_tokens
        tokens = requests = seqs = 0
        for _, req in live:
            tokens += req.uncached_tokens
            if tokens > budget:
                requests += 1
                seqs += req.n
        return requests, seqs

    @property
    def num_requests_waiting(self) -> int:
        """vLLM's ``num_requests_waiting``: waiting for a slot, or queued for the prefill past the
        next step's token budget (module docstring)."""
        return self._waiting_count + (self._beyond_step_budget()[0] if self._prefill_queue else 0)

    @property
    def num_requests_running(self) -> int:
        """vLLM's ``num_requests_running``: sequences holding a slot, less those counted waiting."""
        return self.running_seqs - (self._beyond_step_budget()[1] if self._prefill_queue else 0)

    def _policy_key(self, priority: int) -> tuple[int, int]:
        return (priority if self.settings.scheduling_policy == "priority" else 0, next(self._order))

    def submit(self, prompt: list[int], max_tokens: int, n: int = 1, priority: int = 0) -> SimRequest:
        """Queue a request and admit what fits. The prompt's block hashes are computed here."""
        bs = self.settings.block_size
        req = SimRequest(prompt, max_tokens, n, priority, _block_size=bs)
        req.hashes = block_hashes(prompt, bs, self.root_hash)
        heapq.heappush(self._waiting, (self._policy_key(priority), req))
        self._waiting_count += 1
        self._schedule()
        return req

    async def wait_admitted(self, req: SimRequest) -> None:
        """Return once ``req`` runs (at once when it was admitted on submit)."""
        if req.alloc is None:
            req._admitted = asyncio.get_running_loop().create_future()
            await req._admitted

    async def prefill(self, req: SimRequest) -> None:
        """Sleep for the request's prefill, one prefill at a time on this engine: while another runs,
        wait in the prefill queue (policy order, see the module docstring). Cancelling the caller
        (client disconnect) leaves the queue, or ends a running prefill at once."""
        alloc = req.alloc
        assert alloc is not None
        uncached = req.uncached_tokens = len(req.prompt) - alloc.cached_blocks * self.settings.block_size
        seconds = self.model.prefill_seconds(uncached, alloc.cpu_hits, alloc.disk_hits) * self.settings.time_scale
        if seconds > 0:
            start = await self._prefill_turn(req)
            end = start + seconds
            self._prefill_free_at = end
            try:
                await asyncio.sleep(end - time.monotonic())
            finally:
                self._prefill_done(min(end, time.monotonic()))
        self._first_token(req)

    async def _prefill_turn(self, req: SimRequest) -> float:
        """Wait until the prefill unit is ours; returns the (wall-clock) start of our prefill."""
        now = time.monotonic()
        if not self._prefill_busy:
            self._prefill_busy = True
            return max(now, self._prefill_free_at)
        turn: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._prefill_queue, (self._policy_key(req.priority), req, turn))
        self.prefill_queued += 1
        self.prefill_queued_seqs += req.n
        try:
            return await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():  # handed the unit just as we were cancelled
                self._prefill_done(turn.result())
            else:
                turn.cancel()  # left in the heap; skipped when it reaches the head
                self.prefill_queued -= 1
                self.prefill_queued_seqs -= req.n
            raise

    def _prefill_done(self, end: float) -> None:
        """The prefill unit is free from ``end`` on: hand it to the first live queued prefill."""
        while self._prefill_queue:
            _, req, turn = heapq.heappop(self._prefill_queue)
            if turn.done():  # cancelled while queued
                continue
            self.prefill_queued -= 1
            self.prefill_queued_seqs -= req.n
            turn.set_result(end)
            return
        self._prefill_busy = False
        self._prefill_free_at = end

    def _first_token(self, req: SimRequest) -> None:
        req.first_token_at = time.monotonic()
        req.generated = 1
        if self.observer:
            self.observer.first_token(req.first_token_at - req.arrival)

    async def next_token(self, req: SimRequest) -> None:
        """Sleep one inter-token interval at the current batch size, then count the token."""
        start = time.monotonic()
        seconds = self.model.itl_seconds(self.running_seqs) * self.settings.time_scale
        if seconds > 0:
            await asyncio.sleep(seconds)
        req.generated += 1
        req.itls.append(time.monotonic() - start)

    def finish(self, req: SimRequest, reason: str = "stop") -> None:
        """Leave the engine (done or aborted by a client disconnect): free its blocks, admit others."""
        if req.finished:
            return
        req.finished = True
        if req.alloc is None:
            self._waiting_count -= 1  # still queued: dropped lazily when it reaches the head
            if req._admitted is not None and not req._admitted.done():
                req._admitted.cancel()
        else:
            self.cache.release(req.alloc)
            self.running.discard(req)
            self.running_seqs -= req.n
            if self.observer:
                self.observer.finished(len(req.prompt), req.generated * req.n, req.itls, reason)
        self._schedule()

    def _schedule(self) -> None:
        bs = self.settings.block_size
        limit = self.settings.max_num_seqs
        while self._waiting:
            _, req = self._waiting[0]
            if req.finished:
                heapq.heappop(self._waiting)
                continue
            if self.running_seqs + req.n > limit and self.running:
                return
            plen = len(req.prompt)
            total = -(-(plen + req.max_tokens) // bs) + (req.n - 1) * -(-req.max_tokens // bs)
            total = min(total, self.cache.num_gpu_blocks)  # n > 1 may ask for more than exists
            alloc = self.cache.allocate(req.hashes, req.prompt, total, plen)
            if alloc is None:
                return
            heapq.heappop(self._waiting)
            self._waiting_count -= 1
            req.alloc = alloc
            req.admitted_at = time.monotonic()
            self.running.add(req)
            self.running_seqs += req.n
            if self.observer:
                self.observer.admitted(req.admitted_at - req.arrival)
            if req._admitted is not None and not req._admitted.done():
                req._admitted.set_result(None)
