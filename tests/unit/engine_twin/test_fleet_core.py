"""The pure engine core, step by step (vLLM V1's scheduler): chunked prefill under the token budget,
the long-prefill threshold, partial-prefill limits, block allocation per step, preemption by
recompute under both policies, retention-ordered eviction and the step-time model."""

import ast
import zlib
from pathlib import Path

import pytest

from engine_twin.core import CoreRequest, EngineCore, Status
from engine_twin.kv_cache import DEFAULT_RETENTION, TieredPrefixCache, block_hashes, none_hash
from engine_twin.settings import build_settings
from engine_twin.step_model import StepModel, StepWork

BS = 4
ROOT = none_hash("0")


def make_core(**overrides):
    s = build_settings(**{"block_size": BS, "num_gpu_blocks": 64, "max_model_len": 32, "time_scale": 0.0,
                          "max_num_batched_tokens": 100, "max_num_seqs": 8, **overrides})
    return EngineCore(s, TieredPrefixCache(s.num_gpu_blocks, BS, s.cpu_offload_blocks))


def request(rid, prompt_len, max_tokens=4, seed=None, priority=0, retention=DEFAULT_RETENTION, prompt=None):
    """A request whose prompt repeats one token: ``seed``, else one derived from ``rid`` with CRC-32 (not
    ``hash()``: it changes with ``PYTHONHASHSEED``, and two ids sharing a token share cached blocks)."""
    token = seed if seed is not None else 1000 + zlib.crc32(rid.encode()) % 1000
    prompt = prompt if prompt is not None else [token] * prompt_len
    return CoreRequest(rid, prompt, max_tokens, block_hashes(prompt, BS, ROOT), priority, retention)


def run_to_end(core, limit=1000):
    """Step until idle; returns the outcomes."""
    outcomes = []
    t = 0.0
    while core.has_work():
        out = core.step(t)
        t += out.duration
        outcomes.append(out)
        assert len(outcomes) < limit, "the core never finished"
    return outcomes


def test_a_prompt_is_chunked_under_the_token_budget_and_decodes_after():
    core = make_core(max_num_batched_tokens=8)
    core.add(request("a", 20, max_tokens=3), 0.0)
    steps = [core.step(0.0) for _ in range(5)]
    assert [s.scheduled for s in steps] == [{"a": 8}, {"a": 8}, {"a": 4}, {"a": 1}, {"a": 1}]
    assert [s.sampled for s in steps] == [[], [], ["a"], ["a"], ["a"]]
    assert steps[-1].finished == ["a"] and not core.has_work()


def test_running_decodes_come_first_and_a_new_prompt_gets_the_rest_of_the_budget():
    core = make_core(max_num_batched_tokens=8)
    core.add(request("a", 4, max_tokens=10), 0.0)
    core.step(0.0)  # a: 4 prompt tokens, first token
    core.add(request("b", 20), 0.0)
    out = core.step(0.0)
    assert out.scheduled == {"a": 1, "b": 7} and out.first_scheduled == ["b"]
    assert core.step(0.0).scheduled == {"a": 1, "b": 7}


def test_long_prefill_token_threshold_caps_each_request_per_step():
    core = make_core(long_prefill_token_threshold=5)
    core.add(request("a", 12), 0.0)
    core.add(request("b", 12), 0.0)
    assert [core.step(0.0).scheduled for _ in range(3)] == [{"a": 5, "b": 5}, {"a": 5, "b": 5}, {"a": 2, "b": 2}]


def test_partial_prefill_limits_apply_above_one_and_v1_ignores_them_at_the_default():
    def first_step(**limits):
        core = make_core(long_prefill_token_threshold=5, **limits)
        for rid, length in (("long-1", 12), ("long-2", 12), ("short", 4), ("short-2", 3)):
            core.add(request(rid, length), 0.0)
        return core.step(0.0).scheduled

    # V1 (the default 1 / 1): not enforced, every prompt gets a chunk
    assert first_step() == {"long-1": 5, "long-2": 5, "short": 4, "short-2": 3}
    # 2 partial prefills, 1 long: the second long prompt waits, a short one jumps it
    assert first_step(max_num_partial_prefills=2, max_long_partial_prefills=1) == {"long-1": 5, "short": 4}


def test_partial_prefill_threshold_defaults_to_four_percent_of_the_context():
    assert build_settings(max_num_partial_prefills=2, max_model_len=10_000).long_prefill_token_threshold == 400
    with pytest.raises(ValueError, match="max_long_partial_prefills"):
        build_settings(max_num_partial_prefills=2, max_long_partial_prefills=3)


