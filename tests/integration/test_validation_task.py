"""The validate task through the real API and worker: request rows written once per custom_id with
the byte range of their line, guarded transitions, the enqueued-token quota, outbox relay."""

from __future__ import annotations

import openai
import pytest
from sqlalchemy import select, update

from batch_gateway.store.models import Batch, BatchRequest, Event, Tenant
from tests.conftest import SHARED_BATCHES


def _upload(client, data: bytes, name: str = "in.jsonl"):
    return client.files.create(file=(name, data), purpose="batch")


def _line(custom_id: str, content: str = "hi", model: str = "m") -> bytes:
    return (b'{"custom_id": "%s", "method": "POST", "url": "/v1/chat/completions", '
            b'"body": {"model": "%s", "messages": [{"role": "user", "content": "%s"}]}}'
            % (custom_id.encode(), model.encode(), content.encode()))


def test_rows_locate_each_line_in_the_input_file(gateway):
    client = gateway.client()
    data = b"\xef\xbb\xbf" + _line("a", "x" * 40) + b"\r\n\r\n" + _line("b", "sys prompt") + b"\n" + _line("c")
    uploaded = _upload(client, data)
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    done = gateway.wait_status(batch.id, ("in_progress", "failed"))
    assert done.status == "in_progress", done.errors
    with gateway.session() as session:
        rows = {r.custom_id: r for r in session.execute(
            select(BatchRequest).where(BatchRequest.batch_id == batch.id)).scalars()}
        events = [e.type for e in session.execute(
            select(Event).where(Event.batch_id == batch.id).order_by(Event.id)).scalars()]
        enqueued = session.get(Batch, batch.id).enqueued_tokens
    assert sorted(rows) == ["a", "b", "c"]
    assert [rows[c].line for c in "abc"] == [1, 3, 4]
    for custom_id, row in rows.items():
        piece = data[row.byte_offset: row.byte_offset + row.byte_length]
        assert piece == _line(custom_id, {"a": "x" * 40, "b": "sys prompt", "c": "hi"}[custom_id])
        assert row.state == "pending" and row.attempts == 0
    assert rows["a"].prefix_key.startswith(b"x" * 40)
    assert enqueued == sum(r.est_tokens for r in rows.values()) > 0
    assert events == ["batch.created", "batch.in_progress"]


def test_validate_twice_is_harmless(gateway):
    from workers.tasks import validate_batch

    client = gateway.client()
    uploaded = _upload(client, _line("a") + b"\n" + _line("b") + b"\n")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    first = gateway.wait_status(batch.id, ("in_progress",))
    assert validate_batch(gateway.celery.backfill, batch.id) == "in_progress"
    after = client.batches.retrieve(batch.id)
    assert after.in_progress_at == first.in_progress_at and after.request_counts.total == 2
    with gateway.session() as session:
        assert len(session.execute(select(BatchRequest).where(BatchRequest.batch_id == batch.id)).all()) == 2


def _set_limit(gateway, tokens: int) -> None:
    with gateway.session() as session:
        session.execute(update(Tenant).where(Tenant.name == "default").values(enqueued_token_limit=tokens))
        session.commit()


