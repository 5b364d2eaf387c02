"""Simulated engines publish real KV events to the router's subscriber; the index then places each
prompt on the engine that ran it, a precise-prefix scheduler built from YAML picks that engine, and
GPU evictions into the CPU tier (and the reload back) change the reported tier.

Three engines (subprocesses of ``backfill engine-sim``, logs in the test's tmp_path) connect their PUB sockets to the one bound
SUB address: engine 0 has a tiny GPU tier (64 blocks of 16 tokens) and a CPU tier, engine 1 sends
the older positional event layout, engine 2 uses the CPU build's 128-token blocks. Keys are computed
with ``router.scheduling.hashing`` from the engines' own ``/tokenize`` token ids. Every wait is a
condition with a deadline.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Callable

import httpx
import pytest

from engine_twin.launch import sim_engine_argv
from lab.toolkit.launch import ProcessGroup, free_port
from router.kv_index.index import KVBlockIndex
from router.kv_index.subscriber import KVEventSubscriber
from router.scheduling.config import build_scheduler, parse_config
from router.scheduling.hashing import chain_seed, chained_keys, tokens_to_bytes
from router.scheduling.interfaces import PluginHandle
from router.scheduling.types import Endpoint, LLMRequest

MODEL = "m1"
PRECISE_CONFIG = """
plugins:
- type: precise-prefix-cache-producer
  parameters: {blockSizeTokens: 64}
- type: prefix-cache-scorer
  parameters: {prefixMatchInfoProducerName: precise-prefix-cache-producer}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: prefix-cache-scorer}]
"""
ENGINES = [  # (block size, extra sim_engine_argv options)
    (16, {"num_gpu_blocks": 64, "max_model_len": 1024, "cpu_offload_blocks": 512}),
    (16, {"kv_events_layout": "array"}),
    (128, {}),
]
_words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def text(seed: int, n_words: int) -> str:
    rng = random.Random(seed)
    return f"[{seed}] " + " ".join(rng.choice(_words) for _ in range(n_words))


def our_keys(tokens: list[int]) -> list[int]:
    return chained_keys(tokens_to_bytes(tokens), 64 * 4, chain_seed(MODEL))


async def wait_for(condition: Callable[[], object], what: str, timeout: float = 20.0,
                   tick: Callable[[], object] | None = None, show: Callable[[], object] | None = None) -> None:
    """Await ``condition()`` truthy; ``tick`` (a coroutine function) runs between checks; ``show()``
    goes into the failure message."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}" + (f": {show()}" if show else ""))
        if tick is not None:
            await tick()
        await asyncio.sleep(0.02)


@pytest.fixture
def engines(tmp_path):
    """Start the engines once the test gives the subscriber's address; stops them after."""
    group = ProcessGroup(tmp_path)

    def start(events_address: str) -> list[str]:
        started = []
        for i, (block_size, options) in enumerate(ENGINES):
            port = free_port()
            argv = sim_engine_argv(port, [MODEL], events_address, block_size=block_size, time_scale=0.0, **options)
            started.append((group.start(f"engine-{i}", argv), f"http://127.0.0.1:{port}"))
        for proc, url in started:
            group.wait_ready(proc, url, timeout=30)
        return [url for _, url in started]

    yield start
    group.stop()


def test_the_index_follows_the_fleets_kv_events(engines):
    asyncio.run(_scenario(engines))


async def _scenario(start_engines) -> None:
    index = KVBlockIndex(block_size_tokens=64)
    async with KVEventSubscriber(index, bind=f"tcp://127.0.0.1:{free_port()}") as sub, \
            httpx.AsyncClient(timeout=30) as http:
        urls = await asyncio.to_thread(start_engines, sub.bound_address)
        seeds = itertools.count(1000)

        async def complete(url: str, prompt: str) -> None:
            r = await http.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
            assert r.status_code == 200, r.text

        async def tokenize(url: str, prompt: str) -> list[int]:
            r = await http.post(f"{url}/tokenize", json={"model": MODEL, "prompt": prompt})
            assert r.status_code == 200, r.text
            return r.json()["tokens"]

        # an engine's first events are lost until the SUB's subscription reaches its PUB: send
        # unrelated probe prompts (about 210 tokens: full blocks at 128 tokens too) until the
        # subscriber has heard from every engine
        for url in urls:
            topic = f"kv@{url.removeprefix('http://')}@{MODEL}"
            await wait_for(lambda t=topic: t in sub.stats()["topics"], f"events from {url}",
                           tick=lambda u=url: complete(u, text(next(seeds), 150)))

        prompts = [text(i, 420) for i in range(len(urls))]  # about 590 tokens: 9 of our blocks
        for url, prompt in zip(urls, prompts):
            await complete(url, prompt)
        tokens = [await tokenize(url, prompt) for url, prompt in zip(urls, prompts)]
        keys = [our_keys(t) for t in tokens]
        assert all(len(k) >= 8 for k in keys)
        # an engine caches full blocks only: with 128-token blocks the last key may be missing
        held = [len(t) // size * size // 64 for t, (size, _) in zip(tokens, ENGINES)]
        for url, k, n in zip(urls, keys, held):
            await wait_for(lambda u=url, k=k, n=n: index.longest_prefix(MODEL, k) == {u: (n, "gpu")},
                           f"{url}'s prompt on its GPU tier in the index",
                           show=lambda k=k: (len(k), index.longest_prefix(MODEL, k), index.stats()))

        # a precise-prefix scheduler picks the engine holding the prompt's prefix
        scheduler = build_scheduler(parse_config(PRECISE_CONFIG), PluginHandle(rng=random.Random(0), prefix_index=index))
        pool = [Endpoint(url) for url in urls]
        for i, (url, prompt) in enumerate(zip(urls, prompts)):
            question = await tokenize(url, prompt + " and one more question")
            chosen = scheduler.schedule(LLMRequest(request_id=f"r{i}", model=MODEL, prompt_token_ids=question), pool)
            assert chosen.endpoint.name == url

        # engine 0's 64 GPU blocks fill with other prompts (about 790 tokens each): its prompt
        # moves to the CPU tier
        first_key = keys[0][:1]
        await wait_for(lambda: index.longest_prefix(MODEL, first_key) == {urls[0]: (1, "cpu")},
                       "engine 0's prompt evicted to its CPU tier",
                       tick=lambda: complete(urls[0], text(next(seeds), 560)),
                       show=lambda: (index.longest_prefix(MODEL, keys[0]), index.stats()))
        assert index.longest_prefix(MODEL, keys[0]) == {urls[0]: (len(keys[0]), "cpu")}
        again = await tokenize(urls[0], prompts[0] + " again")
        chosen = scheduler.schedule(LLMRequest(request_id="cpu", model=MODEL, prompt_token_ids=again), pool)
        assert chosen.endpoint.name == urls[0]
        assert chosen.scores["prefix-cache-scorer"][0] == pytest.approx(0.8 * len(keys[0]) / len(our_keys(again)))

        # running it again loads it back to the GPU (kept on CPU too): the tier is gpu again
        await complete(urls[0], prompts[0])
        await wait_for(lambda: index.longest_prefix(MODEL, keys[0]) == {urls[0]: (len(keys[0]), "gpu")},
                       "engine 0's prompt back on its GPU tier")

        stats = index.stats()
        assert stats["decode_errors"] == 0 and stats["unknown_parents"] == 0 and stats["seq_gaps"] == 0
        assert stats["endpoints"][urls[0]]["cpu"] > 0
        assert set(stats["endpoints"]) == set(urls)
