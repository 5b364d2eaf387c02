"""RELIABILITY.md F3, F4, F6, F7 and F16 on the batch lifecycle (leases shrunk to nothing by moving
``lease_expires_at`` back, or a lease of seconds), with a stand-in processor answering from the
request stream; each test checks its invariant on the output and error files: every custom_id
exactly once. F16: a lapsed lease whose message is still waiting, held or answered is renewed (no
attempt, no second message); only a message really gone is published again, within lease + sweep."""

from __future__ import annotations

import datetime as dt
import time

import pytest
from sqlalchemy import select, update

from batch_gateway.store import queries
from batch_gateway.store.models import BatchRequest, File
from common.contracts.queue import PROCESSOR_GROUP, ErrorCode, error_result
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
    ctx.queue.redis.delete(ctx.queue.request_stream)  # its messages were lost while it was stopped
    _lapse_leases(gateway, batch.id)  # the lease lapses with the message gone; the request is fed again
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


def _rows(gateway, batch_id: str) -> dict:
    with gateway.session() as session:
        return {r.custom_id: r for r in session.execute(
            select(BatchRequest.custom_id, BatchRequest.state, BatchRequest.attempts, BatchRequest.lease_token,
                   BatchRequest.lease_expires_at, BatchRequest.queue_entry_id)
            .where(BatchRequest.batch_id == batch_id)).all()}


def test_f16_a_lapsed_lease_of_a_message_still_on_its_way_is_renewed_and_only_a_lost_one_is_fed_again(gateway):
    ctx = gateway.celery.backfill
    r = ctx.queue.redis
    stream = ctx.queue.request_stream
    ids = ["waiting", "held", "running", "answered", "deleted", "orphaned"]
    client, batch = _submit(gateway, [_line(i) for i in ids])
    proc = StandInProcessor(ctx)
    assert lifecycle.feed(ctx) == 6
    sent = {m.metadata["custom_id"]: m for m in proc.take()}
    entries = {custom_id: row.queue_entry_id for custom_id, row in _rows(gateway, batch.id).items()}
    assert all(entries.values())  # the feeder recorded each message's stream entry
    r.xgroup_create(stream, PROCESSOR_GROUP, id="0")
    assert len(r.xreadgroup(PROCESSOR_GROUP, "p1", {stream: ">"}, count=10)[0][1]) == 6  # all pending now
    r.xack(stream, PROCESSOR_GROUP, entries["waiting"])
    r.xgroup_setid(stream, PROCESSOR_GROUP, id="0")  # "waiting" looks undelivered again
    for name in ("answered", "deleted", "orphaned"):  # acked and deleted: with a result, or lost
        r.xack(stream, PROCESSOR_GROUP, entries[name])
        r.xdel(stream, entries[name])
    r.set(f"backfill:claim:{sent['answered'].id}", "done", ex=60)  # the collector has not read it yet
    r.set(f"backfill:claim:{sent['running'].id}", "running", px=30_000)  # a processor renews its claim
    with gateway.session() as session:  # a publish whose entry was never recorded: judged by its claim
        session.execute(update(BatchRequest).where(BatchRequest.batch_id == batch.id,
                                                   BatchRequest.custom_id == "orphaned").values(queue_entry_id=None))
        session.commit()
    before = _rows(gateway, batch.id)
    _lapse_leases(gateway, batch.id)

    assert lifecycle.sweep(ctx) == 2  # "deleted" and "orphaned" handed back; the rest renewed
    after = _rows(gateway, batch.id)
    for name in ("waiting", "held", "running", "answered"):
        assert after[name].state == "queued" and after[name].attempts == 1
        assert after[name].lease_token == before[name].lease_token  # its message's result still counts
        assert after[name].lease_expires_at > before[name].lease_expires_at - dt.timedelta(seconds=1)
    assert {n for n, row in after.items() if row.state == "pending"} == {"deleted", "orphaned"}
    assert lifecycle.feed(ctx) == 2
    again = {m.metadata["custom_id"]: m for m in proc.take()}
    assert set(again) == {"deleted", "orphaned"}  # nothing on its way was published twice
    for request in [*again.values(), *(sent[n] for n in ("waiting", "held", "running", "answered"))]:
        proc.ok(request)
    assert lifecycle.collect(ctx) == 6
    assert lifecycle.finalize_due(ctx) == [batch.id]
    done = client.batches.retrieve(batch.id)
    output, errors = _every_custom_id_once(client, done, set(ids))
    assert errors == {} and done.request_counts.completed == 6


def test_f16_waiting_many_leases_never_fails_and_a_real_loss_is_fed_again_within_lease_and_sweep(gateway):
    ctx = gateway.celery.backfill
    ctx.settings.lease_seconds = 1.0
    ctx.settings.max_attempts = 2
    client, batch = _submit(gateway, [_line("q0"), _line("q1")])
    proc = StandInProcessor(ctx)
    assert lifecycle.feed(ctx) == 2
    first = proc.take()
    waited_until = time.monotonic() + 4 * ctx.settings.lease_seconds  # four leases in the queue
    while time.monotonic() < waited_until:
        assert lifecycle.sweep(ctx) == 0
        time.sleep(0.2)
    assert {row.attempts for row in _rows(gateway, batch.id).values()} == {1}
    assert proc.take() == []  # never published again while it waited

    ctx.queue.redis.delete(ctx.queue.request_stream)  # now really lost
    lost_at = time.monotonic()
    while lifecycle.sweep(ctx) == 0:  # a sweep every 0.1 s plus its own time: lease + 10 s on a loaded machine
        assert time.monotonic() - lost_at < ctx.settings.lease_seconds + 10.0, "not handed back within lease + sweep"
        time.sleep(0.1)
    assert lifecycle.feed(ctx) == 2
    again = proc.take()
    assert {m.metadata["attempt"] for m in again} == {"2"}
    for request in [*first, *again]:
        proc.ok(request)  # the first messages' late results are refused
    assert lifecycle.collect(ctx) == 2
    assert lifecycle.finalize_due(ctx) == [batch.id]
    done = client.batches.retrieve(batch.id)
    _every_custom_id_once(client, done, {"q0", "q1"})
    assert done.request_counts.completed == 2 and done.request_counts.failed == 0


def test_f16_one_sweep_renews_a_backlog_larger_than_its_chunk(gateway, monkeypatch):
    from workers.lifecycle import sweeper

    monkeypatch.setattr(sweeper, "SWEEP_CHUNK", 2)
    ctx = gateway.celery.backfill
    client, batch = _submit(gateway, [_line(f"b{i}") for i in range(5)])
    assert lifecycle.feed(ctx) == 5
    _lapse_leases(gateway, batch.id)
    assert lifecycle.sweep(ctx) == 0
    with gateway.session() as session:
        assert queries.lapsed_leases(session) == []  # all five renewed, in three chunks
    assert {(row.state, row.attempts) for row in _rows(gateway, batch.id).values()} == {("queued", 1)}
    assert len(StandInProcessor(ctx).take()) == 5  # and none published twice
