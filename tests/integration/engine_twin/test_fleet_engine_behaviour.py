"""KV events on a real ZMQ subscriber, tiers, metrics, batching, priority over HTTP, client disconnects
(streamed and not, h11 and httptools) and faults."""

import asyncio
import json
import subprocess
import time

import httpx
import pytest
import zmq

from common.chatml import render_chat
from engine_twin.kv_cache import block_hashes, external_hash, none_hash
from engine_twin.kv_events import decode_batch
from engine_twin.launch import sim_engine_argv, wait_ready
from engine_twin.tokenizer import BuiltinTokenizer

PROMPT = "shared system prompt for the kv event test, long enough for several blocks " * 4


def until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError("condition not reached")


@pytest.fixture
def subscriber():
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    port = sub.bind_to_random_port("tcp://127.0.0.1")  # the engine connects (tcp://host:port endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    yield sub, port
    sub.close(linger=0)
    ctx.term()


def events_sim(make_sim, port, layout="map", **overrides):
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}",
           "topic": "kv@127.0.0.1:1@m"}
    return make_sim(kv_events_config=json.dumps(cfg), kv_events_layout=layout, block_size=16, **overrides)


def collect(sub, want, timeout=5.0):
    """Receive until ``want(events)`` is true; returns frames and decoded events."""
    frames, events = [], []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not want(events):
        if sub.poll(50):
            f = sub.recv_multipart()
            frames.append(f)
            events.extend(decode_batch(f[2])[1])
    return frames, events


def complete(sim, prompt, **extra):
    body = {"model": sim.settings.model, "prompt": prompt, "max_tokens": 2, **extra}
    return httpx.post(f"{sim.url}/v1/completions", json=body, timeout=30).json()


@pytest.mark.parametrize("layout", ["map", "array"])
def test_block_stored_events_carry_vllm_hashes_and_tokens(make_sim, subscriber, layout):
    sub, port = subscriber
    sim = events_sim(make_sim, port, layout)
    # a connecting PUB may lose its first message before the pipe is up: send until events flow
    until(lambda: complete(sim, f"warm-up {time.monotonic()} " * 10) and sub.poll(50))
    collect(sub, lambda e: False, timeout=0.2)
    complete(sim, PROMPT)
    frames, events = collect(sub, lambda e: any(x["type"] == "BlockStored" for x in e))
    topic, seq, payload = frames[-1]
    assert topic == b"kv@127.0.0.1:1@m" and len(seq) == 8
    raw_event = __import__("msgpack").unpackb(payload)[1][0]
    assert isinstance(raw_event, dict if layout == "map" else list)
    stored = [e for e in events if e["type"] == "BlockStored"][-1]
    tokens = BuiltinTokenizer().encode(PROMPT)
    expected = block_hashes(tokens, 16, none_hash("0"))
    assert stored["block_hashes"] == [external_hash(h) for h in expected]
    assert stored["parent_block_hash"] is None and stored["block_size"] == 16 and stored["medium"] == "GPU"
    assert stored["token_ids"] == tokens[: len(expected) * 16]
    # a repeated prompt is a prefix hit: no new BlockStored
    complete(sim, PROMPT)
    _, again = collect(sub, lambda e: False, timeout=0.3)
    assert again == []


def test_gpu_evictions_are_offloaded_to_cpu_and_loaded_back(make_sim, subscriber):
    sub, port = subscriber
    sim = events_sim(make_sim, port, num_gpu_blocks=64, max_model_len=512, cpu_offload_blocks=256)
    until(lambda: complete(sim, f"warm-up {time.monotonic()} " * 10) and sub.poll(50))
    first = complete(sim, PROMPT)
    for i in range(6):  # push PROMPT's blocks out of the small GPU tier
        complete(sim, f"filler {i} " * 160)
    _, events = collect(sub, lambda e: any(x["type"] == "BlockStored" and x["medium"] == "CPU" for x in e))
    cpu_stored = [e for e in events if e["type"] == "BlockStored" and e["medium"] == "CPU"]
    assert cpu_stored and all(e["token_ids"] == [] for e in cpu_stored)
    assert any(e["type"] == "BlockRemoved" and e["medium"] == "GPU" for e in events)
    again = complete(sim, PROMPT)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # served from the CPU tier
    metrics = httpx.get(f"{sim.url}/metrics").text
    external = [line for line in metrics.splitlines() if line.startswith("vllm:external_prefix_cache_hits_total")]
    assert float(external[0].split()[-1]) > 0
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_metrics_have_vllm_names_and_labels(sim):
    complete(sim, PROMPT)
    complete(sim, PROMPT)
    text = httpx.get(f"{sim.url}/metrics").text
    labels = '{engine="0",model_name="gpt-3.5-turbo"}'
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:external_prefix_cache_hits_total", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count",
                 "vllm:inter_token_latency_seconds_count", "vllm:request_queue_time_seconds_count"):
        assert f"{name}{labels}" in text, name
    info = [line for line in text.splitlines() if line.startswith("vllm:cache_config_info{")][0]
    assert 'block_size="16"' in info and 'num_gpu_blocks="8192"' in info
    # the series backfill's vLLM plugin adds, which the twin stands in for: the engine's slots, stated
    stated = [line for line in text.splitlines() if line.startswith("backfill:engine_config_info{")]
    assert len(stated) == 1 and 'max_num_seqs="256"' in stated[0] and 'engine="0"' in stated[0]
    hits = [line for line in text.splitlines() if line.startswith("vllm:prefix_cache_hits_total")][0]
    assert float(hits.split()[-1]) > 0


