"""``backfill router --prefill-engine … --decode-engine …`` against fake vLLM engines.

The engines are small aiohttp servers in this process (a background thread) that record every
body they receive and answer like vLLM with the NixlConnector: a request carrying
``kv_transfer_params.do_remote_decode`` gets a one-token JSON answer with the
``kv_transfer_params`` a decode engine needs; any other request is generated in full (streamed or
not), with ``usage``. The router is the real process, driven over HTTP. Asserted: the exact bodies
each engine got, the client's full output and usage, the retry on another prefill engine, the
fallback to aggregated, and a decode engine dying mid-stream ending the client's stream in an error.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from engine_twin.launch import wait_ready
from router.cli import router_argv
from router.disagg import PREFILL_KV_TRANSFER_PARAMS
from tests.integration.engine_twin.conftest import free_port

MODEL = "sim-model"
_counter = itertools.count()


def long_prompt() -> str:
    """A fresh prompt of ~2,400 bytes = ~600 estimate tokens (over the shipped threshold of 256)."""
    n = next(_counter)
    return " ".join(f"unique-{n}-word-{i}" for i in range(150))


@dataclass
class FakeEngine:
    """One fake vLLM engine: ``mode`` says how it answers (``ok``, ``refuse`` 503, ``no_params``:
    a prefill answer without ``kv_transfer_params``, ``drop``: close the connection at once,
    ``die``: stream three chunks and drop the connection)."""

    name: str
    port: int
    mode: str = "ok"
    received: list[dict[str, Any]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def bodies(self) -> list[dict[str, Any]]:
        return [r["body"] for r in self.received]

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", lambda r: web.json_response({}))
        app.router.add_get("/v1/models", lambda r: web.json_response({"object": "list", "data": [{"id": MODEL}]}))
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        return app

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text='vllm:num_requests_waiting{engine="0"} 0\nvllm:num_requests_running{engine="0"} 0\n'
                                 'vllm:kv_cache_usage_perc{engine="0"} 0.0\n')

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append({"path": request.path, "body": body, "request_id": request.headers.get("x-request-id")})
        prompt = body.get("prompt") or json.dumps(body.get("messages"))
        prompt_tokens = len(prompt) // 4
        chat = request.path.endswith("/chat/completions")
        kv = body.get("kv_transfer_params") or {}
        if self.mode == "drop":
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        if self.mode == "refuse":
            return web.json_response({"error": {"message": "busy", "type": "ServiceUnavailable", "code": 503}},
                                     status=503)
        if kv.get("do_remote_decode"):  # the prefill leg: one token, the KV kept for the decode engine
            answer = _answer(chat, 1, prompt_tokens, cached=0)
            if self.mode != "no_params":
                answer["kv_transfer_params"] = {
                    "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [1, 2, 3],
                    "remote_engine_id": self.name, "remote_request_id": request.headers.get("x-request-id"),
                    "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1}
            return web.json_response(answer)
        n = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        cached = prompt_tokens if kv.get("do_remote_prefill") else 0  # the KV came from the prefill engine
        if not body.get("stream"):
            return web.json_response(_answer(chat, n, prompt_tokens, cached))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(n):
            if self.mode == "die" and i == 3:
                assert request.transport is not None
                request.transport.close()
                return response
            await response.write(b"data: " + json.dumps(_chunk(chat, f"w{i} ")).encode() + b"\n\n")
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {**_chunk(chat, None), "choices": [], "usage": _usage(n, prompt_tokens, cached)}
            await response.write(b"data: " + json.dumps(usage).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _usage(n: int, prompt_tokens: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _answer(chat: bool, n: int, prompt_tokens: int, cached: int) -> dict[str, Any]:
    text = "".join(f"w{i} " for i in range(n))
    choice = {"index": 0, "message": {"role": "assistant", "content": text}} if chat else {"index": 0, "text": text}
    return {"id": "x", "object": "chat.completion" if chat else "text_completion", "model": MODEL,
            "choices": [{**choice, "finish_reason": "length"}], "usage": _usage(n, prompt_tokens, cached)}


def _chunk(chat: bool, text: str | None) -> dict[str, Any]:
    if chat:
        return {"id": "x", "object": "chat.completion.chunk", "model": MODEL,
                "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
    return {"id": "x", "object": "text_completion", "model": MODEL,
            "choices": [{"index": 0, "text": text, "finish_reason": None}]}


class Fleet:
    """Fake engines on a background event loop, and the real router in front of them."""

    def __init__(self, log_dir: Path, prefill: int = 2, decode: int = 1) -> None:
        self.prefill = [FakeEngine(f"prefill-{i}", free_port()) for i in range(prefill)]
        self.decode = [FakeEngine(f"decode-{i}", free_port()) for i in range(decode)]
        self.log_dir = log_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runners: list[web.AppRunner] = []
        self.router: subprocess.Popen | None = None

    @property
    def engines(self) -> list[FakeEngine]:
        return [*self.prefill, *self.decode]

    async def _start(self, engine: FakeEngine) -> None:
        runner = web.AppRunner(engine.app())
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", engine.port).start()
        self._runners.append(runner)

    def __enter__(self) -> Fleet:
        self._thread.start()
        for engine in self.engines:
            asyncio.run_coroutine_threadsafe(self._start(engine), self._loop).result(10)
        argv = router_argv(self.port, [], prefill_engines=[e.url for e in self.prefill],
                           decode_engines=[e.url for e in self.decode],
                           extra=["--log-level", "WARNING"])
        log = open(self.log_dir / "router.log", "ab")
        self.router = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                       env=dict(os.environ, PYTHONUNBUFFERED="1"))
        try:
            wait_ready(self.url, timeout=30, process=self.router)
            deadline = time.monotonic() + 15
            while sum(e["healthy"] and e["metrics_age_s"] is not None for e in self.state()["endpoints"]) \
                    < len(self.engines):
                assert time.monotonic() < deadline, self.state()
                time.sleep(0.05)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.router is not None and self.router.poll() is None:
            os.killpg(self.router.pid, signal.SIGTERM)
            try:
                self.router.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.router.pid, signal.SIGKILL)
                self.router.wait(10)
        for runner in self._runners:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def state(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/admin/state", timeout=5).json()

    def reset(self) -> None:
        for engine in self.engines:
            engine.mode = "ok"
            engine.received.clear()

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, timeout=30)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with Fleet(tmp_path_factory.mktemp("pd-fleet")) as f:
        yield f


@pytest.fixture
def pd(fleet: Fleet) -> Fleet:
    fleet.reset()
    return fleet


def sse_events(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]


def prefill_of(fleet: Fleet) -> list[FakeEngine]:
    return [e for e in fleet.prefill if e.received]


def test_a_long_streamed_chat_is_prefilled_on_a_prefill_engine_and_decoded_on_the_decode_engine(pd: Fleet) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": long_prompt()}], "max_tokens": 6,
            "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.5}
    response = pd.post("/v1/chat/completions", body)
    assert response.status_code == 200
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks if c["choices"]) == "w0 w1 w2 w3 w4 w5 "
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 6 and usage["prompt_tokens"] > 256
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"]  # the decode engine's usage

    (prefill,) = prefill_of(pd)
    assert prefill.bodies() == [{"model": MODEL, "messages": body["messages"], "max_tokens": 1, "stream": False,
                                 "temperature": 0.5, "kv_transfer_params": PREFILL_KV_TRANSFER_PARAMS}]
    (decode,) = pd.decode
    expected_params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [1, 2, 3],
                       "remote_engine_id": prefill.name, "remote_request_id": prefill.received[0]["request_id"],
                       "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1}
    assert decode.bodies() == [{**body, "kv_transfer_params": expected_params}]
    assert decode.received[0]["request_id"] == prefill.received[0]["request_id"]  # one x-request-id for both legs


def test_a_long_completion_without_streaming(pd: Fleet) -> None:
    body = {"model": MODEL, "prompt": long_prompt(), "max_tokens": 4, "max_completion_tokens": 4, "n": 1}
    response = pd.post("/v1/completions", body)
    assert response.status_code == 200
    answer = response.json()
    assert answer["choices"][0]["text"] == "w0 w1 w2 w3 " and answer["usage"]["completion_tokens"] == 4
    (prefill,) = prefill_of(pd)
    assert prefill.bodies() == [{**body, "max_tokens": 1, "max_completion_tokens": 1, "stream": False,
                                 "kv_transfer_params": PREFILL_KV_TRANSFER_PARAMS}]
    assert pd.decode[0].bodies()[0]["kv_transfer_params"]["remote_engine_id"] == prefill.name
    assert {k: v for k, v in pd.decode[0].bodies()[0].items() if k != "kv_transfer_params"} == body


def test_a_short_prompt_runs_whole_on_the_decode_engine(pd: Fleet) -> None:
    before = pd.state()["disaggregation"]["decisions"].get("below_threshold", 0)
    body = {"model": MODEL, "prompt": "Say hi", "max_tokens": 3}
    response = pd.post("/v1/completions", body)
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == "w0 w1 w2 "
    assert prefill_of(pd) == []
    assert pd.decode[0].bodies() == [body]  # the original body, untouched
    assert pd.state()["disaggregation"]["decisions"]["below_threshold"] == before + 1


def test_a_failed_prefill_is_retried_on_the_other_prefill_engine(pd: Fleet) -> None:
    bad, good = pd.prefill
    bad.mode = "refuse"
    retries = pd.state()["disaggregation"]["prefill_retries"]
    for _ in range(4):  # cold prompts spread over both prefill engines (no-hit LRU): some go to the bad one first
        body = {"model": MODEL, "prompt": long_prompt(), "max_tokens": 2}
        response = pd.post("/v1/completions", body)
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == "w0 w1 "
    assert len(bad.received) >= 1
    assert len(good.received) == 4
    assert [b["kv_transfer_params"]["remote_engine_id"] for b in pd.decode[0].bodies()] == [good.name] * 4
    state = pd.state()["disaggregation"]
    assert state["prefill_retries"] == retries + len(bad.received)
    metrics = httpx.get(f"{pd.url}/metrics", timeout=5).text
    assert f'backfill_router_pd_prefill_failures_total{{endpoint="{bad.url}",reason="status"}}' in metrics


def test_no_prefill_answer_falls_back_to_aggregated_on_the_decode_engine(pd: Fleet) -> None:
    for engine in pd.prefill:
        engine.mode = "no_params"
    fallbacks = pd.state()["disaggregation"]["fallbacks"].get("no_kv_transfer_params", 0)
    body = {"model": MODEL, "messages": [{"role": "user", "content": long_prompt()}], "max_tokens": 3,
            "stream": True}
    response = pd.post("/v1/chat/completions", body)
    assert response.status_code == 200
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["delta"]["content"] for e in events[:-1]) == "w0 w1 w2 "
    assert sum(len(e.received) for e in pd.prefill) == 2  # tried once, retried once
    assert pd.decode[0].bodies() == [body]  # the original request: the decode engine computes the prompt
    assert pd.state()["disaggregation"]["fallbacks"]["no_kv_transfer_params"] == fallbacks + 1
    metrics = httpx.get(f"{pd.url}/metrics", timeout=5).text
    assert 'backfill_router_pd_fallbacks_total{reason="no_kv_transfer_params"}' in metrics


def test_a_dropped_prefill_connection_is_retried(pd: Fleet) -> None:
    for engine in pd.prefill:
        engine.mode = "drop"
    body = {"model": MODEL, "prompt": long_prompt(), "max_tokens": 2}
    response = pd.post("/v1/completions", body)
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == "w0 w1 "
    assert sum(len(e.received) for e in pd.prefill) == 2
    assert pd.decode[0].bodies() == [body]


def test_a_decode_engine_dying_mid_stream_ends_the_stream_with_an_error(pd: Fleet) -> None:
    pd.decode[0].mode = "die"
    body = {"model": MODEL, "messages": [{"role": "user", "content": long_prompt()}], "max_tokens": 8,
            "stream": True}
    response = pd.post("/v1/chat/completions", body)
    assert response.status_code == 200  # the stream had begun
    events = sse_events(response.text)
    assert "[DONE]" not in events
    assert [json.loads(e)["choices"][0]["delta"]["content"] for e in events[:3]] == ["w0 ", "w1 ", "w2 "]
    error = json.loads(events[-1])["error"]
    assert error["code"] == "upstream_failed"
    assert len(prefill_of(pd)) == 1  # the prefill ran once; nothing was presented as complete


def test_roles_and_decisions_in_admin_state_and_metrics(pd: Fleet) -> None:
    pd.post("/v1/completions", {"model": MODEL, "prompt": long_prompt(), "max_tokens": 1})
    state = pd.state()
    roles = {e["name"]: e["role"] for e in state["endpoints"]}
    assert roles == {**{e.url: "prefill" for e in pd.prefill}, **{e.url: "decode" for e in pd.decode}}
    assert state["disaggregation"]["decisions"]["disaggregated"] >= 1
    assert set(state["pool_gate_saturation"]) == {"prefill", "decode"}
    assert state["gate_saturation"] == max(state["pool_gate_saturation"].values())
    metrics = httpx.get(f"{pd.url}/metrics", timeout=5).text
    assert 'backfill_router_endpoints{role="prefill",state="healthy"} 2.0' in metrics
    assert 'backfill_router_endpoints{role="decode",state="healthy"} 1.0' in metrics
    assert 'backfill_router_pd_decisions_total{decision="disaggregated",reason="disaggregated"}' in metrics
    assert f'backfill_router_endpoint_role{{endpoint="{pd.decode[0].url}",role="decode"}} 1.0' in metrics
