"""KVBlockIndex: engine blocks of 16 / 48 / 128 tokens map onto our 64-token keys exactly as the
scheduler hashes prompts; tiers, offload copies, removals, clears, unknown parents, speculative
entries, caps and endpoint removal."""

from __future__ import annotations

import pytest
from scheduling_helpers import FakeClock, prompt, request, scheduler_from

from router.kv_index.events import AllBlocksCleared, BlockRemoved, BlockStored
from router.kv_index.index import KVBlockIndex
from router.scheduling.hashing import chain_seed, chained_keys, request_block_keys, tokens_to_bytes
from router.scheduling.types import Endpoint

MODEL = "m"
A, B, C = "http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"


def our_keys(tokens, model=MODEL, salt=None):
    """The keys the scheduler computes for a prompt (64-token blocks)."""
    return chained_keys(tokens_to_bytes(tokens), 64 * 4, chain_seed(model, salt))


def stored(tokens, block_size, first_hash, parent=None, **fields) -> BlockStored:
    """One BlockStored of every full engine block of ``tokens`` with hashes first_hash, +1, …"""
    n = len(tokens) // block_size
    return BlockStored(list(range(first_hash, first_hash + n)), parent, tokens[:n * block_size], block_size, **fields)


@pytest.mark.parametrize("engine_block", [16, 48, 64, 128])
def test_keys_match_the_schedulers_hashing_for_any_engine_block_size(engine_block):
    tokens = prompt(1, 384)  # 6 of our blocks; 384 is a multiple of 16, 48, 64 and 128
    index = KVBlockIndex(block_size_tokens=64)
    index.apply(A, MODEL, [stored(tokens, engine_block, 1)])
    assert index.longest_prefix(MODEL, our_keys(tokens)) == {A: (6, "gpu")}
    # the same keys the precise producer asks with, for a longer prompt sharing the 384 tokens
    keys = request_block_keys(request(tokens + prompt(2, 100), model=MODEL), 64)
    assert index.longest_prefix(MODEL, keys) == {A: (6, "gpu")}
    assert index.stats()["engine_blocks"] == 384 // engine_block


def test_a_chain_continues_across_events_from_the_parents_state():
    shared = prompt(1, 160)  # 10 engine blocks of 16: 2.5 of our blocks
    first, second = shared + prompt(2, 96), shared + prompt(3, 96)
    index = KVBlockIndex()
    index.apply(A, MODEL, [stored(first[:96], 16, 1), stored(first[96:], 16, 7, parent=6)])
    # the second prompt hits the first 10 engine blocks and stores the rest after block hash 10
    index.apply(A, MODEL, [stored(second[160:], 16, 100, parent=10)])
    assert index.longest_prefix(MODEL, our_keys(first)) == {A: (4, "gpu")}
    assert index.longest_prefix(MODEL, our_keys(second)) == {A: (4, "gpu")}
    assert index.longest_prefix(MODEL, our_keys(shared + prompt(4, 96))) == {A: (2, "gpu")}
    assert index.stats()["unknown_parents"] == 0


def test_an_engine_block_may_complete_zero_one_or_two_keys():
    tokens = prompt(5, 256)
    index = KVBlockIndex()
    index.apply(A, MODEL, [stored(tokens[:48], 48, 1)])  # 48 tokens: no key complete yet
    assert index.longest_prefix(MODEL, our_keys(tokens)) == {}
    assert index.stats()["blocks"] == 0
    index.apply(A, MODEL, [stored(tokens[48:96], 48, 2, parent=1)])  # completes key 0
    assert index.longest_prefix(MODEL, our_keys(tokens)) == {A: (1, "gpu")}
    big = KVBlockIndex()
    big.apply(B, MODEL, [stored(tokens[:128], 128, 1)])  # one block, two keys
    assert big.longest_prefix(MODEL, our_keys(tokens)) == {B: (2, "gpu")}