def metric(sim, name):
    """The value of an unlabelled-by-us vLLM gauge or counter from ``/metrics``."""
    for line in httpx.get(f"{sim.url}/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} missing from /metrics")


def aborted(sim):
    """Requests the engine has counted as aborted (``vllm:request_success_total``, reason ``abort``)."""
    for line in httpx.get(f"{sim.url}/metrics").text.splitlines():
        if line.startswith("vllm:request_success_total{") and 'finished_reason="abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def data_lines(lines):
    """``data:`` payloads of an SSE stream until ``[DONE]`` (inclusive)."""
    for line in lines:
        if line.startswith("data: "):
            yield line[6:]
            if line == "data: [DONE]":
                return


def test_queued_http_requests_run_in_priority_order(make_sim):
    """One running slot, a nonzero time scale, five queued requests: lowest priority value first, ties
    in arrival order. The slot is held by a stream closed once all five wait, so nothing is timed."""
    sim = make_sim(time_scale=1.0, scheduling_policy="priority", max_num_seqs=1)
    url = f"{sim.url}/v1/completions"
    arrivals = [("a", 3), ("b", -1), ("c", 2), ("d", 0), ("e", -1)]
    finished = []

    async def main():
        async with httpx.AsyncClient(timeout=30) as client:
            async def queued(label, priority):
                r = await client.post(url, json={"model": sim.settings.model, "prompt": f"queued {label}",
                                                 "max_tokens": 4, "priority": priority})
                assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
                finished.append(label)

            async def waiting():
                return (await client.get(f"{sim.url}/sim/state")).json()["waiting"]

            tasks = []
            async with client.stream("POST", url, json={"model": sim.settings.model, "prompt": "blocker",
                                                        "max_tokens": 10_000, "stream": True}) as blocker:
                # keep the iterator: a dropped httpx line iterator closes the connection (a disconnect)
                lines = blocker.aiter_lines()
                await anext(lines)  # first token: the blocker holds the slot
                for k, (label, priority) in enumerate(arrivals, 1):
                    tasks.append(asyncio.create_task(queued(label, priority)))
                    while await waiting() < k:
                        await asyncio.sleep(0.01)
            # leaving the block closed the blocker mid-stream: it is aborted and the queue drains
            await asyncio.gather(*tasks)

    asyncio.run(main())
    assert finished == ["b", "e", "d", "c", "a"]
    assert sim.state()["running"] == 0 and sim.errors == []


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_streaming_client_that_disconnects_is_aborted_while_another_gets_its_full_stream(make_sim, http):
    """The one that leaves asks for 5,000 tokens, at least 40 s of ~8 ms steps (the driver never runs
    ahead of the wall clock), so it is running from its first token until its client closes however
    slowly this test gets there; the checks poll the engine's counters with a generous deadline and
    nothing depends on how long the one that stays lasts."""
    sim = make_sim(time_scale=1.0, http=http)
    url = f"{sim.url}/v1/chat/completions"

    def body(text, max_tokens):
        return {"model": sim.settings.model, "messages": [{"role": "user", "content": text}],
                "max_tokens": max_tokens, "stream": True}

    with httpx.Client(timeout=60) as leaves_client, httpx.Client(timeout=60) as stays_client:
        with leaves_client.stream("POST", url, json=body("I leave " * 20, 5000)) as leaves:
            left = data_lines(leaves.iter_lines())
            next(left), next(left)  # role chunk, first token
            with stays_client.stream("POST", url, json=body("I stay " * 20, 300)) as stays:
                kept = data_lines(stays.iter_lines())
                received = [next(kept), next(kept)]  # both streaming now
                leaves.close()  # the client goes away after its first token: aborted, its blocks freed
                until(lambda: aborted(sim) == 1, timeout=60)
                assert metric(sim, "vllm:num_requests_running") <= 1  # only the one that stays, if still on
                received += list(kept)
    chunks = [json.loads(x) for x in received[:-1]]
    assert received[-1] == "[DONE]"
    content = [c["choices"][0]["delta"]["content"] for c in chunks[1:]]
    assert "".join(content) == "".join(sim.engine.pieces(300)) and len(content) == 300
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    until(lambda: metric(sim, "vllm:num_requests_running") == 0, timeout=60)
    assert metric(sim, "vllm:kv_cache_usage_perc") == 0.0
    assert aborted(sim) == 1 and sim.errors == []


