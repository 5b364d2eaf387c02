"""Where stored responses live: :class:`RedisResponseStore` (every router replica shares one Redis)
and :class:`MemoryResponseStore` (one process; tests). Both keep a record for ``ttl_s`` seconds
after it is written and scope it to the tenant that wrote it: a tenant asking for another tenant's
id finds nothing, exactly as for an id that never existed.

Record layout and key: :mod:`common.contracts.responses`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

from common.contracts.responses import MAX_RESPONSE_ID_CHARS, RECORD_VERSION, StoredResponse, record_key

log = logging.getLogger(__name__)


class StoreUnavailable(Exception):
    """The store could not be reached or answered with an error (Redis down, timed out)."""


class ResponseStore(Protocol):
    """Stored responses by (tenant, response id).

    Every method raises :class:`StoreUnavailable` when the backing store fails.
    """

    ttl_s: int

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """The record, or None when there is none for this tenant (unknown, expired, deleted,
        another tenant's, or written by a newer record version)."""

    async def put(self, tenant: str, response_id: str, record: StoredResponse) -> None:
        """Keep ``record`` for ``ttl_s`` seconds (replacing any record of that id)."""

    async def delete(self, tenant: str, response_id: str) -> bool:
        """Forget the record; True when there was one for this tenant."""

    async def aclose(self) -> None:
        """Release connections."""


def _decode(data: bytes | str | None, response_id: str) -> StoredResponse | None:
    if data is None:
        return None
    try:
        record = StoredResponse.from_json(data)
    except ValueError as exc:  # orjson.JSONDecodeError is one
        log.warning("stored response unreadable", extra={"action": "router.responses.bad_record",
                                                         "response_id": response_id, "error": str(exc)[:200]})
        return None
    if record.v > RECORD_VERSION:
        return None
    return record


class RedisResponseStore:
    """Records in Redis (redis-py asyncio): one string key each, ``SET … EX ttl_s``.

    Args:
        url: redis-py URL (``redis://host:6379/0``, ``unix:///path?db=0``).
        ttl_s: seconds a record is kept after it is written.
        timeout_s: socket connect and read timeout, seconds: a Redis that does not answer costs a
            request at most this long before it fails with :class:`StoreUnavailable`.
    """

    def __init__(self, url: str, ttl_s: int, timeout_s: float = 2.0) -> None:
        import redis.asyncio as aioredis

        self.ttl_s = ttl_s
        self._redis = aioredis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """See :meth:`ResponseStore.get`."""
        if len(response_id) > MAX_RESPONSE_ID_CHARS:
            return None
        try:
            data = await self._redis.get(record_key(tenant, response_id))
        except Exception as exc:  # redis.RedisError, OSError, TimeoutError
            raise StoreUnavailable(f"{type(exc).__name__}: {exc}") from exc
        return _decode(data, response_id)

    async def put(self, tenant: str, response_id: str, record: StoredResponse) -> None:
        """See :meth:`ResponseStore.put`."""
        try:
            await self._redis.set(record_key(tenant, response_id), record.to_json(), ex=self.ttl_s)
        except Exception as exc:
            raise StoreUnavailable(f"{type(exc).__name__}: {exc}") from exc

    async def delete(self, tenant: str, response_id: str) -> bool:
        """See :meth:`ResponseStore.delete`."""
        if len(response_id) > MAX_RESPONSE_ID_CHARS:
            return False
        try:
            return bool(await self._redis.delete(record_key(tenant, response_id)))
        except Exception as exc:
            raise StoreUnavailable(f"{type(exc).__name__}: {exc}") from exc

    async def ping(self) -> None:
        """Raises :class:`StoreUnavailable` when Redis does not answer ``PING`` (checked at start)."""
        try:
            await self._redis.ping()
        except Exception as exc:
            raise StoreUnavailable(f"{type(exc).__name__}: {exc}") from exc

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._redis.aclose()


class MemoryResponseStore:
    """Records in this process (same contract as :class:`RedisResponseStore`, for tests and one
    process); ``clock`` gives seconds (monotonic by default) for the TTL."""

    def __init__(self, ttl_s: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._records: dict[str, tuple[float, bytes]] = {}

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """See :meth:`ResponseStore.get`."""
        key = record_key(tenant, response_id)
        found = self._records.get(key)
        if found is None:
            return None
        expires, data = found
        if self.clock() >= expires:
            del self._records[key]
            return None
        return _decode(data, response_id)

    async def put(self, tenant: str, response_id: str, record: StoredResponse) -> None:
        """See :meth:`ResponseStore.put`."""
        self._records[record_key(tenant, response_id)] = (self.clock() + self.ttl_s, record.to_json())

    async def delete(self, tenant: str, response_id: str) -> bool:
        """See :meth:`ResponseStore.delete`."""
        found = await self.get(tenant, response_id)
        self._records.pop(record_key(tenant, response_id), None)
        return found is not None

    async def aclose(self) -> None:
        """Nothing to release."""
