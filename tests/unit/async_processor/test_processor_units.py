"""Messages, lanes, gates and retry rules of the processor, without I/O."""

from __future__ import annotations

import random
import secrets
import time

import httpx
import pytest

from async_processor.backends.base import Delivery
from async_processor.gates import AllGates, ConcurrencyGate, SaturationGate, TenantQuotaGate
from async_processor.lanes import LaneBuffer, Work
from async_processor.processor import request_headers
from async_processor.retry import backoff_delay, is_retryable, parse_retry_after
from async_processor.testing import mock_target
from common.contracts.queue import (
    ErrorCode,
    InvalidMessage,
    RequestMessage,
    decode_request,
    decode_result,
    encode_request,
    encode_result,
    error_result,
    http_result,
)


def work(lane="batch", deadline=1000, tenant="t", id=None) -> Work:
    req = RequestMessage(id=id or secrets.token_hex(4), deadline=deadline, payload={}, metadata={"tenant": tenant})
    return Work(req, Delivery(lane, b"", 1, "x"), lane)


# messages


def test_request_round_trip_and_defaults():
    m = decode_request(b'{"id":"a","deadline":5,"payload":{"x":[1]},"request_queue_name":"llm-d extra"}')
    assert (m.endpoint, m.headers, m.metadata, m.result_queue_name) == ("/v1/chat/completions", {}, {}, "")
    assert decode_request(encode_request(m)) == m


@pytest.mark.parametrize("raw", [b"", b"[]", b"{", b'{"id":"a","payload":{}}', b'{"id":"a","deadline":0,"payload":{}}',
                                 b'{"id":"","deadline":5,"payload":{}}', b'{"id":"a","deadline":"5","payload":{}}',
                                 b'{"id":"a","deadline":5,"payload":[]}', b"\xff\xfe", b"[" * 100_000,
                                 b'{"id":"a","deadline":5,"payload":{"n":' + b"9" * 5000 + b"}}"])
def test_bad_requests_raise_invalid_message(raw):
    with pytest.raises(InvalidMessage):
        decode_request(raw)


def test_invalid_message_salvages_addressing():
    with pytest.raises(InvalidMessage) as info:
        decode_request(b'{"id":"a","payload":{},"metadata":{"tenant":"t","n":1},"result_queue_name":"q"}')
    assert (info.value.id, info.value.metadata, info.value.result_queue_name) == ("a", {"tenant": "t"}, "q")


def test_results_always_carry_every_field():
    req = RequestMessage(id="a", deadline=5, payload={}, metadata={"k": "v"})
    ok = decode_result(encode_result(http_result(req, 200, b'{"x":1}')))
    assert (ok.status_code, ok.payload, ok.error_code, ok.metadata, ok.ok) == (200, '{"x":1}', "", {"k": "v"}, True)
    err = error_result("a", ErrorCode.DEADLINE_EXCEEDED, "late")
    assert set(err.__struct_fields__) <= set(encode_result(err).decode().replace('"', " ").split())
    assert err.payload == '{"error":"late"}' and not err.ok


# lanes


def test_lanes_strict_priority_then_edf_then_fifo():
    buf = LaneBuffer(["batch", "async", "interactive"], capacity=10)
    items = [work("batch", 5, id="b5"), work("async", 9, id="a9"), work("batch", 1, id="b1"),
             work("interactive", 7, id="i7"), work("async", 9, id="a9b"), work("interactive", 3, id="i3")]
    for w in items:
        buf.push(w)
    assert (buf.free("batch"), buf.free("interactive"), buf.free("unread")) == (8, 8, 0)
    order = [buf.pop(0, lambda w: True).request.id for _ in items]
    assert order == ["i3", "i7", "a9", "a9b", "b1", "b5"] and buf.pop(0, lambda w: True) is None


def test_lower_lane_runs_when_higher_is_backing_off_or_refused():
    buf = LaneBuffer(["interactive", "batch"], capacity=10)
    waiting, refused, runnable = work("interactive", id="i1"), work("interactive", tenant="full", id="i2"), work("batch")
    waiting.not_before = 50
    for w in (waiting, refused, runnable):
        buf.push(w)
    assert buf.pop(10, lambda w: w.tenant != "full") is runnable
    assert buf.next_ready_at(10) == 50
    assert buf.pop(60, lambda w: w.tenant != "full") is waiting