def test_non_streamed_requests_complete_at_time_scale_one(make_sim):
    sim = make_sim(time_scale=1.0)
    chat = httpx.post(f"{sim.url}/v1/chat/completions", timeout=30, json={
        "model": sim.settings.model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8}).json()
    assert chat["choices"][0]["message"]["content"] == "".join(sim.engine.pieces(8))
    assert chat["usage"]["completion_tokens"] == 8
    done = httpx.post(f"{sim.url}/v1/completions", timeout=30, json={
        "model": sim.settings.model, "prompt": ["one", "two"], "max_tokens": 3}).json()
    assert [c["finish_reason"] for c in done["choices"]] == ["length", "length"]
    response = httpx.post(f"{sim.url}/v1/responses", timeout=30, json={
        "model": sim.settings.model, "input": "hi", "max_output_tokens": 3}).json()
    assert response["status"] == "incomplete" and response["usage"]["output_tokens"] == 3
    assert sim.errors == []


def test_non_streamed_client_that_gives_up_is_aborted_cleanly(make_sim):
    sim = make_sim(time_scale=1.0)
    body = {"model": sim.settings.model, "prompt": PROMPT, "max_tokens": 2000}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{sim.url}/v1/completions", json=body, timeout=0.5)
    until(lambda: sim.state()["running"] == 0)
    assert sim.state()["kv_usage"] == 0.0
    assert aborted(sim) == 1.0
    assert sim.errors == []  # the abort is no "Exception in ASGI application"


def test_faults_answer_errors_hang_and_unhealthy(make_sim):
    sim = make_sim()
    url = f"{sim.url}/v1/completions"
    body = {"model": sim.settings.model, "prompt": "x", "max_tokens": 1}
    httpx.post(f"{sim.url}/sim/fault", json={"mode": "503", "count": 2})
    assert [httpx.post(url, json=body).status_code for _ in range(3)] == [503, 503, 200]
    httpx.post(f"{sim.url}/sim/fault", json={"mode": "429"})
    r = httpx.post(url, json=body)
    assert r.status_code == 429 and r.json()["error"]["type"] == "RateLimitError"
    httpx.post(f"{sim.url}/sim/fault", json={"mode": "unhealthy"})
    assert httpx.get(f"{sim.url}/health").status_code == 503
    httpx.post(f"{sim.url}/sim/fault", json={"mode": "hang"})
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url, json=body, timeout=0.3)
    httpx.post(f"{sim.url}/sim/fault", json={"mode": "none"})
    assert httpx.get(f"{sim.url}/health").status_code == 200
    assert httpx.post(url, json=body).status_code == 200
    assert httpx.post(f"{sim.url}/sim/fault", json={"mode": "bogus"}).status_code == 400


