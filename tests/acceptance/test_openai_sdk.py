"""The Files + Batches API driven by the real ``openai`` client, with every real public batch file
in ../shared/data/batches: upload, create, validate, retrieve, list with pagination, cancel; every
object parses into the SDK's types with the right fields and nulls."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from openai.types import Batch, FileDeleted, FileObject

from tests.conftest import SHARED_BATCHES

SHARED_FILES = sorted(SHARED_BATCHES.glob("*.jsonl"))


def test_shared_batch_files_are_present():
    assert len(SHARED_FILES) >= 6, f"expected the public batch files in {SHARED_BATCHES}"


def _endpoint(path: Path) -> str:
    return "/v1/embeddings" if "embeddings" in path.name else "/v1/chat/completions"


def _request_lines(path: Path) -> int:
    return sum(1 for line in path.read_bytes().splitlines() if line.strip())


@pytest.mark.parametrize("path", SHARED_FILES, ids=lambda p: p.stem)
def test_real_batch_file_validates(gateway, path):
    client = gateway.client()
    uploaded = client.files.create(file=path.open("rb"), purpose="batch")
    assert isinstance(uploaded, FileObject)
    assert uploaded.bytes == path.stat().st_size
    assert uploaded.filename == path.name
    assert uploaded.purpose == "batch" and uploaded.status == "processed"
    assert uploaded.expires_at == uploaded.created_at + 30 * 24 * 3600
    assert client.files.content(uploaded.id).read() == path.read_bytes()

    batch = client.batches.create(input_file_id=uploaded.id, endpoint=_endpoint(path),
                                  completion_window="24h", metadata={"source": path.name})
    assert isinstance(batch, Batch)
    assert batch.status == "validating"
    assert batch.object == "batch" and batch.id.startswith("batch_")
    assert batch.expires_at == batch.created_at + 24 * 3600
    assert batch.metadata == {"source": path.name}
    assert batch.errors is None and batch.output_file_id is None and batch.error_file_id is None
    assert batch.in_progress_at is None and batch.model is None
    assert batch.request_counts.total == 0

    done = gateway.wait_status(batch.id, ("in_progress", "failed"))
    assert done.status == "in_progress", done.errors
    assert done.in_progress_at is not None and done.in_progress_at >= done.created_at
    assert done.request_counts.total == _request_lines(path)
    assert done.request_counts.completed == 0 and done.request_counts.failed == 0
    first_model = next(line for line in path.read_text().splitlines() if line.strip())
    assert done.model and done.model in first_model
    for field in ("finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at", "cancelled_at"):
        assert getattr(done, field) is None, field
    assert done.usage is not None and done.usage.total_tokens == 0

    raw = gateway.http().get(f"/v1/batches/{batch.id}").json()
    assert len(raw) == 22 and "output_expires_after" not in raw


def test_list_pagination_and_files_list(gateway):
    client = gateway.client()
    path = SHARED_BATCHES / "litellm-batch-small.jsonl"
    uploaded = client.files.create(file=path.open("rb"), purpose="batch")
    ids = [client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                 completion_window="2h").id for _ in range(5)]
    page = client.batches.list(limit=2)
    assert [b.id for b in page.data] == ids[::-1][:2]
    assert page.has_more is True
    assert [b.id for b in client.batches.list(limit=2)] == ids[::-1]  # auto-paginates
    second = client.batches.list(limit=2, after=page.data[-1].id)
    assert [b.id for b in second.data] == ids[::-1][2:4]
    last = client.batches.list(limit=2, after=ids[1])
    assert [b.id for b in last.data] == [ids[0]] and last.has_more is False

    other = client.files.create(file=("notes.txt", b"hello"), purpose="user_data")
    assert other.expires_at is None
    assert [f.id for f in client.files.list(purpose="batch")] == [uploaded.id]
    assert [f.id for f in client.files.list(order="asc")] == [uploaded.id, other.id]
    assert [f.id for f in client.files.list(order="desc", limit=1)] == [other.id, uploaded.id]
    deleted = client.files.delete(other.id)
    assert isinstance(deleted, FileDeleted) and deleted.deleted is True and deleted.id == other.id
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(other.id)
    assert [f.id for f in client.files.list()] == [uploaded.id]


def test_expires_after_and_completion_window_extension(gateway):
    client = gateway.client()
    uploaded = client.files.create(file=(SHARED_BATCHES / "aibrix-sample-job-input.jsonl").open("rb"),
                                   purpose="batch", expires_after={"anchor": "created_at", "seconds": 7200})
    assert uploaded.expires_at == uploaded.created_at + 7200
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="30m",
                                  extra_body={"output_expires_after": {"anchor": "created_at", "seconds": 3600}})
    assert batch.completion_window == "30m"
    assert batch.expires_at == batch.created_at + 1800
    with pytest.raises(openai.BadRequestError) as bad:
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                              completion_window="forever")
    assert bad.value.body["param"] == "completion_window"


def test_cancel_validating_then_in_progress(gateway):
    client = gateway.client()
    uploaded = client.files.create(file=(SHARED_BATCHES / "vllm-openai-example-batch.jsonl").open("rb"),
                                   purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    running = gateway.wait_status(batch.id, ("in_progress",))
    cancelled = client.batches.cancel(running.id)
    assert cancelled.status == "cancelled"  # nothing had run yet: straight to cancelled
    assert cancelled.cancelling_at is not None and cancelled.cancelled_at is not None
    with pytest.raises(openai.ConflictError):  # an ended batch refuses a cancel, whatever way it ended
        client.batches.cancel(running.id)
    assert client.batches.retrieve(running.id).status == "cancelled"
