"""What the processor tells the dashboard about its batch requests in flight: one report per
processor in the Redis hash :func:`~common.contracts.queue.running_key` (field = this processor's
name, value = ``{"at": Unix s, "batches": {batch_id: n}}``), rewritten every ``running_report_s``
while it has batch requests in flight and removed when it has none or stops. The job page reads
the sum over the reports younger than
:data:`~common.contracts.queue.RUNNING_REPORT_MAX_AGE_S` (:func:`~common.contracts.queue.running_counts`),
so its "running" count is the requests sent to the router and not answered yet, apart from those
still waiting in a lane; a processor that dies or freezes drops out of it within that age.

Only the Redis backend reports (the dashboard reads the same Redis); other backends run without.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from collections.abc import Mapping
from typing import Protocol

from common.contracts.queue import RUNNING_REPORT_MAX_AGE_S, running_key, running_report

log = logging.getLogger(__name__)

KEY_TTL_S = 60
"""The hash expires this long after the last write of any processor (all stopped: it goes)."""
SWEEP_EVERY = 60
"""Every this many writes a processor deletes the fields of processors gone for longer than
:data:`KEY_TTL_S` (their reports are ignored by age meanwhile)."""


class RunningReporter(Protocol):
    """Where the processor reports its batch requests in flight."""

    async def report(self, batches: Mapping[str, int]) -> None:
        """``{batch_id: requests in flight}`` now (empty: none). Raises what the store raises."""
        ...

    async def close(self) -> None:
        """Withdraw this processor's report and release the connection."""
        ...


class RedisRunningReporter:
    """:class:`RunningReporter` on the Redis hash :func:`~common.contracts.queue.running_key` of
    ``pool``; ``name`` identifies this processor (default ``{host}-{pid}-{random}``)."""

    def __init__(self, redis_url: str, pool: str, name: str = ""):
        import redis.asyncio as aioredis

        self._client = aioredis.Redis.from_url(redis_url, socket_timeout=2.0)
        self.key = running_key(pool)
        self.name = name or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self._reported = False
        self._writes = 0

    async def report(self, batches: Mapping[str, int]) -> None:
        if not batches:
            if self._reported:
                await self._client.hdel(self.key, self.name)
                self._reported = False
            return
        now = time.time()
        async with self._client.pipeline(transaction=False) as pipe:
            pipe.hset(self.key, self.name, running_report(now, batches))
            pipe.expire(self.key, KEY_TTL_S)
            await pipe.execute()
        self._reported = True
        self._writes += 1
        if self._writes % SWEEP_EVERY == 0:
            await self._sweep(now)

    async def _sweep(self, now: float) -> None:
        import orjson

        gone = []
        for field, value in (await self._client.hgetall(self.key)).items():
            try:
                fresh = now - float(orjson.loads(value)["at"]) <= KEY_TTL_S
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                fresh = False
            if not fresh:
                gone.append(field)
        if gone:
            await self._client.hdel(self.key, *gone)

    async def close(self) -> None:
        try:
            if self._reported:
                await self._client.hdel(self.key, self.name)
        except Exception as exc:  # the report then ages out (RUNNING_REPORT_MAX_AGE_S)
            log.warning("running report not withdrawn", extra={"action": "running_report_failed", "error": str(exc),
                                                               "max_age_s": RUNNING_REPORT_MAX_AGE_S})
        finally:
            await self._client.aclose()
