"""KV retention, the cache-pollution guard's engine half, on hand-sized caches: a batch sweep at
retention 0 leaves an interactive prefix cached (and wipes it at the default retention), reads never
lower a block's retention, touching it raises it, and the CPU / disk tiers keep retention too."""

import pytest

from engine_twin.core import CoreRequest, EngineCore
from engine_twin.kv_cache import DEFAULT_RETENTION, TieredPrefixCache, block_hashes, none_hash
from engine_twin.kv_events import BlockStored
from engine_twin.settings import build_settings

BS = 4
ROOT = none_hash("0")


def run_to_end(core, limit=10_000):
    t, steps = 0.0, 0
    while core.has_work():
        t += core.step(t).duration
        steps += 1
        assert steps < limit, "the core never finished"


def compute(cache, tokens, retention, hold=False):
    """One request computing ``tokens`` (full blocks, hits reused) at ``retention``; freed unless ``hold``."""
    hashes = block_hashes(tokens, BS, ROOT)
    hits = cache.find_hits(hashes, len(hashes))
    table = cache.admit(hashes, hits, len(hashes) - hits.blocks, tokens, retention)
    assert table is not None
    cache.commit(table, 0, len(hashes), hashes, tokens, retention)
    if not hold:
        cache.free(table)
    return hashes, table


@pytest.mark.parametrize("batch_retention", [0, DEFAULT_RETENTION])
def test_a_batch_sweep_keeps_the_interactive_prefix_only_at_the_lowest_retention(batch_retention):
    """16 GPU blocks: a 6-block conversation cached, then 40 batch requests (2 at a time) that read the
    conversation's first 2 blocks and compute 2 blocks of their own each (80 blocks in all)."""
    s = build_settings(block_size=BS, num_gpu_blocks=16, max_model_len=32, time_scale=0.0,
                       scheduling_policy="priority")
    core = EngineCore(s, TieredPrefixCache(16, BS))
    chat = [1] * 8 + [2] * 16 + [3]
    chat_hashes = block_hashes(chat, BS, ROOT)
    core.add(CoreRequest("chat", chat, 1, chat_hashes, -100, DEFAULT_RETENTION), 0.0)
    run_to_end(core)
    for pair in range(20):
        for k in (0, 1):
            doc = chat[:8] + [100 + 2 * pair + k] * 8 + [7]
            core.add(CoreRequest(f"b{pair}-{k}", doc, 1, block_hashes(doc, BS, ROOT), 10, batch_retention), 0.0)
        run_to_end(core)
    cache = core.cache
    assert cache.stats.hits_tokens == 40 * 8  # every batch request read the shared 2 blocks
    assert [cache.retention_of(h) for h in chat_hashes[:2]] == [DEFAULT_RETENTION] * 2  # a read never lowers
    on_gpu = [cache.tier_of(h) == "GPU" for h in chat_hashes]
    if batch_retention == 0:
        assert all(on_gpu)
    else:  # plain LRU: the conversation's own blocks were the oldest freed
        assert on_gpu[:2] == [True, True] and not any(on_gpu[2:])


def test_an_interactive_hit_on_a_batch_block_raises_it_and_lowest_retention_is_evicted_first():
    cache = TieredPrefixCache(4, BS)
    shared, _ = compute(cache, [1] * 8, 0)  # 2 blocks at 0
    compute(cache, [1] * 8, DEFAULT_RETENTION)  # an interactive request hits both
    assert [cache.retention_of(h) for h in shared] == [DEFAULT_RETENTION] * 2
    other, _ = compute(cache, [5] * 8, 0)
    compute(cache, [6] * 8, 0)  # needs 2 blocks: the batch-only ones go, not the raised ones
    assert [cache.tier_of(h) for h in shared + other] == ["GPU", "GPU", None, None]