def test_blocks_are_allocated_as_tokens_are_computed():
    core = make_core()
    core.add(request("a", 6, max_tokens=5), 0.0)
    used = []
    for _ in range(5):
        core.step(0.0)
        used.append(core.cache.used_blocks)
    # computed tokens after each step: 6, 7, 8, 9, (finished) -> blocks of 4: 2, 2, 2, 3, then freed
    assert used == [2, 2, 2, 3, 0]


def pressure_core(policy):
    # 8 blocks of 4 tokens; three requests of 4 prompt + 12 output tokens need 4 blocks each (12 > 8)
    core = make_core(num_gpu_blocks=8, scheduling_policy=policy)
    core.add(request("a", 4, 12, seed=1, priority=0), 0.0)
    core.add(request("b", 4, 12, seed=2, priority=5), 1.0)
    core.add(request("c", 4, 12, seed=3, priority=1), 2.0)
    return core


@pytest.mark.parametrize(("policy", "victim"), [("fcfs", "c"), ("priority", "b")])
def test_kv_pressure_preempts_the_last_or_lowest_priority_running_request_and_all_complete(policy, victim):
    core = pressure_core(policy)
    outcomes = run_to_end(core)
    first = next(o for o in outcomes if o.preempted)
    # step 6: every request holds 2 blocks and needs a third for token 9; a and b get theirs (7, 8 of 8)
    assert outcomes.index(first) == 5
    assert first.preempted == [victim] and victim not in first.scheduled
    assert core.num_preemptions == sum(len(o.preempted) for o in outcomes) >= 1
    finished = [rid for o in outcomes for rid in o.finished]
    assert sorted(finished) == ["a", "b", "c"]
    generated = {rid: sum(1 for o in outcomes for r in o.sampled if r == rid) for rid in "abc"}
    assert generated == {"a": 12, "b": 12, "c": 12}
    assert core.cache.used_blocks == 0
    # no waiting request was admitted in a step that preempted
    assert all(not o.first_scheduled for o in outcomes if o.preempted)


def test_a_preempted_request_restarts_from_zero_and_its_redo_hits_its_own_cached_prompt():
    core = make_core(num_gpu_blocks=8)
    core.add(request("a", 8, 12, seed=1), 0.0)
    core.add(request("b", 8, 12, seed=2), 0.0)
    outcomes = run_to_end(core)
    preempted = [rid for o in outcomes for rid in o.preempted]
    assert preempted and preempted[0] == "b"
    redo = next(i for i, o in enumerate(outcomes) if "b" in o.scheduled and i > [
        k for k, o in enumerate(outcomes) if "b" in o.preempted][0])
    # b had 8 prompt tokens (2 blocks, the second recomputed: at most num_tokens - 1 cached) + outputs
    assert outcomes[redo].scheduled["b"] > 1
    assert core.cache.stats.queries_tokens == 16  # the redo's lookup is not counted again (vLLM)


def test_the_preempting_request_itself_goes_when_it_is_the_lowest_priority():
    core = make_core(num_gpu_blocks=8, scheduling_policy="priority")
    core.add(request("hi", 4, 12, seed=1, priority=0), 0.0)
    core.add(request("lo", 4, 12, seed=2, priority=9), 0.0)
    core.add(request("mid", 4, 12, seed=3, priority=1), 0.0)
    outcomes = run_to_end(core)
    assert outcomes[5].preempted == ["lo"]
    assert sorted(r for o in outcomes for r in o.finished) == ["hi", "lo", "mid"]


def test_a_request_larger_than_the_whole_cache_is_refused():
    core = make_core(num_gpu_blocks=8)
    with pytest.raises(ValueError, match="needs 9 KV cache blocks"):
        core.add(request("huge", 20, 16), 0.0)
    assert not core.has_work()


def test_max_num_seqs_bounds_the_running_list():
    core = make_core(max_num_seqs=2)
    for rid in "abc":
        core.add(request(rid, 4, 3), 0.0)
    assert set(core.step(0.0).scheduled) == {"a", "b"}
    assert (core.num_running, core.num_waiting) == (2, 1)


