"""llm-d-async's producers against the Redis backend, on real Redis: each test replays the exact
Redis commands of llm-d/llm-d-async @5de949b (``producer/redis_sortedset_producer.go``:
``SubmitRequest``, ``CancelRequests``, ``GetResult``; its redis-pubsub transport's ``PUBLISH`` and
result ``SUBSCRIBE``) and reads results the way its consumer does (``BRPOP`` on the result list,
a result without ``id`` being an error there)."""

from __future__ import annotations

import asyncio
import secrets
import time

import orjson
import pytest
import redis as sync_redis
import redis.asyncio as aioredis

from async_processor.backends.base import Admission
from async_processor.backends.redis_streams import RedisStreamsBackend
from common.contracts.queue import (
    LLMD_REQUEST_CHANNEL,
    LLMD_REQUEST_SORTED_SET,
    LLMD_RETRY_SORTED_SET,
    ErrorCode,
    InvalidMessage,
    decode_request,
    error_result,
    http_result,
    invalid_request_result,
    request_active_key,
    request_cancel_key,
    with_tenant,
)

LANES = ["interactive", "async", "batch"]
CANCELLATION_MARKER_TTL_S = 7 * 24 * 3600  # the producer's cancellationMarkerTTL
# The producer's markRequestCancelledScript, verbatim in effect: copy the active token to the cancel key.
MARK_CANCELLED = """
local active = redis.call("GET", KEYS[1])
if not active then
  return 0
end
redis.call("SET", KEYS[2], active, "EX", ARGV[1])
return 1
"""


def envelope(id: str, deadline: int, token: str, result_list: str, kind: str = "redis",
             queue: str = LLMD_REQUEST_SORTED_SET, **data) -> bytes:
    """What ``json.Marshal(InternalRequest)`` writes for a ``RedisRequest`` (``api/internal_api.go``)."""
    body = {"id": id, "created": int(time.time()), "deadline": deadline,
            "payload": {"model": "m", "prompt": "hi"}, "metadata": {"userid": "u-7"}, **data}
    return orjson.dumps({"internal": {"request_token": token, "request_queue_name": queue,
                                      "result_queue_name": result_list},
                         "request_kind": kind, "data": body})


def submit(client: sync_redis.Redis, id: str, result_list: str, deadline_in: int = 300,
           sorted_set: str = LLMD_REQUEST_SORTED_SET, token: str = "") -> tuple[str, int]:
    """``SubmitRequest``: ``MULTI; DEL request-cancel:{id}; SET request-active:{id} <token> EX …;
    ZADD <set> <deadline> <json>; EXEC``. Returns (token, deadline)."""
    token = token or secrets.token_hex(16)
    deadline = int(time.time()) + deadline_in
    with client.pipeline(transaction=True) as pipe:
        pipe.delete(f"request-cancel:{id}")
        pipe.set(f"request-active:{id}", token, ex=deadline_in)
        pipe.zadd(sorted_set, {envelope(id, deadline, token, result_list, queue=sorted_set): deadline})
        pipe.execute()
    return token, deadline


def get_result(client: sync_redis.Redis, result_list: str) -> dict:
    """``GetResult``: ``BRPOP`` the result list; a result without ``id`` is an error there."""
    reply = client.brpop([result_list], timeout=5)
    assert reply is not None, f"no result on {result_list}"
    result = orjson.loads(reply[1])
    assert result["id"], "result missing 'id' field"
    return result


@pytest.fixture
def redis_url(stores) -> str:
    return stores.redis_url


@pytest.fixture
def names(redis_url):
    """A fresh namespace: (sync client, stream prefix, result list); the default sorted set emptied."""
    client = sync_redis.Redis.from_url(redis_url)
    client.delete(LLMD_REQUEST_SORTED_SET)
    ns = f"l{secrets.token_hex(4)}"
    yield client, ns, f"llm-d-async:results:{ns}"
    client.delete(LLMD_REQUEST_SORTED_SET)
    client.close()


def backend(redis_url: str, ns: str, **kwargs) -> RedisStreamsBackend:
    return RedisStreamsBackend(aioredis.Redis.from_url(redis_url), lanes=LANES, group=f"{ns}-g",
                               stream_prefix=f"{ns}:requests", result_stream=f"{ns}:results",
                               llmd_sorted_sets=kwargs.pop("sets", [LLMD_REQUEST_SORTED_SET]), **kwargs)


async def receive_all(b: RedisStreamsBackend, lane: str = "async", want: int = 1, lease_s: float = 0.4,
                      timeout_s: float = 5.0) -> list:
    out: list = []
    until = time.monotonic() + timeout_s
    while len(out) < want:
        assert time.monotonic() < until, f"{len(out)} of {want} deliveries"
        out += await b.receive(lane, want - len(out), lease_s)
    return out