def test_endpoints_report_their_own_run_lengths():
    tokens = prompt(1, 256)
    index = KVBlockIndex()
    index.apply(A, MODEL, [stored(tokens, 16, 1)])
    index.apply(B, MODEL, [stored(tokens[:64], 16, 1)])
    index.apply(C, MODEL, [stored(tokens[64:128], 16, 1, parent=None)])  # not from block 0: other keys
    assert index.longest_prefix(MODEL, our_keys(tokens)) == {A: (4, "gpu"), B: (1, "gpu")}
    assert index.longest_prefix("other-model", our_keys(tokens, "other-model")) == {}


def test_cpu_copy_without_tokens_then_gpu_removal_leaves_the_cpu_tier():
    tokens = prompt(1, 128)  # engine hashes 1..8, keys completed by hashes 4 and 8
    index = KVBlockIndex()
    index.apply(A, MODEL, [stored(tokens, 16, 1)])
    index.apply(A, MODEL, [BlockStored([8], None, [], 16, medium="CPU")])
    assert index.longest_prefix(MODEL, our_keys(tokens)) == {A: (2, "gpu")}  # GPU and CPU: gpu
    index.apply(A, MODEL, [BlockRemoved([8], "GPU")])
    assert index.longest_prefix(MODEL, our_keys(tokens)) == {A: (2, "cpu")}  # slowest along the run
    assert index.stats()["endpoints"][A] == {"gpu": 1, "cpu": 1, "disk": 0}
    index.apply(A, MODEL, [BlockStored([4], None, [], 16, medium="DISK"), BlockRemoved([4], "GPU")])
    assert index.longest_prefix(MODEL, our_keys(tokens)) == {A: (2, "disk")}
    index.apply(A, MODEL, [BlockRemoved([8], "CPU")])  # key 1 has no tier left: the run shortens
    assert index.longest_prefix(MODEL, our_keys(tokens)) == {A: (1, "disk")}
    assert index.stats()["blocks"] == 1


def test_an_offload_announced_after_the_gpu_removal_still_finds_its_block():
    tokens = prompt(1, 128)
    index = KVBlockIndex()
    index.apply(A, MODEL, [stored(tokens[:64], 16, 1)])
    # the simulator's eviction order: GPU removal first, then the CPU copy (no tokens)
    index.apply(A, MODEL, [BlockRemoved([4], "GPU")])
    assert index.longest_prefix(MODEL, our_keys(tokens)) == {}
    index.apply(A, MODEL, [BlockStored([4], None, [], 16, medium="CPU")])
    assert index.longest_prefix(MODEL, our_keys(tokens)) == {A: (1, "cpu")}
    index.apply(A, MODEL, [stored(tokens[64:], 16, 5, parent=4)])  # child of a CPU-only block
    assert index.longest_prefix(MODEL, our_keys(tokens)) == {A: (2, "cpu")}
    index.apply(A, MODEL, [BlockRemoved([3], "GPU")])  # a block that completes no key
    other = tokens[:48] + prompt(7, 16)
    index.apply(A, MODEL, [stored(other[48:], 16, 40, parent=3)])  # child of the removed block
    assert index.longest_prefix(MODEL, our_keys(other)) == {A: (1, "gpu")}
    assert index.stats()["unknown_parents"] == 0 and index.stats()["skipped"] == 0


def test_removed_blocks_are_remembered_up_to_a_bound(monkeypatch):
    monkeypatch.setattr("router.kv_index.index.REMOVED_BLOCKS_KEPT", 2)
    tokens = prompt(1, 64)
    index = KVBlockIndex()
    index.apply(A, MODEL, [stored(tokens, 16, 1)])
    index.apply(A, MODEL, [BlockRemoved([4, 3, 2], "GPU")])  # 4 is forgotten, 3 and 2 kept
    index.apply(A, MODEL, [BlockStored([4, 3], None, [], 16, medium="CPU")])
    assert index.stats()["skipped"] == 1 and index.stats()["engine_blocks"] == 2
    assert index.longest_prefix(MODEL, our_keys(tokens)) == {}


