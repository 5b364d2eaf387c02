"""Helpers for tests of code that uses the processor (shipped like ``httpx.MockTransport``):
polling for a condition, a backend wrapper that checks "ack only after publish", and running a
processor in the current event loop until a condition holds."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from typing import Any

import httpx

from async_processor.backends.base import Delivery, QueueBackend
from async_processor.processor import Processor
from async_processor.router_client import HttpxRouterClient, RouterClient
from async_processor.settings import ProcessorSettings
from common.contracts.queue import ResultMessage


async def eventually(fn: Callable[[], Awaitable], timeout_s: float = 10.0, interval_s: float = 0.05):
    """Await ``fn()`` until it returns something truthy and return it; ``AssertionError`` after
    ``timeout_s`` seconds."""
    until = time.monotonic() + timeout_s
    while True:
        value = await fn()
        if value:
            return value
        if time.monotonic() > until:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(interval_s)


class OrderCheckingBackend:
    """Wraps a backend; records published result ids, the request ids acknowledged (``acked``, by
    ``ack`` or ``dead_letter``, in order) and in ``violations`` those acknowledged before a result for
    them was published through this wrapper. Deliveries without ``request_id`` (undecodable
    messages) are exempt."""

    def __init__(self, inner: QueueBackend):
        self.inner = inner
        self.published: set[str] = set()
        self.acked: list[str] = []
        self.violations: list[str] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def publish_results(self, results: Sequence[tuple[ResultMessage, str]]) -> list[bool]:
        published = await self.inner.publish_results(results)
        self.published.update(r.id for (r, _), ok in zip(results, published) if ok)
        return published

    def _check(self, deliveries: Sequence[Delivery]) -> None:
        for d in deliveries:
            self.acked.append(d.request_id)
            if d.request_id and d.request_id not in self.published:
                self.violations.append(d.request_id)

    async def ack(self, deliveries: Sequence[Delivery]) -> None:
        self._check(deliveries)
        await self.inner.ack(deliveries)

    async def dead_letter(self, deliveries: Sequence[Delivery], reason: str) -> None:
        self._check(deliveries)
        await self.inner.dead_letter(deliveries, reason)


@contextlib.asynccontextmanager
async def running(settings: ProcessorSettings, backend: QueueBackend, http: RouterClient
                  ) -> AsyncIterator[Processor]:
    """A :class:`Processor` pumping in the current loop for the duration of the block, then stopped
    (with its normal shutdown)."""
    processor = Processor(settings, backend, http)
    stop = asyncio.Event()
    task = asyncio.create_task(processor.run(stop))
    try:
        yield processor
    finally:
        stop.set()
        await task


def mock_target(handler: Callable[[httpx.Request], httpx.Response]
                | Callable[[httpx.Request], Coroutine[Any, Any, httpx.Response]]) -> HttpxRouterClient:
    """A router client whose requests go to ``handler`` (``httpx.MockTransport``); an exception
    ``handler`` raises that is an ``httpx.HTTPError`` (``httpx.ConnectError``, ...) is "no answer"."""
    return HttpxRouterClient(httpx.AsyncClient(transport=httpx.MockTransport(handler)))
