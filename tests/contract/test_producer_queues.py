"""The queue port's producer side (:class:`~async_processor.backends.base.LaneProducer`,
:class:`~async_processor.backends.base.ResultQueue`) on memory and Redis Streams, against the
processor's side of the same backend: what a producer publishes is received, its cancel marker is
seen by ``admit``, lane depths count held and dead messages, Redis says where a published message
is now (waiting, held, answered, gone), a result queue hands each entry to one consumer of a group
until acked and a pending entry to another consumer once idle; on Redis, a result queue made with
``delete_acked`` deletes exactly what it acknowledged."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import pytest

from async_processor.backends.base import Admission, LaneProducer, QueueBackend, ResultQueue
from common.contracts.queue import ErrorCode, RequestMessage, decode_request, error_result

LANES = ["interactive", "batch"]


@dataclass
class Side:
    backend: QueueBackend
    lanes: LaneProducer
    results: Callable[[str, str, float], ResultQueue]  # (group, consumer, reclaim idle s)
    queue: str


def _request(batch_id: str = "") -> RequestMessage:
    return RequestMessage(id=f"req-{secrets.token_hex(6)}", deadline=int(time.time() + 300), payload={"model": "m"},
                          metadata={"batch_id": batch_id} if batch_id else {})


@pytest.fixture(params=["memory", "redis"])
def side(request) -> Callable[[Callable[[Side], Awaitable[None]]], None]:
    """Runs a test body against one backend's processor and producer sides."""
    def run(body: Callable[[Side], Awaitable[None]]) -> None:
        async def main() -> None:
            if request.param == "memory":
                from async_processor.backends.memory import MemoryBackend

                memory = MemoryBackend()
                await body(Side(memory, memory.lane_producer(),
                                lambda group, consumer, idle: memory.result_queue("results", group=group,
                                                                                  consumer=consumer,
                                                                                  reclaim_idle_s=idle),
                                "results"))
                return
            import redis
            import redis.asyncio as aioredis

            from async_processor.backends.redis_producer import RedisLaneProducer, RedisResultQueue
            from async_processor.backends.redis_streams import RedisStreamsBackend

            url, ns = request.getfixturevalue("stores").redis_url, f"t{secrets.token_hex(4)}"
            backend = RedisStreamsBackend(aioredis.Redis.from_url(url), lanes=LANES, group=f"{ns}-group",
                                          stream_prefix=f"{ns}:requests", result_stream=f"{ns}:results")
            await backend.start()
            client = redis.Redis.from_url(url)
            try:
                await body(Side(backend, RedisLaneProducer(client, stream_prefix=f"{ns}:requests"),
                                lambda group, consumer, idle: RedisResultQueue(client, f"{ns}:results", group=group,
                                                                               consumer=consumer,
                                                                               reclaim_idle_s=idle),
                                f"{ns}:results"))
            finally:
                client.close()
                await backend.close()
        asyncio.run(main())
    return run


def test_published_requests_reach_the_processor_side_and_lane_depths_count_them(side):
    async def body(s: Side) -> None:
        sent = [_request(), _request()]
        s.lanes.publish("batch", sent)
        group = getattr(s.backend, "group", "")
        before = {d.lane: d for d in s.lanes.lane_depths(LANES, group)}
        assert (before["batch"].length, before["batch"].pending, before["interactive"].length) == (2, 0, 0)
        got = await s.backend.receive("batch", 1, 30.0)
        assert [decode_request(d.body).id for d in got] == [sent[0].id]
        await s.backend.dead_letter(got, "test")
        after = {d.lane: d for d in s.lanes.lane_depths(LANES, group)}
        assert (after["batch"].length, after["batch"].dead) == (1, 1)
        held = await s.backend.receive("batch", 1, 30.0)
        assert [d.lane for d in s.lanes.lane_depths(["batch"], group)] == ["batch"]
        assert s.lanes.lane_depths(["batch"], group)[0].pending == 1
        await s.backend.ack(held)
    side(body)


def test_a_cancel_marker_is_seen_by_admit(side):
    async def body(s: Side) -> None:
        batch_id = f"batch_{secrets.token_hex(4)}"
        s.lanes.mark_cancelled(batch_id, 60)
        assert await s.backend.cancelled_batches([batch_id, "batch_other"]) == {batch_id}
        assert await s.backend.admit([_request(batch_id)], 30.0) == [Admission.CANCELLED]
    side(body)


