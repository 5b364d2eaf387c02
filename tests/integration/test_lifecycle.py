"""The batch lifecycle after validation, with a stand-in processor that answers from the request
stream: feed in prefix order within a window, collect once per custom_id (duplicates and late
results refused), finalize into OpenAI's output and error files, cancel and expiry with partial
output, and the sweeper handing back lost requests; collected results deleted from the result
stream, results that name no request logged and counted, input lines that must not sink a batch
(an empty custom_id, a lone surrogate) and an answer over the response-size limit."""

from __future__ import annotations

import time

import openai
import orjson
import pytest
from openai.types import Batch as SdkBatch
from openai.types.chat import ChatCompletion
from sqlalchemy import select, update

from batch_gateway.store.models import Batch, BatchRequest
from common.contracts.queue import (
    COLLECTOR_GROUP,
    REQUEST_FIELD,
    ErrorCode,
    ResultMessage,
    decode_request,
    encode_result,
    error_result,
    http_result,
)
from workers import lifecycle


def _line(custom_id: str, system: str = "sys", model: str = "m") -> bytes:
    return orjson.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": model, "messages": [{"role": "system", "content": system},
                                                                {"role": "user", "content": custom_id}]}})


def _completion(request, prompt_tokens: int = 10, cached: int = 4, completion: int = 3) -> bytes:
    return orjson.dumps({
        "id": f"chatcmpl-{request.metadata['custom_id']}", "object": "chat.completion", "created": 1,
        "model": request.payload["model"],
        "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                     "message": {"role": "assistant", "content": "ok", "refusal": None}}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                  "total_tokens": prompt_tokens + completion,
                  "prompt_tokens_details": {"cached_tokens": cached}},
    })