@pytest.mark.parametrize(("policy", "order"), [("priority", ["high", "mid", "low"]), ("fcfs", ["low", "mid", "high"])])
def test_waiting_requests_are_taken_in_policy_order(policy, order):
    core = make_core(max_num_seqs=1, scheduling_policy=policy)
    for rid, priority in (("low", 7), ("mid", 3), ("high", -1)):
        core.add(request(rid, 4, 1, priority=priority), 0.0)
    seen = [rid for o in run_to_end(core) for rid in o.first_scheduled]
    assert seen == order


def test_abort_frees_a_running_or_waiting_request():
    core = make_core(max_num_seqs=1)
    core.add(request("run", 8, 10), 0.0)
    core.add(request("wait", 8, 10), 0.0)
    core.step(0.0)
    assert core.abort("wait").status == Status.ABORTED and core.num_waiting == 0
    core.abort("run")
    assert core.num_running == 0 and core.cache.used_blocks == 0 and core.abort("run") is None
    assert core.step(0.0).scheduled == {}


def test_a_repeated_prompt_hits_the_gpu_cache_at_schedule_time():
    core = make_core()
    core.add(request("a", 10, 1, seed=5), 0.0)
    run_to_end(core)
    again = request("b", 10, 1, seed=5)
    core.add(again, 0.0)
    assert core.step(0.0).scheduled == {"b": 2}  # 2 of 2 full blocks cached: 8 tokens
    assert again.num_cached_tokens == 8
    assert (core.cache.stats.queries_tokens, core.cache.stats.hits_tokens) == (20, 8)


def test_cpu_tier_hits_are_loaded_and_cost_step_time():
    core = make_core(num_gpu_blocks=8, cpu_offload_blocks=16)
    core.add(request("a", 16, 1, seed=1), 0.0)
    run_to_end(core)
    core.add(request("flush", 31, 1, seed=2), 0.0)  # 8 blocks: pushes a's 4 blocks to the CPU tier
    stores = sum(o.work.cpu_stores for o in run_to_end(core))
    assert stores >= 4
    core.add(request("again", 16, 1, seed=1), 0.0)
    out = core.step(0.0)
    assert out.work.cpu_loads == 3 and out.scheduled == {"again": 4}  # at most 15 tokens cached
    model = core.model
    assert out.duration == pytest.approx(model.seconds(out.work))
    assert out.duration - model.seconds(StepWork(4, out.work.attention_pairs, 12)) == pytest.approx(
        3 * model.cpu_block_s + out.work.cpu_stores * model.cpu_block_s)


def test_batch_blocks_are_evicted_before_interactive_ones_and_shared_prefixes_keep_their_retention():
    core = make_core(num_gpu_blocks=8)
    shared = [1] * 8
    core.add(request("chat", 9, 1, prompt=shared + [2]), 0.0)  # 2 full blocks: the shared prefix
    run_to_end(core)
    core.add(request("batch", 17, 1, retention=0, prompt=shared + [3] * 9), 0.0)  # hits 2, computes 2
    run_to_end(core)
    cache = core.cache
    shared_hashes = block_hashes(shared, BS, ROOT)
    batch_hashes = block_hashes(shared + [3] * 9, BS, ROOT)
    assert [cache.retention_of(h) for h in batch_hashes] == [DEFAULT_RETENTION] * 2 + [0] * 2
    # 4 blocks are empty; a 23-token prompt needs 6: the 2 others come from the batch's own blocks,
    # although the shared prefix was freed first (plain LRU would evict the shared prefix)
    core.add(request("other", 23, 1, seed=9), 0.0)
    run_to_end(core)
    assert [cache.tier_of(h) for h in batch_hashes[2:]] == [None, None]
    assert [cache.tier_of(h) for h in shared_hashes] == ["GPU", "GPU"]


def test_an_interactive_hit_raises_a_batch_block_to_its_retention():
    cache = TieredPrefixCache(8, BS)
    tokens = list(range(8))
    hashes = block_hashes(tokens, BS, ROOT)
    table = cache.admit(hashes, cache.find_hits(hashes, 1), 2, tokens, 0)
    cache.commit(table, 0, 2, hashes, tokens, 0)
    cache.free(table)
    hits = cache.find_hits(hashes, 1)
    again = cache.admit(hashes, hits, 1, tokens, DEFAULT_RETENTION)
    assert hits.gpu == 1 and [cache.retention_of(h) for h in hashes] == [DEFAULT_RETENTION, 0]
    cache.free(again)