def test_a_submitted_request_is_consumed_and_its_result_brpopped_from_its_list(names, redis_url):
    client, ns, result_list = names
    token, _ = submit(client, "llmd-req-1", result_list)

    async def main():
        b = backend(redis_url, ns)
        await b.start()
        try:
            [d] = await receive_all(b)
            request = decode_request(d.body)
            assert (request.id, request.request_token, request.metadata) == ("llmd-req-1", token, {"userid": "u-7"})
            assert await b.admit([request], 5.0) == [Admission.NEW]
            assert await b.publish_results([(http_result(request, 200, '{"ok":true}'),
                                             request.result_queue_name)]) == [True]
            await b.ack([d])
        finally:
            await b.close()
    asyncio.run(main())
    assert client.zcard(LLMD_REQUEST_SORTED_SET) == 0
    assert client.type(result_list) == b"list"
    result = get_result(client, result_list)
    assert (result["id"], result["status_code"], result["payload"]) == ("llmd-req-1", 200, '{"ok":true}')
    # llm-d-async's cleanup: the active and cancel keys of this generation are gone with the result
    assert not client.exists(request_active_key("llmd-req-1"), request_cancel_key("llmd-req-1"))


def test_members_come_out_earliest_deadline_first(names, redis_url):
    client, ns, result_list = names
    for id, deadline_in in (("llmd-late", 900), ("llmd-early", 60), ("llmd-middle", 300)):
        submit(client, id, result_list, deadline_in)

    async def main():
        b = backend(redis_url, ns)
        await b.start()
        try:
            return [decode_request(d.body).id for d in await receive_all(b, want=3)]
        finally:
            await b.close()
    assert asyncio.run(main()) == ["llmd-early", "llmd-middle", "llmd-late"]


def test_two_processors_never_take_the_same_member_and_a_dead_ones_member_is_redelivered(names, redis_url):
    client, ns, result_list = names
    ids = [f"llmd-m{i}" for i in range(40)]
    for id in ids:
        submit(client, id, result_list)

    async def main():
        a, b = backend(redis_url, ns), backend(redis_url, ns)
        await a.start()
        await b.start()
        got_a, got_b = await asyncio.gather(receive_all(a, want=20), receive_all(b, want=20))
        seen = [decode_request(d.body).id for d in got_a + got_b]
        assert sorted(seen) == sorted(ids) and all(d.delivery_count == 1 for d in got_a + got_b)
        await b.ack(got_b)  # b finished its own 20 (else their leases lapse too and come back with a's)
        await a.close()  # a dies holding its 20: nothing acknowledged
        again = await receive_all(b, want=20, timeout_s=10.0)
        assert sorted(decode_request(d.body).id for d in again) == sorted(decode_request(d.body).id
                                                                          for d in got_a)
        assert all(d.delivery_count == 2 for d in again)
        await b.close()
    asyncio.run(main())
    assert client.zcard(LLMD_REQUEST_SORTED_SET) == 0


def test_a_cancelled_request_is_answered_cancelled_and_a_stale_cancel_does_not_cancel(names, redis_url):
    client, ns, result_list = names
    submit(client, "llmd-gone", result_list)
    submit(client, "llmd-kept", result_list)
    mark = client.register_script(MARK_CANCELLED)  # CancelRequests(["llmd-gone"])
    assert mark(keys=[request_active_key("llmd-gone"), request_cancel_key("llmd-gone")], args=[CANCELLATION_MARKER_TTL_S]) == 1
    client.set(request_cancel_key("llmd-kept"), "an-older-generation")  # a marker of an earlier submission

    async def main():
        b = backend(redis_url, ns)
        await b.start()
        try:
            deliveries = await receive_all(b, want=2)
            requests = [decode_request(d.body) for d in deliveries]
            admissions = dict(zip([r.id for r in requests], await b.admit(requests, 5.0)))
            assert admissions == {"llmd-gone": Admission.CANCELLED, "llmd-kept": Admission.NEW}
            gone = next(r for r in requests if r.id == "llmd-gone")
            await b.publish_results([(error_result("llmd-gone", ErrorCode.CANCELLED, "cancelled"),
                                      gone.result_queue_name)])
        finally:
            await b.close()
    asyncio.run(main())
    result = get_result(client, result_list)
    assert (result["id"], result["error_code"]) == ("llmd-gone", "CANCELLED")
    assert not client.exists(request_active_key("llmd-gone"), request_cancel_key("llmd-gone"))


