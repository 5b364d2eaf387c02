"""Optional: compare the simulator with a real vLLM (CPU build) on the same requests.

Start the engine first with ``scripts/real_vllm/serve_tiny_vllm.sh`` (defaults: port 8100, events on
tcp://*:5570), then run ``pytest -m real_vllm tests/conformance``. Not in the default run.
"""

import os

import httpx
import msgpack
import pytest
import zmq

pytestmark = pytest.mark.real_vllm

URL = os.environ.get("REAL_VLLM_URL", "http://127.0.0.1:8100")
EVENTS = os.environ.get("REAL_VLLM_EVENTS", "tcp://127.0.0.1:5570")
NAMES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
         "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
         "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count",
         "vllm:request_queue_time_seconds_count", "vllm:cache_config_info")


def test_real_engine_metric_names_usage_errors_and_event_layout():
    try:
        httpx.get(f"{URL}/health", timeout=2).raise_for_status()
    except httpx.HTTPError:
        pytest.fail(f"no real vLLM at {URL}: start scripts/real_vllm/serve_tiny_vllm.sh first")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(EVENTS)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    prompt = "conformance prompt " * 40
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2}
    first = httpx.post(f"{URL}/v1/completions", json=body, timeout=60).json()
    second = httpx.post(f"{URL}/v1/completions", json=body, timeout=60).json()
    assert "cached_tokens" in second["usage"]["prompt_tokens_details"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert first["choices"][0]["finish_reason"] == "length"
    metrics = httpx.get(f"{URL}/metrics").text
    for name in NAMES:
        assert name in metrics, name
    missing = httpx.post(f"{URL}/v1/completions", json={**body, "model": "nope"})
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "The model `nope` does not exist."
    if sub.poll(5000):
        topic, seq, payload = sub.recv_multipart()
        ts, events, rank = msgpack.unpackb(payload)[:3]
        assert isinstance(events[0], dict) and events[0]["type"] == "BlockStored"
    sub.close(linger=0)
    ctx.term()
