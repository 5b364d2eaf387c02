"""The dashboard's background readers: one asyncio task that calls :meth:`Poller.poll_once` every
``interval_s`` seconds over one HTTP client (the router's admin state, every service's health)."""

from __future__ import annotations

import asyncio
import contextlib
from abc import ABC, abstractmethod

import httpx


class Poller(ABC):
    """Runs :meth:`poll_once` every ``interval_s`` seconds as the asyncio task ``name`` between
    :meth:`start` and :meth:`stop`, over :attr:`_client` (``timeout_s`` per request; ``transport``
    for tests). Subclasses implement :meth:`poll_once`, which must not raise for a service that is
    down (it records that instead)."""

    name = "admin-poller"

    def __init__(self, interval_s: float, timeout_s: float, transport: httpx.AsyncBaseTransport | None = None):
        self.interval_s = interval_s
        self._client = httpx.AsyncClient(timeout=timeout_s, transport=transport)
        self._task: asyncio.Task | None = None

    @abstractmethod
    async def poll_once(self) -> None:
        """Read once (subclasses)."""

    async def _run(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        """Start polling in the running loop."""
        self._task = asyncio.create_task(self._run(), name=self.name)

    async def stop(self) -> None:
        """Stop polling and close the HTTP client."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._client.aclose()
