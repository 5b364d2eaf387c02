"""Helpers for the scheduling tests (imported by the test modules): endpoints, prompts, configs, and a test-only precise index."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from router.scheduling.config import build_scheduler, parse_config
from router.scheduling.interfaces import PluginHandle
from router.scheduling.scheduler import Scheduler
from router.scheduling.types import Endpoint, LLMRequest

TIER_ORDER = {"gpu": 0, "cpu": 1, "disk": 2}


class InMemoryPrefixIndex:
    """Trivial :class:`~router.scheduling.interfaces.PrefixIndex` for tests (the real one is fed by
    KV events, :mod:`router.kv_index`): ``blocks[(model, key)][endpoint] = tier``."""

    def __init__(self) -> None:
        self.blocks: dict[tuple[str, int], dict[str, str]] = {}
        self.speculative: list[tuple[str, str, int, float]] = []

    def put(self, model: str, endpoint: str, keys: Sequence[int], tier: str = "gpu") -> None:
        for key in keys:
            self.blocks.setdefault((model, key), {})[endpoint] = tier

    def longest_prefix(self, model: str, block_keys: Sequence[int]) -> Mapping[str, tuple[int, str]]:
        found: dict[str, tuple[int, str]] = {}
        for i, key in enumerate(block_keys):
            advanced = False
            for ep, tier in self.blocks.get((model, key), {}).items():
                blocks, worst = found.get(ep, (0, "gpu"))
                if blocks == i:
                    found[ep] = (i + 1, max(worst, tier, key=TIER_ORDER.__getitem__))
                    advanced = True
            if not advanced:
                break
        return found

    def add_speculative(self, model: str, endpoint_name: str, block_keys: Sequence[int], ttl_s: float) -> None:
        self.speculative.append((model, endpoint_name, len(block_keys), ttl_s))


class FakeClock:
    """A settable monotonic clock, in seconds."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def endpoints(n: int, **fields) -> list[Endpoint]:
    """``n`` endpoints ``http://e0`` … with the given metric fields."""
    return [Endpoint(f"http://e{i}", **fields) for i in range(n)]


def prompt(seed: int, n_tokens: int) -> list[int]:
    """``n_tokens`` pseudo-random token ids, the same for the same seed."""
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n_tokens)]


_counter = iter(range(10**9))


def request(tokens: Sequence[int] | None = None, model: str = "m", **fields) -> LLMRequest:
    """A request with a fresh id."""
    return LLMRequest(request_id=f"req-{next(_counter)}", model=model, prompt_token_ids=tokens, **fields)


def scheduler_from(yaml_text: str, seed: int = 0, **handle_fields) -> tuple[Scheduler, PluginHandle]:
    """Build a scheduler from YAML with a seeded rng; returns it with its handle."""
    handle = PluginHandle(rng=random.Random(seed), **handle_fields)
    return build_scheduler(parse_config(yaml_text), handle), handle

