"""The queries moved into the store from the command line and the ingest benchmark, against a real
database: ``backfill tenants quota`` and ``queued-responses``, and the benchmark's stand-in results."""

from __future__ import annotations

from click.testing import CliRunner
from sqlalchemy import select

from backfill.cli import main
from batch_gateway.store import queries
from batch_gateway.store.db import make_engine, make_sessionmaker
from batch_gateway.store.models import Batch, BatchRequest, File, Tenant
from batch_gateway.store.queries import responses as response_queries
from batch_gateway.store.settings import sqlalchemy_url


def _sessions(database_url: str):
    return make_sessionmaker(make_engine(sqlalchemy_url(database_url), pool_size=1))


def test_tenants_quota_sets_and_clears_the_limit(database_url, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("DATABASE_URL", database_url)
    runner = CliRunner()
    result = runner.invoke(main, ["tenants", "quota", "--tenant", "acme", "--enqueued-tokens", "1234",
                                  "--data-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == "acme: enqueued token limit 1234"
    sessions = _sessions(database_url)
    with sessions() as session:
        assert session.execute(select(Tenant.enqueued_token_limit).where(Tenant.name == "acme")).scalar_one() == 1234
    result = runner.invoke(main, ["tenants", "quota", "--tenant", "acme", "--data-dir", str(tmp_path)])
    assert result.exit_code == 0 and result.output.strip() == "acme: enqueued token limit default"
    with sessions() as session:
        assert session.execute(select(Tenant.enqueued_token_limit).where(Tenant.name == "acme")).scalar_one() is None


def test_tenants_queued_responses_sets_and_clears_the_cap_the_gateway_enforces(database_url, monkeypatch,
                                                                              tmp_path) -> None:
    monkeypatch.setenv("DATABASE_URL", database_url)
    runner = CliRunner()
    result = runner.invoke(main, ["tenants", "queued-responses", "--tenant", "acme", "--limit", "7",
                                  "--data-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == "acme: queued background response limit 7"
    sessions = _sessions(database_url)
    with sessions() as session:
        tenant = session.execute(select(Tenant).where(Tenant.name == "acme")).scalar_one()
        assert tenant.queued_response_limit == 7 and tenant.enqueued_token_limit is None  # only this cap
        assert response_queries.lock_tenant_response_limit(session, tenant.id) == 7  # what the gateway's create reads
    result = runner.invoke(main, ["tenants", "queued-responses", "--tenant", "acme", "--data-dir", str(tmp_path)])
    assert result.exit_code == 0 and result.output.strip() == "acme: queued background response limit default"
    with sessions() as session:
        assert session.execute(select(Tenant.queued_response_limit).where(Tenant.name == "acme")).scalar_one() is None
    assert runner.invoke(main, ["tenants", "queued-responses", "--tenant", "acme", "--limit", "0",
                                "--data-dir", str(tmp_path)]).exit_code == 2


def test_succeed_all_requests_answers_every_request_and_counts_them(database_url) -> None:
    sessions = _sessions(database_url)
    with sessions() as session:
        tenant = queries.ensure_tenant(session, "bench")
        queries.insert_file(session, file_id="file-in", tenant_id=tenant.id, size=1, filename="in.jsonl",
                            purpose="batch", storage_key="files/in/file-in", sha256=None, expires_after_seconds=None)
        batch = queries.insert_batch(session, tenant_id=tenant.id, endpoint="/v1/chat/completions",
                                     input_file_id="file-in", completion_window="24h", window_seconds=86400,
                                     metadata=None, output_expires_after=None, idempotency_key=None,
                                     request_hash=None)
        queries.replace_requests(session, batch.id, [("a", 1, 0, 10, b"p", 3), ("b", 2, 10, 10, b"p", 3)])
        session.execute(Batch.__table__.update().where(Batch.id == batch.id).values(request_total=2))
        queries.succeed_all_requests(session, batch.id, b'{"id": "x"}')
        session.commit()
        rows = session.execute(select(BatchRequest.custom_id, BatchRequest.state, BatchRequest.status_code,
                                      BatchRequest.request_id, BatchRequest.response_body)
                               .where(BatchRequest.batch_id == batch.id).order_by(BatchRequest.line)).all()
        assert [tuple(r) for r in rows] == [("a", "succeeded", 200, "r", b'{"id": "x"}'),
                                            ("b", "succeeded", 200, "r", b'{"id": "x"}')]
        assert session.execute(select(Batch.request_completed).where(Batch.id == batch.id)).scalar_one() == 2
        assert session.get(File, "file-in") is not None