def test_removal_applies_to_its_medium_only():
    tokens = prompt(1, 64)
    index = KVBlockIndex()
    index.apply(A, MODEL, [stored(tokens, 16, 1)])
    index.apply(A, MODEL, [BlockRemoved([4], "CPU")])  # not on CPU: nothing changes
    assert index.longest_prefix(MODEL, our_keys(tokens)) == {A: (1, "gpu")}
    index.apply(A, MODEL, [BlockRemoved([4])])  # no medium (older vLLM): GPU
    assert index.longest_prefix(MODEL, our_keys(tokens)) == {}
    assert index.stats()["engine_blocks"] == 3


def test_a_cpu_copy_of_an_unknown_block_is_skipped():
    index = KVBlockIndex()
    index.apply(A, MODEL, [BlockStored([77], None, [], 16, medium="CPU")])
    assert index.stats()["blocks"] == 0 and index.stats()["skipped"] == 1


def test_all_blocks_cleared_drops_only_that_endpoint():
    tokens = prompt(1, 128)
    index = KVBlockIndex()
    index.apply(A, MODEL, [stored(tokens, 16, 1)])
    index.apply(B, MODEL, [stored(tokens, 16, 1)])
    index.apply(A, MODEL, [AllBlocksCleared()])
    assert index.longest_prefix(MODEL, our_keys(tokens)) == {B: (2, "gpu")}
    assert index.stats()["endpoints"][A] == {"gpu": 0, "cpu": 0, "disk": 0}
    assert index.stats()["engine_blocks"] == 8


def test_unknown_parent_is_counted_and_indexes_nothing():
    tokens = prompt(1, 192)
    index = KVBlockIndex()
    index.apply(A, MODEL, [stored(tokens[64:], 16, 5, parent=4)])  # parent never seen
    assert index.stats()["unknown_parents"] == 1
    assert index.stats()["blocks"] == 0 and index.stats()["engine_blocks"] == 0
    index.apply(A, MODEL, [stored(tokens[:64], 16, 1)])  # block 0 arrives later: only its key
    assert index.longest_prefix(MODEL, our_keys(tokens)) == {A: (1, "gpu")}


def test_lora_blocks_are_keyed_by_the_adapter_name_and_the_salt_comes_from_extra_keys():
    tokens = prompt(1, 128)
    index = KVBlockIndex()
    index.apply(A, MODEL, [stored(tokens, 16, 1, lora_id=1, lora_name="sql-adapter")])
    assert index.longest_prefix(MODEL, our_keys(tokens, "sql-adapter")) == {A: (2, "gpu")}
    assert index.longest_prefix(MODEL, our_keys(tokens)) == {}
    salted = stored(tokens, 16, 1, extra_keys=[("tenant-7",)] + [None] * 7)
    index.apply(B, MODEL, [salted])
    assert index.longest_prefix(MODEL, our_keys(tokens, salt="tenant-7")) == {B: (2, "gpu")}


def test_blocks_that_cannot_be_keyed_like_prompts_are_skipped():
    tokens = prompt(1, 128)
    index = KVBlockIndex()
    index.apply(A, MODEL, [stored(tokens, 16, 1, lora_id=1)])  # adapter without a name
    index.apply(A, MODEL, [stored(tokens, 16, 11, extra_keys=[None] * 5 + [("mm-hash",)] + [None] * 2)])
    index.apply(A, MODEL, [stored(tokens, 16, 21, medium="LMCACHE")])
    index.apply(A, MODEL, [stored(tokens, 16, 31, group_idx=1, kv_cache_spec_kind="sliding_window")])
    index.apply(A, MODEL, [BlockStored([41, 42], None, tokens[:40], 16)])  # 40 tokens for 2 blocks of 16
    # only the 5 blocks before the multimodal one were keyed: one key
    assert index.longest_prefix(MODEL, our_keys(tokens)) == {A: (1, "gpu")}
    assert index.stats()["skipped"] == 8 + 3 + 8 + 8 + 2