def test_failure_rate_fails_requests_with_500(make_sim):
    sim = make_sim(failure_rate=1.0)
    r = httpx.post(f"{sim.url}/v1/chat/completions",
                   json={"model": sim.settings.model, "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 500 and r.json()["error"]["type"] == "InternalServerError"


def test_chat_prompt_tokens_are_the_rendered_template(sim):
    messages = [{"role": "user", "content": PROMPT}]
    r = httpx.post(f"{sim.url}/v1/chat/completions", json={"model": sim.settings.model, "messages": messages,
                                                          "max_tokens": 1}).json()
    assert r["usage"]["prompt_tokens"] == len(BuiltinTokenizer().encode(render_chat(messages)))


def test_subprocess_engine_from_launch_argv_starts_and_dies_on_request():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv = sim_engine_argv(port, ["gpt-3.5-turbo", "other"], time_scale=0.0)
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(f"http://127.0.0.1:{port}", timeout=20, process=proc)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["gpt-3.5-turbo", "other"]
        httpx.post(f"http://127.0.0.1:{port}/sim/fault", json={"mode": "die"})
        assert proc.wait(timeout=10) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_engine_sim_help_lists_vllm_flags():
    argv = sim_engine_argv(1, ["m"])[:-0 or None]
    out = subprocess.run([*argv[: argv.index("engine-sim") + 1], "--help"], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0
    for flag in ("--served-model-name", "--kv-events-config", "--num-gpu-blocks-override", "--time-scale"):
        assert flag in out.stdout


def test_kv_pressure_preempts_counts_it_in_metrics_and_every_request_completes(make_sim):
    """A cache of 64 blocks of 16 (1,024 tokens) and eight requests of 100 + 120 tokens (14 blocks
    each when done, 112 together): vLLM V1 admits all eight, then preempts by recompute; all finish.
    In model time (time scale 1: a request runs about a second) so the eight overlap however slowly
    they arrive; at time scale 0 the first could finish before the last is sent."""
    sim = make_sim(num_gpu_blocks=64, max_model_len=1024, block_size=16, time_scale=1.0)
    url = f"{sim.url}/v1/completions"

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            async def one(i):
                r = await client.post(url, json={"model": sim.settings.model, "prompt": f"p{i} " * 100,
                                                 "max_tokens": 120})
                return r.json()["usage"]["completion_tokens"]
            return await asyncio.gather(*(one(i) for i in range(8)))

    assert asyncio.run(main()) == [120] * 8
    assert metric(sim, "vllm:num_preemptions_total") > 0
    assert sim.state()["num_preemptions"] == metric(sim, "vllm:num_preemptions_total")
    assert metric(sim, "vllm:kv_cache_usage_perc") == 0.0 and sim.state()["running"] == 0


def test_a_request_larger_than_the_cache_is_refused_with_400(make_sim):
    sim = make_sim(num_gpu_blocks=64, max_model_len=1024, block_size=16)
    r = httpx.post(f"{sim.url}/v1/completions", json={"model": sim.settings.model, "prompt": [1] * 100,
                                                      "max_tokens": 900, "n": 2})
    assert r.status_code == 200  # each of the n sequences fits on its own
    r = httpx.post(f"{sim.url}/v1/completions", json={"model": sim.settings.model, "prompt": [1] * 10,
                                                      "kv_retention_priority": 101})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_retention_priority"


@pytest.mark.parametrize("marked", [{"kv_retention_priority": 0}, {"priority": 10}])
def test_batch_retention_keeps_the_interactive_prefix_on_gpu(make_sim, marked):
    """The interactive prefix is cached first; batch requests (kv_retention_priority 0, or a vLLM
    priority at the engine's --retention-priority-threshold) then fill the cache with their own
    blocks; the prefix is still a GPU hit afterwards (plain LRU would have evicted it)."""
    sim = make_sim(num_gpu_blocks=64, max_model_len=1024, block_size=16, scheduling_policy="priority",
                   retention_priority_threshold=10)
    url = f"{sim.url}/v1/completions"
    prefix = [7] * 320  # 20 blocks
    body = {"model": sim.settings.model, "prompt": prefix + [1], "max_tokens": 1}
    assert httpx.post(url, json=body).status_code == 200
    for i in range(6):  # 6 x 40 blocks of batch prompts through a 64-block cache
        batch = {"model": sim.settings.model, "prompt": [100 + i] * 640, "max_tokens": 1, **marked}
        assert httpx.post(url, json=batch).status_code == 200
    again = httpx.post(url, json=body).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 320


def test_kv_transfer_config_is_accepted_and_checked():
    from pydantic import ValidationError

    from engine_twin.settings import build_settings

    s = build_settings(kv_transfer_config='{"kv_connector": "NixlConnector", "kv_role": "kv_both"}')
    assert s.kv_transfer_config is not None and s.kv_transfer_config.kv_role == "kv_both"
    with pytest.raises(ValidationError, match="kv_role"):
        build_settings(kv_transfer_config='{"kv_connector": "NixlConnector"}')