def test_an_invalid_envelope_is_answered_on_its_list_with_its_id(names, redis_url):
    client, ns, result_list = names
    deadline = int(time.time()) + 300
    bad = orjson.loads(envelope("llmd-bad-1", deadline, "t0", result_list))
    del bad["data"]["payload"]
    client.zadd(LLMD_REQUEST_SORTED_SET, {orjson.dumps(bad): deadline})

    async def main():
        b = backend(redis_url, ns)
        await b.start()
        try:
            [d] = await receive_all(b)
            with pytest.raises(InvalidMessage) as caught:
                decode_request(d.body)
            assert await b.publish_results([(invalid_request_result(caught.value),
                                             caught.value.result_queue_name)]) == [True]
        finally:
            await b.close()
    asyncio.run(main())
    result = get_result(client, result_list)
    assert (result["id"], result["error_code"]) == ("llmd-bad-1", "INVALID_REQUEST")


def test_an_envelope_xadded_to_a_lane_stream_is_answered_on_a_list_never_a_stream(names, redis_url):
    client, ns, result_list = names

    async def main():
        b = backend(redis_url, ns, sets=[])
        await b.start()
        try:
            await b.publish_request("batch", envelope("llmd-x-1", int(time.time()) + 60, "", result_list))
            [d] = await receive_all(b, lane="batch")
            request = decode_request(d.body)
            await b.publish_results([(http_result(request, 200, "{}"), request.result_queue_name)])
        finally:
            await b.close()
    asyncio.run(main())
    assert client.type(result_list) == b"list"
    assert get_result(client, result_list)["id"] == "llmd-x-1"


def test_redis_pubsub_transport_publish_in_and_subscribe_for_the_result(names, redis_url):
    client, ns, _ = names
    channel, results_channel = f"{ns}-{LLMD_REQUEST_CHANNEL}", f"{ns}-result-queue"
    listener = client.pubsub(ignore_subscribe_messages=True)
    listener.subscribe(results_channel)

    async def main():
        b = backend(redis_url, ns, sets=[], llmd_channels=[channel], llmd_result_channel=results_channel)
        await b.start()
        try:
            until = time.monotonic() + 5
            while client.pubsub_numsub(channel)[0][1] < 1:  # the subscriber is listening
                assert time.monotonic() < until
                await asyncio.sleep(0.01)
            client.publish(channel, envelope("llmd-ps-1", int(time.time()) + 60, "", "", kind="plain"))
            client.publish(channel, b'{"request_kind": "plain", "data": {"id": "llmd-ps-bad"}}')
            [d] = await receive_all(b)
            request = decode_request(d.body)
            assert request.id == "llmd-ps-1"
            await b.publish_results([(http_result(request, 200, "{}"), request.result_queue_name)])
        finally:
            await b.close()
    asyncio.run(main())
    got = []
    until = time.monotonic() + 5
    while len(got) < 2 and time.monotonic() < until:
        message = listener.get_message(timeout=0.5)
        if message:
            got.append(orjson.loads(message["data"]))
    listener.close()
    assert sorted((r["id"], r["error_code"]) for r in got) == [("llmd-ps-1", ""), ("llmd-ps-bad", "INVALID_REQUEST")]


def test_pubsub_attributes_are_merged_into_metadata_and_userid_names_the_tenant(pubsub_fake):
    from async_processor.backends.pubsub import PubSubBackend

    body = orjson.dumps({"id": "a-1", "deadline": int(time.time()) + 60, "payload": {"model": "m"},
                         "metadata": {"userid": "from-body", "llmd-kept": "yes"}})

    async def main():
        b = PubSubBackend(f"t{secrets.token_hex(4)}", lanes=LANES, emulator_host=pubsub_fake)
        await b.start()
        try:
            await asyncio.wrap_future(b.publisher.publish(b.topic_path(b.topic_id("async")), body,
                                                          userid="u-9", team="t"))
            [d] = await receive_all(b, lease_s=10.0)
            await b.ack([d])
            return decode_request(d.body)
        finally:
            await b.close()
    request = asyncio.run(main())
    assert request.metadata == {"userid": "u-9", "llmd-kept": "yes", "team": "t"}  # the attribute wins
    assert with_tenant(request).tenant == "u-9"
    assert with_tenant(request, "team").tenant == "t" and with_tenant(request, "").tenant == ""


def test_metadata_tenant_wins_over_the_tenant_attribute():
    request = decode_request(orjson.dumps({"id": "x", "deadline": 1, "payload": {},
                                           "metadata": {"tenant": "acme", "userid": "u"}}))
    assert with_tenant(request).tenant == "acme"