def test_token_quota_refuses_create_and_releases_when_a_batch_ends(gateway):
    client = gateway.client()
    data = _line("b", "z" * 4000) + b"\n"  # ~1,025 tokens reserved at create (file bytes / 4), 1,000 after validation
    small = _upload(client, data)
    _set_limit(gateway, 900)
    with pytest.raises(openai.RateLimitError) as refused:
        client.batches.create(input_file_id=small.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert refused.value.status_code == 429 and refused.value.body["code"] == "token_limit_exceeded"
    assert "Enqueued token limit reached" in refused.value.body["message"]
    assert refused.value.response.headers["x-should-retry"] == "false"  # final: the SDK raises at once
    assert "retry-after" not in refused.value.response.headers

    _set_limit(gateway, 2000)
    first = client.batches.create(input_file_id=small.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert gateway.wait_status(first.id, ("in_progress",)).status == "in_progress"
    with gateway.session() as session:
        assert session.get(Batch, first.id).enqueued_tokens == 1000
    with pytest.raises(openai.RateLimitError):  # 1,000 enqueued + 1,025 reserved > 2,000
        client.batches.create(input_file_id=small.id, endpoint="/v1/chat/completions", completion_window="24h")

    client.batches.cancel(first.id)  # the quota is released when a batch ends
    again = client.batches.create(input_file_id=small.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert again.status == "validating"


def test_validation_fails_a_batch_over_the_quota_it_meets_then(gateway):
    from workers.tasks import validate_batch

    client = gateway.client()
    uploaded = _upload(client, _line("a", "y" * 4000) + b"\n")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    gateway.wait_status(batch.id, ("in_progress",))
    with gateway.session() as session:  # the quota was lowered while the batch waited for validation
        session.execute(update(Batch).where(Batch.id == batch.id).values(status="validating", in_progress_at=None))
        session.execute(BatchRequest.__table__.delete().where(BatchRequest.batch_id == batch.id))
        session.commit()
    _set_limit(gateway, 900)
    assert validate_batch(gateway.celery.backfill, batch.id) == "failed"
    failed = client.batches.retrieve(batch.id)
    assert failed.errors.data[0].code == "token_limit_exceeded"
    assert "Enqueued token limit reached" in failed.errors.data[0].message
    with gateway.session() as session:
        assert session.execute(select(BatchRequest).where(BatchRequest.batch_id == batch.id)).first() is None


def test_outbox_relay_sends_what_the_broker_missed(gateway):
    from workers.tasks import relay_outbox, validate_batch

    client = gateway.client()
    uploaded = client.files.create(file=(SHARED_BATCHES / "litellm-batch-small.jsonl").open("rb"), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    gateway.wait_status(batch.id, ("in_progress",))
    with gateway.session() as session:  # pretend the hand-off after commit never happened
        session.execute(update(Batch).where(Batch.id == batch.id).values(status="validating", in_progress_at=None))
        session.execute(update(Event).where(Event.batch_id == batch.id).values(
            published_at=None, created_at=Event.created_at - __import__("datetime").timedelta(minutes=1)))
        session.commit()
    assert relay_outbox(gateway.celery.backfill) == 1
    assert gateway.wait_status(batch.id, ("in_progress",)).status == "in_progress"
    assert relay_outbox(gateway.celery.backfill) == 0
    assert validate_batch(gateway.celery.backfill, "batch_missing") == "missing"


def test_validation_that_keeps_failing_fails_the_batch_and_stale_ones_are_resent(gateway, monkeypatch):
    from workers import tasks

    client = gateway.client()
    uploaded = _upload(client, _line("a") + b"\n")
    calls = []

    def broken(ctx, batch_id):
        calls.append(batch_id)
        raise RuntimeError("store unreachable")

    monkeypatch.setattr(tasks, "validate_batch", broken)
    monkeypatch.setattr(tasks, "VALIDATE_RETRIES", 1)
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    failed = gateway.wait_status(batch.id, ("failed",))
    assert failed.errors.data[0].code == "validation_error"
    assert len(calls) >= 2  # tried, retried, then gave up

    monkeypatch.undo()
    second = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    gateway.wait_status(second.id, ("in_progress",))
    with gateway.session() as session:  # as if its task had been lost ten minutes ago
        session.execute(update(Batch).where(Batch.id == second.id).values(
            status="validating", in_progress_at=None, created_at=Batch.created_at - 601))
        session.commit()
    assert tasks.resend_stale_validations(gateway.celery.backfill) == 1
    assert gateway.wait_status(second.id, ("in_progress",)).status == "in_progress"


class FakeRouter:
    """The router's ``GET /v1/models`` and nothing else (OpenAI's list shape), counting calls."""

    def __init__(self, models: list[str]):
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        self.models = models
        self.calls = 0

        async def models_route(request):
            self.calls += 1
            return JSONResponse({"object": "list", "data": [
                {"id": m, "object": "model", "created": 0, "owned_by": "backfill"} for m in self.models]})

        self.app = Starlette(routes=[Route("/v1/models", models_route)])


@pytest.fixture
def fake_router(gateway):
    from backfill.up import free_port
    from tests.conftest import serve

    router = FakeRouter(["served-model"])
    port = free_port()
    with serve(router.app, port):
        gateway.celery.backfill.settings.router_url = f"http://127.0.0.1:{port}"
        yield router


def test_a_model_no_engine_serves_fails_the_batch_at_validation(gateway, fake_router):
    client = gateway.client()
    data = b"\n" + b"\n".join(_line(f"r{i}", model="gpt-4o-mini") for i in range(50)) + b"\n"
    batch = client.batches.create(input_file_id=_upload(client, data).id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    done = gateway.wait_status(batch.id, ("in_progress", "failed"))
    assert done.status == "failed"
    assert len(done.errors.data) == 1
    error = done.errors.data[0]
    assert (error.code, error.line, error.param) == ("model_not_found", 2, "body.model")  # line 1 is blank
    assert "'gpt-4o-mini'" in error.message and "'served-model'" in error.message
    with gateway.session() as session:  # nothing was queued
        assert session.execute(select(BatchRequest).where(BatchRequest.batch_id == batch.id)).first() is None

    # a served model runs; the list is asked once for both batches (cached briefly)
    ok = client.batches.create(input_file_id=_upload(client, _line("a", model="served-model")).id,
                               endpoint="/v1/chat/completions", completion_window="24h")
    assert gateway.wait_status(ok.id, ("in_progress", "failed")).status == "in_progress"
    assert fake_router.calls == 1


def test_a_fleet_that_cannot_be_asked_leaves_the_model_to_the_engines(gateway, caplog):
    from backfill.up import free_port

    gateway.celery.backfill.settings.router_url = f"http://127.0.0.1:{free_port()}"  # nothing listens
    client = gateway.client()
    batch = client.batches.create(input_file_id=_upload(client, _line("a", model="gpt-4o-mini")).id,
                                  endpoint="/v1/chat/completions", completion_window="24h")
    assert gateway.wait_status(batch.id, ("in_progress", "failed")).status == "in_progress"
    assert any(getattr(r, "action", None) == "fleet_models_unknown" for r in caplog.records)
