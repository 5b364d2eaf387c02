"""RELIABILITY.md F20: two processors on one pool; one stalls (its event loop blocked, as under
SIGSTOP) past its lease with work held and in flight; the other takes the work over and answers it.
When the stalled one resumes it drops what was taken over (counted ``taken_over``) instead of
running it or publishing a second result: the result queue holds one result per id, and the stale
processor sends nothing more to the target.

Each processor runs in a thread with its own event loop, so blocking one loop stalls that processor
only. Redis Streams (the session's Redis), the in-process Pub/Sub fake and Google's Pub/Sub emulator
(skipped when it is not installed).
"""

from __future__ import annotations

import asyncio
import collections
import secrets
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from async_processor.backends.base import QueueBackend
from async_processor.processor import Processor
from async_processor.settings import ProcessorSettings, build_settings
from async_processor.testing import mock_target
from tests.contract.conftest import pubsub_emulator, pubsub_fake  # noqa: F401 (fixtures)
from tests.contract.test_queue_backends import request

IDS = [f"job-{i}" for i in range(8)]
LEASE_S = 2.0


class Pumped:
    """A :class:`Processor` in a thread with its own event loop. ``hold``: while not set, the
    target keeps this processor's requests waiting (they stay in flight). ``hits``: ids it sent to
    the target, with ``phase`` at the time."""

    def __init__(self, name: str, settings: ProcessorSettings, make_backend: Callable[[], QueueBackend]):
        self.name, self.settings, self.make_backend = name, settings, make_backend
        self.hold = threading.Event()
        self.hold.set()
        self.phase = "running"
        self.hits: list[tuple[str, str]] = []
        self.processor: Processor | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.error: BaseException | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name=f"processor-{name}", daemon=True)

    async def _handler(self, req: httpx.Request) -> httpx.Response:
        self.hits.append((req.headers["x-job"], self.phase))
        while not self.hold.is_set():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        return httpx.Response(200, json={"by": self.name})

    def _main(self) -> None:
        async def run() -> None:
            backend = self.make_backend()
            await backend.start()
            self.loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            self.processor = Processor(self.settings, backend, mock_target(self._handler))
            self._ready.set()
            try:
                await self.processor.run(self._stop)
            finally:
                await backend.close()
        try:
            asyncio.run(run())
        except BaseException as exc:  # reported by stop()
            self.error = exc
            self._ready.set()

    def start(self) -> Pumped:
        self._thread.start()
        assert self._ready.wait(30), f"{self.name} did not start"
        assert self.error is None, self.error
        return self

    def stall(self) -> threading.Event:
        """Block this processor's event loop until the returned event is set."""
        resume = threading.Event()
        started = threading.Event()

        def block() -> None:
            started.set()
            resume.wait(60)
        assert self.loop is not None
        self.loop.call_soon_threadsafe(block)
        assert started.wait(10)
        return resume

    @property
    def held(self) -> int:
        p = self.processor
        assert p is not None
        return len(p.buffer) + len(p.in_flight)

    def quiet(self) -> bool:
        p = self.processor
        assert p is not None
        return self.held == 0 and not p._settle

    def stop(self) -> None:
        if self.loop is not None and self._stop is not None and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        assert not self._thread.is_alive(), f"{self.name} did not stop"
        if self.error is not None:
            raise self.error


def until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} not within {timeout_s} s"
        time.sleep(0.02)


def _redis_side(stores):
    import redis.asyncio as aioredis

    from async_processor.backends.redis_streams import RedisStreamsBackend

    ns = f"t{secrets.token_hex(4)}"

    def make() -> QueueBackend:
        return RedisStreamsBackend(aioredis.Redis.from_url(stores.redis_url), lanes=["batch"], group=f"{ns}-group",
                                   stream_prefix=f"{ns}:requests", result_stream=f"{ns}:results")
    return make


def _pubsub_side(host: str):
    from async_processor.backends.pubsub import PubSubBackend

    project = f"t{secrets.token_hex(4)}"

    def make() -> QueueBackend:
        return PubSubBackend(project, lanes=["batch"], emulator_host=host)
    return make


@pytest.fixture(params=["redis", "pubsub-fake", "pubsub-emulator"])
def make_backend(request) -> Callable[[], QueueBackend]:
    if request.param == "redis":
        return _redis_side(request.getfixturevalue("stores"))
    if request.param == "pubsub-fake":
        return _pubsub_side(request.getfixturevalue("pubsub_fake"))
    return _pubsub_side(request.getfixturevalue("pubsub_emulator"))


def test_stalled_processor_drops_what_another_took_over(make_backend):
    common = dict(backend="memory", lanes=["batch"], lease_s=LEASE_S, router_url="http://target",
                  poll_interval_s=0.01, saturation_poll_s=0.05, grace_s=2.0)
    a = Pumped("a", build_settings(**common, concurrency=2, buffer_size=len(IDS), receive_batch=len(IDS)),
               make_backend)
    b = Pumped("b", build_settings(**common, concurrency=len(IDS)), make_backend)
    results: collections.Counter[str] = collections.Counter()

    async def control() -> None:
        side = make_backend()
        await side.start()
        reader = side.result_reader()
        try:
            await asyncio.to_thread(a.start)
            a.hold.clear()  # a's requests stay in flight until it has resumed
            for job in IDS:
                await side.publish_request("batch", request(id=job, headers={"x-job": job}))
            await asyncio.to_thread(until, lambda: a.held == len(IDS) and len(a.hits) == 2, 20, "a holding all")
            await asyncio.to_thread(b.start)
            resume = a.stall()  # 2 in flight, 6 held; its leases lapse
            deadline = time.monotonic() + 30
            while set(results) != set(IDS):  # b answers every id
                assert time.monotonic() < deadline, f"b answered only {sorted(results)}"
                results.update(r.id for r in await reader.read(0.2))
            a.phase = "resumed"
            resume.set()
            a.hold.set()
            await asyncio.to_thread(until, a.quiet, 20, "a dropping what b took over")
            await asyncio.to_thread(a.stop)
            await asyncio.to_thread(b.stop)
            while found := await reader.read(1.0):  # whatever either published up to its stop
                results.update(r.id for r in found)
        finally:
            await reader.close()
            await side.close()
            a.stop()
            b.stop()

    asyncio.run(control())

    assert results == collections.Counter({job: 1 for job in IDS})  # one result per id
    assert [job for job, phase in a.hits if phase == "resumed"] == []  # nothing re-run by the stale one
    assert sorted(job for job, _ in b.hits) == IDS
    assert a.processor is not None and a.processor.counts["taken_over"] == len(IDS)