@pytest.mark.parametrize("raw, id, address", [
    # no payload in data: the id and the result list of the envelope still answer it
    ({"internal": {"request_token": "t1", "result_queue_name": "r"}, "request_kind": "redis",
      "data": {"id": "e-1", "deadline": 5}}, "e-1", "redis-list:t1:r"),
    # a request_kind llm-d-async does not define
    ({"internal": {}, "request_kind": "carrier-pigeon",
      "data": {"id": "e-2", "deadline": 5, "payload": {}, "result_queue_name": "mine"}}, "e-2", "redis-list::mine"),
    # data not an object; the envelope's list is still known
    ({"request_kind": "plain", "data": "nope"}, "", "redis-list::result-list"),
    # a flat message keeps its stream
    ({"id": "f-1", "deadline": 0, "payload": {}, "result_queue_name": "s"}, "f-1", "s"),
])
def test_an_invalid_message_keeps_every_id_and_destination_it_has(raw, id, address):
    with pytest.raises(InvalidMessage) as caught:
        decode_request(orjson.dumps(raw))
    assert (caught.value.id, caught.value.result_queue_name) == (id, address)
    assert invalid_request_result(caught.value).id == id


def test_a_flat_message_mentioning_request_kind_in_its_payload_stays_flat():
    request = decode_request(orjson.dumps({"id": "p", "deadline": 9, "payload": {"request_kind": "redis"}}))
    assert (request.id, request.result_queue_name, request.request_token) == ("p", "", "")


def test_an_envelope_s_result_over_google_pubsub_goes_to_the_result_topic(pubsub_fake):
    from async_processor.backends.pubsub import PubSubBackend

    async def main():
        b = PubSubBackend(f"t{secrets.token_hex(4)}", lanes=LANES, emulator_host=pubsub_fake)
        await b.start()
        try:
            reader = b.result_reader()
            result = error_result("llmd-over-pubsub", ErrorCode.CANCELLED, "cancelled")
            assert await b.publish_results([(result, "redis-list:t0:result-list")]) == [True]
            got: list = []
            until = time.monotonic() + 10
            while not got and time.monotonic() < until:
                got = await reader.read(1.0)
            await reader.close()
            return [r.id for r in got]
        finally:
            await b.close()
    assert asyncio.run(main()) == ["llmd-over-pubsub"]


def test_an_invalid_flat_message_is_not_read_as_an_envelope():
    with pytest.raises(InvalidMessage, match="deadline") as caught:
        decode_request(orjson.dumps({"id": "flat", "payload": {"request_kind": "redis"}}))
    assert (caught.value.id, caught.value.result_queue_name) == ("flat", "")


def park_retry(client: sync_redis.Redis, id: str, result_list: str, due_in: int, token: str) -> bytes:
    """llm-d-async's consumer parking a retryable failure (``flushRetryBatch``): ``ZADD
    retry-sortedset <now + backoff> <envelope>``, the envelope naming its origin request set."""
    member = envelope(id, int(time.time()) + 300, token, result_list)
    client.zadd(LLMD_RETRY_SORTED_SET, {member: int(time.time()) + due_in})
    return member


def test_a_retry_llmd_async_parked_is_run_once_due_and_answered_on_its_list(names, redis_url):
    client, ns, result_list = names
    client.delete(LLMD_RETRY_SORTED_SET)
    due = park_retry(client, "llmd-retry-due", result_list, -1, "tok-due")
    later = park_retry(client, "llmd-retry-later", result_list, 3600, "tok-later")

    async def main():
        b = backend(redis_url, ns, llmd_retry_sorted_sets=[LLMD_RETRY_SORTED_SET])
        other = backend(redis_url, ns, llmd_retry_sorted_sets=[LLMD_RETRY_SORTED_SET])
        await b.start()
        await other.start()
        try:
            [d] = await receive_all(b)
            assert await other.receive("async", 10, 0.4) == []  # moved once: nothing left for another processor
            request = decode_request(d.body)
            assert (request.id, request.request_token) == ("llmd-retry-due", "tok-due")
            assert await b.admit([request], 5.0) == [Admission.NEW]
            assert await b.publish_results([(http_result(request, 200, '{"ok":true}'),
                                             request.result_queue_name)]) == [True]
            await b.ack([d])
        finally:
            await b.close()
            await other.close()
    asyncio.run(main())
    # the one not yet due stays parked, as llm-d-async's mover leaves it
    assert client.zrange(LLMD_RETRY_SORTED_SET, 0, -1) == [later] and due != later
    result = get_result(client, result_list)
    assert (result["id"], result["status_code"]) == ("llmd-retry-due", 200)
    client.delete(LLMD_RETRY_SORTED_SET)


def test_the_retry_set_is_not_read_unless_configured(names, redis_url):
    client, ns, result_list = names
    client.delete(LLMD_RETRY_SORTED_SET)
    park_retry(client, "llmd-retry-ignored", result_list, -1, "tok")

    async def main():
        b = backend(redis_url, ns)
        await b.start()
        try:
            return await b.receive("async", 10, 0.4)
        finally:
            await b.close()
    assert asyncio.run(main()) == [] and client.zcard(LLMD_RETRY_SORTED_SET) == 1
    client.delete(LLMD_RETRY_SORTED_SET)
