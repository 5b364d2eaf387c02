"""The workers' side of the request and result queues (Redis Streams, names and formats from
:mod:`common.contracts.queue`).

- :meth:`BatchQueue.publish` ``XADD``-s request messages to the ``batch`` lane's stream;
- :meth:`BatchQueue.read_results` reads the batch result stream through the consumer group
  ``collectors`` (new entries, then entries another collector left pending longer than
  ``reclaim_idle_seconds``, via ``XAUTOCLAIM``); :meth:`BatchQueue.ack` acknowledges them once their
  outcome is committed in Postgres;
- :meth:`BatchQueue.mark_cancelled` sets the cancel marker the processor checks.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis

from common.contracts.queue import (
    BATCH_LANE,
    BATCH_RESULT_STREAM,
    COLLECTOR_GROUP,
    REQUEST_FIELD,
    RESULT_FIELD,
    InvalidMessage,
    RequestMessage,
    ResultMessage,
    cancel_marker_key,
    decode_result,
    encode_request,
    request_stream,
)


class BatchQueue:
    """Redis Streams I/O of the batch lifecycle. ``redis_url`` in redis-py form."""

    def __init__(self, redis_url: str, *, pool: str = "default", result_stream: str = BATCH_RESULT_STREAM,
                 consumer: str = "collector", reclaim_idle_seconds: float = 60.0):
        self.redis = redis.Redis.from_url(redis_url)
        self.request_stream = request_stream(BATCH_LANE, pool)
        self.result_stream = result_stream
        self.consumer = consumer
        self.reclaim_idle_ms = int(reclaim_idle_seconds * 1000)
        self._group_ready = False

    def publish(self, messages: Sequence[RequestMessage]) -> None:
        """``XADD`` each message to the batch lane's request stream (one round trip)."""
        if not messages:
            return
        with self.redis.pipeline(transaction=False) as pipe:
            for message in messages:
                pipe.xadd(self.request_stream, {REQUEST_FIELD: encode_request(message)})
            pipe.execute()

    def _ensure_group(self) -> None:
        if self._group_ready:
            return
        try:
            self.redis.xgroup_create(self.result_stream, COLLECTOR_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._group_ready = True

    def read_results(self, count: int = 1000) -> list[tuple[bytes, ResultMessage | None]]:
        """Up to ``count`` result entries as ``(entry_id, result)``; ``result`` is None for an entry
        that is not a result message or was trimmed (ack it and move on). A consumer group lost
        with its Redis (restarted empty) is created again."""
        try:
            return self._read_results(count)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self._group_ready = False
            return self._read_results(count)

    def _read_results(self, count: int) -> list[tuple[bytes, ResultMessage | None]]:
        self._ensure_group()
        reply = self.redis.xautoclaim(self.result_stream, COLLECTOR_GROUP, self.consumer,
                                      min_idle_time=self.reclaim_idle_ms, start_id="0-0", count=count)
        entries = [entry for entry in reply[1] if entry[0]]  # Redis 7 adds a third part: deleted ids
        if len(entries) < count:
            fresh = self.redis.xreadgroup(COLLECTOR_GROUP, self.consumer, {self.result_stream: ">"},
                                          count=count - len(entries))
            for _, items in fresh or []:
                entries.extend(items)
        out: list[tuple[bytes, ResultMessage | None]] = []
        for entry_id, fields in entries:
            raw = (fields or {}).get(RESULT_FIELD.encode())
            try:
                out.append((entry_id, decode_result(raw) if raw is not None else None))
            except InvalidMessage:
                out.append((entry_id, None))
        return out

    def ack(self, entry_ids: Sequence[bytes]) -> None:
        """Acknowledge result entries whose outcome is committed."""
        if entry_ids:
            self.redis.xack(self.result_stream, COLLECTOR_GROUP, *entry_ids)

    def mark_cancelled(self, batch_id: str, ttl_seconds: int = 7 * 24 * 3600) -> None:
        """Tell processors to drop the batch's queued messages (answered ``CANCELLED``)."""
        self.redis.set(cancel_marker_key(batch_id), b"1", ex=ttl_seconds)

    def close(self) -> None:
        """Close the connection pool."""
        self.redis.close()
