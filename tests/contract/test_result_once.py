"""Backend contract of one result per id (RELIABILITY.md F20) and of a Redis that lost its streams
(F19), on every backend of the ``kit`` fixture.

A consumer whose lease lapsed and whose message another consumer took and answered learns it from
:meth:`extend` (the delivery is reported lost, its lease not renewed); where claims are shared
(memory, Redis) its late result is refused too. On Redis, a stream and group deleted under a
consumer (Redis restarted empty) are created again by the next receive.
"""

from __future__ import annotations

from async_processor.backends.base import Admission
from async_processor.testing import eventually
from common.contracts.queue import decode_request, http_result
from tests.contract.test_queue_backends import receive_soon, request


def test_a_lapsed_consumer_learns_its_work_was_taken_over(kit):
    async def body(kit):
        stale, fresh = await kit.make(), await kit.make()
        message = request()
        await stale.publish_request("batch", message)
        [first] = await receive_soon(stale, "batch", kit)
        first.request_id = message.id
        assert await stale.admit([decode_request(first.body)], kit.lease_s) == [Admission.NEW]

        async def taken() -> list:  # the lease lapses; the other consumer gets it and claims it
            got = await fresh.receive("batch", 10, kit.lease_s)
            if got and await fresh.admit([decode_request(got[0].body)], kit.lease_s) != [Admission.NEW]:
                await fresh.nack(got)
                return []
            return got
        [second] = await eventually(taken, 15)
        assert second.delivery_count > first.delivery_count
        second.request_id = message.id
        result = http_result(message, 200, b'{"by": "fresh"}')
        assert await fresh.publish_results([(result, "")]) == [True]
        await fresh.ack([second])

        assert await stale.extend([first], kit.lease_s) == [first]  # lost: not renewed
        late = await stale.publish_results([(http_result(message, 200, b'{"by": "stale"}'), "")])
        if kit.kind in ("memory", "redis"):  # shared claims: the late result is refused
            assert late == [False]
        assert await fresh.receive("batch", 10, kit.lease_s) == []
    kit.run(body)


def test_a_renewed_claim_stays_ours(kit):
    async def body(kit):
        backend = await kit.make()
        message = request()
        await backend.publish_request("batch", message)
        got = await receive_soon(backend, "batch", kit)
        got[0].request_id = message.id
        assert await backend.admit([message], kit.lease_s) == [Admission.NEW]
        assert await backend.extend(got, kit.lease_s) == []
        assert await backend.publish_results([(http_result(message, 200, b"{}"), "")]) == [True]
        # a second result for the same id is refused (one result per id)
        assert await backend.publish_results([(http_result(message, 200, b"{}"), "")]) == [False]
    kit.run(body)


def test_redis_receive_makes_a_lost_group_again(redis_kit):
    async def body(kit):
        backend = await kit.make()
        assert await backend.receive("batch", 10, kit.lease_s) == []
        await backend.client.delete(backend.stream("batch"))  # what a restart without data leaves
        assert await backend.receive("batch", 10, kit.lease_s) == []  # NOGROUP: made again
        message = request()
        await backend.publish_request("batch", message)
        got = await receive_soon(backend, "batch", kit)
        assert decode_request(got[0].body).id == message.id
    redis_kit.run(body)


def test_redis_private_result_stream_expires_but_a_shared_one_does_not(redis_kit):
    """A waiting client's private stream (``backfill enqueue --wait``) that gave up and deleted it
    before the result came is made again by the result's XADD: it must expire, not stay for ever."""
    from async_processor.backends.redis_streams import private_result_stream

    async def body(kit):
        backend = await kit.make()
        backend.done_ttl_s = 120
        late, shared = request(), request()
        private = private_result_stream(backend.result_stream, late.id)
        named = f"{backend.result_stream}:service-a"  # a producer's own result queue
        assert await backend.publish_results([(http_result(late, 200, b"{}"), private),
                                              (http_result(shared, 200, b"{}"), named)]) == [True, True]
        assert 0 < await backend.client.ttl(private) <= 120
        assert await backend.client.ttl(named) == -1  # no expiry
        assert await backend.client.ttl(backend.result_stream) == -2  # untouched: absent
        assert await backend.client.xlen(private) == 1
    redis_kit.run(body)