def test_expired_are_removed():
    buf = LaneBuffer(["batch"], capacity=10)
    old, new = work(deadline=10), work(deadline=100)
    buf.push(old), buf.push(new)
    assert buf.expired(50) == [old] and len(buf) == 1


# gates


def test_concurrency_and_tenant_gates_compose_and_release():
    gate = AllGates([ConcurrencyGate(2), TenantQuotaGate(1, {"big": 2})])
    a1, a2, big1, big2 = work(tenant="a"), work(tenant="a"), work(tenant="big"), work(tenant="big")
    assert gate.admits(a1)
    gate.acquire(a1)
    assert not gate.admits(a2) and gate.admits(big1)
    gate.acquire(big1)
    assert not gate.admits(big2)  # global limit 2 reached
    gate.release(a1)
    assert gate.admits(big2) and gate.admits(a2)


@pytest.mark.parametrize("answer,open_", [
    ((200, {"gate_saturation": 0.5}), True), ((200, {"gate_saturation": 1.0}), False),
    ((200, {"gate_saturation": "low"}), False), ((200, {}), False), ((500, {"gate_saturation": 0.1}), False),
    ((200, {"gate_saturation": -1}), False), ((200, [1]), False),
])
def test_saturation_gate_fails_closed(answer, open_):
    import asyncio

    async def main():
        clock = [0.0]
        client = mock_target(lambda r: httpx.Response(answer[0], json=answer[1]))
        gate = SaturationGate(client, "http://router", max_age_s=2.0, clock=lambda: clock[0])
        assert not gate.admits(work("batch"))  # nothing read yet: closed
        assert gate.admits(work("interactive"))  # exempt
        await gate.refresh()
        assert gate.admits(work("batch")) is open_
        clock[0] = 5.0  # stale
        assert not gate.admits(work("batch"))
        await client.aclose()
    asyncio.run(main())


def test_saturation_gate_closed_when_router_unreachable():
    import asyncio

    def refuse(request):
        raise httpx.ConnectError("refused", request=request)

    async def main():
        client = mock_target(refuse)
        gate = SaturationGate(client, "http://router")
        await gate.refresh()
        assert not gate.admits(work("async"))
        await client.aclose()
    asyncio.run(main())


# retry


def test_retryable_statuses():
    assert all(is_retryable(s) for s in (0, 429, 503, 500, 502, 504, 408))
    assert not any(is_retryable(s) for s in (200, 400, 401, 404, 422))


def test_backoff_grows_is_capped_and_stays_inside_the_deadline():
    rng = random.Random(1)
    delays = [backoff_delay(n, 1000, rng=rng) for n in range(1, 10)]
    assert all(1.0 <= d <= 2.0 for d in delays[:1]) and all(d <= 60 for d in delays)
    assert max(delays) >= 30  # reached the cap region
    assert backoff_delay(5, 3.0, rng=rng) < 3.0 and backoff_delay(1, 0) is None


def test_retry_after_wins_but_is_clamped_to_half_the_time_left():
    rng = random.Random(2)
    assert backoff_delay(1, 100, retry_after_s=30, rng=rng) == 30
    assert backoff_delay(1, 20, retry_after_s=30, rng=rng) == 10
    assert backoff_delay(1, 100, retry_after_s=0.1, rng=rng) >= 1.0


def test_parse_retry_after():
    assert parse_retry_after("3") == 3.0 and parse_retry_after(None) is None and parse_retry_after("soon") is None
    assert 9 <= parse_retry_after("Wed, 21 Oct 2015 07:28:10 GMT", now_unix=1445412480) <= 11


