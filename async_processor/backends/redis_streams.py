"""Redis Streams backend (redis-py asyncio) and the stream layout it shares with the synchronous
producer side (:mod:`async_processor.backends.redis_producer`): the entry fields, the consumer-group
set-up and the parsing of ``XAUTOCLAIM`` replies are written once, here.

Layout (names from :mod:`common.contracts.queue`):

- one stream per (pool, lane), ``backfill:requests:{pool}:{lane}``, entry field ``message`` = JSON;
- one consumer group ``backfill-processors`` (setting ``consumer_group``) shared by every processor,
  each processor one consumer (``{host}-{pid}-{random}`` unless named);
- results ``XADD``-ed to the message's ``result_queue_name`` or ``backfill:results``, field ``result``;
  llm-d-async's messages (its envelope) answered as it does: ``LPUSH`` to their result list, or
  ``PUBLISH`` on the result channel for its redis-pubsub transport;
- llm-d-async's sorted-set transport (setting ``llmd_sorted_sets``, e.g. ``request-sortedset``):
  each receive of the ``llmd_lane`` lane first moves up to as many members as it asks for, earliest
  deadline (lowest score) first, from the sets into that lane's stream, in one script (``ZPOPMIN``
  + ``XADD``): a member is claimed by exactly one move, and once in the stream it has the stream's
  leases, so a processor that dies holding it loses nothing. Its ``request-cancel:{id}`` marker
  is checked at admission (cancelled while it holds the message's ``request_token``) and its
  ``request-active:{id}``/``request-cancel:{id}`` keys are deleted with the result where they still
  hold that token (llm-d-async's cleanup);
- llm-d-async's retry sorted set (setting ``llmd_retry_sorted_sets``, e.g. ``retry-sortedset``):
  where llm-d-async's own consumer parks a retryable failure until due (score: the Unix second it
  is due). Each receive of the ``llmd_lane`` lane also moves the members due by now (the
  processor's clock, as llm-d-async's mover reads it), earliest first, into that lane's stream, in
  one script (``ZRANGE … BYSCORE`` + ``ZREM`` + ``XADD``), so retries llm-d-async's consumer left
  (a fleet moving over, or both consumers on one Redis) run here, once each;
- llm-d-async's redis-pubsub transport (setting ``llmd_channels``, e.g. ``request-queue``): a
  subscriber puts each published message on the ``llmd_lane`` stream (see :meth:`RedisStreamsBackend.take_published`);
- dead letters ``XADD``-ed to ``{stream}:dead`` with fields ``message``, ``reason``, ``source_id``,
  ``deliveries``;
- id claims as keys ``backfill:claim:{id}`` (``running:{token}`` with the lease as TTL, the token
  one per backend instance, then ``done`` for ``dedup_ttl_s``); cancel markers as in
  :func:`~common.contracts.queue.cancel_marker_key`.

One result per id: the publishing script refuses a result whose id is ``done`` or claimed by
another token, and lease extension reports claims lost to another processor (the processor drops
that work instead of running or publishing it).

Redis restarted empty: a ``NOGROUP`` reply makes :meth:`RedisStreamsBackend.receive` create the
stream and group again (the lanes made ready are forgotten); claims, done marks and scripts
(``EVALSHA`` falls back to loading the script) need nothing.

Receiving: ``XAUTOCLAIM`` of entries idle longer than the lease (at most every ``lease/4`` s per lane),
their delivery counts from ``XPENDING``; then ``XREADGROUP >`` for new entries. Entries trimmed
while pending (nil entries) are acknowledged and logged: Redis 7 reports their ids from
``XAUTOCLAIM``; Redis 6.2 returns them as nil, and the consumer's own pending list is swept for
entries without fields. Acks are ``XACK`` then (setting ``delete_acked``) ``XDEL``; the processor
never trims a stream, so unacknowledged entries are never lost to trimming by us.

Hand back (nack) sets the entry's idle time to ``lease - delay`` with ``XCLAIM … IDLE … JUSTID`` so
the next ``XAUTOCLAIM`` past ``delay`` takes it; lease extension resets the idle time to 0 the same
way. ``JUSTID`` counts no delivery. Every processor of a group must use the same lease.

Claims (admit, extend, release) and result publishing take one Lua script call per batch: a script
runs atomically and answers once, where a pipeline or ``MULTI`` answers (and redis-py parses) once
per command.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError
from redis.typing import EncodableT, FieldT

from async_processor.backends.base import Admission, Delivery
from async_processor.errors import BackendError
from common.contracts.queue import (
    DEFAULT_POOL,
    DEFAULT_RESULT_STREAM,
    LLMD_RESULT_CHANNEL,
    PROCESSOR_GROUP,
    REQUEST_FIELD,
    REQUEST_STREAM_PREFIX,
    RESULT_FIELD,
    InvalidMessage,
    RequestMessage,
    ResultMessage,
    cancel_marker_key,
    dead_letter_stream,
    decode_request,
    decode_result,
    encode_request,
    encode_result,
    invalid_request_result,
    parse_result_address,
    request_active_key,
    request_cancel_key,
    request_stream,
    result_channel_address,
)

log = logging.getLogger(__name__)

CLAIM_PREFIX = "backfill:claim:"

# One call per batch (a script runs atomically and answers once, where a pipeline answers per command).
# A running claim holds the claiming backend's token (``running:{token}``), so a processor can tell
# its own claim from one another processor took after its lease lapsed.
# KEYS: claim key, batch cancel key (or ""), llm-d-async request cancel key (or "") per request;
# ARGV[1]: lease ms, ARGV[2]: claim value, ARGV[2 + j]: request j's token
# -> per request 0 new, 1 running, 2 done, 3 cancelled
_ADMIT = """
local out = {}
for i = 1, #KEYS, 3 do
  local state = redis.call('GET', KEYS[i])
  if state == 'done' then out[#out + 1] = 2
  elseif KEYS[i + 1] ~= '' and redis.call('EXISTS', KEYS[i + 1]) == 1 then out[#out + 1] = 3
  elseif KEYS[i + 2] ~= '' and redis.call('GET', KEYS[i + 2]) == ARGV[2 + (i + 2) / 3] then out[#out + 1] = 3
  elseif state then out[#out + 1] = 1
  else
    redis.call('SET', KEYS[i], ARGV[2], 'PX', ARGV[1])
    out[#out + 1] = 0
  end
end
return out
"""
# KEYS: claim keys; ARGV[1]: lease ms, ARGV[2]: our claim value -> per key 1 still ours (renewed; a
# lapsed claim nobody took is taken again), 0 lost (done, or another processor's claim)
_EXTEND = """
local out = {}
for i = 1, #KEYS do
  local state = redis.call('GET', KEYS[i])
  if state == ARGV[2] then redis.call('PEXPIRE', KEYS[i], ARGV[1]); out[i] = 1
  elseif not state then redis.call('SET', KEYS[i], ARGV[2], 'PX', ARGV[1]); out[i] = 1
  else out[i] = 0 end
end
return out
"""
# KEYS: claim keys; ARGV[1]: our claim value -> delete our running claims
_RELEASE = """
for i = 1, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[1] then redis.call('DEL', KEYS[i]) end
end
return 0
"""
# KEYS per result i: destination, claim key (or ""), llm-d-async active key, cancel key (or "" twice);
# ARGV[1]: done TTL s, ARGV[2]: our claim value, ARGV[3]: the prefix of private result streams, then
# per result: its JSON, its kind ('s' XADD to a stream, 'l' LPUSH to a list, 'c' PUBLISH on a channel)
# and its request token -> per result 1 published (id marked done; the request's active and cancel
# keys deleted where they still hold its token, as llm-d-async's cleanup does), 0 refused: the id is
# done already or claimed by another processor (a result is published once per id). All or (on a
# failed write) a prefix; never an id done without its result. A private result stream (one waiting
# client's) expires after the done TTL: a client that gave up waiting has deleted it already, and
# the XADD would otherwise leave it behind for ever.
_PUBLISH = """
local out = {}
local private = ARGV[3]
for i = 1, #KEYS / 4 do
  local dest, claim, active, cancel = KEYS[4 * i - 3], KEYS[4 * i - 2], KEYS[4 * i - 1], KEYS[4 * i]
  local body, kind, token = ARGV[3 * i + 1], ARGV[3 * i + 2], ARGV[3 * i + 3]
  local state = false
  if claim ~= '' then state = redis.call('GET', claim) end
  if state and state ~= ARGV[2] then out[i] = 0
  else
    if kind == 'l' then redis.call('LPUSH', dest, body)
    elseif kind == 'c' then redis.call('PUBLISH', dest, body)
    else
      redis.call('XADD', dest, '*', '""" + RESULT_FIELD + """', body)
      if string.sub(dest, 1, #private) == private then redis.call('EXPIRE', dest, ARGV[1]) end
    end
    if claim ~= '' then redis.call('SET', claim, 'done', 'EX', ARGV[1]) end
    if token ~= '' then
      if redis.call('GET', active) == token then redis.call('DEL', active) end
      if redis.call('GET', cancel) == token then redis.call('DEL', cancel) end
    end
    out[i] = 1
  end
end
return out
"""
# KEYS[1]: the lane's stream, KEYS[2..]: llm-d-async request sorted sets; ARGV[1]: most members to
# move, ARGV[2]: the request field -> members moved. Each step pops the member of lowest score
# (earliest deadline) over all the sets and XADDs it, in one script: a member leaves its set only
# into the stream, where leases keep it (at-least-once from there on).
_MOVE = """
local moved = 0
for n = 1, tonumber(ARGV[1]) do
  local best, low = nil, nil
  for i = 2, #KEYS do
    local head = redis.call('ZRANGE', KEYS[i], 0, 0, 'WITHSCORES')
    if head[1] and (not low or tonumber(head[2]) < low) then best, low = KEYS[i], tonumber(head[2]) end
  end
  if not best then break end
  local popped = redis.call('ZPOPMIN', best)
  redis.call('XADD', KEYS[1], '*', ARGV[2], popped[1])
  moved = moved + 1
end
return moved
"""
# KEYS[1]: the lane's stream, KEYS[2..]: llm-d-async retry sorted sets; ARGV[1]: most members to
# move, ARGV[2]: the request field, ARGV[3]: now (Unix s) -> members moved. Members scored at or
# before now leave their set only into the stream (llm-d-async's retry mover: ZRANGE BYSCORE, ZREM).
_MOVE_DUE = """
local moved = 0
for i = 2, #KEYS do
  local left = tonumber(ARGV[1]) - moved
  if left <= 0 then break end
  local due = redis.call('ZRANGEBYSCORE', KEYS[i], '-inf', ARGV[3], 'LIMIT', 0, left)
  for _, member in ipairs(due) do
    redis.call('ZREM', KEYS[i], member)
    redis.call('XADD', KEYS[1], '*', ARGV[2], member)
    moved = moved + 1
  end
end
return moved
"""
_KIND_CODES = {"stream": "s", "list": "l", "channel": "c"}


def private_result_stream(result_stream: str, request_id: str) -> str:
    """The private result stream of one waiting client (``backfill enqueue --wait``):
    ``{result_stream}:enqueue:{request_id}``. Published results make it expire after the done TTL."""
    return f"{result_stream}:enqueue:{request_id}"


_ADMISSIONS = [Admission.NEW, Admission.RUNNING, Admission.DONE, Admission.CANCELLED]

# ---------------------------------------------------------------- the layout, shared with the sync side

Fields = Mapping[bytes, bytes]
"""An entry's fields as redis-py returns them (bytes responses)."""
GROUP_START_ID = "0"
"""A consumer group is created at the start of its stream (every entry already there is new to it)."""
CANCEL_MARKER_VALUE = b"1"


def request_fields(body: bytes) -> dict[FieldT, EncodableT]:
    """The fields of a request entry: :data:`~common.contracts.queue.REQUEST_FIELD` = the JSON."""
    return {REQUEST_FIELD: body}


def request_body(fields: Fields | None) -> bytes:
    """The request JSON of an entry (``b""`` when it has none)."""
    return (fields or {}).get(REQUEST_FIELD.encode(), b"")


def result_of(fields: Fields | None) -> ResultMessage | None:
    """The result of a result entry; None when it has no result field (trimmed) or is not a result."""
    raw = (fields or {}).get(RESULT_FIELD.encode())
    if raw is None:
        return None
    try:
        return decode_result(raw)
    except InvalidMessage:
        return None


def group_exists(exc: ResponseError) -> bool:
    """``XGROUP CREATE`` refused because the group is there already (``BUSYGROUP``)."""
    return "BUSYGROUP" in str(exc)


def group_missing(exc: ResponseError) -> bool:
    """A group command refused because the group (or its stream) is gone (``NOGROUP``)."""
    return "NOGROUP" in str(exc)


def autoclaim_reply(reply: Any) -> tuple[str, list[tuple[bytes, Fields | None]], list[bytes]]:
    """``XAUTOCLAIM``'s reply as ``(next cursor, entries, deleted ids)``: entries keep their id and
    fields (None fields: Redis 6.2's nil entry, data trimmed); Redis 7 lists the ids it dropped from
    the pending list because their data was trimmed, Redis 6.2 has no third part."""
    cursor = reply[0]
    entries = [(entry_id, fields) for entry_id, fields in reply[1] if entry_id is not None]
    deleted = list(reply[2]) if len(reply) > 2 else []
    return cursor.decode() if isinstance(cursor, bytes) else str(cursor), entries, deleted


def stream_entries(reply: Any) -> list[tuple[bytes, Fields | None]]:
    """The entries of an ``XREADGROUP``/``XREAD`` reply over any number of streams, in order."""
    return [entry for _stream, entries in reply or [] for entry in entries]


def default_consumer_name() -> str:
    """``{host}-{pid}-{4 random hex bytes}``: unique per process start."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


class RedisStreamsBackend:
    """See the module docstring. ``client``: a ``redis.asyncio.Redis`` (bytes responses) owned by
    this backend and closed by :meth:`close`. Durations in seconds."""

    name = "redis"

    def __init__(self, client: aioredis.Redis, *, pool: str = DEFAULT_POOL, lanes: Sequence[str] = (),
                 group: str = PROCESSOR_GROUP, consumer: str = "", stream_prefix: str = REQUEST_STREAM_PREFIX,
                 result_stream: str = DEFAULT_RESULT_STREAM, delete_acked: bool = True,
                 done_ttl_s: float = 86400.0, llmd_sorted_sets: Sequence[str] = (),
                 llmd_channels: Sequence[str] = (), llmd_lane: str = "async",
                 llmd_result_channel: str = LLMD_RESULT_CHANNEL, llmd_retry_sorted_sets: Sequence[str] = ()):
        self.client = client
        self.pool = pool
        self.lanes = list(lanes)
        self.group = group
        self.consumer = consumer or default_consumer_name()
        self.stream_prefix = stream_prefix
        self.result_stream = result_stream
        self.delete_acked = delete_acked
        self.done_ttl_s = done_ttl_s
        self._cursor: dict[str, str] = {}
        self._claimed_at: dict[str, float] = {}
        self._ready: set[str] = set()
        self._lease_s = 30.0
        self.claim_value = "running:" + secrets.token_hex(8)
        self._admit = client.register_script(_ADMIT)
        self._extend = client.register_script(_EXTEND)
        self._release = client.register_script(_RELEASE)
        self._publish = client.register_script(_PUBLISH)
        self._move = client.register_script(_MOVE)
        self._move_due = client.register_script(_MOVE_DUE)
        self.llmd_sorted_sets = list(llmd_sorted_sets)
        self.llmd_retry_sorted_sets = list(llmd_retry_sorted_sets)
        self.llmd_channels = list(llmd_channels)
        self.llmd_lane = llmd_lane
        self.llmd_result_channel = llmd_result_channel
        self._subscriber: asyncio.Task | None = None

    @classmethod
    def from_settings(cls, settings) -> RedisStreamsBackend:
        """From :class:`~async_processor.settings.ProcessorSettings`."""
        return cls(aioredis.Redis.from_url(settings.redis_url), pool=settings.pool, lanes=settings.lanes,
                   group=settings.consumer_group, consumer=settings.consumer_name,
                   stream_prefix=settings.stream_prefix, result_stream=settings.result_stream,
                   delete_acked=settings.delete_acked, done_ttl_s=settings.dedup_ttl_s,
                   llmd_sorted_sets=settings.llmd_sorted_sets, llmd_channels=settings.llmd_channels,
                   llmd_lane=settings.llmd_lane, llmd_result_channel=settings.llmd_result_channel,
                   llmd_retry_sorted_sets=settings.llmd_retry_sorted_sets)

    def stream(self, lane: str) -> str:
        """The stream of ``lane`` in this pool."""
        return request_stream(lane, self.pool, self.stream_prefix)

    async def _ensure(self, lane: str) -> None:
        if lane in self._ready:
            return
        try:
            await self.client.xgroup_create(self.stream(lane), self.group, id=GROUP_START_ID, mkstream=True)
        except ResponseError as exc:
            if not group_exists(exc):
                raise BackendError(f"cannot create group on {self.stream(lane)}: {exc}") from exc
        self._ready.add(lane)

    async def _regroup(self, lane: str, exc: ResponseError) -> None:
        """The group of ``lane`` is gone (Redis restarted empty, or the stream was deleted): forget
        that the lane was ready and create stream and group again."""
        log.warning("consumer group missing; creating it again",
                    extra={"action": "group_recreated", "lane": lane, "group": self.group, "error": str(exc)})
        self._ready.discard(lane)
        self._cursor.pop(lane, None)
        self._claimed_at.pop(lane, None)
        await self._ensure(lane)

    async def start(self) -> None:
        """Create the streams and the consumer group of every configured lane; subscribe to the
        llm-d-async redis-pubsub channels (``llmd_channels``), if any."""
        try:
            for lane in self.lanes:
                await self._ensure(lane)
        except RedisError as exc:
            raise BackendError(f"redis: {exc}") from exc
        if self.llmd_channels and self._subscriber is None:
            self._subscriber = asyncio.create_task(self._subscribe(), name="llmd-redis-pubsub")

    async def close(self) -> None:
        """Stop the subscriber, close the client (pending entries stay for other consumers)."""
        if self._subscriber is not None:
            self._subscriber.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._subscriber
            self._subscriber = None
        await self.client.aclose()

    async def _subscribe(self) -> None:
        """llm-d-async's redis-pubsub transport: each message ``PUBLISH``-ed on ``llmd_channels``
        goes onto the ``llmd_lane`` stream, answered by ``PUBLISH`` on ``llmd_result_channel``.
        Redis Pub/Sub keeps nothing: a message published while no processor listens is lost, as
        with llm-d-async; every subscribed processor gets each message, and the id claims let one
        run it. Reconnects after a failure, backing off up to 5 s."""
        backoff = 0.1
        while True:
            try:
                async with self.client.pubsub(ignore_subscribe_messages=True) as pubsub:
                    await pubsub.subscribe(*self.llmd_channels)
                    backoff = 0.1
                    while True:
                        message = await pubsub.get_message(timeout=1.0)
                        if message and message.get("type") == "message":
                            await self.take_published(message["data"])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis down, or a message that could not be put on the lane
                log.warning("redis-pubsub subscription failed; subscribing again",
                            extra={"action": "llmd_subscribe_failed", "error": str(exc)})
                await asyncio.sleep(backoff)
                backoff = min(5.0, backoff * 2)

    async def take_published(self, data: bytes) -> None:
        """One message of the redis-pubsub transport: onto the ``llmd_lane`` stream with its result
        address set to the result channel; an invalid one is answered there at once."""
        channel = result_channel_address(self.llmd_result_channel)
        try:
            request = decode_request(data)
        except InvalidMessage as exc:
            await self.client.publish(parse_result_address(channel).name,
                                      encode_result(invalid_request_result(exc)))
            return
        await self.client.xadd(self.stream(self.llmd_lane),
                               request_fields(encode_request(msgspec.structs.replace(
                                   request, result_queue_name=channel))))

    async def receive(self, lane: str, max_messages: int, lease_s: float) -> list[Delivery]:
        """Lapsed entries (``XAUTOCLAIM``) then new ones (``XREADGROUP >``), up to ``max_messages``.
        A group found missing (``NOGROUP``: Redis restarted empty) is created again and the receive
        tried once more."""
        self._lease_s = lease_s
        try:
            try:
                return await self._receive(lane, max_messages, lease_s)
            except ResponseError as exc:
                if not group_missing(exc):
                    raise
                await self._regroup(lane, exc)
                return await self._receive(lane, max_messages, lease_s)
        except RedisError as exc:
            raise BackendError(f"redis receive on {lane}: {exc}") from exc

    async def _receive(self, lane: str, max_messages: int, lease_s: float) -> list[Delivery]:
        await self._ensure(lane)
        if lane == self.llmd_lane and self.llmd_retry_sorted_sets:
            await self._move_due(keys=[self.stream(lane), *self.llmd_retry_sorted_sets],
                                 args=[max_messages, REQUEST_FIELD, int(time.time())])
        if lane == self.llmd_lane and self.llmd_sorted_sets:
            await self._move(keys=[self.stream(lane), *self.llmd_sorted_sets], args=[max_messages, REQUEST_FIELD])
        out: list[Delivery] = []
        now = time.monotonic()
        if now - self._claimed_at.get(lane, 0.0) >= min(1.0, lease_s / 4):
            self._claimed_at[lane] = now
            out = await self._reclaim(lane, max_messages, lease_s)
        if len(out) < max_messages:
            found = await self.client.xreadgroup(self.group, self.consumer, {self.stream(lane): ">"},
                                                 count=max_messages - len(out))
            for entry_id, fields in stream_entries(found):
                out.append(Delivery(lane, request_body(fields), 1, entry_id.decode(), handle=entry_id))
        return out

    async def _reclaim(self, lane: str, count: int, lease_s: float) -> list[Delivery]:
        stream = self.stream(lane)
        reply = await self.client.xautoclaim(stream, self.group, self.consumer, int(lease_s * 1000),
                                             start_id=self._cursor.get(lane, "0-0"), count=count)
        self._cursor[lane], entries, deleted = autoclaim_reply(reply)
        if deleted:  # Redis 7: already removed from the pending list
            log.warning("nil entries dropped from pending list", extra={"action": "nil_entries", "lane": lane,
                                                                         "ids": [i.decode() for i in deleted]})
        live = [(i, f) for i, f in entries if f]
        if len(live) != len(reply[1]):  # Redis 6.2 nil entries
            await self._sweep_nil_entries(lane)
        if not live:
            return []
        async with self.client.pipeline(transaction=False) as pipe:
            for entry_id, _ in live:
                pipe.xpending_range(stream, self.group, entry_id, entry_id, 1)
            pending = await pipe.execute()
        out = []
        for (entry_id, fields), info in zip(live, pending):
            count_seen = info[0]["times_delivered"] if info else 1
            out.append(Delivery(lane, request_body(fields), count_seen, entry_id.decode(), handle=entry_id))
        return out

    async def _sweep_nil_entries(self, lane: str) -> None:
        """Ack our pending entries whose data was trimmed (Redis 6.2 shows them without fields)."""
        stream = self.stream(lane)
        found = await self.client.xreadgroup(self.group, self.consumer, {stream: "0"}, count=10_000)
        gone = [entry_id for entry_id, fields in stream_entries(found) if not fields]
        if gone:
            await self.client.xack(stream, self.group, *gone)
            log.warning("nil entries dropped from pending list",
                        extra={"action": "nil_entries", "lane": lane, "ids": [i.decode() for i in gone]})

    def _by_stream(self, deliveries: Sequence[Delivery]) -> dict[str, list]:
        grouped: dict[str, list] = {}
        for d in deliveries:
            grouped.setdefault(self.stream(d.lane), []).append(d.handle)
        return grouped

    async def ack(self, deliveries: Sequence[Delivery]) -> None:
        """``XACK`` (then ``XDEL`` when ``delete_acked``)."""
        if not deliveries:
            return
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for stream, ids in self._by_stream(deliveries).items():
                    pipe.xack(stream, self.group, *ids)
                    if self.delete_acked:
                        pipe.xdel(stream, *ids)
                await pipe.execute()
        except RedisError as exc:
            raise BackendError(f"redis ack: {exc}") from exc

    async def _set_idle(self, deliveries: Sequence[Delivery], idle_ms: int) -> None:
        """Set the entries' idle time to ``idle_ms`` (>= 0; Redis clamps delivery times to now) with
        ``XCLAIM … IDLE … JUSTID`` (no delivery counted)."""
        async with self.client.pipeline(transaction=False) as pipe:
            for stream, ids in self._by_stream(deliveries).items():
                pipe.xclaim(stream, self.group, self.consumer, 0, ids, idle=max(0, idle_ms), justid=True)
            await pipe.execute()

    async def nack(self, deliveries: Sequence[Delivery], delay_s: float = 0.0) -> None:
        """Make the entries look idle for ``lease - delay_s`` (lease: the one of the last
        :meth:`receive`) so ``XAUTOCLAIM`` takes them after ``delay_s``."""
        if not deliveries:
            return
        try:
            await self._set_idle(deliveries, int((self._lease_s - delay_s) * 1000))
            for lane in {d.lane for d in deliveries}:
                self._claimed_at[lane] = 0.0
                self._cursor[lane] = "0-0"
        except RedisError as exc:
            raise BackendError(f"redis nack: {exc}") from exc

    async def extend(self, deliveries: Sequence[Delivery], lease_s: float) -> list[Delivery]:
        """Renew the claims that are still ours (one script call), then reset those entries' idle
        time to 0 (``XCLAIM … IDLE 0 … JUSTID``); returns the deliveries whose claim is lost: the id
        is done, or another processor claimed it after our lease lapsed (its entry is left alone).

        On Redis a lease is the consumer group's ``XAUTOCLAIM`` idle threshold, the same ``lease_s``
        for every processor: extension renews that lease from now; a longer ``lease_s`` than the
        receivers' is not expressible (Redis clamps delivery times to the present)."""
        if not deliveries:
            return []
        try:
            claimed = [d for d in deliveries if d.request_id]
            lost: list[Delivery] = []
            if claimed:
                kept = await self._extend(keys=[CLAIM_PREFIX + d.request_id for d in claimed],
                                          args=[max(1, int(lease_s * 1000)), self.claim_value])
                lost = [d for d, ok in zip(claimed, kept) if not int(ok)]
            keep = [d for d in deliveries if d not in lost] if lost else list(deliveries)
            if keep:
                await self._set_idle(keep, 0)
            return lost
        except RedisError as exc:
            raise BackendError(f"redis extend: {exc}") from exc

    async def dead_letter(self, deliveries: Sequence[Delivery], reason: str) -> None:
        """``XADD {stream}:dead`` then ack."""
        if not deliveries:
            return
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for d in deliveries:
                    pipe.xadd(dead_letter_stream(self.stream(d.lane)),
                              {**request_fields(d.body), "reason": reason, "source_id": d.transport_id,
                               "deliveries": d.delivery_count})
                await pipe.execute()
        except RedisError as exc:
            raise BackendError(f"redis dead letter: {exc}") from exc
        await self.ack(deliveries)

    async def publish_results(self, results: Sequence[tuple[ResultMessage, str]]) -> list[bool]:
        """Write each result where its result address says (``XADD`` to a stream, llm-d-async's
        ``LPUSH`` to a list or ``PUBLISH`` on a channel: :func:`~common.contracts.queue.parse_result_address`)
        and mark its id done (``SET backfill:claim:{id} done EX
        dedup_ttl_s``), in one script call: atomic, so a crash leaves both or neither. A result whose
        id is done already or claimed by another processor is refused (False in the answer): one
        result per id across every processor of the pool."""
        if not results:
            return []
        keys: list[str] = []
        args: list[bytes | int | str] = [max(1, int(self.done_ttl_s)), self.claim_value,
                                         private_result_stream(self.result_stream, "")]
        for result, queue in results:
            address = parse_result_address(queue)
            token = address.token if result.id else ""
            keys += (address.name or self.result_stream, CLAIM_PREFIX + result.id if result.id else "",
                     request_active_key(result.id) if token else "", request_cancel_key(result.id) if token else "")
            args += (encode_result(result), _KIND_CODES[address.kind], token)
        try:
            published = await self._publish(keys=keys, args=args)
        except RedisError as exc:
            raise BackendError(f"redis publish: {exc}") from exc
        return [bool(int(flag)) for flag in published]

    async def publish_request(self, lane: str, message: RequestMessage | bytes) -> str:
        """``XADD`` to the lane's stream; returns the entry id."""
        body = message if isinstance(message, bytes) else encode_request(message)
        try:
            entry_id = await self.client.xadd(self.stream(lane), request_fields(body))
        except RedisError as exc:
            raise BackendError(f"redis publish request: {exc}") from exc
        return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)

    async def admit(self, requests: Sequence[RequestMessage], lease_s: float) -> list[Admission]:
        """One script call for the batch (per id: done, cancel and claim checks). A request carrying
        llm-d-async's ``request_token`` is cancelled while ``request-cancel:{id}`` holds that token."""
        if not requests:
            return []
        keys: list[str] = []
        for r in requests:
            batch_id = r.metadata.get("batch_id", "")
            keys += (CLAIM_PREFIX + r.id, cancel_marker_key(batch_id) if batch_id else "",
                     request_cancel_key(r.id) if r.request_token else "")
        try:
            replies = await self._admit(keys=keys, args=[max(1, int(lease_s * 1000)), self.claim_value,
                                                         *(r.request_token for r in requests)])
        except RedisError as exc:
            raise BackendError(f"redis admit: {exc}") from exc
        return [_ADMISSIONS[int(r)] for r in replies]

    async def cancelled_batches(self, batch_ids: Sequence[str]) -> set[str]:
        """See :meth:`QueueBackend.cancelled_batches` (one pipelined ``EXISTS`` per batch id)."""
        ids = list(batch_ids)
        if not ids:
            return set()
        async with self.client.pipeline(transaction=False) as pipe:
            for batch_id in ids:
                pipe.exists(cancel_marker_key(batch_id))
            flags = await pipe.execute()
        return {batch_id for batch_id, flag in zip(ids, flags) if flag}

    async def cancelled_requests(self, requests: Sequence[RequestMessage]) -> set[str]:
        """See :meth:`QueueBackend.cancelled_requests` (one pipelined ``GET request-cancel:{id}`` per
        request with a token)."""
        tokened = [r for r in requests if r.request_token]
        if not tokened:
            return set()
        async with self.client.pipeline(transaction=False) as pipe:
            for r in tokened:
                pipe.get(request_cancel_key(r.id))
            markers = await pipe.execute()
        return {r.id for r, marker in zip(tokened, markers) if marker is not None and marker.decode() == r.request_token}

    async def release(self, ids: Sequence[str]) -> None:
        """Delete our running claims (another processor's claim or a done mark stays)."""
        if not ids:
            return
        try:
            await self._release(keys=[CLAIM_PREFIX + id for id in ids], args=[self.claim_value])
        except RedisError as exc:
            raise BackendError(f"redis release: {exc}") from exc

    def result_reader(self, queue_name: str = "") -> RedisResultReader:
        """Reads the result stream from its start (``XREAD``)."""
        return RedisResultReader(self.client, queue_name or self.result_stream)


class RedisResultReader:
    """``XREAD``s one result stream from ``start_id`` ("0-0" = the beginning)."""

    def __init__(self, client: aioredis.Redis, stream: str, start_id: str = "0-0"):
        self.client, self.stream, self.last_id = client, stream, start_id

    async def read(self, timeout_s: float) -> list[ResultMessage]:
        """Results after the last one read; blocks up to ``timeout_s`` for the first."""
        found = await self.client.xread({self.stream: self.last_id}, count=1000,
                                        block=max(1, int(timeout_s * 1000)))
        out = []
        for entry_id, fields in stream_entries(found):
            self.last_id = entry_id.decode()
            out.append(decode_result((fields or {})[RESULT_FIELD.encode()]))
        return out

    async def close(self) -> None:
        """The client belongs to the backend."""
