"""Block hashing (vLLM's sha256_cbor scheme) and the tiered prefix cache."""

import hashlib

import cbor2

from engine_twin.kv_cache import (
    Hits,
    TieredPrefixCache,
    block_hashes,
    external_hash,
    hash_block_tokens,
    none_hash,
    sha256_cbor,
)
from engine_twin.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

BS = 4


def test_sha256_cbor_is_sha256_of_canonical_cbor():
    value = (b"\x01" * 32, (1, 2, 3), None)
    assert sha256_cbor(value) == hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def test_none_hash_comes_from_the_seed_string_and_falls_back_to_pythonhashseed(monkeypatch):
    assert none_hash("0") == sha256_cbor("0")
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    assert none_hash(None) == sha256_cbor("42")
    monkeypatch.delenv("PYTHONHASHSEED")
    assert none_hash(None) != none_hash(None)  # random, as vLLM without PYTHONHASHSEED


def test_block_hashes_chain_from_none_hash_and_skip_the_partial_block():
    root = none_hash("0")
    tokens = list(range(10))
    hashes = block_hashes(tokens, BS, root)
    assert len(hashes) == 2
    assert hashes[0] == hash_block_tokens(root, tokens[0:4])
    assert hashes[1] == hash_block_tokens(hashes[0], tokens[4:8])
    other = block_hashes([99, 99, 99, 99] + tokens[4:8], BS, root)
    assert other[1] != hashes[1]  # same tokens, different parent


def test_external_hash_is_the_last_eight_bytes_big_endian():
    h = bytes(range(32))
    assert external_hash(h) == int.from_bytes(h[-8:], "big")
    assert external_hash(h) == int.from_bytes(h, "big") & ((1 << 64) - 1)


def make_cache(gpu=8, cpu=0, disk=0):
    events = []
    cache = TieredPrefixCache(gpu, BS, cpu, disk, sink=events.extend)
    return cache, events


