"""Redis Streams, the producer side (synchronous redis-py, for Celery workers and the dashboard):
:class:`RedisLaneProducer` (:class:`~async_processor.backends.base.TrackedLaneProducer`) and
:class:`RedisResultQueue` (:class:`~async_processor.backends.base.ResultQueue`).

The stream layout is :mod:`async_processor.backends.redis_streams`' (entry fields, group set-up,
``XAUTOCLAIM`` replies): requests are ``XADD``-ed to ``backfill:requests:{pool}:{lane}`` with one
field ``message``; a result queue is read through a consumer group (created at the stream's start
when missing, and again when Redis lost it) with ``XAUTOCLAIM`` of entries idle longer than
``reclaim_idle_s`` first, then ``XREADGROUP >``; with ``delete_acked`` an acknowledged entry is also
``XDEL``-eted (``XACK`` and ``XDEL`` in one ``MULTI``, one round trip), so a stream read by one group
holds only what that group has not acknowledged; a cancel marker is ``SET`` with a TTL; where a
published request is now (:meth:`RedisLaneProducer.whereabouts`) is read from the stream, the
processors' consumer group and the id claims, never written. Transport
errors raise :class:`~async_processor.errors.BackendError`.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis
from redis.exceptions import RedisError, ResponseError

from async_processor.backends.base import LaneDepth, ResultEntry, Whereabouts
from async_processor.backends.redis_streams import (
    CANCEL_MARKER_VALUE,
    CLAIM_PREFIX,
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
        self.publish_tracked(lane, messages)

    def publish_tracked(self, lane: str, messages: Sequence[RequestMessage]) -> list[str]:
        """:meth:`publish`, returning the stream entry id of each message, in order."""
        if not messages:
            return []
        stream = self.stream(lane)
        try:
            with self.client.pipeline(transaction=False) as pipe:
                for message in messages:
                    pipe.xadd(stream, request_fields(encode_request(message)))
                ids = pipe.execute()
        except RedisError as exc:
            raise BackendError(f"redis publish to {stream}: {exc}") from exc
        return [entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id) for entry_id in ids]

    def whereabouts(self, lane: str, group: str, messages: Sequence[tuple[str, str]]) -> list[Whereabouts]:
        """Where each ``(entry_id, request_id)`` is now, read in one pipelined round trip, in the
        order a message moves (so a message that moves on between two reads is never taken for
        lost): the group's last-delivered id (``XINFO GROUPS``), the entry (``XRANGE id id``), its
        place in the group's pending list (``XPENDING … id id 1``), then its id claim
        (``backfill:claim:{request_id}``: ``running:{token}`` while a processor renews it, ``done`` once
        its result is published).

        ``ANSWERED`` when the claim is ``done``; ``HELD`` when it is a running claim or the entry is
        pending; ``WAITING`` when the entry is there and not yet delivered (or the group does not
        exist yet); else ``GONE``. An empty ``entry_id`` (never recorded) is judged by its claim alone."""
        if not messages:
            return []
        stream = self.stream(lane)
        try:
            with self.client.pipeline(transaction=False) as pipe:
                pipe.xinfo_groups(stream)
                for entry_id, _ in messages:
                    if entry_id:
                        pipe.xrange(stream, min=entry_id, max=entry_id, count=1)
                        pipe.xpending_range(stream, group, min=entry_id, max=entry_id, count=1)
                for _, request_id in messages:
                    pipe.get(CLAIM_PREFIX + request_id if request_id else CLAIM_PREFIX)
                replies = pipe.execute(raise_on_error=False)
        except RedisError as exc:
            raise BackendError(f"redis whereabouts on {stream}: {exc}") from exc
        groups, replies = replies[0], replies[1:]
        delivered_up_to = None  # None: no group (or no stream) yet, nothing delivered
        if isinstance(groups, list):
            for info in groups:
                if info.get("name") in (group, group.encode()):
                    delivered_up_to = _entry_key(info.get("last-delivered-id"))
        claims = replies[-len(messages):]
        out = []
        index = 0
        for (entry_id, request_id), claim in zip(messages, claims):
            present = pending = False
            if entry_id:
                found, held = replies[index], replies[index + 1]
                index += 2
                present = isinstance(found, list) and bool(found) and bool(found[0][1])
                pending = isinstance(held, list) and bool(held)
            if request_id and claim == b"done":
                out.append(Whereabouts.ANSWERED)
            elif (request_id and isinstance(claim, bytes) and claim.split(b":", 1)[0] == b"running") or (
                    present and pending):
                out.append(Whereabouts.HELD)
            elif present and (delivered_up_to is None or _entry_key(entry_id) > delivered_up_to):
                out.append(Whereabouts.WAITING)
            else:
                out.append(Whereabouts.GONE)
        return out

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


def _entry_key(entry_id: bytes | str | None) -> tuple[int, int]:
    """A stream entry id ``ms-seq`` as a tuple that sorts as Redis orders entries."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id or "0-0")
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


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