def test_an_interactive_duplicate_of_a_block_batch_cached_first_raises_it():
    """Both compute the same block in one step (no hit at admission); the batch copy is cached first
    and stays the cached one (as vLLM keeps the first copy), at the interactive retention."""
    cache = TieredPrefixCache(4, BS)
    tokens = [3] * 4
    hashes = block_hashes(tokens, BS, ROOT)
    batch = cache.admit(hashes, cache.find_hits(hashes, 1), 1, tokens, 0)
    chat = cache.admit(hashes, cache.find_hits(hashes, 1), 1, tokens, DEFAULT_RETENTION)
    assert batch is not None and chat is not None
    cache.commit(batch, 0, 1, hashes, tokens, 0)
    cache.commit(chat, 0, 1, hashes, tokens, DEFAULT_RETENTION)
    assert cache.retention_of(hashes[0]) == DEFAULT_RETENTION and chat == [None]
    cache.free(batch)
    cache.free(chat)
    compute(cache, [8] * 4, 0)
    compute(cache, [9] * 12, 0)  # 3 blocks: the 0-level [8] block and 2 empty ones, never the raised one
    assert cache.tier_of(hashes[0]) == "GPU"


def test_the_cpu_tier_keeps_an_interactive_block_while_batch_blocks_pass_through_and_a_reload_keeps_it():
    cache = TieredPrefixCache(2, BS, cpu_blocks=2)
    chat, _ = compute(cache, [1] * 4, DEFAULT_RETENTION)
    held = [compute(cache, [10 + k] * 4, 0, hold=True)[1] for k in range(2)]  # running batch: chat → CPU
    assert cache.tier_of(chat[0]) == "CPU" and cache.retention_of(chat[0]) == DEFAULT_RETENTION
    for table in held:
        cache.free(table)
    for k in range(8):  # batch blocks evicted from GPU into the CPU tier, one after another
        compute(cache, [20 + k] * 4, 0)
    assert cache.tier_of(chat[0]) == "CPU"  # plain LRU would have pushed it out 7 blocks ago
    assert cache.stats.cpu_evictions > 0  # the batch blocks did evict each other there
    hashes, table = compute(cache, [1] * 4 + [2] * 4, 0, hold=True)  # batch reads it back from CPU
    assert hashes[0] == chat[0] and cache.tier_of(chat[0]) == "GPU"
    assert cache.retention_of(chat[0]) == DEFAULT_RETENTION and cache.retention_of(hashes[1]) == 0
    cache.free(table)


def test_a_block_a_full_cpu_tier_would_not_keep_goes_to_disk_instead_of_evicting():
    events = []
    cache = TieredPrefixCache(1, BS, cpu_blocks=1, disk_blocks=1, sink=events.extend)
    chat, _ = compute(cache, [1] * 4, DEFAULT_RETENTION)
    batch, _ = compute(cache, [2] * 4, 0)  # chat → CPU
    compute(cache, [3] * 4, 0)  # batch → CPU is full of higher retention: batch goes to disk
    cache.flush()
    assert (cache.tier_of(chat[0]), cache.tier_of(batch[0])) == ("CPU", "DISK")
    assert cache.stats.cpu_evictions == 0
    stored = [(e.medium, e.block_hashes) for e in events if isinstance(e, BlockStored) and e.medium != "GPU"]
    assert [m for m, _ in stored] == ["CPU", "DISK"]


@pytest.mark.parametrize(("priority", "threshold", "asked", "expected"), [
    (10, 1, None, 0),                   # at or past the threshold: the lowest
    (1, 1, None, 0),
    (0, 1, None, DEFAULT_RETENTION),    # below it: the default
    (10, None, None, DEFAULT_RETENTION),  # threshold off
    (10, 1, 70, 70),                    # kv_retention_priority wins, either way
    (-100, 1, 0, 0),
])
def test_one_retention_rule_for_the_server_and_the_lab(priority, threshold, asked, expected):
    from engine_twin.engine import SimEngine
    from engine_twin.protocol import GenerationSpec
    from engine_twin.retention import request_retention
    from lab.toolkit.model_time import ModelTimeEngine

    assert request_retention(priority, threshold, asked) == expected
    s = build_settings(retention_priority_threshold=threshold, time_scale=0.0)
    spec = GenerationSpec("chat", "m", [[1]], 4, "length", priority=priority, retention=asked)
    assert SimEngine(s).retention_of(spec) == expected  # the twin's server path
    assert ModelTimeEngine(s).request([1] * 20, 4, priority, kv_retention_priority=asked).retention == expected
