"""Tenant isolation (RELIABILITY.md bad-input class 8) on every endpoint.

With its own key, tenant A naming tenant B's file or batch — by path, as ``input_file_id``, or as an
``after`` cursor — must get exactly what a never-existing id gets (status, content type and body,
the id string aside); no list ever shows B's objects; and B's objects are unchanged afterwards.
"""

from __future__ import annotations

import json
import uuid

import openai
import pytest
from sqlalchemy import text

ENDPOINT = "/v1/chat/completions"


def _line(custom_id: str) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": ENDPOINT,
                       "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}).encode() + b"\n"


def _missing(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def _shape(response, object_id: str) -> tuple:
    """What a client can tell apart: status, content type and body, with ``object_id`` masked."""
    return (response.status_code, response.headers.get("content-type"),
            response.text.replace(object_id, "<ID>"))


def _snapshot(gateway, client, file_id: str, batch_id: str) -> dict:
    from batch_gateway.store.files import storage_key

    with gateway.session() as session:
        rows = session.execute(text("SELECT count(*) FROM batch_requests WHERE batch_id = :b"),
                               {"b": batch_id}).scalar_one()
        deleted = session.execute(text("SELECT deleted_at FROM files WHERE id = :f"), {"f": file_id}).scalar_one()
    return {
        "file": client.files.retrieve(file_id).model_dump(),
        "content": client.files.content(file_id).content,
        "batch": client.batches.retrieve(batch_id).model_dump(),
        "rows": rows,
        "deleted_at": deleted,
        "on_disk": (gateway.settings.files_dir / storage_key(file_id)).is_file(),
    }


@pytest.fixture
def two_tenants(gateway):
    """Tenant B with a file and an in-progress batch; tenant A with its own file and batch."""
    a, b = gateway.client("tenant-a"), gateway.client("tenant-b")
    b_file = b.files.create(file=("b.jsonl", _line("b1") + _line("b2")), purpose="batch")
    b_batch = b.batches.create(input_file_id=b_file.id, endpoint=ENDPOINT, completion_window="24h",
                               metadata={"owner": "b"}, extra_headers={"Idempotency-Key": "shared-key"})
    a_file = a.files.create(file=("a.jsonl", _line("a1")), purpose="batch")
    a_batch = a.batches.create(input_file_id=a_file.id, endpoint=ENDPOINT, completion_window="24h")
    gateway.wait_status(b_batch.id, ("in_progress",), tenant="tenant-b")
    gateway.wait_status(a_batch.id, ("in_progress",), tenant="tenant-a")
    return a, b, a_file, a_batch, b_file, b_batch


def test_foreign_ids_answer_like_missing_ids_on_every_endpoint(gateway, two_tenants):
    a, b, a_file, a_batch, b_file, b_batch = two_tenants
    http = gateway.http("tenant-a")
    before = _snapshot(gateway, b, b_file.id, b_batch.id)
    missing_file, missing_batch = _missing("file-"), _missing("batch_")

    def create_with(file_id: str):
        return http.post("/v1/batches", json={"input_file_id": file_id, "endpoint": ENDPOINT,
                                              "completion_window": "24h"})

    calls = {
        "GET /files/{id}": (lambda i: http.get(f"/v1/files/{i}"), "file"),
        "GET /files/{id}/content": (lambda i: http.get(f"/v1/files/{i}/content"), "file"),
        "DELETE /files/{id}": (lambda i: http.delete(f"/v1/files/{i}"), "file"),
        "POST /batches input_file_id": (create_with, "file"),
        "GET /batches/{id}": (lambda i: http.get(f"/v1/batches/{i}"), "batch"),
        "POST /batches/{id}/cancel": (lambda i: http.post(f"/v1/batches/{i}/cancel"), "batch"),
        "GET /files?after": (lambda i: http.get("/v1/files", params={"after": i}), "file"),
        "GET /batches?after": (lambda i: http.get("/v1/batches", params={"after": i}), "batch"),
        "GET /files?after=batch": (lambda i: http.get("/v1/files", params={"after": i}), "batch"),
        "GET /batches?after=file": (lambda i: http.get("/v1/batches", params={"after": i}), "file"),
        "GET /files?purpose&after": (lambda i: http.get("/v1/files", params={"after": i, "purpose": "batch",
                                                                             "order": "asc"}), "file"),
    }
    for name, (call, kind) in calls.items():
        foreign, missing = (b_file.id, missing_file) if kind == "file" else (b_batch.id, missing_batch)
        got, want = call(foreign), call(missing)
        assert want.status_code in (400, 404), (name, want.status_code, want.text)
        assert _shape(got, foreign) == _shape(want, missing), name
        body = got.json()
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, name

    # The SDK raises the same error class for a foreign and a missing id.
    for call in (lambda i: a.files.retrieve(i), lambda i: a.files.content(i), lambda i: a.files.delete(i)):
        with pytest.raises(openai.NotFoundError) as foreign:
            call(b_file.id)
        with pytest.raises(openai.NotFoundError) as missing:
            call(missing_file)
        assert json.dumps(foreign.value.body).replace(b_file.id, "<ID>") == \
            json.dumps(missing.value.body).replace(missing_file, "<ID>")
    for call in (lambda i: a.batches.retrieve(i), lambda i: a.batches.cancel(i)):
        with pytest.raises(openai.NotFoundError):
            call(b_batch.id)
    with pytest.raises(openai.BadRequestError) as info:
        a.batches.create(input_file_id=b_file.id, endpoint=ENDPOINT, completion_window="24h")
    assert info.value.body["param"] == "input_file_id"

    # B's objects are untouched, and A created nothing from B's file.
    assert _snapshot(gateway, b, b_file.id, b_batch.id) == before
    assert before["batch"]["status"] == "in_progress" and before["rows"] == 2 and before["on_disk"]
    with gateway.session() as session:
        assert session.execute(text("SELECT count(*) FROM batches WHERE input_file_id = :f"),
                               {"f": b_file.id}).scalar_one() == 1


def test_lists_never_show_another_tenants_objects(gateway, two_tenants):
    a, b, a_file, a_batch, b_file, b_batch = two_tenants
    # More objects on both sides, so that pagination crosses tenants' rows in the shared sequence.
    for i in range(3):
        b.files.create(file=(f"b{i}.jsonl", _line(f"b{i}")), purpose="batch")
        a.files.create(file=(f"a{i}.txt", b"notes"), purpose="user_data")
        b.batches.create(input_file_id=b_file.id, endpoint=ENDPOINT, completion_window="24h")
        a.batches.create(input_file_id=a_file.id, endpoint=ENDPOINT, completion_window="24h")

    def all_ids(client, kind: str, **params) -> list[str]:
        pages = client.files.list(limit=1, **params) if kind == "file" else client.batches.list(limit=1, **params)
        return [obj.id for obj in pages]  # iterating a page follows the cursors

    a_files, b_files = set(all_ids(a, "file")), set(all_ids(b, "file"))
    a_batches, b_batches = set(all_ids(a, "batch")), set(all_ids(b, "batch"))
    assert len(a_files) == 4 and len(b_files) == 4 and not a_files & b_files
    assert len(a_batches) == 4 and len(b_batches) == 4 and not a_batches & b_batches
    assert a_file.id in a_files and b_file.id in b_files
    assert a_batch.id in a_batches and b_batch.id in b_batches
    assert set(all_ids(a, "file", order="asc")) == a_files
    assert set(all_ids(a, "file", purpose="batch")) == {a_file.id}
    assert {f.id for f in a.files.list().data} == a_files
    assert {x.id for x in a.batches.list(limit=100).data} == a_batches
    # A's own id works as a cursor (the control for the foreign-cursor case above).
    assert a.batches.list(after=a_batch.id).data is not None


def test_idempotency_keys_are_per_tenant(gateway, two_tenants):
    a, b, a_file, a_batch, b_file, b_batch = two_tenants
    http = gateway.http("tenant-a")
    # B's exact arguments under B's key: A gets the missing-file answer, never B's batch.
    args = {"input_file_id": b_file.id, "endpoint": ENDPOINT, "completion_window": "24h",
            "metadata": {"owner": "b"}}
    got = http.post("/v1/batches", json=args, headers={"Idempotency-Key": "shared-key"})
    missing = _missing("file-")
    want = http.post("/v1/batches", json={**args, "input_file_id": missing},
                     headers={"Idempotency-Key": "fresh-key"})
    assert got.status_code == 400
    assert _shape(got, b_file.id) == _shape(want, missing)
    # The same key with A's own file: a new batch of A's.
    mine = a.batches.create(input_file_id=a_file.id, endpoint=ENDPOINT, completion_window="24h",
                            metadata={"owner": "b"}, extra_headers={"Idempotency-Key": "shared-key"})
    assert mine.id != b_batch.id and mine.input_file_id == a_file.id
    # And B's key still means B's batch to B.
    again = b.batches.create(input_file_id=b_file.id, endpoint=ENDPOINT, completion_window="24h",
                             metadata={"owner": "b"}, extra_headers={"Idempotency-Key": "shared-key"})
    assert again.id == b_batch.id
