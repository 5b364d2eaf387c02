"""Precise prefix matches of long prompts (issue 12): a run partly offloaded to the CPU tier keeps
its GPU blocks at full weight, and a decision's speculative entries last while its request runs
(an engine announces a queued or long prefill's blocks late), then ``speculativeTTL``."""

from __future__ import annotations

import random

import pytest
from scheduling_helpers import FakeClock, endpoints, prompt, request

from router.kv_index.events import BlockRemoved, BlockStored
from router.kv_index.index import KVBlockIndex
from router.scheduling.hashing import request_block_keys
from router.scheduling.interfaces import PluginHandle
from router.scheduling.plugins.prefix import build_precise_producer
from router.scheduling.scheduler import SchedulingResult
from router.scheduling.types import CycleState, prefix_match_key

MODEL = "m"
A, B = "http://e0", "http://e1"


def _stored(tokens: list[int], first_hash: int = 1) -> BlockStored:
    n = len(tokens) // 16
    return BlockStored(list(range(first_hash, first_hash + n)), None, tokens[:n * 16], 16)


def _producer(index: KVBlockIndex, **params):
    return build_precise_producer("precise", params or None, PluginHandle(rng=random.Random(0), prefix_index=index))


def _matched(producer, req) -> dict[str, float]:
    state = CycleState()
    producer.produce(state, req, endpoints(2))
    return state.read(prefix_match_key("precise")).matched


def test_a_long_run_offloaded_at_its_end_keeps_its_gpu_blocks_at_full_weight():
    tokens = prompt(1, 64 * 100)  # 100 of our blocks, 400 engine blocks of 16
    index = KVBlockIndex()
    index.apply(A, MODEL, [_stored(tokens)])
    # the engine moved the deepest 64-token chunk (engine blocks 397..400) to the CPU tier
    index.apply(A, MODEL, [BlockRemoved([397, 398, 399, 400], "GPU"),
                           BlockStored([397, 398, 399, 400], None, [], 16, medium="CPU")])
    keys = request_block_keys(request(tokens, model=MODEL), 64)
    assert index.longest_prefix(MODEL, keys) == {A: (100, "cpu")}
    assert index.longest_prefix_tiers(MODEL, keys) == {A: (99, 1, 0)}
    # before: 100 × 0.8 = 80 blocks, i.e. 1,280 tokens "uncached" for the affinity filter's wait
    assert _matched(_producer(index), request(tokens, model=MODEL)) == {A: pytest.approx(99.8)}


def test_longest_prefix_tiers_follows_each_endpoints_own_run():
    tokens = prompt(2, 64 * 6)
    index = KVBlockIndex()
    index.apply(A, MODEL, [_stored(tokens)])
    index.apply(B, MODEL, [BlockStored(list(range(1, 9)), None, tokens[:128], 16, medium="CPU")])
    keys = request_block_keys(request(tokens, model=MODEL), 64)
    assert index.longest_prefix_tiers(MODEL, keys) == {A: (6, 0, 0), B: (0, 2, 0)}
    assert index.longest_prefix_tiers(MODEL, []) == {}


def test_speculative_entries_outlive_the_ttl_while_the_request_runs_then_expire():
    clock = FakeClock()
    index = KVBlockIndex(clock=clock)
    producer = _producer(index, speculativeIndexing=True, speculativeTTL="2s")
    long_prompt = prompt(3, 64 * 50)
    first = request(long_prompt, model=MODEL)
    ep = endpoints(2)[0]
    producer.pre_request(first, SchedulingResult("default", ep, [ep], [0.0], {}, CycleState()))
    # the engine has not announced the blocks yet (queued, or a long prefill): 5 s later, the
    # next turn of the conversation must still see them on A (before the fix: nothing after 2 s)
    clock.now += 5.0
    follow_up = request(long_prompt + prompt(4, 128), model=MODEL)
    assert _matched(producer, follow_up) == {A: 50.0}
    producer.response_complete(first, ep, None)
    clock.now += 1.0
    assert _matched(producer, request(long_prompt, model=MODEL)) == {A: 50.0}
    clock.now += 1.5  # speculativeTTL after completion, and no event ever came: gone
    assert _matched(producer, request(long_prompt, model=MODEL)) == {}
    assert index.stats()["speculative"] == 0


def test_held_entries_do_not_grow_the_expiry_heap_past_the_live_ones():
    clock = FakeClock()
    index = KVBlockIndex(clock=clock)
    for i in range(200):
        keys = request_block_keys(request(prompt(100 + i, 64 * 40), model=MODEL), 64)
        index.add_speculative(MODEL, A, keys, ttl_s=600.0)
        index.add_speculative(MODEL, A, keys, ttl_s=1.0)  # its response completed
        clock.now += 2.0
        index.apply(B, MODEL, [])  # sweeps the expired
    assert index.stats()["speculative"] == 0
    assert len(index._spec_heap) <= 4096 + 200  # without compaction: 8,000 stale 600 s items