def test_removals_in_a_skipped_group_do_not_touch_full_attention_blocks():
    tokens = prompt(1, 64)
    index = KVBlockIndex()
    index.apply(A, MODEL, [stored(tokens, 16, 1, group_idx=0, kv_cache_spec_kind="full_attention"),
                           stored(tokens, 16, 1, group_idx=1, kv_cache_spec_kind="sliding_window")])
    index.apply(A, MODEL, [BlockRemoved([4], "GPU", group_idx=1)])
    assert index.longest_prefix(MODEL, our_keys(tokens)) == {A: (1, "gpu")}
    index.apply(A, MODEL, [BlockRemoved([4], "GPU", group_idx=0)])
    assert index.longest_prefix(MODEL, our_keys(tokens)) == {}


def test_speculative_entries_count_as_gpu_until_their_ttl():
    clock = FakeClock()
    tokens = prompt(1, 256)
    keys = our_keys(tokens)
    index = KVBlockIndex(clock=clock)
    index.add_speculative(MODEL, A, keys, ttl_s=2.0)
    index.add_speculative(MODEL, B, keys[:2], ttl_s=2.0)
    assert index.longest_prefix(MODEL, keys) == {A: (4, "gpu"), B: (2, "gpu")}
    index.apply(B, MODEL, [stored(tokens[:64], 16, 1)])  # B's events confirm one block
    clock.now += 2.0
    assert index.longest_prefix(MODEL, keys) == {B: (1, "gpu")}
    assert index.stats()["blocks"] == 1 and index.stats()["speculative"] == 0


def test_a_speculative_entry_extends_a_cpu_run_as_gpu():
    clock = FakeClock()
    tokens = prompt(1, 128)
    keys = our_keys(tokens)
    index = KVBlockIndex(clock=clock)
    index.apply(A, MODEL, [stored(tokens, 16, 1, medium="CPU")])
    index.add_speculative(MODEL, A, keys, ttl_s=1.0)
    assert index.longest_prefix(MODEL, keys) == {A: (2, "gpu")}
    clock.now += 1.5
    assert index.longest_prefix(MODEL, keys) == {A: (2, "cpu")}


def test_expired_speculative_entries_are_swept_without_lookups():
    clock = FakeClock()
    index = KVBlockIndex(clock=clock)
    index.add_speculative(MODEL, A, our_keys(prompt(1, 640)), ttl_s=1.0)
    assert index.stats()["blocks"] == 10
    clock.now += 1.0
    index.apply(B, MODEL, [])  # any later call sweeps
    assert index.stats()["blocks"] == 0 and index.stats()["speculative"] == 0


def test_the_key_cap_evicts_the_least_recently_stored_keys():
    first, second = prompt(1, 192), prompt(2, 192)
    index = KVBlockIndex(max_blocks=4, max_engine_blocks=100)
    index.apply(A, MODEL, [stored(first, 16, 1)])
    index.apply(B, MODEL, [stored(second, 16, 1)])
    stats = index.stats()
    assert stats["blocks"] == 4 and stats["evicted"] == 2
    assert index.longest_prefix(MODEL, our_keys(second)) == {B: (3, "gpu")}
    assert index.longest_prefix(MODEL, our_keys(first)) == {}  # its block 0 went first
    assert stats["endpoints"][A]["gpu"] == 1  # per-tier counts follow evictions
    index.apply(A, MODEL, [BlockStored([4], None, [], 16, medium="CPU")])  # re-store recreates the key
    assert index.longest_prefix(MODEL, our_keys(first)) == {A: (1, "gpu")}


def test_the_engine_block_cap_evicts_from_the_biggest_endpoint():
    index = KVBlockIndex(max_blocks=100, max_engine_blocks=12)
    index.apply(A, MODEL, [stored(prompt(1, 128), 16, 1)])  # 8 engine blocks
    index.apply(B, MODEL, [stored(prompt(2, 96), 16, 1)])  # 6 more: 14 > 12
    stats = index.stats()
    assert stats["engine_blocks"] == 12
    assert index.longest_prefix(MODEL, our_keys(prompt(2, 96))) == {B: (1, "gpu")}
    assert index.longest_prefix(MODEL, our_keys(prompt(1, 128))) == {A: (2, "gpu")}  # A lost 2 non-key blocks
    index.apply(A, MODEL, [stored(prompt(3, 64), 16, 50)])  # A is biggest: loses its oldest, key 0 of prompt 1
    assert index.longest_prefix(MODEL, our_keys(prompt(1, 128))) == {}


