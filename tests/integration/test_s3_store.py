"""The gateway and the worker on the S3 file store (moto's server mode, in process), selected the
way a deployment selects it: ``BACKFILL_FILE_STORE=s3`` and the ``BACKFILL_S3_*`` variables.

A batch whose input file and output file each span several multipart parts runs end to end with a
stand-in processor: the upload streams into S3, validation and the feeder read it back (whole and
by byte range), finalisation writes the output file in parts, the API serves both files, and
deleting the input file removes its object. Nothing lands on the local disk.
"""

from __future__ import annotations

import orjson
import pytest

from batch_gateway.settings import load_settings
from batch_gateway.store.files.s3 import MIN_PART_BYTES, S3FileStore
from common.contracts.queue import http_result
from tests.integration.test_lifecycle import StandInProcessor, _line
from tests.moto_s3 import aws_test_env, moto_s3_server, multipart_uploads, new_bucket, s3_client
from workers import lifecycle

PREFIX = "backfill-it"
LINES = 6
PROMPT_BYTES = 1_000_000  # six ~1 MB lines: the input file is more than one 5 MiB part
ANSWER_BYTES = 2_000_000  # and the output file more than two


@pytest.fixture(scope="module")
def s3_endpoint():
    with moto_s3_server() as endpoint:
        yield endpoint


@pytest.fixture
def s3_bucket(s3_endpoint, monkeypatch) -> str:
    """A fresh bucket, named to the gateway and the worker through their environment."""
    aws_test_env(monkeypatch)
    bucket = new_bucket(s3_endpoint)
    for name, value in {"BACKFILL_FILE_STORE": "s3", "BACKFILL_S3_BUCKET": bucket, "BACKFILL_S3_PREFIX": PREFIX,
                        "BACKFILL_S3_ENDPOINT_URL": s3_endpoint,
                        "BACKFILL_S3_PART_BYTES": str(MIN_PART_BYTES)}.items():
        monkeypatch.setenv(name, value)
    return bucket


@pytest.fixture
def gateway_settings(gateway_settings, s3_bucket):
    """The shared fixture's settings, rebuilt from an environment that selects S3 (the worker of
    the ``gateway`` fixture reads the same environment)."""
    return load_settings(**gateway_settings.model_dump(
        include={"database_url", "redis_url", "data_dir", "api_key", "task_queue"}))


def _answer(request) -> bytes:
    content = request.metadata["custom_id"] * (ANSWER_BYTES // len(request.metadata["custom_id"]))
    return orjson.dumps({
        "id": f"chatcmpl-{request.metadata['custom_id']}", "object": "chat.completion", "created": 1,
        "model": request.payload["model"],
        "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                     "message": {"role": "assistant", "content": content, "refusal": None}}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13},
    })


def _objects(endpoint: str, bucket: str) -> dict[str, int]:
    listed = s3_client(endpoint).list_objects_v2(Bucket=bucket)
    return {o["Key"]: o["Size"] for o in listed.get("Contents", [])}


def _parts(etag: str) -> int:
    """Parts of a multipart object from its ETag (``"md5-N"``); 0 for a single PUT."""
    tail = etag.strip('"').rpartition("-")[2]
    return int(tail) if "-" in etag else 0


def test_batch_end_to_end_on_s3(gateway, s3_endpoint, s3_bucket):
    ctx = gateway.celery.backfill
    assert isinstance(ctx.store, S3FileStore) and ctx.store.bucket == s3_bucket
    client = gateway.client()
    prompts = {f"r{i}": f"{i}-" + "p" * PROMPT_BYTES for i in range(LINES)}
    body = b"\n".join(_line(cid, system=prompt) for cid, prompt in prompts.items()) + b"\n"
    assert len(body) > MIN_PART_BYTES

    uploaded = client.files.create(file=("in.jsonl", body), purpose="batch")
    input_key = f"{PREFIX}/files/{uploaded.id.split('-', 1)[1][:2]}/{uploaded.id}"
    assert _objects(s3_endpoint, s3_bucket) == {input_key: len(body)}
    assert _parts(s3_client(s3_endpoint).head_object(Bucket=s3_bucket, Key=input_key)["ETag"]) >= 1
    assert client.files.content(uploaded.id).read() == body

    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    gateway.wait_status(batch.id, ("in_progress",))
    proc = StandInProcessor(ctx)
    assert lifecycle.feed(ctx) == LINES
    requests = proc.take()
    # the feeder read each line back from S3 by byte range
    assert {r.metadata["custom_id"]: r.payload["messages"][0]["content"] for r in requests} == prompts
    for request in requests:
        proc.answer(request, http_result(request, 200, _answer(request)))
    assert lifecycle.collect(ctx) == LINES
    assert lifecycle.finalize_due(ctx) == [batch.id]

    done = client.batches.retrieve(batch.id)
    assert done.status == "completed" and done.error_file_id is None
    assert (done.request_counts.completed, done.request_counts.failed) == (LINES, 0)
    output = client.files.content(done.output_file_id).read()
    assert len(output) > MIN_PART_BYTES and len(output) == client.files.retrieve(done.output_file_id).bytes
    rows = {row["custom_id"]: row for row in map(orjson.loads, output.splitlines())}
    assert set(rows) == set(prompts)
    for cid, row in rows.items():
        assert row["response"]["status_code"] == 200
        assert row["response"]["body"]["choices"][0]["message"]["content"] == cid * (ANSWER_BYTES // len(cid))
    head = s3_client(s3_endpoint).head_object(
        Bucket=s3_bucket, Key=f"{PREFIX}/files/{done.output_file_id.split('-', 1)[1][:2]}/{done.output_file_id}")
    assert _parts(head["ETag"]) >= 2  # written at finalisation as a multipart upload
    assert multipart_uploads(s3_endpoint, s3_bucket) == []

    client.files.delete(uploaded.id)
    assert input_key not in _objects(s3_endpoint, s3_bucket)
    local = gateway.settings.files_dir / "files"
    assert not local.exists() or not any(p.is_file() for p in local.rglob("*"))
