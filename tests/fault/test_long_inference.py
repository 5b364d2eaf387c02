"""RELIABILITY.md F17: an inference longer than the fixed attempt timeout finishes, once
(docs/reliability.md, "Long inferences"), scaled down: ``request_timeout_s`` 2 s at the processor
and at the router, and a simulated engine taking about 6 s (200 tokens at 30 ms).

* a non-streamed request gets its bound from its ``max_tokens`` (base + tokens × per-token bound),
  a streamed one lives while its tokens flow; both come back 200 with the whole answer, run once;
* an attempt that times out after reaching the router is not run again: one call, then an
  ``INFERENCE_TIMEOUT`` result (formerly five calls and ``INFERENCE_ERROR``);
* the router's own timeout is a 504 ``upstream_timeout``, never a re-run on another engine.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import orjson
import pytest
from fastapi import FastAPI

from backfill.up import free_port
from common.contracts.queue import RequestMessage
from tests.conftest import serve
from tests.integration.processor.test_processor_end_to_end import InProcess, Ns
from tests.router_stack import RouterStack

TOKENS = 200
ITL_MS = 30  # step overhead: 200 tokens x more than 30 ms > 6 s, three times the 2 s base timeout


@pytest.fixture
def ns(stores) -> Ns:
    return Ns(stores.redis_url)


def _message(id: str, *, stream: bool = False, max_tokens: int = TOKENS, deadline_in: float = 120) -> RequestMessage:
    payload = {"model": "sim-model", "max_tokens": max_tokens, "stream": stream,
               "messages": [{"role": "user", "content": f"a long answer please ({id})"}]}
    return RequestMessage(id=id, created=int(time.time()), deadline=int(time.time() + deadline_in), payload=payload,
                          metadata={"tenant": "acme", "objective": "batch"})


def test_an_inference_longer_than_the_base_timeout_finishes_once(ns, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("BACKFILL_ROUTER_REQUEST_TIMEOUT_S", "2")
    engine = {"time_scale": 1.0, "extra": ["--step-overhead-ms", str(ITL_MS)]}
    with RouterStack(tmp_path, engines=1, engine_options=[engine]) as stack:
        ns.put("batch", _message("long-plain"))
        ns.put("batch", _message("long-stream", stream=True))
        started = time.monotonic()
        with InProcess(ns.settings(stack.url, request_timeout_s=2.0, max_error_attempts=5,
                                     router_token=stack.token)):
            results = {r.id: r for r in ns.wait_results(2, timeout_s=60)}
        took = time.monotonic() - started
        served = stack.served_counts()
    plain, streamed = results["long-plain"], results["long-stream"]
    assert (plain.status_code, plain.error_code) == (200, ""), plain
    assert orjson.loads(plain.payload)["usage"]["completion_tokens"] == TOKENS
    assert (streamed.status_code, streamed.error_code) == (200, ""), streamed
    assert streamed.payload.rstrip().endswith("data: [DONE]")
    assert took > TOKENS * ITL_MS / 1000  # really longer than the 2 s base: not answered some other way
    assert served == [2]  # each ran once: no attempt was cut and run again


def test_a_timed_out_attempt_is_not_run_again(ns) -> None:
    calls: list[float] = []
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def never(body: dict) -> dict:  # accepts the request, never answers in time
        calls.append(time.monotonic())
        await asyncio.sleep(30)
        return {}

    port = free_port()
    ns.put("batch", _message("stalled", max_tokens=100))
    settings = ns.settings(f"http://127.0.0.1:{port}", request_timeout_s=1.0, attempt_per_token_s=0.01)
    with serve(app, port), InProcess(settings):
        [result] = ns.wait_results(1, timeout_s=30)
    assert result.error_code == "INFERENCE_TIMEOUT" and result.status_code == 0
    assert "2.0 s (request_timeout_s 1 s + 100 tokens x 0.01 s)" in result.error_message
    assert "not retried" in result.error_message
    assert len(calls) == 1  # formerly 5 attempts, each from scratch


def test_the_router_timeout_is_a_504_and_no_rerun_elsewhere(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("BACKFILL_ROUTER_REQUEST_TIMEOUT_S", "1")
    monkeypatch.setenv("BACKFILL_ROUTER_REQUEST_TIMEOUT_PER_TOKEN_S", "0.001")
    engine = {"time_scale": 1.0, "extra": ["--step-overhead-ms", str(ITL_MS)]}
    with RouterStack(tmp_path, engines=2, engine_options=[engine, engine]) as stack:
        body = {"model": "sim-model", "max_tokens": TOKENS, "messages": [{"role": "user", "content": "slow"}]}
        answer = httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=30)
        assert answer.status_code == 504, answer.text
        assert answer.json()["error"]["code"] == "upstream_timeout"
        timeouts = next(float(line.rsplit(" ", 1)[1]) for line in httpx.get(f"{stack.url}/metrics").text.splitlines()
                        if line.startswith('backfill_router_upstream_errors_total{kind="timeout"}'))
        assert timeouts == 1  # one try of ~1.2 s (1 s + 200 x 1 ms), not one per engine
        assert len(stack.wait_candidates(2)["endpoints"]) == 2  # a slow engine is not marked down