class StandInProcessor:
    """Reads the batch request stream and writes results, as the async processor would."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.redis = ctx.queue.redis
        self.last = "0-0"

    def take(self) -> list:
        entries = self.redis.xrange(self.ctx.queue.request_stream, min=f"({self.last}", max="+") \
            if self.last != "0-0" else self.redis.xrange(self.ctx.queue.request_stream)
        if entries:
            self.last = entries[-1][0].decode()
        return [decode_request(fields[REQUEST_FIELD.encode()]) for _, fields in entries]

    def answer(self, request, result) -> None:
        self.redis.xadd(request.result_queue_name, {"result": encode_result(result)})

    def ok(self, request, **usage) -> None:
        self.answer(request, http_result(request, 200, _completion(request, **usage)))


def _submit(gateway, lines: list[bytes], window: str = "24h"):
    client = gateway.client()
    uploaded = client.files.create(file=("in.jsonl", b"\n".join(lines) + b"\n"), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window=window)
    gateway.wait_status(batch.id, ("in_progress",))
    return client, batch


def _lines(client, file_id) -> dict:
    return {row["custom_id"]: row for row in map(orjson.loads, client.files.content(file_id).read().splitlines())}


def test_feed_collect_finalize_writes_openai_files(gateway):
    ctx = gateway.celery.backfill
    ctx.settings.feed_window = 3
    lines = [_line(f"r{i}", system="B-shared" if i % 2 else "A-shared") for i in range(5)]
    lines.append(orjson.dumps({"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
                               "body": {"model": "m", "messages": [{"role": "user", "content": "A-zzz"}]}}))
    client, batch = _submit(gateway, lines)
    proc = StandInProcessor(ctx)

    assert lifecycle.feed(ctx) == 3
    assert lifecycle.feed(ctx) == 0  # the window is full
    first = proc.take()
    assert [m.metadata["custom_id"] for m in first] == ["r0", "r2", "r4"]  # prefix order: all "A-shared"
    assert all(m.metadata["objective"] == "batch" and m.deadline == batch.expires_at for m in first)
    assert first[0].payload["messages"][1]["content"] == "r0"
    for request in first:
        proc.ok(request)
    proc.ok(first[0])  # a duplicate delivery: refused
    assert lifecycle.collect(ctx) == 3
    live = client.batches.retrieve(batch.id)
    assert (live.request_counts.completed, live.request_counts.failed, live.request_counts.total) == (3, 0, 6)
    assert live.usage.input_tokens == 30 and live.usage.input_tokens_details.cached_tokens == 12

    assert lifecycle.feed(ctx) == 3
    rest = {m.metadata["custom_id"]: m for m in proc.take()}
    assert set(rest) == {"bad", "r1", "r3"}
    proc.ok(rest["r1"])
    proc.answer(rest["bad"], http_result(rest["bad"], 400, orjson.dumps({"error": {
        "message": "This model's maximum context length is 16 tokens.", "type": "invalid_request_error",
        "param": "messages", "code": "context_length_exceeded"}})))
    assert lifecycle.collect(ctx) == 2
    assert lifecycle.finalize_due(ctx) == []  # r3 still out
    proc.ok(rest["r3"])
    lifecycle.collect(ctx)
    assert lifecycle.finalize_due(ctx) == [batch.id]

    done = client.batches.retrieve(batch.id)
    assert isinstance(done, SdkBatch) and done.status == "completed"
    assert done.finalizing_at is not None and done.completed_at >= done.finalizing_at >= done.in_progress_at
    assert (done.request_counts.completed, done.request_counts.failed) == (5, 1)
    out, err = _lines(client, done.output_file_id), _lines(client, done.error_file_id)
    assert set(out) == {f"r{i}" for i in range(5)} and set(err) == {"bad"}
    for row in out.values():
        assert row["error"] is None and row["response"]["status_code"] == 200 and row["id"].startswith("batch_req_")
        ChatCompletion.model_validate(row["response"]["body"])
    assert err["bad"]["error"] is None
    assert err["bad"]["response"]["body"]["error"]["code"] == "context_length_exceeded"
    assert done.usage.input_tokens == sum(r["response"]["body"]["usage"]["prompt_tokens"] for r in out.values())
    assert done.usage.total_tokens == done.usage.input_tokens + done.usage.output_tokens
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"

    # finalising again changes nothing
    assert lifecycle.finalize(ctx, batch.id) == "completed"
    assert _lines(client, done.output_file_id) == out


def test_all_failed_has_no_output_file(gateway):
    ctx = gateway.celery.backfill
    client, batch = _submit(gateway, [_line("x"), _line("y")])
    proc = StandInProcessor(ctx)
    lifecycle.feed(ctx)
    for request in proc.take():
        proc.answer(request, http_result(request, 404, b'{"error": {"message": "The model `m` does not exist.", '
                                                       b'"type": "NotFoundError", "param": null, "code": 404}}'))
    lifecycle.collect(ctx)
    lifecycle.finalize_due(ctx)
    done = client.batches.retrieve(batch.id)
    assert done.status == "completed" and done.output_file_id is None and done.error_file_id
    assert set(_lines(client, done.error_file_id)) == {"x", "y"}


def test_cancel_midway_keeps_partial_output(gateway):
    ctx = gateway.celery.backfill
    ctx.settings.feed_window = 2
    client, batch = _submit(gateway, [_line(f"c{i}") for i in range(4)])
    proc = StandInProcessor(ctx)
    assert lifecycle.feed(ctx) == 2
    running = proc.take()
    proc.ok(running[0])
    lifecycle.collect(ctx)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at
    assert client.batches.cancel(batch.id).status == "cancelling"
    assert lifecycle.feed(ctx) == 0  # nothing more is fed
    deadline = time.monotonic() + 15  # the cancel task marks the batch for the processors
    while not ctx.queue.redis.exists(f"backfill:cancel:batch:{batch.id}"):
        assert time.monotonic() < deadline, "the cancel marker was never set"
        time.sleep(0.05)
    assert lifecycle.finalize_due(ctx) == []  # c1 still in flight
    proc.answer(running[1], error_result(running[1].id, ErrorCode.CANCELLED, "batch cancelled", running[1].metadata))
    assert lifecycle.collect(ctx) == 1
    assert lifecycle.finalize_due(ctx) == [batch.id]
    done = client.batches.retrieve(batch.id)
    assert done.status == "cancelled" and done.cancelled_at >= done.cancelling_at
    assert set(_lines(client, done.output_file_id)) == {"c0"}
    errors = _lines(client, done.error_file_id)
    assert set(errors) == {"c1", "c2", "c3"}
    assert all(e["response"] is None and e["error"]["code"] == "batch_cancelled" for e in errors.values())
    assert (done.request_counts.completed, done.request_counts.failed) == (1, 3)
    with pytest.raises(openai.ConflictError):  # it has ended: a cancel now is refused, as for any ended batch
        client.batches.cancel(batch.id)
    assert client.batches.retrieve(batch.id).model_dump() == done.model_dump()


def test_expiry_ends_unfinished_requests_as_batch_expired(gateway):
    ctx = gateway.celery.backfill
    client, batch = _submit(gateway, [_line(f"e{i}") for i in range(3)])
    proc = StandInProcessor(ctx)
    lifecycle.feed(ctx)
    proc.ok(proc.take()[0])
    lifecycle.collect(ctx)
    with gateway.session() as session:
        session.execute(update(Batch).where(Batch.id == batch.id).values(
            deadline=Batch.deadline - __import__("datetime").timedelta(days=2)))
        session.commit()
    assert lifecycle.feed(ctx) == 0  # no dispatch after expiry
    assert lifecycle.finalize_due(ctx) == [batch.id]
    done = client.batches.retrieve(batch.id)
    assert done.status == "expired" and done.expired_at
    assert set(_lines(client, done.output_file_id)) == {"e0"}
    errors = _lines(client, done.error_file_id)
    assert {k: v["error"]["code"] for k, v in errors.items()} == {"e1": "batch_expired", "e2": "batch_expired"}


def test_sweeper_hands_back_lost_requests_and_refuses_the_late_result(gateway):
    ctx = gateway.celery.backfill
    ctx.settings.max_attempts = 2
    client, batch = _submit(gateway, [_line("s0"), _line("s1")])
    proc = StandInProcessor(ctx)
    lifecycle.feed(ctx)
    lost = {m.metadata["custom_id"]: m for m in proc.take()}
    ctx.queue.redis.delete(ctx.queue.request_stream)  # Redis lost its queue
    with gateway.session() as session:
        session.execute(update(BatchRequest).where(BatchRequest.batch_id == batch.id)
                        .values(lease_expires_at=BatchRequest.lease_expires_at - __import__("datetime").timedelta(hours=1)))
        session.commit()
    assert lifecycle.sweep(ctx) == 2
    assert lifecycle.feed(ctx) == 2
    again = {m.metadata["custom_id"]: m for m in StandInProcessor(ctx).take()}
    assert again["s0"].metadata["attempt"] == "2" and again["s0"].metadata["lease_token"] != lost["s0"].metadata["lease_token"]
    proc.ok(lost["s0"])  # the late result of the first delivery: refused
    proc.ok(again["s0"])
    assert lifecycle.collect(ctx) == 1
    ctx.queue.redis.delete(ctx.queue.request_stream)  # s1 is lost a second time: it ends as request_timeout
    with gateway.session() as session:
        session.execute(update(BatchRequest).where(BatchRequest.batch_id == batch.id, BatchRequest.custom_id == "s1")
                        .values(lease_expires_at=BatchRequest.lease_expires_at - __import__("datetime").timedelta(hours=1)))
        session.commit()
    lifecycle.sweep(ctx)
    assert lifecycle.finalize_due(ctx) == [batch.id]
    done = client.batches.retrieve(batch.id)
    errors = _lines(client, done.error_file_id)
    assert errors["s1"]["error"]["code"] == "request_timeout" and errors["s1"]["response"] is None
    assert set(_lines(client, done.output_file_id)) == {"s0"}
    with gateway.session() as session:
        assert session.execute(select(BatchRequest.attempts).where(
            BatchRequest.batch_id == batch.id, BatchRequest.custom_id == "s0")).scalar_one() == 2


# --- bounded state and input that must not sink a batch --------------------------------------------


def test_collected_results_are_deleted_from_the_stream_and_pending_ones_kept(gateway):
    ctx = gateway.celery.backfill
    client, batch = _submit(gateway, [_line(f"d{i}") for i in range(4)])
    proc = StandInProcessor(ctx)
    lifecycle.feed(ctx)
    requests = proc.take()
    for request in requests[:3]:
        proc.ok(request)
    proc.ok(requests[0])  # a duplicate: refused, and deleted too (it is acknowledged)
    assert lifecycle.collect(ctx) == 3
    redis, stream = ctx.queue.redis, ctx.queue.result_stream
    assert redis.xlen(stream) == 0
    proc.ok(requests[3])
    held = redis.xreadgroup(COLLECTOR_GROUP, "collector-elsewhere", {stream: ">"})  # read, not yet acked
    assert lifecycle.collect(ctx) == 0  # held by another collector (not idle long enough to reclaim)
    assert redis.xlen(stream) == 1  # an unacknowledged entry is never deleted
    assert redis.xpending(stream, COLLECTOR_GROUP)["pending"] == 1
    redis.xack(stream, COLLECTOR_GROUP, held[0][1][0][0])
    assert client.batches.retrieve(batch.id).request_counts.completed == 3


def test_a_result_that_names_no_request_is_logged_and_counted(gateway, caplog):
    ctx = gateway.celery.backfill
    redis, stream = ctx.queue.redis, ctx.queue.result_stream
    unplaced = ctx.metrics.unplaced
    before = {reason: unplaced.labels(reason)._value.get() for reason in ("unreadable", "no_request")}
    nameless = ResultMessage(id="req-x", status_code=200, payload="{}",
                             metadata={"batch_id": "batch_x", "custom_id": "", "lease_token": "t"})
    redis.xadd(stream, {"result": encode_result(nameless)})
    redis.xadd(stream, {"result": b"not a result"})
    with caplog.at_level("WARNING", logger="workers.lifecycle.collector"):
        assert lifecycle.collect(ctx) == 0
    records = [r for r in caplog.records if getattr(r, "action", None) == "result_unplaced"]
    assert sorted(r.reason for r in records) == ["no_request", "unreadable"]
    assert [r.result_id for r in records if r.reason == "no_request"] == ["req-x"]
    assert {reason: unplaced.labels(reason)._value.get() - count for reason, count in before.items()} == \
        {"unreadable": 1, "no_request": 1}
    assert redis.xlen(stream) == 0


def test_an_empty_custom_id_fails_validation_with_its_line(gateway):
    client = gateway.client()
    uploaded = client.files.create(file=("in.jsonl", _line("ok") + b"\n" + _line("") + b"\n"), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    failed = gateway.wait_status(batch.id, ("failed", "in_progress"))
    assert failed.status == "failed"
    assert [(e.code, e.param, e.line) for e in failed.errors.data] == [("invalid_request", "custom_id", 2)]


def test_a_lone_surrogate_line_runs_with_the_replacement_character_and_the_others_too(gateway):
    ctx = gateway.celery.backfill
    lone = _line("lone", system="PLACEHOLDER").replace(b"PLACEHOLDER", b"\\ud83d alone")
    client, batch = _submit(gateway, [_line("before"), lone, _line("after")])
    proc = StandInProcessor(ctx)
    assert lifecycle.feed(ctx) == 3
    fed = {m.metadata["custom_id"]: m for m in proc.take()}
    assert fed["lone"].payload["messages"][0]["content"] == "\ufffd alone"
    for request in fed.values():
        proc.ok(request)
    assert lifecycle.collect(ctx) == 3
    assert lifecycle.finalize_due(ctx) == [batch.id]
    done = client.batches.retrieve(batch.id)
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 3, 0)


def test_an_answer_over_the_response_limit_is_a_line_of_the_error_file(gateway):
    ctx = gateway.celery.backfill
    ctx.settings.max_response_bytes = 4096
    client, batch = _submit(gateway, [_line("small"), _line("huge")])
    proc = StandInProcessor(ctx)
    lifecycle.feed(ctx)
    fed = {m.metadata["custom_id"]: m for m in proc.take()}
    proc.ok(fed["small"])
    big = orjson.loads(_completion(fed["huge"]))
    big["choices"] = [{**big["choices"][0], "index": i} for i in range(200)]  # n = 200 choices' worth
    proc.answer(fed["huge"], http_result(fed["huge"], 200, orjson.dumps(big)))
    assert lifecycle.collect(ctx) == 2
    assert lifecycle.finalize_due(ctx) == [batch.id]
    done = client.batches.retrieve(batch.id)
    assert (done.request_counts.completed, done.request_counts.failed) == (1, 1)
    assert set(_lines(client, done.output_file_id)) == {"small"}
    line = _lines(client, done.error_file_id)["huge"]
    assert line["response"] is None and line["error"]["code"] == "response_too_large"
    with gateway.session() as session:
        assert session.execute(select(BatchRequest.response_body).where(
            BatchRequest.batch_id == batch.id, BatchRequest.custom_id == "huge")).scalar_one() is None


def test_engine_errors_reach_the_error_file_in_openai_s_words_with_the_engine_s_request_id(gateway):
    ctx = gateway.celery.backfill
    client, batch = _submit(gateway, [_line("long"), _line("gone"), _line("fine")])
    proc = StandInProcessor(ctx)
    lifecycle.feed(ctx)
    requests = {m.metadata["custom_id"]: m for m in proc.take()}
    proc.answer(requests["long"], http_result(requests["long"], 400, orjson.dumps({"error": {
        "message": "'max_tokens' or 'max_completion_tokens' is too large: 8000. This model's maximum context "
                   "length is 4096 tokens and your request has 2778 input tokens (8000 > 4096 - 2778).",
        "type": "BadRequestError", "param": "max_tokens", "code": 400}})))
    proc.answer(requests["gone"], http_result(requests["gone"], 404, b'{"detail":"Not Found"}'))
    proc.ok(requests["fine"])
    lifecycle.collect(ctx)
    assert lifecycle.finalize_due(ctx) == [batch.id]

    done = client.batches.retrieve(batch.id)
    errors, output = _lines(client, done.error_file_id), _lines(client, done.output_file_id)
    long = errors["long"]["response"]
    assert long["status_code"] == 400 and errors["long"]["error"] is None
    assert {k: long["body"]["error"][k] for k in ("type", "code", "param")} == {
        "type": "invalid_request_error", "code": "context_length_exceeded", "param": "messages"}
    gone = errors["gone"]["response"]["body"]["error"]
    assert (gone["type"], gone["code"]) == ("invalid_request_error", "unknown_url")
    assert "/v1/chat/completions" in gone["message"] and "'m'" in gone["message"]
    # the engine's id of an answer, never the queue's message id ({batch_id}:{custom_id}:{attempt})
    assert output["fine"]["response"]["request_id"] == "chatcmpl-fine"
    assert {row["response"]["request_id"] for row in errors.values()} == {""}
