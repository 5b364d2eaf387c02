"""``backfill router`` in front of simulated engines, driven with the real ``openai`` client.

What a user of the router sees: the OpenAI endpoints answer through it (JSON and SSE passed
through chunk by chunk), repeated prefixes stick to the engine that has them cached (the engines'
own ``cached_tokens`` say so), new prefixes spread over the pool, a saturated engine is avoided,
bad input gets OpenAI's error envelope, and the admin JSON and Prometheus series are there.
The slot-bound stacks (the gate, the slot reserve, make-room) are in ``test_router_proxy_make_room.py``
and the trusted identities in ``test_router_proxy_tenants.py``, so the files run on separate test
workers.
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.router_stack import SPREAD_CONFIG, RouterStack

#: A shared prefix of 2,000 bytes = 500 estimate tokens (the simulator's built-in tokenizer counts
#: 4 bytes per token too): 7 blocks of 64 tokens for the router, 31 blocks of 16 for the engine.
PREFIX = "".join(f"Rule {i}: answer politely and cite the handbook section {i}. " for i in range(40))[:2000]


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> RouterStack:
    log_dir: Path = tmp_path_factory.mktemp("router-stack")
    config = log_dir / "spread.yaml"
    config.write_text(SPREAD_CONFIG)
    with RouterStack(log_dir, engines=3, router_options={"config": str(config)}) as s:
        yield s


@pytest.fixture
def client(stack: RouterStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=30)


def chat(client: openai.OpenAI, system: str, user: str, **kw):
    return client.chat.completions.create(model="sim-model", max_tokens=4, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": user}], **kw)


def test_chat_completions_and_streaming_pass_through(client: openai.OpenAI, stack: RouterStack) -> None:
    answer = chat(client, "You are terse.", "Say hi")
    assert answer.object == "chat.completion" and answer.choices[0].message.content
    assert answer.usage.prompt_tokens > 0 and answer.usage.completion_tokens == 4

    chunks = list(chat(client, "You are terse.", "Stream please", stream=True,
                       stream_options={"include_usage": True}))
    assert [c.object for c in chunks] == ["chat.completion.chunk"] * len(chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4

    completion = client.completions.create(model="sim-model", prompt="Once upon a time", max_tokens=3)
    assert completion.object == "text_completion" and completion.usage.completion_tokens == 3
    emb = client.embeddings.create(model="sim-model", input="hello")
    assert emb.data[0].embedding
    assert [m.id for m in client.models.list()] == ["sim-model"]


def test_repeated_prefix_sticks_to_the_engine_that_caches_it(client: openai.OpenAI) -> None:
    first = chat(client, PREFIX, "question 0")
    cached = [chat(client, PREFIX, f"question {i}").usage.prompt_tokens_details.cached_tokens for i in range(1, 7)]
    # the system prompt alone is 500 tokens: every follow-up finds at least 30 blocks of 16 cached
    assert first.usage.prompt_tokens > 500
    assert all(c >= 480 for c in cached), cached


def test_new_prefixes_spread_over_the_pool(client: openai.OpenAI, stack: RouterStack) -> None:
    before = stack.served_counts()
    for i in range(6):
        chat(client, f"Tenant {i} has its own long instructions. " * 40, "hello")
    after = stack.served_counts()
    per_engine = [a - b for a, b in zip(after, before)]
    assert sum(per_engine) == 6
    assert per_engine == [2, 2, 2], per_engine  # no-hit LRU: each cold prefix to the least recently used


def _hog(url: str, n: int, max_tokens: int = 400) -> list[threading.Thread]:
    """``n`` long requests (400 tokens: ~5 s at the simulator's ~12 ms a token) straight to one
    engine (not through the router), in threads."""
    def hog() -> None:
        with contextlib.suppress(httpx.HTTPError):  # the engine is stopped under it at the end
            httpx.post(f"{url}/v1/completions", timeout=120,
                       json={"model": "sim-model", "prompt": "x", "max_tokens": max_tokens})

    threads = [threading.Thread(target=hog, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def test_a_saturated_engine_is_avoided(tmp_path: Path) -> None:
    # engine 0 runs one sequence at a time, slowly: a few direct requests fill its waiting queue
    slow = {"time_scale": 1.0, "max_num_seqs": 1}
    with RouterStack(tmp_path, engines=2, engine_options=[slow, {}]) as s:
        _hog(s.engine_urls[0], 6)
        deadline = time.monotonic() + 10
        while not any(e["num_requests_waiting"] >= 3 for e in s.state()["endpoints"]):
            assert time.monotonic() < deadline, "the slow engine never showed a waiting queue"
            time.sleep(0.05)
        before = s.served_counts()
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=30)
        for i in range(4):
            chat(client, f"fresh prompt {i}", "go")
        after = s.served_counts()
        assert after[1] - before[1] == 4  # all on the idle engine
        assert after[0] == before[0] or after[0] - before[0] <= 1  # hogs may finish, none of ours ran there


def test_bad_input_gets_openai_error_envelopes(stack: RouterStack) -> None:
    cases = [
        (b"not json", 400, None),
        (b'{"messages": []}', 400, "model"),
        (b'{"model": "sim-model"}', 400, "messages"),
    ]
    for body, status, param in cases:
        r = httpx.post(f"{stack.url}/v1/chat/completions", content=body,
                       headers={"content-type": "application/json"}, timeout=10)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["message"] and err["type"] == "invalid_request_error"
    r = httpx.post(f"{stack.url}/v1/chat/completions", timeout=10, headers={"x-llm-d-inference-fairness-id": "t" * 300},
                   json={"model": "sim-model", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "x-llm-d-inference-fairness-id"
    r = httpx.post(f"{stack.url}/v1/chat/completions", timeout=10,
                   json={"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and r.json()["error"]["message"] == "The model `no-such-model` does not exist."
    r = httpx.get(f"{stack.url}/v1/nope", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_url"
    chat_body = {"model": "sim-model", "messages": [{"role": "user", "content": "x"}]}
    odd = [
        # a text part whose text is not a string
        dict(json={"model": "sim-model", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}),
        # a fairness id that is not UTF-8
        dict(json=chat_body, headers={"x-llm-d-inference-fairness-id": b"t\xff\xfe"}),
        # a body that does not decode as its Content-Encoding says
        dict(content=b"notgzip", headers={"content-type": "application/json", "content-encoding": "gzip"}),
    ]
    for kwargs in odd:
        r = httpx.post(f"{stack.url}/v1/chat/completions", timeout=10, **kwargs)
        assert r.status_code == 400, (kwargs, r.status_code, r.text)
        assert r.json()["error"]["message"]
    assert "code=\"500\"" not in httpx.get(f"{stack.url}/metrics", timeout=10).text


def test_requests_go_only_to_engines_serving_their_model(tmp_path: Path) -> None:
    with RouterStack(tmp_path, engines=2, engine_options=[{}, {"models": ["other-model"]}]) as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=30)
        for i in range(6):
            for model in ("sim-model", "other-model"):
                answer = client.chat.completions.create(model=model, max_tokens=1,
                                                        messages=[{"role": "user", "content": f"hi {i}"}])
                assert answer.model == model
        assert sorted(m.id for m in client.models.list()) == ["other-model", "sim-model"]
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            client.chat.completions.create(model="nobody-serves-it", messages=[{"role": "user", "content": "x"}])


def test_admin_state_and_metrics(stack: RouterStack, client: openai.OpenAI) -> None:
    chat(client, PREFIX, "metrics please")
    state = stack.state()
    assert 0 <= state["pool_saturation"] < 1
    assert {e["name"] for e in state["endpoints"]} == set(stack.engine_urls)
    for e in state["endpoints"]:
        assert e["healthy"] and e["block_size"] == 16 and e["num_gpu_blocks"] > 0
        assert e["metrics_age_s"] < 1.0
    assert {b["objective"] for b in state["bands"]} >= {"interactive", "async", "batch"}
    assert state["index"]["kind"] == "approximate" and state["index"]["tiers"]["gpu"] > 0
    text = httpx.get(f"{stack.url}/metrics", timeout=10).text
    for series in ("backfill_router_requests_total", "backfill_router_decision_duration_seconds_bucket",
                   "backfill_router_pool_saturation", "backfill_router_endpoint_in_flight_requests",
                   "backfill_router_flow_queue_requests", "backfill_router_prefix_index_blocks",
                   "backfill_router_dispatched_total", "backfill_router_prefix_lookups_total",
                   "backfill_router_gate_saturation", "backfill_router_endpoint_saturation",
                   "backfill_router_endpoint_gate_open"):
        assert series in text, series
    assert 'backfill_router_requests_total{code="200",objective="interactive"}' in text


PRECISE = str(Path(__file__).parents[2] / "router" / "scheduling" / "precise-config.yaml")
#: Small GPU tier (64 blocks × 16 tokens) so a few long prompts evict a prefix; a CPU tier when asked.
SMALL_GPU = {"num_gpu_blocks": 64, "max_model_len": 1024}


def _flood(engine_url: str, n: int = 40) -> None:
    """Short unrelated prompts sent straight to one engine (not through the router): 40 × 3 engine
    blocks push every older block out of its 64-block GPU tier, and being shorter than one
    64-token router block, they add nothing to the router's index."""
    for i in range(n):
        r = httpx.post(f"{engine_url}/v1/completions", timeout=30,
                       json={"model": "sim-model", "prompt": f"filler {i:03d} " + "lorem ipsum " * 15,
                             "max_tokens": 1})
        assert r.status_code == 200, r.text


def _wait_index(stack: RouterStack, predicate, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        state = stack.state()
        if predicate({e["name"]: e["cache_blocks"] for e in state["endpoints"]}):
            return state
        assert time.monotonic() < deadline, [(e["name"], e["cache_blocks"]) for e in state["endpoints"]]
        time.sleep(0.05)


@contextlib.contextmanager
def _precise_stack(tmp_path: Path, cpu_offload_blocks: int):
    """Two small-GPU engines behind a precise router, after one request with :data:`PREFIX`:
    yields (stack, client, the engine the index says holds the prefix)."""
    engine = {**SMALL_GPU, "cpu_offload_blocks": cpu_offload_blocks}
    with RouterStack(tmp_path, engines=2, engine_options=[engine, engine], kv_events=True,
                     router_options={"config": PRECISE}) as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=30)
        chat(client, PREFIX, "first")
        state = _wait_index(s, lambda blocks: any(b["gpu"] >= 7 for b in blocks.values()))
        assert state["index"]["kind"] == "kv-events"
        yield s, client, next(e["name"] for e in state["endpoints"] if e["cache_blocks"]["gpu"] >= 7)


def test_precise_routing_follows_kv_events_removals_and_cpu_tier(tmp_path: Path) -> None:
    with _precise_stack(tmp_path, cpu_offload_blocks=0) as (s, client, holder):
        other = next(u for u in s.engine_urls if u != holder)
        assert all(chat(client, PREFIX, f"again {i}").usage.prompt_tokens_details.cached_tokens >= 480
                   for i in range(3))

        # the holder evicts the prefix (BlockRemoved), the other engine computes it (BlockStored):
        # the router follows the events, not its own routing history
        _flood(holder)
        httpx.post(f"{other}/v1/chat/completions", timeout=30, json={
            "model": "sim-model", "max_tokens": 1,
            "messages": [{"role": "system", "content": PREFIX}, {"role": "user", "content": "direct"}]})
        _wait_index(s, lambda blocks: blocks[holder]["gpu"] < 7 and blocks[other]["gpu"] >= 7)
        before = s.served_counts()
        answer = chat(client, PREFIX, "after the move")
        after = s.served_counts()
        assert after[s.engine_urls.index(other)] - before[s.engine_urls.index(other)] == 1
        assert answer.usage.prompt_tokens_details.cached_tokens >= 480


def test_precise_routing_counts_the_cpu_tier(tmp_path: Path) -> None:
    with _precise_stack(tmp_path, cpu_offload_blocks=512) as (s, client, holder):
        _flood(holder)  # the prefix leaves the GPU tier but stays in the CPU tier
        _wait_index(s, lambda blocks: blocks[holder]["gpu"] < 7 and blocks[holder]["cpu"] >= 7)
        before = s.served_counts()
        answer = chat(client, PREFIX, "from the cpu tier")
        after = s.served_counts()
        assert after[s.engine_urls.index(holder)] - before[s.engine_urls.index(holder)] == 1
        assert answer.usage.prompt_tokens_details.cached_tokens >= 480  # loaded back from CPU, not recomputed


def _aborted(engine_url: str) -> float:
    text = httpx.get(f"{engine_url}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total") and 'finished_reason="abort"' in line)


