"""Cost of the KV-event index: bytes per indexed block (tracemalloc) and ``longest_prefix`` latency.

``python -m lab.bench.kv_index [--endpoints 16] [--prompt-tokens 8000] [--engine-block-size 16]``
prints one JSON object. The bytes figures are what :class:`~router.kv_index.index.KVBlockIndex`
states in its docstring and uses for ``stats()["approx_bytes"]``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
import tracemalloc
from typing import Any

from lab.toolkit.stats import percentile
from router.kv_index.events import BlockStored
from router.kv_index.index import KVBlockIndex
from router.scheduling.hashing import chain_seed, chained_keys, tokens_to_bytes

MODEL = "bench-model"


def _prompt(rng: random.Random, n_tokens: int) -> list[int]:
    return [rng.randrange(1, 50_000) for _ in range(n_tokens)]


def _stored(tokens: list[int], engine_block_size: int, first_hash: int) -> BlockStored:
    """One BlockStored of every full engine block of ``tokens``, hashes ``first_hash`` + i."""
    n = len(tokens) // engine_block_size
    return BlockStored(list(range(first_hash, first_hash + n)), None, tokens[: n * engine_block_size],
                       engine_block_size)


def measure_bytes(endpoints: int = 16, prompts_per_endpoint: int = 40, prompt_tokens: int = 4096,
                  engine_block_size: int = 16, block_size_tokens: int = 64, seed: int = 0) -> dict[str, float]:
    """Bytes per our key and per engine block state, measured with tracemalloc.

    Each endpoint stores its own distinct prompts (every key has one holder). The index's traced
    size is taken after the stores, then again after dropping every engine block state: the
    difference is the engine blocks' share, the rest the keys'.

    Returns:
        ``{"bytes_per_block", "bytes_per_engine_block", "blocks", "engine_blocks"}``.
    """
    rng = random.Random(seed)
    prompts = [[_prompt(rng, prompt_tokens) for _ in range(prompts_per_endpoint)] for _ in range(endpoints)]
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        index = KVBlockIndex(block_size_tokens=block_size_tokens, max_blocks=1 << 30)
        next_hash = 1
        for e, own in enumerate(prompts):
            for tokens in own:
                event = _stored(tokens, engine_block_size, next_hash)
                next_hash += len(event.block_hashes)
                index.apply(f"http://10.0.0.{e}:8000", MODEL, [event])
        total = tracemalloc.get_traced_memory()[0] - start
        stats = index.stats()
        for ep in index._endpoints.values():  # the measurement needs the parts
            ep.blocks = {}
        keys_only = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    return {"bytes_per_block": round(keys_only / stats["blocks"]),
            "bytes_per_engine_block": round((total - keys_only) / stats["engine_blocks"]),
            "blocks": stats["blocks"], "engine_blocks": stats["engine_blocks"]}


def longest_prefix_latency(endpoints: int = 16, prompt_tokens: int = 8000, engine_block_size: int = 16,
                           block_size_tokens: int = 64, holders: int | None = None, rounds: int = 2000,
                           seed: int = 0) -> dict[str, float]:
    """``longest_prefix`` time (µs) for one prompt whose whole run is held by ``holders`` endpoints
    (default: all of them — the worst case: a fleet-wide shared prefix)."""
    rng = random.Random(seed)
    tokens = _prompt(rng, prompt_tokens)
    index = KVBlockIndex(block_size_tokens=block_size_tokens)
    for e in range(holders if holders is not None else endpoints):
        index.apply(f"http://10.0.0.{e}:8000", MODEL, [_stored(tokens, engine_block_size, 1)])
    keys = chained_keys(tokens_to_bytes(tokens), block_size_tokens * 4, chain_seed(MODEL))
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        index.longest_prefix(MODEL, keys)
        times.append((time.perf_counter() - t0) * 1e6)
    return {"blocks": len(keys), "p50_us": round(percentile(times, 50, default=math.nan), 1),
            "p99_us": round(percentile(times, 99, default=math.nan), 1)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoints", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=8000)
    parser.add_argument("--engine-block-size", type=int, default=16)
    args = parser.parse_args(argv)
    out = {"memory": measure_bytes(endpoints=args.endpoints, engine_block_size=args.engine_block_size),
           "longest_prefix": longest_prefix_latency(args.endpoints, args.prompt_tokens, args.engine_block_size)}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
