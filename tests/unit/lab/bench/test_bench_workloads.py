"""Workload generators and the oracle-reusable tokens (shared/PERFORMANCE.md)."""

from __future__ import annotations

import pytest

from common.chatml import render_chat
from engine_twin.tokenizer import BuiltinTokenizer
from lab.toolkit.workloads import (
    TimedRequest,
    agentic_sessions,
    chat_tokens,
    merge,
    oracle_reusable_tokens,
    shared_prefix_groups,
)


def _req(i: int, tokens: list[int]) -> TimedRequest:
    return TimedRequest(float(i), f"s{i}", 0, 0.0, {"tokens": tokens}, 1, "hand")


def test_oracle_on_a_hand_made_trace_counts_whole_blocks_shared_with_earlier_requests():
    trace = [
        _req(0, [1, 2, 3, 4, 5]),        # first: nothing earlier
        _req(1, [1, 2, 3, 4, 9, 9]),     # blocks [1,2] [3,4] seen → 4
        _req(2, [1, 2, 3, 4]),           # same 2 blocks, but the last token is recomputed: cap 1 block → 2
        _req(3, [7, 2, 3, 4]),           # block 0 differs; [3,4] after it is a different prefix → 0
        _req(4, [1, 2, 3, 5, 9, 9]),     # [1,2] hit, [3,5] miss → 2
        _req(5, [1, 2, 3, 5, 9, 9, 1]),  # all 3 blocks of request 4 → 6
    ]
    result = oracle_reusable_tokens(trace, tokenize=lambda body: body["tokens"], block_size=2)
    assert result.reusable_tokens == [0, 4, 2, 0, 2, 6]
    assert result.prompt_tokens == [5, 6, 4, 4, 6, 7]
    assert result.total_reusable == 14
    # distinct prefixes: [1,2] [1,2|3,4] [1,2|3,4|9,9] [7,2] [7,2|3,4] [1,2|3,5] [1,2|3,5|9,9]
    assert result.distinct_blocks == 7
    assert result.sharing_share == pytest.approx(4 / 6)


def test_oracle_rejects_a_block_size_below_one():
    with pytest.raises(ValueError):
        oracle_reusable_tokens([], block_size=0)


def test_chat_tokens_are_the_simulator_tokenization_of_the_chatml_rendering():
    body = {"messages": [{"role": "system", "content": "abcd" * 20}, {"role": "user", "content": "hi"}]}
    expected = BuiltinTokenizer().encode(render_chat(body["messages"]), add_special_tokens=False)
    assert chat_tokens(body) == expected
    assert len(expected) == -(-len(render_chat(body["messages"]).encode()) // 4)


def test_generators_are_deterministic_per_seed():
    assert agentic_sessions(seed=3) == agentic_sessions(seed=3)
    assert shared_prefix_groups(seed=3) == shared_prefix_groups(seed=3)
    assert agentic_sessions(seed=3) != agentic_sessions(seed=4)


def test_agentic_sessions_share_a_prefix_in_about_92_percent_of_calls_and_grow_their_history():
    trace = agentic_sessions(seed=0)
    share = oracle_reusable_tokens(trace).sharing_share
    assert 0.88 <= share <= 0.96
    by_session: dict[str, list[TimedRequest]] = {}
    for r in trace:
        by_session.setdefault(r.session_id, []).append(r)
    multi = [turns for turns in by_session.values() if len(turns) > 1]
    assert multi
    for turns in multi:
        turns.sort(key=lambda r: r.turn)
        assert [r.turn for r in turns] == list(range(len(turns)))
        for prev, nxt in zip(turns, turns[1:]):
            assert nxt.body["messages"][: len(prev.body["messages"])] == prev.body["messages"]
            assert len(nxt.body["messages"]) == len(prev.body["messages"]) + 2
            assert nxt.pause_s > 0 and nxt.arrival_s == pytest.approx(prev.arrival_s + nxt.pause_s)
    assert [r.arrival_s for r in trace] == sorted(r.arrival_s for r in trace)


def test_shared_prefix_groups_reuse_the_group_prefix_after_its_first_request():
    trace = shared_prefix_groups(seed=1, groups=3, users=2, questions_per_user=2, prefix_tokens=200,
                                 question_tokens=40)
    oracle = oracle_reusable_tokens(trace)
    assert len(trace) == 12
    assert sum(1 for r in oracle.reusable_tokens if r == 0) == 3  # the first request of each group
    for request, reusable, prompt in zip(trace, oracle.reusable_tokens, oracle.prompt_tokens):
        assert reusable == 0 or 200 <= reusable < prompt
        assert request.body["max_tokens"] == request.max_tokens == 16


def test_merge_keeps_arrival_order_and_applies_offsets():
    a = shared_prefix_groups(seed=0, groups=1, users=2, questions_per_user=1, prefix_tokens=20, question_tokens=5)
    b = shared_prefix_groups(seed=9, groups=1, users=2, questions_per_user=1, prefix_tokens=20, question_tokens=5)
    merged = merge(a, b, offsets=(0.0, 100.0))
    assert [r.session_id for r in merged] == [r.session_id for r in a] + [r.session_id for r in b]
    assert merged[2].arrival_s == pytest.approx(b[0].arrival_s + 100.0)


def test_generators_reject_bad_arguments():
    with pytest.raises(ValueError):
        agentic_sessions(sessions=0)
    with pytest.raises(ValueError):
        agentic_sessions(one_off_share=1.0)
    with pytest.raises(ValueError):
        shared_prefix_groups(rate_per_s=0)