def alloc(cache, tokens, root=none_hash("0")):
    """Schedule ``tokens`` as one fresh prompt computed in one step: hits, new blocks, full blocks
    cached; returns (hashes, block table, hits) after flushing the step's events."""
    hashes = block_hashes(tokens, BS, root)
    hits = cache.find_hits(hashes, (len(tokens) - 1) // BS)
    total = -(-len(tokens) // BS)
    table = cache.admit(hashes, hits, total - hits.blocks, tokens, 35)
    if table is not None:
        cache.commit(table, hits.blocks, len(hashes), hashes, tokens, 35)
    cache.flush()
    return hashes, table, hits


def test_new_blocks_are_stored_once_and_a_repeat_is_a_silent_hit():
    cache, events = make_cache()
    tokens = list(range(9))  # 2 full blocks + 1 partial
    hashes, a, hits = alloc(cache, tokens)
    assert events == [BlockStored([external_hash(h) for h in hashes], None, tokens[:8], BS)]
    assert cache.used_blocks == 3 and hits.gpu == 0
    cache.free(a)
    events.clear()
    _, b, hits = alloc(cache, tokens)
    assert hits.gpu == 2 and hits.blocks * BS == 8
    assert events == []  # a prefix hit produces no event


def test_hits_are_capped_at_prompt_len_minus_one():
    cache, _ = make_cache()
    tokens = list(range(8))
    _, a, _ = alloc(cache, tokens)
    cache.free(a)
    _, b, hits = alloc(cache, tokens)
    assert hits.gpu == 1  # the last block holds the last prompt token, recomputed


def test_lru_eviction_offloads_to_cpu_and_cpu_hits_are_loaded_back():
    cache, events = make_cache(gpu=4, cpu=4)
    first = list(range(100, 108))
    h1, a, _ = alloc(cache, first)
    cache.free(a)
    events.clear()
    h2, b, _ = alloc(cache, list(range(200, 216)))  # needs all 4 GPU blocks: evicts both of `first`
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    offloaded = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert {e.block_hashes[0] for e in removed} == {external_hash(h) for h in h1}
    assert all(e.medium == "GPU" for e in removed)
    assert all(e.token_ids == [] and e.parent_block_hash is None for e in offloaded)
    assert removed[0].block_hashes == [external_hash(h1[1])]  # deepest block is evicted first
    assert cache.tier_of(h1[0]) == "CPU" and cache.stats.cpu_stores == 2
    cache.free(b)
    events.clear()
    _, c, hits = alloc(cache, first + [1])
    assert (hits.gpu, hits.cpu) == (0, 2)
    assert cache.tier_of(h1[0]) == "GPU"
    assert any(isinstance(e, BlockStored) and e.medium == "GPU" for e in events)


def test_cpu_evictions_go_to_disk():
    cache, events = make_cache(gpu=2, cpu=1, disk=4)
    h1, a, _ = alloc(cache, list(range(8)))
    cache.free(a)
    alloc(cache, list(range(50, 58)))
    assert cache.tier_of(h1[1]) == "DISK" and cache.tier_of(h1[0]) == "CPU"
    assert any(isinstance(e, BlockStored) and e.medium == "DISK" for e in events)
    assert any(isinstance(e, BlockRemoved) and e.medium == "CPU" for e in events)
    assert cache.stats.disk_stores == 1


def test_a_tier_hit_already_on_gpu_past_the_prefix_loads_a_duplicate_and_leaves_the_gpu_copy_alone():
    """x1 on GPU (evictable) and on CPU while its parent x0 is on CPU only: a request for x0 x1
    loads both into new blocks (x1 an uncached duplicate, as vLLM's connector loads the run after
    the GPU prefix hit). Before the fix, admit gave x1 a reference count of 1 while leaving it in
    the evictable queue: a later eviction dropped it under the request and its free raised KeyError."""
    cache, _ = make_cache(gpu=5, cpu=8)
    prompt = list(range(9))  # blocks x0, x1 and a partial one
    x, a, _ = alloc(cache, prompt)
    cache.free(a)
    _, f, _ = alloc(cache, list(range(100, 120)))  # 5 blocks: x1, x0 evicted to CPU
    cache.free(f)
    # A P/D decode-side request (local GPU hits only, none here) at retention 90 waits for its KV;
    # meanwhile another request loads x0 back; the KV arrives: x0 a duplicate, x1 cached by it.
    remote = cache.admit(x, Hits(), 3, prompt, 90)
    _, b, hits = alloc(cache, prompt[:5])
    assert hits.cpu == 1 and cache.tier_of(x[0]) == "GPU"
    cache.commit(remote, 0, 2, x, prompt, 90)
    assert remote[:2] == [None, x[1]]
    cache.free(b)
    cache.free(remote)  # x0 then x1 evictable, both at 90
    _, c, _ = alloc(cache, list(range(200, 216)))  # 3 empty blocks + x0, evicted to CPU
    cache.free(c)
    assert (cache.tier_of(x[0]), cache.tier_of(x[1])) == ("CPU", "GPU")

    hashes, d, hits = alloc(cache, prompt)
    assert (hits.gpu, hits.cpu) == (0, 2)
    assert d == [x[0], None, None]  # x1 loaded into a new block beside its evictable GPU copy
    assert cache.used_blocks == 3 and cache.available() == 2
    assert alloc(cache, list(range(300, 312)))[1] is None  # 3 blocks do not fit: nothing held is evicted
    e = alloc(cache, list(range(300, 308)))[1]  # 2 do
    cache.free(d)
    cache.free(e)
    assert cache.used_blocks == 0


def test_held_blocks_are_pinned_and_grow_refuses_when_full():
    cache, _ = make_cache(gpu=4)
    _, a, _ = alloc(cache, list(range(16)))
    assert cache.usage == 1.0
    _, b, _ = alloc(cache, list(range(100, 104)))
    assert b is None  # nothing evictable: the caller waits
    assert cache.grow(a, 1) is False and len(a) == 4
    cache.free(a)
    assert cache.usage == 0.0
    _, c, _ = alloc(cache, list(range(100, 104)))
    assert c is not None and cache.grow(c, 3) and cache.used_blocks == 4


def test_a_step_sends_one_batch_and_a_continued_run_is_one_block_stored():
    batches = []
    cache = TieredPrefixCache(8, BS, sink=batches.append)
    tokens = list(range(12))
    hashes = block_hashes(tokens, BS, none_hash("0"))
    table = cache.admit(hashes, cache.find_hits(hashes, 2), 3, tokens, 35)
    cache.commit(table, 0, 1, hashes, tokens, 35)
    cache.commit(table, 1, 3, hashes, tokens, 35)
    cache.flush()
    cache.flush()  # nothing new: nothing sent
    assert len(batches) == 1 and len(batches[0]) == 1
    assert batches[0][0].block_hashes == [external_hash(h) for h in hashes]


def test_clear_refuses_while_running_then_emits_all_blocks_cleared():
    cache, events = make_cache()
    _, a, _ = alloc(cache, list(range(8)))
    assert cache.clear() is False
    cache.free(a)
    assert cache.clear() is True
    assert events[-1] == AllBlocksCleared()
    assert cache.sizes()["GPU"] == 0
