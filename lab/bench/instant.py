"""An OpenAI-compatible engine that answers at once, and a raw keep-alive HTTP/1.1 load client.

Both sit on asyncio protocols with ``httptools`` (the parser under uvicorn), so neither is the
bottleneck when a router is measured between them (``backfill bench router-overhead``).

The server (``python -m lab.bench.instant --port P [--port P2 …]``, one process, several
ports, each an "engine") answers, whatever the body:

* ``POST /v1/chat/completions``, ``POST /v1/completions``: a one-token completion with ``usage``
  (SSE with a usage chunk and ``[DONE]`` when the body asks ``"stream": true``);
* ``GET /health`` (200), ``GET /v1/models`` (``sim-model``), ``GET /metrics`` (vLLM's gauge
  names at an idle engine, so a router's saturation detector sees room);
* anything else: 404 in OpenAI's error envelope.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Sequence
from typing import cast

import httptools
import orjson

MODEL = "sim-model"

_COMPLETION = orjson.dumps({
    "id": "chatcmpl-instant", "object": "chat.completion", "created": 0, "model": MODEL,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2,
              "prompt_tokens_details": {"cached_tokens": 0}},
})
_STREAM = (b'data: {"id":"chatcmpl-instant","object":"chat.completion.chunk","created":0,"model":"sim-model",'
           b'"choices":[{"index":0,"delta":{"role":"assistant","content":"ok"},"finish_reason":"length"}]}\n\n'
           b'data: {"id":"chatcmpl-instant","object":"chat.completion.chunk","created":0,"model":"sim-model",'
           b'"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2,'
           b'"prompt_tokens_details":{"cached_tokens":0}}}\n\ndata: [DONE]\n\n')
_METRICS = (
    f'vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} 0.0\n'
    f'vllm:num_requests_waiting{{engine="0",model_name="{MODEL}"}} 0.0\n'
    f'vllm:kv_cache_usage_perc{{engine="0",model_name="{MODEL}"}} 0.0\n'
    f'vllm:cache_config_info{{block_size="16",engine="0",num_gpu_blocks="30000"}} 1.0\n'
).encode()
_MODELS = orjson.dumps({"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0,
                                                    "owned_by": "vllm", "max_model_len": 131072}]})
_NOT_FOUND = orjson.dumps({"error": {"message": "Not Found", "type": "NotFoundError", "param": None, "code": 404}})


def _response(status: bytes, body: bytes, content_type: bytes = b"application/json") -> bytes:
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: " + content_type + b"\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


_ANSWERS = {
    (b"GET", b"/health"): _response(b"200 OK", b""),
    (b"GET", b"/metrics"): _response(b"200 OK", _METRICS, b"text/plain; version=0.0.4"),
    (b"GET", b"/v1/models"): _response(b"200 OK", _MODELS),
    (b"POST", b"/v1/chat/completions"): _response(b"200 OK", _COMPLETION),
    (b"POST", b"/v1/completions"): _response(b"200 OK", _COMPLETION),
}
_STREAM_ANSWER = _response(b"200 OK", _STREAM, b"text/event-stream")
_NOT_FOUND_ANSWER = _response(b"404 Not Found", _NOT_FOUND)


class _InstantServer(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a stream connection's transport
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        key = (self.parser.get_method(), self.url.split(b"?", 1)[0])
        answer = _ANSWERS.get(key, _NOT_FOUND_ANSWER)
        if key[0] == b"POST" and answer is not _NOT_FOUND_ANSWER:
            body = b"".join(self.body)
            if b'"stream":true' in body.replace(b" ", b""):
                answer = _STREAM_ANSWER
        self.transport.write(answer)
        self.url = b""
        self.body = []


async def serve(host: str, ports: Sequence[int]) -> None:
    """Serve the instant engine on every port until cancelled."""
    loop = asyncio.get_running_loop()
    servers = [await loop.create_server(_InstantServer, host, port, backlog=1024) for port in ports]
    try:
        await asyncio.Future()
    finally:
        for server in servers:
            server.close()


# ---- load client ---------------------------------------------------------------------------------
class _Client(asyncio.Protocol):
    """One keep-alive connection; :meth:`send` resolves with the status code when the response
    (Content-Length or chunked) is complete."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[int] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a stream connection's transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_message_complete(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(self.parser.get_status_code())

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("connection closed"))

    def send(self, request: bytes) -> asyncio.Future[int]:
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self.waiter


def post_bytes(host: str, port: int, path: str, body: bytes) -> bytes:
    """A complete keep-alive ``POST`` request (``application/json``)."""
    return (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


async def _connect(host: str, port: int) -> _Client:
    _, client = await asyncio.get_running_loop().create_connection(_Client, host, port)
    return client


async def latencies(host: str, port: int, requests: Sequence[bytes], count: int) -> list[float]:
    """Send ``count`` requests one after another on one connection (cycling through ``requests``);
    each round trip in seconds. Raises ``RuntimeError`` on a non-200 answer."""
    client = await _connect(host, port)
    out = []
    try:
        for i in range(count):
            t0 = time.perf_counter()
            status = await client.send(requests[i % len(requests)])
            out.append(time.perf_counter() - t0)
            if status != 200:
                raise RuntimeError(f"{host}:{port} answered {status}")
    finally:
        client.transport.close()
    return out


async def throughput(host: str, port: int, requests: Sequence[bytes], seconds: float, connections: int
                     ) -> tuple[int, int, float]:
    """Closed loop on ``connections`` connections for ``seconds``: (200 answers, other answers,
    elapsed seconds)."""
    clients = [await _connect(host, port) for _ in range(connections)]
    counts = [0, 0]
    t0 = time.perf_counter()
    stop = t0 + seconds

    async def loop(k: int, client: _Client) -> None:
        i = k * 7919
        while time.perf_counter() < stop:
            status = await client.send(requests[i % len(requests)])
            counts[0 if status == 200 else 1] += 1
            i += 1

    try:
        await asyncio.gather(*(loop(k, c) for k, c in enumerate(clients)))
    finally:
        for c in clients:
            c.transport.close()
    return counts[0], counts[1], time.perf_counter() - t0


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m lab.bench.instant --port P [--port P …] [--host H]``."""
    parser = argparse.ArgumentParser(description="An OpenAI-compatible engine that answers at once.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, action="append", required=True)
    args = parser.parse_args(argv)
    try:
        import uvloop

        uvloop.run(serve(args.host, args.port))
    except ImportError:  # pragma: no cover - uvloop is a dependency of the project
        asyncio.run(serve(args.host, args.port))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
