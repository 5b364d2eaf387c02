"""The lab's model-time driver: a closed set of requests run to completion with per-token and
per-request callbacks, the counters it keeps, its KV events and scrape, and its failure modes."""

from __future__ import annotations

import pytest

from engine_twin.kv_cache import DEFAULT_RETENTION
from engine_twin.kv_events import BlockStored
from engine_twin.settings import build_settings
from lab.toolkit.model_time import ModelTimeEngine


def settings(**overrides):
    return build_settings(**{"num_gpu_blocks": 256, "max_model_len": 2048, "time_scale": 0.0, **overrides})


def test_a_closed_set_runs_to_completion_with_first_tokens_before_finishes():
    engine = ModelTimeEngine(settings())
    reqs = [engine.submit(engine.request([k] * 100, 5 + k)) for k in range(3)]
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    engine.run_until_idle(on_sampled=lambda rid, t: first.setdefault(rid, t),
                          on_finished=lambda rid, t: done.setdefault(rid, t))
    assert [r.request_id for r in reqs] == ["r1", "r2", "r3"]
    assert set(first) == set(done) == {"r1", "r2", "r3"}
    assert all(0 < first[rid] < done[rid] <= engine.now for rid in done)
    assert engine.generated == 5 + 6 + 7 and all(r.output_tokens == r.max_tokens for r in reqs)
    assert engine.steps == engine.core.steps and engine.busy_s == pytest.approx(engine.now)
    assert not engine.core.has_work()


def test_a_closed_loop_submits_from_the_finish_callback():
    engine = ModelTimeEngine(settings())
    finished: list[str] = []

    def on_finished(rid: str, _t: float) -> None:
        finished.append(rid)
        if len(finished) < 10:
            engine.submit(engine.request([len(finished)] * 40, 3))

    engine.submit(engine.request([0] * 40, 3))
    engine.run_until_idle(on_finished=on_finished)
    assert finished == [f"r{k}" for k in range(1, 11)] and engine.generated == 30


def test_serve_alone_gives_the_ttft_and_a_repeat_finds_its_prompt_cached():
    engine = ModelTimeEngine(settings(), collect_events=True)
    prompt = list(range(200))
    cold = engine.serve_alone(engine.request(prompt, 4))
    events = engine.take_events()
    assert any(isinstance(e, BlockStored) for e in events) and engine.take_events() == []
    warm = engine.serve_alone(engine.request(prompt, 4))
    assert 0 < warm < cold  # 192 of its 200 tokens were cached
    scrape = engine.metrics()
    assert scrape.prefix_cache_hits == 192 and scrape.prefix_cache_queries == 400
    assert scrape.num_requests_running == scrape.num_requests_waiting == 0 and scrape.block_size == 16


def test_an_outer_loop_keeps_its_own_time_and_the_engine_counts_busy_seconds():
    engine = ModelTimeEngine(settings())
    engine.submit(engine.request([1] * 50, 2), at=10.0)
    now = 10.0
    while engine.core.has_work():
        now += engine.step(now).duration
    assert engine.now == 0.0 and engine.busy_s == pytest.approx(now - 10.0) and engine.generated == 2


def test_requests_take_their_retention_from_the_one_rule():
    engine = ModelTimeEngine(settings(retention_priority_threshold=5, scheduling_policy="priority"))
    assert engine.request([1] * 20, 1, 10).retention == 0
    assert engine.request([1] * 20, 1, 0).retention == DEFAULT_RETENTION
    assert engine.request([1] * 20, 1, 10, kv_retention_priority=80).retention == 80


def test_a_run_that_cannot_end_is_an_error_not_a_hang():
    engine = ModelTimeEngine(settings())
    engine.submit(engine.request([1] * 50, 100))
    with pytest.raises(RuntimeError, match="not idle after 10 steps"):
        engine.run_until_idle(max_steps=10)
    with pytest.raises(ValueError, match="KV cache blocks"):
        engine.submit(engine.request([1] * 5000, 1))
