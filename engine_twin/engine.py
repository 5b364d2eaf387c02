"""One simulated engine: tokenizer, tiered prefix cache, KV event publisher, scheduler, metrics and
faults wired together. Built and closed by the app's lifespan (``server.create_app``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine_twin.faults import FaultState
from engine_twin.kv_cache import TieredPrefixCache, none_hash
from engine_twin.kv_events import KVEventPublisher
from engine_twin.metrics import EngineMetrics
from engine_twin.protocol import GenerationSpec
from engine_twin.scheduler import EngineScheduler, SimRequest
from engine_twin.settings import EngineSimSettings
from engine_twin.tokenizer import load_tokenizer


@dataclass
class Outcome:
    """A finished prompt: its token count, cached tokens and generated tokens per sequence."""

    prompt_tokens: int
    cached_tokens: int
    generated: int


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
        self.metrics = EngineMetrics(settings)
        self.root_hash = none_hash(settings.hash_seed)
        self.scheduler = EngineScheduler(settings, self.cache, self.root_hash, observer=self.metrics)
        self.metrics.attach(self.scheduler)
        self.faults = FaultState(settings.failure_rate, settings.seed)
        text, ids = self.tokenizer.filler(64)
        self._filler_pieces = [self.tokenizer.decode([i]) for i in ids]

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()

    def pieces(self, n: int) -> list[str]:
        """Text of each of ``n`` generated filler tokens (deterministic)."""
        unit = self._filler_pieces
        return (unit * (n // len(unit) + 1))[:n]

    def piece(self, index: int) -> str:
        """Text of generated token number ``index`` (1-based), the last of ``pieces(index)``."""
        unit = self._filler_pieces
        return unit[(index - 1) % len(unit)]

    async def run(self, spec: GenerationSpec) -> list[Outcome]:
        """Run every prompt of ``spec`` to completion (concurrently) and report each."""
        if len(spec.prompts) == 1:
            return [await self._run_one(spec.prompts[0], spec)]
        return list(await asyncio.gather(*(self._run_one(p, spec) for p in spec.prompts)))

    async def _run_one(self, prompt: list[int], spec: GenerationSpec) -> Outcome:
        sched = self.scheduler
        req = sched.submit(prompt, spec.max_tokens, spec.n, spec.priority)
        try:
            await sched.wait_admitted(req)
            await sched.prefill(req)
            while req.generated < spec.max_tokens:
                await sched.next_token(req)
        finally:
            sched.finish(req, spec.finish_reason if req.generated >= spec.max_tokens else "abort")
        return Outcome(len(prompt), req.cached_tokens, req.generated)

    async def stream(self, spec: GenerationSpec) -> AsyncIterator[tuple[SimRequest, int]]:
        """Yield ``(request, tokens so far)`` after the first token and after each later one.

        Closing the iterator early (client disconnect) aborts the request and frees its blocks.
        """
        sched = self.scheduler
        req = sched.submit(spec.prompts[0], spec.max_tokens, spec.n, spec.priority)
        try:
            await sched.wait_admitted(req)
            await sched.prefill(req)
            yield req, req.generated
            while req.generated < spec.max_tokens:
                await sched.next_token(req)
                yield req, req.generated
        finally:
            sched.finish(req, spec.finish_reason if req.generated >= spec.max_tokens else "abort")