def test_client_disconnect_cancels_the_upstream_request(tmp_path: Path) -> None:
    with RouterStack(tmp_path, engines=1, engine_options=[{"time_scale": 1.0}]) as s:
        before = _aborted(s.engine_urls[0])
        with httpx.Client(timeout=30) as client, client.stream(
                "POST", f"{s.url}/v1/chat/completions",
                json={"model": "sim-model", "max_tokens": 500, "stream": True,
                      "messages": [{"role": "user", "content": "a long story"}]}) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
        # the client closed mid-stream; the router closes its upstream connection; the engine aborts
        deadline = time.monotonic() + 10
        while _aborted(s.engine_urls[0]) == before:
            assert time.monotonic() < deadline, "the engine never saw the abort"
            time.sleep(0.05)
        assert s.wait_candidates(1)["endpoints"][0]["in_flight_requests"] == 0
        # a client going away is not the engine's failure: no upstream error, the engine stays a candidate
        assert 'backfill_router_upstream_errors_total{kind="stream"}' not in httpx.get(f"{s.url}/metrics").text


def test_a_request_past_its_deadline_is_shed_with_the_reason(stack: RouterStack) -> None:
    r = httpx.post(f"{stack.url}/v1/chat/completions", timeout=10,
                   headers=stack.trusted({"x-llm-d-slo-ttft-ms": "0", "x-llm-d-inference-objective": "batch"}),
                   json={"model": "sim-model", "messages": [{"role": "user", "content": "too late"}]})
    assert r.status_code == 429
    assert r.headers["x-llm-d-request-dropped-reason"] == "rejected-ttl-expired"
    assert int(r.headers["retry-after"]) >= 1 and r.json()["error"]["code"] == "rejected-ttl-expired"
    batch = next(b for b in stack.state()["bands"] if b["objective"] == "batch")
    assert batch["shed_total"]["rejected_ttl_expired"] >= 1
