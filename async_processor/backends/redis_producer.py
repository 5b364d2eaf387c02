"""Redis Streams, the producer side (synchronous redis-py, for Celery workers and the dashboard):
:class:`RedisLaneProducer` (:class:`~async_processor.backends.base.LaneProducer`) and
:class:`RedisResultQueue` (:class:`~async_processor.backends.base.ResultQueue`).

The stream layout is :mod:`async_processor.backends.redis_streams`' (entry fields, group set-up,
``XAUTOCLAIM`` replies): requests are ``XADD``-ed to ``backfill:requests:{pool}:{lane}`` with one
field ``message``; a result queue is read through a consumer group (created at the stream's start
when missing, and again when Redis lost it) with ``XAUTOCLAIM`` of entries idle longer than
``reclaim_idle_s`` first, then ``XREADGROUP >``; with ``delete_acked`` an acknowledged entry is also
``XDEL``-eted (``XACK`` and ``XDEL`` in one ``MULTI``, one round trip), so a stream read by one group
holds only what that group has not acknowledged; a cancel marker is ``SET`` with a TTL. Transport
errors raise :class:`~async_processor.errors.BackendError`.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis
from redis.exceptions import RedisError, ResponseError

from async_processor.backends.base import LaneDepth, ResultEntry
from async_processor.backends.redis_streams import (
    CANCEL_MARKER_VALUE,
    GROUP_START_ID,
    autoclaim_reply,
    group_exists,
    group_missing,
    request_fields,
    result_of,
    stream_entries,
)
from async_processor.errors import BackendError
from common.contracts.queue import (
    COLLECTOR_GROUP,
    DEFAULT_POOL,
    REQUEST_STREAM_PREFIX,
    RequestMessage,
    cancel_marker_key,
    dead_letter_stream,
    encode_request,
    request_stream,
)


class RedisLaneProducer:
    """The request lanes of one pool. ``client``: a ``redis.Redis`` (bytes responses), the
    caller's."""

    def __init__(self, client: redis.Redis, *, pool: str = DEFAULT_POOL, stream_prefix: str = REQUEST_STREAM_PREFIX):
        self.client = client
        self.pool = pool
        self.stream_prefix = stream_prefix

    def stream(self, lane: str) -> str:
        """The stream of ``lane`` in this pool."""
        return request_stream(lane, self.pool, self.stream_prefix)

    def publish(self, lane: str, messages: Sequence[RequestMessage]) -> None:
        """``XADD`` each message to the lane's stream (one pipelined round trip)."""
        if not messages:
            return
        stream = self.stream(lane)
        try:
            with self.client.pipeline(transaction=False) as pipe:
                for message in messages:
                    pipe.xadd(stream, request_fields(encode_request(message)))
                pipe.execute()
        except RedisError as exc:
            raise BackendError(f"redis publish to {stream}: {exc}") from exc

    def mark_cancelled(self, batch_id: str, ttl_s: int) -> None:
        """``SET`` the batch's cancel marker with a TTL of ``ttl_s``."""
        try:
            self.client.set(cancel_marker_key(batch_id), CANCEL_MARKER_VALUE, ex=ttl_s)
        except RedisError as exc:
            raise BackendError(f"redis cancel marker of {batch_id}: {exc}") from exc

    def lane_depths(self, lanes: Sequence[str], group: str) -> list[LaneDepth]:
        """Per lane: ``XLEN`` of its stream (the processors delete acknowledged entries, so this is
        what is not yet acknowledged), ``XPENDING`` of ``group`` (0 while the group does not exist)
        and ``XLEN`` of its dead-letter stream; one pipelined round trip."""
        try:
            with self.client.pipeline(transaction=False) as pipe:
                for lane in lanes:
                    stream = self.stream(lane)
                    pipe.xlen(stream)
                    pipe.xpending(stream, group)
                    pipe.xlen(dead_letter_stream(stream))
                replies = pipe.execute(raise_on_error=False)
        except RedisError as exc:
            raise BackendError(f"redis lane depths: {exc}") from exc
        out = []
        for index, lane in enumerate(lanes):
            length, pending, dead = replies[3 * index: 3 * index + 3]
            out.append(LaneDepth(lane=lane, queue=self.stream(lane),
                                 length=length if isinstance(length, int) else 0,
                                 pending=pending["pending"] if isinstance(pending, dict) else 0,  # NOGROUP: none yet
                                 dead=dead if isinstance(dead, int) else 0))
        return out


class RedisResultQueue:
    """One result stream read by ``consumer`` of ``group`` (see the module docstring).
    ``client``: a ``redis.Redis`` (bytes responses), the caller's. ``delete_acked``: :meth:`ack`
    deletes the entries too; only for a stream that ``group`` alone reads (another group would lose
    them), such as the batch result stream the collectors read."""

    def __init__(self, client: redis.Redis, stream: str, *, group: str = COLLECTOR_GROUP, consumer: str,
                 reclaim_idle_s: float = 60.0, delete_acked: bool = False):
        self.client = client
        self.delete_acked = delete_acked
        self.stream = stream
        self.group = group
        self.consumer = consumer
        self.reclaim_idle_ms = int(reclaim_idle_s * 1000)
        self._group_ready = False

    def _ensure_group(self) -> None:
        if self._group_ready:
            return
        try:
            self.client.xgroup_create(self.stream, self.group, id=GROUP_START_ID, mkstream=True)
        except ResponseError as exc:
            if not group_exists(exc):
                raise
        self._group_ready = True

    def read(self, count: int) -> list[ResultEntry]:
        """Up to ``count`` entries, reclaimed ones first; a group lost with its Redis (restarted
        empty) is created again."""
        try:
            try:
                return self._read(count)
            except ResponseError as exc:
                if not group_missing(exc):
                    raise
                self._group_ready = False
                return self._read(count)
        except RedisError as exc:
            raise BackendError(f"redis read of {self.stream}: {exc}") from exc

    def _read(self, count: int) -> list[ResultEntry]:
        self._ensure_group()
        reply = self.client.xautoclaim(self.stream, self.group, self.consumer, min_idle_time=self.reclaim_idle_ms,
                                       start_id="0-0", count=count)
        _cursor, entries, _deleted = autoclaim_reply(reply)
        if len(entries) < count:
            entries += stream_entries(self.client.xreadgroup(self.group, self.consumer, {self.stream: ">"},
                                                             count=count - len(entries)))
        return [(entry_id, result_of(fields)) for entry_id, fields in entries]

    def ack(self, entry_ids: Sequence[bytes]) -> None:
        """``XACK`` the entries; with ``delete_acked``, ``XDEL`` them in the same ``MULTI`` (only
        these ids: an entry not acknowledged is never deleted)."""
        if not entry_ids:
            return
        try:
            if not self.delete_acked:
                self.client.xack(self.stream, self.group, *entry_ids)
                return
            with self.client.pipeline(transaction=True) as pipe:
                pipe.xack(self.stream, self.group, *entry_ids)
                pipe.xdel(self.stream, *entry_ids)
                pipe.execute()
        except RedisError as exc:
            raise BackendError(f"redis ack on {self.stream}: {exc}") from exc
