"""In-process micro-benchmark of one scheduling decision (not a test; no assertions).

:func:`decision_latency` times :meth:`Scheduler.schedule` (prompt hashed, index looked up, filters,
scorers, picker) and, separately, :meth:`Scheduler.pre_request` (the index learning the decision),
on a warmed index, for prompts made of a shared prefix (one of ``shared_prefixes``) followed by a
suffix unique to the request — the shape of agentic and shared-prefix workloads. Each request is a
new :class:`LLMRequest`, so its hashing is timed (nothing is memoised across requests).

Run: ``python -m lab.bench.scheduling --endpoints 16 --prompt-tokens 8000``. The goal in
shared/PERFORMANCE.md (``router-overhead``) is decision p50 ≤ 0.2 ms at 16 endpoints and 8k-token
prompts (llm-d's Go scheduler: 0.10–0.20 ms). Timings are of this machine at this moment: compare
runs side by side, not against a lone absolute figure.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from pathlib import Path

from lab.toolkit.stats import percentile
from router.scheduling import DEFAULT_CONFIG_PATH
from router.scheduling.config import build_scheduler, load_config
from router.scheduling.interfaces import PluginHandle
from router.scheduling.types import Endpoint, LLMRequest

_VOCAB = 150_000


def decision_latency(
    endpoints: int = 16,
    prompt_tokens: int = 8000,
    shared_fraction: float = 0.75,
    shared_prefixes: int = 32,
    iterations: int = 2000,
    warmup: int = 500,
    config_path: str | Path = DEFAULT_CONFIG_PATH,
    profile: str | None = None,
    seed: int = 0,
) -> dict[str, float]:
    """Time ``iterations`` decisions after ``warmup`` untimed ones.

    Args:
        endpoints: pool size.
        prompt_tokens: tokens per prompt.
        shared_fraction: share of each prompt that is one of the shared prefixes (0..1).
        shared_prefixes: number of distinct shared prefixes.
        iterations: timed decisions.
        warmup: untimed decisions first (they fill the prefix index).
        config_path: the scheduling config to build.
        profile: profile to run (default: the config's first).
        seed: seeds the workload and the scheduler's rng.

    Returns:
        ``decision_p50_ms``, ``decision_p99_ms`` (schedule only), ``learn_p50_ms``,
        ``learn_p99_ms`` (pre_request only), ``chosen_prefix_score_mean`` (mean prefix-cache-scorer
        score of the chosen endpoint, 0..1: shows the hit path was exercised; about
        ``shared_fraction`` once warm), ``endpoints``, ``prompt_tokens``, ``iterations``.
    """
    rng = random.Random(seed)
    scheduler = build_scheduler(load_config(config_path), PluginHandle(rng=random.Random(seed)))
    pool = [
        Endpoint(
            f"http://10.0.0.{i}:8000",
            num_requests_waiting=rng.randrange(0, 8),
            num_requests_running=rng.randrange(0, 64),
            kv_cache_usage_perc=rng.random(),
            block_size=16,
            num_gpu_blocks=30_000,
            num_cpu_blocks=60_000,
            metrics_updated_at=time.monotonic(),
        )
        for i in range(endpoints)
    ]
    shared_len = int(prompt_tokens * shared_fraction)
    suffix_len = prompt_tokens - shared_len
    prefixes = [[rng.randrange(_VOCAB) for _ in range(shared_len)] for _ in range(shared_prefixes)]
    suffixes = [[rng.randrange(_VOCAB) for _ in range(suffix_len)] for _ in range(64)]

    def make_request(n: int) -> LLMRequest:
        suffix = suffixes[n % len(suffixes)][:]
        if suffix:
            suffix[0] = n % _VOCAB  # unique from here on: later blocks hash differently
        tokens = rng.choice(prefixes) + suffix
        return LLMRequest(request_id=f"bench-{n}", model="bench-model", prompt_token_ids=tokens)

    decide: list[float] = []
    learn: list[float] = []
    hit: list[float] = []
    clock = time.perf_counter_ns
    for n in range(warmup + iterations):
        request = make_request(n)
        t0 = clock()
        result = scheduler.schedule(request, pool, profile)
        t1 = clock()
        scheduler.pre_request(request, result)
        t2 = clock()
        if n >= warmup:
            decide.append((t1 - t0) / 1e6)
            learn.append((t2 - t1) / 1e6)
            prefix_scores = result.scores.get("prefix-cache-scorer")
            if prefix_scores is not None:
                hit.append(prefix_scores[result.candidates.index(result.endpoint)])
    return {
        "endpoints": endpoints,
        "prompt_tokens": prompt_tokens,
        "iterations": iterations,
        "decision_p50_ms": percentile(decide, 50, default=math.nan),
        "decision_p99_ms": percentile(decide, 99, default=math.nan),
        "learn_p50_ms": percentile(learn, 50, default=math.nan),
        "learn_p99_ms": percentile(learn, 99, default=math.nan),
        "chosen_prefix_score_mean": statistics.fmean(hit) if hit else 0.0,
    }


def main() -> None:
    """Command line: print :func:`decision_latency` as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoints", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=8000)
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--profile", default=None)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG_PATH))
    args = parser.parse_args()
    print(json.dumps(decision_latency(args.endpoints, args.prompt_tokens, iterations=args.iterations,
                                      config_path=args.config, profile=args.profile), indent=2))


if __name__ == "__main__":
    main()
