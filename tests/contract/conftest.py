"""Fixtures of the queue-backend contract suite: one ``kit`` per backend (memory, Redis Streams,
Google's Pub/Sub emulator, the in-process Pub/Sub fake), each in a namespace of its own per test."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import subprocess
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from async_processor.backends.base import QueueBackend
from common.contracts.queue import REQUEST_FIELD, dead_letter_stream

EMULATOR_CANDIDATES = ("/usr/lib/google-cloud-sdk/platform/pubsub-emulator/bin/cloud-pubsub-emulator",)


def emulator_binary() -> str | None:
    """Path of Google's ``cloud-pubsub-emulator`` launcher, or None."""
    for path in EMULATOR_CANDIDATES:
        if Path(path).exists():
            return path
    return shutil.which("cloud-pubsub-emulator")


@pytest.fixture(scope="session")
def pubsub_emulator():
    """``host:port`` of a Pub/Sub emulator started for this session (stopped at its end)."""
    binary = emulator_binary()
    if binary is None:
        pytest.skip("Google's Pub/Sub emulator (cloud-pubsub-emulator) is not installed here; "
                    "the in-process fake covers the Pub/Sub backend")
    from backfill.up import free_port

    port = free_port()
    proc = subprocess.Popen([binary, "--host=127.0.0.1", f"--port={port}"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    started = threading.Event()

    def watch():
        for line in proc.stdout:
            if "Server started" in line:
                started.set()
    threading.Thread(target=watch, daemon=True).start()
    try:
        if not started.wait(60):
            raise RuntimeError("Pub/Sub emulator did not start within 60 s")
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def pubsub_fake():
    """``host:port`` of an in-process Pub/Sub fake for this session."""
    from async_processor.backends.pubsub_fake import PubSubFake

    with PubSubFake() as fake:
        yield fake.host


class Kit:
    """Makes backends (each a separate consumer) over one namespace; knows how to read dead letters.

    ``lease_s``: the lease the tests use (Pub/Sub deadlines are whole seconds)."""

    def __init__(self, kind: str, factory: Callable[[], QueueBackend], lease_s: float,
                 dead: Callable[[QueueBackend, str], Awaitable[list[bytes]]]):
        self.kind, self.factory, self.lease_s, self._dead = kind, factory, lease_s, dead
        self.made: list[QueueBackend] = []

    async def make(self) -> QueueBackend:
        backend = self.factory()
        await backend.start()
        self.made.append(backend)
        return backend

    async def dead_letters(self, backend: QueueBackend, lane: str) -> list[bytes]:
        return await self._dead(backend, lane)

    def run(self, body: Callable[[Kit], Awaitable[None]]) -> None:
        """Run ``body(kit)`` in a fresh event loop, closing every backend made."""
        async def main():
            try:
                await body(self)
            finally:
                for backend in self.made:
                    await backend.close()
        asyncio.run(main())


LANES = ["interactive", "async", "batch"]


def _memory_kit() -> Kit:
    from async_processor.backends.memory import MemoryBackend

    shared = MemoryBackend()

    async def dead(backend, lane):
        return [body for body, _ in backend.dead.get(lane, [])]

    class _Shared:  # every "consumer" is the same in-memory queue; close() is a no-op
        def __call__(self):
            return shared
    return Kit("memory", _Shared(), 0.4, dead)


def _redis_kit(redis_url: str) -> Kit:
    import redis.asyncio as aioredis

    from async_processor.backends.redis_streams import RedisStreamsBackend

    ns = f"t{secrets.token_hex(4)}"

    def factory():
        return RedisStreamsBackend(aioredis.Redis.from_url(redis_url), lanes=LANES, group=f"{ns}-group",
                                   stream_prefix=f"{ns}:requests", result_stream=f"{ns}:results")

    async def dead(backend, lane):
        entries = await backend.client.xrange(dead_letter_stream(backend.stream(lane)))
        return [fields[REQUEST_FIELD.encode()] for _, fields in entries]
    return Kit("redis", factory, 0.4, dead)


def _pubsub_kit(kind: str, host: str) -> Kit:
    from async_processor.backends.pubsub import PubSubBackend

    project = f"t{secrets.token_hex(4)}"

    def factory():
        return PubSubBackend(project, lanes=LANES, emulator_host=host, max_deliveries=3)

    async def dead(backend, lane):
        sub = backend.subscription_path(backend.topic_id(lane) + "-dead-reader")
        reply = await asyncio.to_thread(backend.subscriber.pull, request={
            "subscription": sub, "max_messages": 100, "return_immediately": True})
        return [bytes(m.message.data) for m in reply.received_messages]
    return Kit(kind, factory, 1.0, dead)


@pytest.fixture(params=["memory", "redis", "pubsub-emulator", "pubsub-fake"])
def kit(request) -> Kit:
    """A :class:`Kit` for each backend."""
    if request.param == "memory":
        return _memory_kit()
    if request.param == "redis":
        return _redis_kit(request.getfixturevalue("stores").redis_url)
    if request.param == "pubsub-emulator":
        return _pubsub_kit("pubsub-emulator", request.getfixturevalue("pubsub_emulator"))
    return _pubsub_kit("pubsub-fake", request.getfixturevalue("pubsub_fake"))


@pytest.fixture
def redis_kit(stores) -> Kit:
    """A :class:`Kit` for Redis Streams alone (what only Redis has: streams and groups to erase)."""
    return _redis_kit(stores.redis_url)


os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
