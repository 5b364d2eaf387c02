"""One contract suite over every queue backend: memory, Redis Streams, Google's Pub/Sub emulator and
the in-process Pub/Sub fake (``kit`` fixture in conftest.py).

Backend level: leases lapse and redeliver with a higher delivery count, acks are final, nack hands
back, extension holds, dead-lettering moves the message. Through a processor (HTTP target mocked):
results are published before acks, a dead consumer's messages reach another, dead-letter after N
deliveries, one result per duplicated id, unparsable or deadline-less messages answer INVALID_REQUEST,
a passed deadline answers DEADLINE_EXCEEDED without dispatch.
"""

from __future__ import annotations

import asyncio
import secrets
import time

import httpx

from async_processor.settings import build_settings
from async_processor.testing import OrderCheckingBackend, eventually, mock_target, running
from common.contracts.queue import ErrorCode, RequestMessage, decode_request


def request(lane_deadline_s: float = 300, **fields) -> RequestMessage:
    fields.setdefault("id", f"req-{secrets.token_hex(6)}")
    fields.setdefault("payload", {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    fields.setdefault("metadata", {"tenant": "acme", "objective": "batch"})
    return RequestMessage(deadline=int(time.time() + lane_deadline_s), **fields)


def settings_for(kit, **overrides):
    base = dict(backend="memory", lease_s=kit.lease_s, router_url="http://target", backoff_base_s=0.05,
                poll_interval_s=0.01, saturation_poll_s=0.05, grace_s=2.0, max_deliveries=3)
    return build_settings(**{**base, **overrides})


def echo_target(calls: list | None = None) -> httpx.AsyncClient:
    async def handler(req: httpx.Request) -> httpx.Response:
        if calls is not None:
            calls.append(req)
        return httpx.Response(200, json={"echo": req.headers.get("x-llm-d-inference-objective")})
    return mock_target(handler)


async def receive_soon(backend, lane: str, kit, timeout_s: float = 10.0):
    return await eventually(lambda: backend.receive(lane, 10, kit.lease_s), timeout_s)


async def read_results(reader, n: int, timeout_s: float = 15.0) -> list:
    found: list = []
    until = time.monotonic() + timeout_s
    while len(found) < n and time.monotonic() < until:
        found += await reader.read(0.2)
    return found


# ---------------------------------------------------------------- backend level


def test_lapsed_lease_redelivers_with_higher_count(kit):
    async def body(kit):
        first, second = await kit.make(), await kit.make()
        msg = request()
        await first.publish_request("batch", msg)
        got = await receive_soon(first, "batch", kit)
        assert [decode_request(d.body).id for d in got] == [msg.id] and got[0].delivery_count == 1
        again = await receive_soon(second, "batch", kit)  # the first consumer never acks
        assert decode_request(again[0].body).id == msg.id and again[0].delivery_count == 2
        third = await receive_soon(first, "batch", kit)
        assert third[0].delivery_count == 3
        await first.ack(third)
    kit.run(body)


def test_ack_is_final(kit):
    async def body(kit):
        backend = await kit.make()
        await backend.publish_request("async", request())
        got = await receive_soon(backend, "async", kit)
        await backend.ack(got)
        await asyncio.sleep(kit.lease_s * 1.6)
        assert await backend.receive("async", 10, kit.lease_s) == []
        assert await backend.receive("async", 10, kit.lease_s) == []
    kit.run(body)


def test_extend_holds_and_nack_hands_back(kit):
    async def body(kit):
        backend = await kit.make()
        await backend.publish_request("batch", request())
        # a lease of 5 of the kit's: 40 % of it (0.8 s or more) is the slack of each extension on a
        # busy machine, where the loop may wake late from its sleep
        lease = kit.lease_s * 5
        got = await eventually(lambda: backend.receive("batch", 10, lease), 10.0)
        for _ in range(3):  # held for 1.8 leases in all: only the extensions keep it
            await asyncio.sleep(lease * 0.6)
            await backend.extend(got, lease)
            assert await backend.receive("batch", 10, lease) == []
        await backend.nack(got, 0)
        back = await receive_soon(backend, "batch", kit)
        assert back[0].body == got[0].body and back[0].delivery_count == 2
        await backend.ack(back)
    kit.run(body)


def test_dead_letter_moves_the_message(kit):
    async def body(kit):
        backend = await kit.make()
        msg = request()
        await backend.publish_request("batch", msg)
        got = await receive_soon(backend, "batch", kit)
        await backend.dead_letter(got, "poison")
        dead = await eventually(lambda: kit.dead_letters(backend, "batch"))
        assert [decode_request(b).id for b in dead] == [msg.id]
        await asyncio.sleep(kit.lease_s * 1.6)
        assert await backend.receive("batch", 10, kit.lease_s) == []
    kit.run(body)


# ---------------------------------------------------------------- through a processor


def test_results_are_published_before_acks_once_per_request(kit):
    async def body(kit):
        backend = OrderCheckingBackend(await kit.make())
        reader = backend.result_reader()
        messages = [request(metadata={"tenant": "acme", "objective": lane}) for lane in ("batch", "async") * 10]
        for m in messages:
            await backend.publish_request(m.metadata["objective"], m)
        async with running(settings_for(kit), backend, echo_target()):
            results = await read_results(reader, len(messages))
        await reader.close()
        assert sorted(r.id for r in results) == sorted(m.id for m in messages)
        assert all(r.status_code == 200 and r.error_code == "" and r.metadata["tenant"] == "acme" for r in results)
        assert backend.violations == [] and sorted(backend.acked) == sorted(m.id for m in messages)
    kit.run(body)


def test_dead_consumer_messages_reach_another(kit):
    async def body(kit):
        dead_consumer, survivor = await kit.make(), await kit.make()
        reader = survivor.result_reader()
        msg = request()
        await dead_consumer.publish_request("batch", msg)
        assert await receive_soon(dead_consumer, "batch", kit)  # taken, then the consumer "dies"
        async with running(settings_for(kit), survivor, echo_target()):
            results = await read_results(reader, 1)
            await asyncio.sleep(0.3)
            results += await reader.read(0.1)
        await reader.close()
        assert [(r.id, r.status_code) for r in results] == [(msg.id, 200)]
    kit.run(body)


def test_dead_letter_after_max_deliveries_with_one_result(kit):
    async def body(kit):
        crasher, processor_backend = await kit.make(), await kit.make()
        reader = processor_backend.result_reader()
        msg = request()
        await crasher.publish_request("batch", msg)
        for _ in range(2):  # two deliveries that never finish (e.g. a crashing processor)
            await receive_soon(crasher, "batch", kit)
        calls: list = []
        async with running(settings_for(kit, max_deliveries=2), processor_backend, echo_target(calls)):
            results = await read_results(reader, 1)
            dead = await eventually(lambda: kit.dead_letters(processor_backend, "batch"))
        await reader.close()
        assert calls == []
        assert [(r.id, r.error_code) for r in results] == [(msg.id, ErrorCode.INFERENCE_ERROR)]
        assert "dead-lettered after 2 deliveries" in results[0].error_message
        assert [decode_request(b).id for b in dead] == [msg.id]
    kit.run(body)


def test_duplicate_delivery_yields_one_result(kit):
    async def body(kit):
        backend = await kit.make()
        reader = backend.result_reader()
        msg = request()
        for _ in range(3):
            await backend.publish_request("batch", msg)
        calls: list = []
        async with running(settings_for(kit), backend, echo_target(calls)) as processor:
            results = await read_results(reader, 1)
            await eventually(lambda: _true(processor.counts["duplicate"] >= 2), timeout_s=20)
        results += await reader.read(0.1)
        await reader.close()
        assert [r.id for r in results] == [msg.id] and len(calls) == 1
    kit.run(body)


async def _true(value: bool) -> bool:
    return value


def test_unparsable_and_deadline_less_messages_answer_invalid_request(kit):
    async def body(kit):
        backend = await kit.make()
        reader = backend.result_reader()
        await backend.publish_request("batch", b"{not json")
        await backend.publish_request("batch", b'{"id": "no-deadline", "payload": {}, "metadata": {"tenant": "t"}}')
        await backend.publish_request("batch", b'{"id": "zero", "deadline": 0, "payload": {}}')
        calls: list = []
        async with running(settings_for(kit), backend, echo_target(calls)):
            results = await read_results(reader, 3)
            dead = await eventually(lambda: _at_least(kit.dead_letters(backend, "batch"), 3))
        await reader.close()
        assert calls == []
        assert sorted(r.id for r in results) == ["", "no-deadline", "zero"]
        assert {r.error_code for r in results} == {ErrorCode.INVALID_REQUEST}
        assert next(r for r in results if r.id == "no-deadline").metadata == {"tenant": "t"}
        assert len(dead) == 3
    kit.run(body)


async def _at_least(found_coro, n: int):
    found = await found_coro
    return found if len(found) >= n else None


def test_passed_deadline_answers_deadline_exceeded_without_dispatch(kit):
    async def body(kit):
        backend = await kit.make()
        reader = backend.result_reader()
        msg = request(lane_deadline_s=-5)
        await backend.publish_request("batch", msg)
        calls: list = []
        async with running(settings_for(kit), backend, echo_target(calls)):
            results = await read_results(reader, 1)
        await reader.close()
        assert calls == []
        assert [(r.id, r.error_code, r.status_code) for r in results] == [(msg.id, ErrorCode.DEADLINE_EXCEEDED, 0)]
    kit.run(body)
