"""RELIABILITY.md F3, F4, F6 and F7 on the batch lifecycle (leases shrunk to nothing by moving
``lease_expires_at`` back), with a stand-in processor answering from the request stream; each
test checks its invariant on the output and error files: every custom_id exactly once."""

from __future__ import annotations

import datetime as dt

import pytest
from sqlalchemy import select, update

from batch_gateway.store import queries
from batch_gateway.store.models import BatchRequest, File
from common.contracts.queue import ErrorCode, error_result
from tests.integration.test_lifecycle import StandInProcessor, _line, _lines, _submit
from workers import lifecycle
from workers.lifecycle import output_file_id


def _lapse_leases(gateway, batch_id: str) -> None:
    with gateway.session() as session:
        session.execute(update(BatchRequest).where(BatchRequest.batch_id == batch_id, BatchRequest.state == "queued")
                        .values(lease_expires_at=BatchRequest.lease_expires_at - dt.timedelta(hours=2)))
        session.commit()


def _every_custom_id_once(client, batch, expected: set[str]) -> tuple[dict, dict]:
    output = _lines(client, batch.output_file_id) if batch.output_file_id else {}
    errors = _lines(client, batch.error_file_id) if batch.error_file_id else {}
    assert not set(output) & set(errors)
    assert set(output) | set(errors) == expected
    return output, errors


def test_f3_crash_while_writing_files_leaves_no_half_file_and_the_retry_finishes(gateway, monkeypatch):
    ctx = gateway.celery.backfill
    ids = {f"f{i}" for i in range(6)}
    client, batch = _submit(gateway, [_line(i) for i in sorted(ids)])
    proc = StandInProcessor(ctx)
    lifecycle.feed(ctx)
    for request in proc.take():
        proc.ok(request)
    lifecycle.collect(ctx)

    real_begin = ctx.store.begin

    def dying_begin(key):
        upload = real_begin(key)
        written = []

        def write(chunk):
            written.append(chunk)
            if len(written) == 3:
                raise SystemExit("killed while writing the output file")
            type(upload).write(upload, chunk)

        upload.write = write
        return upload

    monkeypatch.setattr(ctx.store, "begin", dying_begin)
    with pytest.raises(SystemExit):
        lifecycle.finalize(ctx, batch.id)
    assert client.batches.retrieve(batch.id).status == "finalizing"
    with gateway.session() as session:
        assert session.get(File, output_file_id(batch.id, "output")) is None  # nothing published
    assert list((gateway.settings.files_dir / "tmp").iterdir()) == []  # no half file left
    monkeypatch.undo()

    # crash after the files were written but before the state change: the retry writes them again
    real_transition = queries.transition
    monkeypatch.setattr(queries, "transition", lambda *a, **k: (_ for _ in ()).throw(SystemExit("killed")))
    with pytest.raises(SystemExit):
        lifecycle.finalize(ctx, batch.id)
    first_bytes = (gateway.settings.files_dir / "files").rglob(output_file_id(batch.id, "output"))
    first = [p.read_bytes() for p in first_bytes]
    monkeypatch.setattr(queries, "transition", real_transition)

    assert lifecycle.finalize_due(ctx) == [batch.id]
    done = client.batches.retrieve(batch.id)
    assert done.status == "completed" and done.request_counts.completed == 6
    output, _ = _every_custom_id_once(client, done, ids)
    assert first == [client.files.content(done.output_file_id).read()]  # identical files


def test_f4_late_result_after_takeover_is_refused(gateway):
    ctx = gateway.celery.backfill
    client, batch = _submit(gateway, [_line("late"), _line("other")])
    proc = StandInProcessor(ctx)
    lifecycle.feed(ctx)
    first = {m.metadata["custom_id"]: m for m in proc.take()}
    _lapse_leases(gateway, batch.id)  # the stopped processor's lease lapses; the request is fed again
    lifecycle.sweep(ctx)
    lifecycle.feed(ctx)
    second = {m.metadata["custom_id"]: m for m in proc.take()}
    proc.ok(second["late"])
    proc.ok(second["other"])
    assert lifecycle.collect(ctx) == 2
    proc.ok(first["late"], prompt_tokens=999)  # SIGCONT: the stopped processor answers at last
    assert lifecycle.collect(ctx) == 0
    lifecycle.finalize_due(ctx)
    done = client.batches.retrieve(batch.id)
    output, errors = _every_custom_id_once(client, done, {"late", "other"})
    assert errors == {} and done.usage.input_tokens == 20  # the late result counted nowhere


def test_f6_poison_request_ends_after_max_attempts_with_one_error_line(gateway):
    ctx = gateway.celery.backfill
    ctx.settings.max_attempts = 3
    client, batch = _submit(gateway, [_line("poison"), _line("fine")])
    proc = StandInProcessor(ctx)
    for attempt in range(1, 4):
        assert lifecycle.feed(ctx) >= 1
        for request in proc.take():
            if request.metadata["custom_id"] == "poison":
                assert request.metadata["attempt"] == str(attempt)
                proc.answer(request, error_result(request.id, ErrorCode.INFERENCE_ERROR, "engine crashed",
                                                  request.metadata))
            else:
                proc.ok(request)
        lifecycle.collect(ctx)
    assert lifecycle.feed(ctx) == 0  # never fed a fourth time
    assert lifecycle.finalize_due(ctx) == [batch.id]
    done = client.batches.retrieve(batch.id)
    assert done.status == "completed"
    output, errors = _every_custom_id_once(client, done, {"poison", "fine"})
    assert errors["poison"]["response"] is None and errors["poison"]["error"]["code"] == "request_timeout"


def test_f7_redis_restarted_empty_loses_nothing_and_reruns_nothing_finished(gateway):
    ctx = gateway.celery.backfill
    ids = {f"r{i}" for i in range(4)}
    client, batch = _submit(gateway, [_line(i) for i in sorted(ids)])
    proc = StandInProcessor(ctx)
    lifecycle.feed(ctx)
    taken = proc.take()
    for request in taken[:2]:
        proc.ok(request)
    lifecycle.collect(ctx)
    finished = {r.metadata["custom_id"] for r in taken[:2]}

    ctx.queue.redis.flushdb()  # Redis restarted empty: queued requests and results are gone
    _lapse_leases(gateway, batch.id)
    assert lifecycle.sweep(ctx) == 2
    assert lifecycle.feed(ctx) == 2
    again = StandInProcessor(ctx).take()
    assert {m.metadata["custom_id"] for m in again} == ids - finished  # finished ones are not re-run
    for request in again:
        proc.ok(request)
    assert lifecycle.collect(ctx) == 2
    assert lifecycle.finalize_due(ctx) == [batch.id]
    done = client.batches.retrieve(batch.id)
    _every_custom_id_once(client, done, ids)
    with gateway.session() as session:
        attempts = dict(session.execute(select(BatchRequest.custom_id, BatchRequest.attempts)
                                        .where(BatchRequest.batch_id == batch.id)).all())
    assert all(attempts[c] == 1 for c in finished) and all(attempts[c] == 2 for c in ids - finished)