def test_a_result_goes_to_one_consumer_until_acked_then_to_another_once_idle(side):
    async def body(s: Side) -> None:
        results = [error_result(f"req-{i}", ErrorCode.CANCELLED, "batch cancelled") for i in range(3)]
        await s.backend.publish_results([(r, s.queue) for r in results])
        first = s.results("collectors", "a", 60.0)
        entries = first.read(2)
        assert [r.id for _, r in entries if r] == ["req-0", "req-1"]
        first.ack([entries[0][0]])
        assert [r.id for _, r in first.read(10) if r] == ["req-2"]
        other = s.results("collectors", "b", 0.0)  # entries pending at all count as idle
        reclaimed = other.read(10)
        assert sorted(r.id for _, r in reclaimed if r) == ["req-1", "req-2"]
        other.ack([entry_id for entry_id, _ in reclaimed])
        assert other.read(10) == []
        assert [r.id for _, r in s.results("auditors", "c", 60.0).read(10) if r] == ["req-0", "req-1", "req-2"]
    side(body)


def test_redis_whereabouts_follow_a_message_from_waiting_to_answered_and_see_a_lost_one_gone(stores):
    import redis
    import redis.asyncio as aioredis

    from async_processor.backends.base import Whereabouts
    from async_processor.backends.redis_producer import RedisLaneProducer
    from async_processor.backends.redis_streams import RedisStreamsBackend

    ns = f"t{secrets.token_hex(4)}"
    client = redis.Redis.from_url(stores.redis_url)
    lanes = RedisLaneProducer(client, stream_prefix=f"{ns}:requests")
    group = f"{ns}-group"

    async def main() -> None:
        backend = RedisStreamsBackend(aioredis.Redis.from_url(stores.redis_url), lanes=["batch"], group=group,
                                      stream_prefix=f"{ns}:requests", result_stream=f"{ns}:results")
        try:
            sent = [_request(), _request(), _request()]
            entry_ids = lanes.publish_tracked("batch", sent)
            asked = [(entry_id, m.id) for entry_id, m in zip(entry_ids, sent)]
            assert lanes.whereabouts("batch", group, asked) == [Whereabouts.WAITING] * 3  # no group yet
            await backend.start()
            assert lanes.whereabouts("batch", group, asked) == [Whereabouts.WAITING] * 3
            got = await backend.receive("batch", 2, 30.0)
            assert [d.transport_id for d in got] == entry_ids[:2]  # the ids publish returned
            assert lanes.whereabouts("batch", group, asked) == [Whereabouts.HELD, Whereabouts.HELD,
                                                                Whereabouts.WAITING]
            assert await backend.admit(sent[:2], 30.0) == [Admission.NEW, Admission.NEW]
            assert lanes.whereabouts("batch", group, [("", sent[1].id)]) == [Whereabouts.HELD]  # its claim alone
            await backend.publish_results([(error_result(sent[0].id, ErrorCode.CANCELLED, "x"), "")])
            await backend.ack(got[:1])  # XACK + XDEL: the entry is gone, its result is out
            await backend.release([sent[1].id])  # held with no claim: a dead processor's entry, taken over later
            assert lanes.whereabouts("batch", group, asked) == [Whereabouts.ANSWERED, Whereabouts.HELD,
                                                                Whereabouts.WAITING]
            client.xdel(lanes.stream("batch"), entry_ids[2])  # deleted before anyone read it: lost
            assert lanes.whereabouts("batch", group, asked)[2] is Whereabouts.GONE
            assert lanes.whereabouts("batch", group, [("", sent[0].id), ("", "never-published")]) == \
                [Whereabouts.ANSWERED, Whereabouts.GONE]  # an entry never recorded: its claim alone
            client.delete(lanes.stream("batch"), f"backfill:claim:{sent[0].id}")  # Redis emptied
            assert lanes.whereabouts("batch", group, asked) == [Whereabouts.GONE] * 3
            assert lanes.whereabouts("batch", group, []) == []
        finally:
            await backend.close()

    try:
        asyncio.run(main())
    finally:
        client.close()


def test_a_redis_result_queue_that_deletes_acked_entries_keeps_only_unacked_ones(stores):
    import redis

    from async_processor.backends.redis_producer import RedisResultQueue

    client, stream = redis.Redis.from_url(stores.redis_url), f"t{secrets.token_hex(4)}:results"
    try:
        ids = [client.xadd(stream, {"result": b"{}"}) for _ in range(3)]
        first = RedisResultQueue(client, stream, group="collectors", consumer="a", delete_acked=True)
        assert [entry_id for entry_id, _ in first.read(2)] == ids[:2]
        first.ack(ids[:1])
        assert client.xlen(stream) == 2  # the unacknowledged read one and the unread one stay
        first.ack(ids[1:2])
        assert [entry_id for entry_id, _ in client.xrange(stream)] == ids[2:]
        assert client.xpending(stream, "collectors")["pending"] == 0
    finally:
        client.delete(stream)
        client.close()