def test_remove_endpoint_frees_its_slot_for_a_new_endpoint():
    tokens = prompt(1, 128)
    index = KVBlockIndex(clock=FakeClock())
    index.apply(A, MODEL, [stored(tokens, 16, 1)])
    index.add_speculative(MODEL, A, our_keys(prompt(2, 128)), ttl_s=5)
    index.apply(B, MODEL, [stored(tokens[:64], 16, 1)])
    index.remove_endpoint(A)
    index.remove_endpoint("http://never-seen")
    assert index.longest_prefix(MODEL, our_keys(tokens)) == {B: (1, "gpu")}
    assert index.longest_prefix(MODEL, our_keys(prompt(2, 128))) == {}
    assert set(index.stats()["endpoints"]) == {B}
    index.apply(C, MODEL, [])  # takes A's slot
    assert index.longest_prefix(MODEL, our_keys(tokens)) == {B: (1, "gpu")}
    assert index.stats()["blocks"] == 1 and index.stats()["engine_blocks"] == 4


def test_stats_has_the_documented_shape():
    index = KVBlockIndex()
    index.apply(A, MODEL, [stored(prompt(1, 64), 16, 1)])
    index.record_decode_error()
    index.record_seq_gap(3)
    stats = index.stats()
    assert {k: stats[k] for k in ("blocks", "engine_blocks", "decode_errors", "unknown_parents", "seq_gaps")} == {
        "blocks": 1, "engine_blocks": 4, "decode_errors": 1, "unknown_parents": 0, "seq_gaps": 3}
    assert stats["endpoints"] == {A: {"gpu": 1, "cpu": 0, "disk": 0}}
    assert stats["approx_bytes"] > 0


def test_constructor_rejects_sizes_below_one():
    with pytest.raises(ValueError):
        KVBlockIndex(max_blocks=0)
    with pytest.raises(ValueError):
        KVBlockIndex(block_size_tokens=0)


def test_a_precise_producer_scheduler_picks_the_endpoint_holding_the_prompt():
    tokens = prompt(9, 300)
    index = KVBlockIndex()
    index.apply(B, MODEL, [stored(tokens[:256], 16, 1)])
    index.apply(C, MODEL, [stored(tokens[:128], 16, 1, medium="CPU")])
    scheduler, _ = scheduler_from("""
plugins:
- type: precise-prefix-cache-producer
- type: prefix-cache-scorer
  parameters: {prefixMatchInfoProducerName: precise-prefix-cache-producer}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: prefix-cache-scorer}]
""", prefix_index=index)
    result = scheduler.schedule(request(tokens, model=MODEL), [Endpoint(A), Endpoint(B), Endpoint(C)])
    assert result.endpoint.name == B
    # 4 of 4 blocks on B's GPU; 2 blocks on C's CPU weighted 0.8; nothing on A
    assert result.scores["prefix-cache-scorer"] == [0.0, 1.0, pytest.approx(2 * 0.8 / 4)]


def test_a_lapsed_speculative_holder_stays_gone_on_later_lookups():
    now = [0.0]
    index = KVBlockIndex(clock=lambda: now[0])
    model = "m"
    first, second = "http://10.0.0.1:8000", "http://10.0.0.2:8000"
    keys = [11, 12, 13]
    index.add_speculative(model, first, keys, 1.0)
    index.add_speculative(model, second, keys, 10.0)
    now[0] = 2.0
    for _ in range(3):  # the first lookup clears the lapsed bit; the next ones must not see it
        assert index.longest_prefix_tiers(model, keys) == {second: (3, 0, 0)}
        assert index.longest_prefix(model, keys) == {second: (3, "gpu")}