def test_headers_follow_llm_d_names_and_fairness_is_not_taken_from_producers():
    req = RequestMessage(id="a", deadline=int(time.time()) + 10, payload={},
                         headers={"x-llm-d-inference-fairness-id": "spoof", "x-extra": "1"},
                         metadata={"tenant": "acme", "session_id": "s", "traceparent": "00-x"})
    h = request_headers(req, "batch", 9.5)
    assert h["x-llm-d-inference-objective"] == "batch" and h["x-llm-d-inference-fairness-id"] == "acme"
    assert h["x-llm-d-slo-ttft-ms"] == "9500" and h["x-session-id"] == "s" and h["traceparent"] == "00-x"
    assert h["x-extra"] == "1"


def test_producer_headers_are_case_folded_and_framing_headers_dropped():
    req = RequestMessage(id="a", deadline=int(time.time()) + 10, payload={}, metadata={"tenant": "acme"},
                         headers={"X-LLM-D-Inference-Fairness-Id": "spoof", "Content-Type": "text/plain",
                                  "Content-Length": "3", "Host": "evil", "Transfer-Encoding": "chunked",
                                  "Connection": "close", "X-Extra": "1"})
    h = request_headers(req, "batch", 1.0)
    assert h["x-llm-d-inference-fairness-id"] == "acme" and h["content-type"] == "application/json"
    assert h["x-extra"] == "1"
    assert not {"content-length", "host", "transfer-encoding", "connection"} & {k.lower() for k in h}
    assert len({k.lower() for k in h}) == len(h)


def test_the_router_token_is_the_processors_own_never_a_producers():
    req = RequestMessage(id="a", deadline=int(time.time()) + 10, payload={}, metadata={"tenant": "acme"},
                         headers={"X-Backfill-Router-Token": "guessed"})
    assert "x-backfill-router-token" not in request_headers(req, "batch", 1.0)
    h = request_headers(req, "batch", 1.0, "s3cret")
    assert h["x-backfill-router-token"] == "s3cret" and h["x-llm-d-inference-fairness-id"] == "acme"
    assert [k for k in h if k.lower() == "x-backfill-router-token"] == ["x-backfill-router-token"]


def test_llm_d_async_settings_need_their_lane_read_and_parse_json_lists_from_the_environment(monkeypatch):
    from pydantic import ValidationError

    from async_processor.settings import build_settings

    monkeypatch.setenv("BACKFILL_PROCESSOR_LLMD_SORTED_SETS", '["request-sortedset"]')
    monkeypatch.setenv("BACKFILL_PROCESSOR_LLMD_CHANNELS", '["request-queue"]')
    settings = build_settings()
    assert (settings.llmd_sorted_sets, settings.llmd_channels, settings.llmd_lane, settings.llmd_result_channel,
            settings.tenant_attribute) == (["request-sortedset"], ["request-queue"], "async", "result-queue", "userid")
    with pytest.raises(ValidationError, match="llmd_lane"):
        build_settings(lanes=["batch"])
    assert build_settings(lanes=["batch"], llmd_lane="batch").llmd_lane == "batch"


def test_queue_wait_is_read_from_the_stream_entry_id_else_created_and_observed_once():
    from prometheus_client import generate_latest

    from async_processor.metrics import ProcessorMetrics, enqueued_at

    req = RequestMessage(id="a", created=1_700_000_000, deadline=2_000_000_000, payload={})
    assert enqueued_at(Work(req, Delivery("async", b"", 1, "1700000012345-7"), "async")) == 1_700_000_012.345
    assert enqueued_at(Work(req, Delivery("async", b"", 1, "projects/p/messages/99"), "async")) == 1_700_000_000.0
    metrics = ProcessorMetrics()
    fresh = Work(req, Delivery("async", b"", 1, f"{int((time.time() - 30) * 1000)}-0"), "async")
    metrics.dispatched(fresh)
    fresh.started = True
    metrics.dispatched(fresh)  # dispatched again (a held refusal, a retry): its wait is not observed twice
    text = generate_latest(metrics.registry).decode()
    assert 'backfill_processor_queue_wait_seconds_count{lane="async"} 1.0' in text
    assert 'backfill_processor_queue_wait_seconds_bucket{lane="async",le="10.0"} 0.0' in text
    assert 'backfill_processor_queue_wait_seconds_bucket{lane="async",le="60.0"} 1.0' in text