def test_step_model_matches_the_documented_formula():
    s = build_settings()
    m = StepModel.from_settings(s)
    hbm, flops = 3350e9 * 0.77, 989e12 * 0.5
    assert m.kv_bytes_per_token == 131072  # 2 x 32 layers x 8 heads x 128 x 2 bytes
    assert m.fixed_s == pytest.approx(8.03e9 * 2 / hbm + 0.002)
    assert m.seconds(StepWork()) == 0.0
    work = StepWork(tokens=100, attention_pairs=5050, context_tokens=1000, cpu_loads=2, disk_stores=1)
    expected = (m.fixed_s + 100 * 2 * 8.03e9 / flops + 5050 * 4 * 32 * 32 * 128 / flops + 1000 * 131072 / hbm
                + 2 * 131072 * 16 / 25e9 + 131072 * 16 / 5e9)
    assert m.seconds(work) == pytest.approx(expected)
    # the idle decode step: about 8.2 ms (module docstring)
    assert m.seconds(StepWork(1, 1, 0)) == pytest.approx(0.0082, abs=0.0001)


# ---- background prefills bounded per step (--background-priority-threshold) -------------------


def test_background_prefill_chunks_share_at_most_the_background_budget_per_step():
    core = make_core(max_num_batched_tokens=100, background_priority_threshold=5, max_background_prefill_tokens=12,
                     scheduling_policy="priority")
    core.add(request("b1", 20, priority=10), 0.0)
    core.add(request("b2", 20, priority=10), 0.0)
    steps = [core.step(0.0).scheduled for _ in range(3)]
    # 12 background tokens per step in all: b1 takes them, then b1's last 8 and 4 of b2, ...
    assert steps == [{"b1": 12}, {"b1": 8, "b2": 4}, {"b1": 1, "b2": 12}]
    # under FCFS vLLM ignores priority, so nothing is background
    fcfs = make_core(max_num_batched_tokens=100, background_priority_threshold=5, max_background_prefill_tokens=12)
    fcfs.add(request("b1", 20, priority=10), 0.0)
    assert fcfs.step(0.0).scheduled == {"b1": 20}


def test_no_background_prefill_in_a_step_that_starts_with_a_foreground_prefill_waiting_or_partial():
    core = make_core(max_num_batched_tokens=10, background_priority_threshold=5, max_background_prefill_tokens=8,
                     scheduling_policy="priority")
    core.add(request("b", 20, max_tokens=3, priority=10), 0.0)
    assert core.step(0.0).scheduled == {"b": 8}
    core.add(request("i", 12, max_tokens=3, priority=-100), 0.0)
    # i waits at the head: b (partial) gets nothing; i's 12 tokens take two steps, b still nothing
    # in the second (i is partial when it starts); b resumes beside i's decode
    assert [core.step(0.0).scheduled for _ in range(3)] == [{"i": 10}, {"i": 2}, {"b": 8, "i": 1}]


def test_background_decodes_are_never_limited_and_foreground_is_not_limited():
    core = make_core(max_num_batched_tokens=100, background_priority_threshold=5, max_background_prefill_tokens=4,
                     scheduling_policy="priority")
    core.add(request("b", 4, max_tokens=3, priority=10), 0.0)
    core.add(request("i", 40, max_tokens=3, priority=0), 0.0)
    # i (foreground) waits at the start of the first step: b gets no prefill, i all 40 tokens
    assert core.step(0.0).scheduled == {"i": 40}
    assert core.step(0.0).scheduled == {"i": 1, "b": 4}
    assert core.step(0.0).scheduled == {"i": 1, "b": 1}


def test_without_the_threshold_background_prefills_fill_the_budget_as_vllm():
    core = make_core(max_num_batched_tokens=30, max_background_prefill_tokens=4)
    core.add(request("b1", 20, priority=10), 0.0)
    core.add(request("b2", 20, priority=10), 0.0)
    assert core.step(0.0).scheduled == {"b1": 20, "b2": 10}


PURE_MODULES = ("core.py", "kv_cache.py", "step_model.py")
CLOCK_MODULES = {"time", "datetime", "asyncio", "threading", "random"}


@pytest.mark.parametrize("module", PURE_MODULES)
def test_the_pure_core_imports_no_clock_and_no_randomness(module):
    """Time reaches the core only as the ``now`` arguments of its calls."""
    tree = ast.parse((Path(__file__).parents[3] / "engine_twin" / module).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {(node.module or "").split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not imported & CLOCK_MODULES

