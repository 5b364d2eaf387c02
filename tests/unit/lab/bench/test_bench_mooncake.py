"""Mooncake-format traces (read, replay as text, write), the long-context generator's shape and the
bench's workload shapes."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from lab.bench.prefix import SHAPES, shape_trace
from lab.toolkit.workloads import (
    MOONCAKE_BLOCK_TOKENS,
    MooncakeRecord,
    agentic_sessions,
    chat_tokens,
    conversation_records,
    long_context_records,
    mooncake_trace,
    oracle_reusable_tokens,
    read_mooncake,
    reusable_share,
    shared_prefix_batch,
    tool_agents,
    write_mooncake,
)

SAMPLE = Path(__file__).parent / "data" / "mooncake-sample.jsonl"


def test_read_mooncake_sorts_by_timestamp_and_skips_blank_lines():
    records = read_mooncake(SAMPLE)
    assert [r.timestamp_ms for r in records] == [0, 500, 1000, 1500, 400000]
    assert records[0] == MooncakeRecord(0, 1200, 20, (0, 1, 2))


@pytest.mark.parametrize("line", ['{"timestamp": 0, "input_length": 10, "output_length": 1}',
                                  '{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": [1]}',
                                  '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": []}',
                                  'not json'])
def test_read_mooncake_names_the_bad_line(tmp_path, line):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n' + line + "\n")
    with pytest.raises(ValueError, match=":2:"):
        read_mooncake(path)


def test_mooncake_requests_have_the_trace_lengths_and_share_tokens_exactly_where_hash_ids_match():
    records = read_mooncake(SAMPLE)
    trace = mooncake_trace(records)
    tokens = [chat_tokens(r.body) for r in trace]
    assert [len(t) for t in tokens] == [r.input_length for r in records]
    assert [r.max_tokens for r in trace] == [r.output_length for r in records]
    assert [r.arrival_s for r in trace] == [0.0, 0.5, 1.0, 1.5, 400.0]
    assert len({r.session_id for r in trace}) == len(trace) and all(r.turn == 0 for r in trace)

    def common(a: list[int], b: list[int]) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    first, other, same_root, longer = tokens[0], tokens[1], tokens[2], tokens[3]
    # [0, 1, 2] vs [0, 1, 2, 5]: the whole first prompt's content (its last block was partial) is shared
    assert common(first, longer) >= 1200 - 13
    # [0, 1, 2] vs [0, 6]: block 0 only (512 tokens, plus the ChatML header)
    assert MOONCAKE_BLOCK_TOKENS <= common(first, same_root) < MOONCAKE_BLOCK_TOKENS + 13
    assert common(first, other) < 8  # [3, 4]: nothing but the ChatML header
    # the oracle counts the same reuse on the simulator's 16-token blocks
    oracle = oracle_reusable_tokens(trace)
    assert oracle.reusable_tokens[3] >= 1200 - 32 and oracle.reusable_tokens[1] == 0


def test_mooncake_window_speed_and_context_cap():
    records = read_mooncake(SAMPLE)
    window = mooncake_trace(records, start_min=0.01, minutes=1.0, speed=2.0)  # 600 ms .. 60.6 s
    assert [r.arrival_s for r in window] == [0.2, 0.45]
    capped = mooncake_trace(records, max_model_len=1024, max_output_tokens=8)
    assert max(len(chat_tokens(r.body)) + r.max_tokens for r in capped) <= 1024
    assert all(r.max_tokens <= 8 for r in capped)
    with pytest.raises(ValueError):
        mooncake_trace(records, speed=0)


def test_reusable_share_counts_whole_prefix_blocks_within_the_window():
    records = read_mooncake(SAMPLE)
    # record at 1000 ms reuses block 0 (512); at 1500 ms, blocks 0-2 (1536); the one at 400 s reuses
    # [3, 4] but its last sighting was 399.5 s earlier, outside 5 minutes
    total = sum(r.input_length for r in records)
    assert reusable_share(records) == pytest.approx((512 + 1536) / total)
    assert reusable_share(records, window_s=1000) == pytest.approx((512 + 1536 + 1024) / total)


def test_write_then_read_round_trips(tmp_path):
    records = long_context_records(seed=2, conversations=5)
    path = tmp_path / "trace.jsonl"
    write_mooncake(records, path)
    assert read_mooncake(path) == records
    assert set(json.loads(path.read_text().splitlines()[0])) == {"timestamp", "input_length", "output_length",
                                                                 "hash_ids"}


def test_long_context_generator_has_the_production_shape():
    # ~12k-token mean prompt, a tail past 90k, ~20 % of prompt tokens reusable within 5 minutes
    means, shares, peaks = [], [], []
    for seed in range(6):
        records = long_context_records(seed)
        lengths = [r.input_length for r in records]
        means.append(statistics.mean(lengths))
        shares.append(reusable_share(records))
        peaks.append(max(lengths))
        assert all(len(r.hash_ids) == -(-r.input_length // MOONCAKE_BLOCK_TOKENS) for r in records)
        assert max(lengths) <= 122_000 and [r.timestamp_ms for r in records] == sorted(r.timestamp_ms for r in records)
    assert 9_000 <= statistics.mean(means) <= 15_000
    assert 0.15 <= statistics.mean(shares) <= 0.30
    assert min(peaks) >= 60_000 and max(peaks) >= 110_000
    assert long_context_records(seed=1) == long_context_records(seed=1)


def test_later_turns_repeat_the_previous_turns_full_blocks():
    records = long_context_records(seed=0, conversations=30, multi_turn_share=1.0)
    by_first = {}
    for r in records:
        by_first.setdefault(r.hash_ids[0], []).append(r)
    for turns in by_first.values():
        for prev, nxt in zip(turns, turns[1:]):
            full = prev.input_length // MOONCAKE_BLOCK_TOKENS
            assert nxt.hash_ids[:full] == prev.hash_ids[:full] and nxt.input_length > prev.input_length


def test_tool_agents_differ_from_agentic_sessions_as_documented():
    tools, agentic = tool_agents(seed=0), agentic_sessions(seed=0)
    assert {r.workload for r in tools} == {"tool-agent"}
    assert not {r.session_id for r in tools} & {r.session_id for r in agentic}

    def calls_per_session(trace):
        counts: dict[str, int] = {}
        for r in trace:
            counts[r.session_id] = counts.get(r.session_id, 0) + 1
        sessions = [n for n in counts.values() if n > 1]  # one-off calls are not agents
        return statistics.mean(sessions), len(sessions)

    (tool_calls, tool_sessions), (agentic_calls, agentic_sessions_n) = calls_per_session(tools), calls_per_session(agentic)
    assert tool_calls >= 2 * agentic_calls and tool_sessions >= 1.8 * agentic_sessions_n
    oracle = oracle_reusable_tokens(tools)
    assert oracle.total_reusable / sum(oracle.prompt_tokens) >= 0.9  # consecutive calls share ~95 %


def test_shared_prefix_batch_shares_one_system_prompt():
    trace = shared_prefix_batch(seed=0, lines=50)
    assert len({r.body["messages"][0]["content"] for r in trace}) == 1
    assert len({r.body["messages"][1]["content"] for r in trace}) == 50
    oracle = oracle_reusable_tokens(trace)
    assert oracle.reusable_tokens[0] == 0 and min(oracle.reusable_tokens[1:]) >= 160


@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_full_shape_outgrows_its_fleets_gpu_cache(shape):
    opts = SHAPES[shape].full
    trace = shape_trace(shape, max_model_len=opts.max_model_len)
    oracle = oracle_reusable_tokens(trace, block_size=opts.block_size)
    assert oracle.distinct_blocks > opts.engines * opts.num_gpu_blocks
    assert max(oracle.prompt_tokens) + max(r.max_tokens for r in trace) <= opts.max_model_len


def test_conversation_generator_has_the_public_trace_statistics():
    # CONVERSATION_DEFAULTS: ~3.1 requests/s, mean prompt ~14k tokens, tail toward 121k, mean answer
    # ~343 tokens, and ~40 % of prompt tokens reusable within 5 minutes (Mooncake's conversation trace)
    means, shares, counts, peaks, outputs = [], [], [], [], []
    for seed in range(6):
        records = conversation_records(seed, duration_s=120.0)
        lengths = [r.input_length for r in records]
        means.append(statistics.mean(lengths))
        shares.append(reusable_share(records))
        counts.append(len(records))
        peaks.append(max(lengths))
        outputs.append(statistics.mean(r.output_length for r in records))
        assert all(len(r.hash_ids) == -(-r.input_length // MOONCAKE_BLOCK_TOKENS) for r in records)
        assert all(0 <= r.timestamp_ms < 120_000 for r in records)
        assert max(lengths) <= 121_000
    assert 12_000 <= statistics.mean(means) <= 16_000
    assert 0.30 <= statistics.mean(shares) <= 0.50
    assert 300 <= statistics.mean(counts) <= 400
    assert max(peaks) >= 100_000
    assert 280 <= statistics.mean(outputs) <= 400
    assert conversation_records(seed=3) == conversation_records(seed=3)
    assert conversation_records(seed=3) != conversation_records(seed=4)


def test_conversation_turns_repeat_their_history_and_share_system_prompts():
    records = conversation_records(seed=1, duration_s=60.0, think_s=5.0, mean_turns=4.0)
    first_blocks = {r.hash_ids[:2] for r in records}
    assert len(first_blocks) <= 4  # the 4 shared 1,024-token system prompts
    # a later turn: some earlier record's full blocks are its prefix, and it is longer
    by_prefix = {r.hash_ids[:r.input_length // MOONCAKE_BLOCK_TOKENS]: r for r in records}
    later = [r for r in records if any(r.hash_ids[:len(p)] == p and r is not q and len(p) > 2
                                       for p, q in by_prefix.items())]
    assert len(later) >= len(records) // 3
    with pytest.raises(ValueError):
        conversation_records(mean_turns=0.5)
