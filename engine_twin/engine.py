"""One simulated engine: tokenizer, tiered prefix cache, KV event publisher, the pure core, metrics
and faults wired together, and the real-time driver of the core. Built, started and closed by the
app's lifespan (``server.create_app``).

The driver is one asyncio task: while the core has work it runs a step, sleeps the step's duration ×
``time_scale`` and then delivers the step's tokens to the request handlers (each waits on an event of
its request). Step ends are kept on a schedule measured against the monotonic clock: the next step
starts at the previous one's scheduled end, not at the moment the sleep returned, so timer overshoot
does not add up (after a lag over :data:`MAX_LAG_S` the schedule restarts from now). At
``time_scale`` 0 it never sleeps and yields to the event loop once per step. With nothing to do it
waits for the next request. A handler whose client goes away aborts its requests in the core.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from engine_twin.core import CoreRequest, EngineCore, StepOutcome
from engine_twin.errors import BadRequestError
from engine_twin.faults import FaultState
from engine_twin.kv_cache import DEFAULT_RETENTION, TieredPrefixCache, block_hashes, none_hash
from engine_twin.kv_events import KVEventPublisher
from engine_twin.metrics import EngineMetrics
from engine_twin.protocol import GenerationSpec
from engine_twin.settings import EngineSimSettings
from engine_twin.tokenizer import load_tokenizer

MAX_LAG_S = 0.25
"""Wall seconds the driver may run behind its step schedule before restarting it from now."""


@dataclass
class Outcome:
    """A finished prompt: its token count, cached tokens and generated tokens per sequence."""

    prompt_tokens: int
    cached_tokens: int
    generated: int


@dataclass(eq=False)
class RequestGroup:
    """The ``n`` core requests of one prompt, as one handler sees them (wall-clock times)."""

    children: list[CoreRequest]
    arrival: float
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    delivered: list[int] = field(default_factory=list)
    """Tokens delivered per child (the core may be ahead: it runs a step before it is slept)."""
    token_times: list[float] = field(default_factory=list)
    """Delivery times of the first child's tokens."""
    done: int = 0
    want: int = 1
    """Tokens per child the handler waits for; ``changed`` is set once they are all there."""

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from cache at the first schedule (any tier; 0 before it)."""
        return max(self.children[0].num_cached_tokens, 0)

    @property
    def generated(self) -> int:
        """Tokens every child has delivered."""
        return min(self.delivered)


class SimEngine:
    """Owns every part of one simulated engine. Not thread-safe: use from the event loop."""

    def __init__(self, settings: EngineSimSettings):
        self.settings = settings
        self.tokenizer = load_tokenizer(settings.tokenizer)
        cfg = settings.kv_events_config
        self.publisher = (KVEventPublisher(cfg, settings.kv_events_layout, settings.data_parallel_rank)
                          if cfg.active else None)
        self.cache = TieredPrefixCache(settings.num_gpu_blocks, settings.block_size, settings.cpu_offload_blocks,
                                       settings.disk_offload_blocks,
                                       sink=self.publisher.publish if self.publisher else None)
        self.core = EngineCore(settings, self.cache)
        self.metrics = EngineMetrics(settings)
        self.metrics.attach(self.core)
        self.root_hash = none_hash(settings.hash_seed)
        self.faults = FaultState(settings.failure_rate, settings.seed)
        text, ids = self.tokenizer.filler(64)
        self._filler_pieces = [self.tokenizer.decode([i]) for i in ids]
        self._groups: dict[str, tuple[RequestGroup, int]] = {}
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Start the driver task on the running loop (idempotent)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._drive(), name="engine-twin-driver")

    async def aclose(self) -> None:
        """Stop the driver and the KV event publisher."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.close()

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()

    # ---- text ------------------------------------------------------------------------------
    def pieces(self, n: int) -> list[str]:
        """Text of each of ``n`` generated filler tokens (deterministic)."""
        unit = self._filler_pieces
        return (unit * (n // len(unit) + 1))[:n]

    def piece(self, index: int) -> str:
        """Text of generated token number ``index`` (1-based), the last of ``pieces(index)``."""
        unit = self._filler_pieces
        return unit[(index - 1) % len(unit)]

    # ---- requests --------------------------------------------------------------------------
    def retention_of(self, spec: GenerationSpec) -> int:
        """The KV retention of a request: its ``kv_retention_priority``, else the lowest (0) when its
        vLLM ``priority`` reaches ``--retention-priority-threshold``, else the default."""
        if spec.retention is not None:
            return spec.retention
        threshold = self.settings.retention_priority_threshold
        if threshold is not None and spec.priority >= threshold:
            return 0
        return DEFAULT_RETENTION

    def submit(self, prompt: list[int], spec: GenerationSpec) -> RequestGroup:
        """Queue ``spec.n`` core requests for ``prompt``; raises BadRequestError when they can never fit."""
        self.start()
        hashes = block_hashes(prompt, self.settings.block_size, self.root_hash)
        base = f"req-{next(self._ids)}"
        retention = self.retention_of(spec)
        children = [CoreRequest(f"{base}-{k}", prompt, spec.max_tokens, hashes, spec.priority, retention)
                    for k in range(spec.n)]
        now = time.monotonic()
        group = RequestGroup(children, now, delivered=[0] * spec.n)
        for k, child in enumerate(children):
            try:
                self.core.add(child, now)
            except ValueError as exc:
                for added in children[:k]:
                    self.core.abort(added.request_id)
                    self._groups.pop(added.request_id, None)
                raise BadRequestError(str(exc), "messages") from None
            self._groups[child.request_id] = (group, k)
        self._wake.set()
        return group

    def finish(self, group: RequestGroup, reason: str) -> None:
        """Leave the engine: done, or aborted (client disconnect) with every unfinished child removed."""
        complete = group.done == len(group.children)
        for child in group.children:
            if self._groups.pop(child.request_id, None) is not None:
                self.core.abort(child.request_id)
        prompt = len(group.children[0].prompt)
        gaps = [b - a for a, b in zip(group.token_times, group.token_times[1:])]
        self.metrics.finished(prompt, sum(group.delivered), gaps, reason if complete else "abort",
                              time.monotonic() - group.arrival)

    async def _wait(self, group: RequestGroup, tokens: int) -> None:
        """Return once every child has delivered ``tokens`` tokens."""
        group.want = tokens
        while group.generated < tokens:
            group.changed.clear()
            await group.changed.wait()

    async def run(self, spec: GenerationSpec) -> list[Outcome]:
        """Run every prompt of ``spec`` to completion (concurrently) and report each."""
        groups = []
        try:
            for prompt in spec.prompts:
                groups.append(self.submit(prompt, spec))
            for group in groups:
                await self._wait(group, spec.max_tokens)
        finally:
            for group in groups:
                self.finish(group, spec.finish_reason)
        return [Outcome(len(g.children[0].prompt), g.cached_tokens, g.generated) for g in groups]

    async def stream(self, spec: GenerationSpec) -> AsyncIterator[tuple[RequestGroup, int]]:
        """Yield ``(group, tokens so far)`` after the first token and after each later one.

        Closing the iterator early (client disconnect) aborts the request and frees its blocks.
        """
        group = self.submit(spec.prompts[0], spec)
        try:
            seen = 0
            while seen < spec.max_tokens:
                await self._wait(group, seen + 1)
                while seen < group.generated:
                    seen += 1
                    yield group, seen
        finally:
            self.finish(group, spec.finish_reason)

    # ---- the driver --------------------------------------------------------------------------
    async def _drive(self) -> None:
        core, scale = self.core, self.settings.time_scale
        clock = time.monotonic
        start = clock()
        while True:
            if not core.has_work():
                self._wake.clear()
                await self._wake.wait()
                start = clock()
                continue
            outcome = core.step(start)
            if not outcome.scheduled:  # nothing can run until a request arrives or leaves
                self._wake.clear()
                await self._wake.wait()
                start = clock()
                continue
            if scale > 0:
                end = start + outcome.duration * scale
                delay = end - clock()
                if delay > 0:
                    await asyncio.sleep(delay)
                now = clock()
                self._deliver(outcome, start, now)
                start = end if now - end < MAX_LAG_S else now
            else:
                now = clock()
                self._deliver(outcome, start, now)
                await asyncio.sleep(0)
                start = clock()

    def _deliver(self, outcome: StepOutcome, started: float, now: float) -> None:
        groups = self._groups
        for rid in outcome.first_scheduled:
            entry = groups.get(rid)
            if entry is not None:
                self.metrics.queue_time.observe(max(0.0, started - entry[0].arrival))
        for rid in outcome.sampled:
            entry = groups.get(rid)
            if entry is None:
                continue
            group, k = entry
            delivered = group.delivered
            delivered[k] += 1
            if k == 0:
                if not group.token_times:
                    self.metrics.first_token(now - group.arrival)
                group.token_times.append(now)
            if delivered[k] >= group.want and (len(delivered) == 1 or min(delivered) >= group.want):
                group.changed.set()
        for rid in outcome.finished:
            entry = groups.pop(rid, None)
            if entry is not None:
                entry[0].done += 1
