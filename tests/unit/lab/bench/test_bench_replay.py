"""The replayer against a real simulated engine: cached tokens, TTFT and captured-reuse arithmetic."""

from __future__ import annotations

import pytest

from engine_twin.launch import sim_engine_argv
from lab.toolkit.launch import HOST, free_port, process_group
from lab.toolkit.replay import ReplayResult, RequestResult, replay, summarize
from lab.toolkit.workloads import TimedRequest, chat_tokens, oracle_reusable_tokens

SYSTEM = "you are a careful assistant that answers in short sentences " * 8  # 480 bytes = 120 tokens


def _turn(session: str, turn: int, messages: list[dict[str, str]], model: str = "sim-model") -> TimedRequest:
    return TimedRequest(0.0, session, turn, 0.01 if turn else 0.0,
                        {"model": model, "messages": messages, "max_tokens": 3}, 3, "test")


@pytest.fixture(scope="module")
def engine_url():
    with process_group() as group:
        port = free_port()
        proc = group.start("engine", sim_engine_argv(port, ["sim-model"], time_scale=0.0, num_gpu_blocks=4096))
        url = f"http://{HOST}:{port}"
        group.wait_ready(proc, url)
        yield url


def test_replay_reads_cached_tokens_and_captured_reuse_matches_the_oracle_on_one_engine(engine_url):
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first question about cats"}]
    second = history + [{"role": "assistant", "content": "an answer about cats " * 4},
                        {"role": "user", "content": "a follow-up about dogs " * 3}]
    trace = [_turn("a", 0, history), _turn("a", 1, second),
             _turn("a", 2, second + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "bye"}])]
    oracle = oracle_reusable_tokens(trace)
    assert oracle.reusable_tokens[0] == 0 and all(r > 0 for r in oracle.reusable_tokens[1:])

    result = replay(trace, engine_url, time_scale=1.0)

    assert result.errors == 0
    assert [r.prompt_tokens for r in result.results] == [len(chat_tokens(t.body)) for t in trace]
    # one engine with room for everything: it reuses exactly what the oracle says
    assert [r.cached_tokens for r in result.results] == oracle.reusable_tokens
    assert all(r.completion_tokens == 3 for r in result.results)
    assert all(0 < r.ttft_s <= r.latency_s for r in result.results)
    figures = summarize(result, oracle.reusable_tokens)
    assert figures["captured_reuse"] == 1.0 and figures["cached_above_oracle_tokens"] == 0
    assert figures["cached_tokens"] == oracle.total_reusable
    assert figures["requests"] == 3 and figures["errors"] == 0
    assert figures["output_tokens_per_s"] == pytest.approx(9 / result.wall_s)


def test_a_failed_call_is_recorded_and_its_session_goes_on(engine_url):
    messages = [{"role": "user", "content": "hello"}]
    trace = [_turn("b", 0, messages, model="no-such-model"), _turn("b", 1, messages)]
    result = replay(trace, engine_url)
    assert result.results[0].error is not None and "404" in result.results[0].error
    assert result.results[0].ttft_s is None
    assert result.results[1].error is None and result.results[1].completion_tokens == 3


def _done(index: int, cached: int, ttft: float, tokens: int = 10, error: str | None = None) -> RequestResult:
    return RequestResult(index, f"s{index}", "w" if index % 2 else "v", 1.0, None if error else ttft,
                         None if error else ttft + 1, 100, cached, tokens, error)


def test_summarize_counts_successful_calls_only_and_breaks_down_by_index():
    replayed = ReplayResult([_done(0, 16, 0.1), _done(1, 48, 0.2), _done(2, 16, 0.4), _done(3, 64, 9.0, error="HTTP 500")],
                            wall_s=2.0)
    reusable = [0, 64, 32, 64]
    figures = summarize(replayed, reusable)
    assert figures["captured_reuse"] == pytest.approx((16 + 48 + 16) / (64 + 32))
    assert figures["cached_above_oracle_tokens"] == 16  # call 0: cached 16 where the oracle says 0
    assert figures["ttft_p50_s"] == pytest.approx(0.2)
    assert figures["ttft_p99_s"] == pytest.approx(0.4)
    assert figures["output_tokens_per_s"] == pytest.approx(30 / 2.0)
    assert figures["errors"] == 1 and figures["requests"] == 4
    odd = summarize(replayed, reusable, [1, 3])
    assert odd["captured_reuse"] == pytest.approx(48 / 64) and odd["errors"] == 1
    assert summarize(replayed, [0, 0, 0, 0])["captured_reuse"] is None
