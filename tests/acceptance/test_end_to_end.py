"""Every real public batch file through ``backfill up`` (gateway, worker + beat, processor,
simulated engines) with the real ``openai`` client, as a user runs it: statuses and timestamps in
order, counts, every custom_id exactly once across the output and error files, lines that parse
into the SDK's types, usage totals equal to the sum of the lines."""

from __future__ import annotations

import time

import orjson
import pytest
from openai.types import CreateEmbeddingResponse
from openai.types.chat import ChatCompletion

from tests.conftest import SHARED_BATCHES, backfill_up

SERVED = ["gpt-3.5-turbo", "gpt-3.5-turbo-0125", "meta-llama/Meta-Llama-3-8B-Instruct",
          "intfloat/e5-mistral-7b-instruct"]
"""Every model of the shared files except Azure's placeholder deployment name, whose batch must then
fail at validation with ``model_not_found`` (the worker asks the router's ``/v1/models``), as
OpenAI's batches do, instead of running every line to a 404."""


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with backfill_up(tmp_path_factory.mktemp("e2e") / "data", "--engines", "1",
                     "--served-model-name", ",".join(SERVED)) as up:
        yield up.client()


def wait_terminal(client, batch_id: str, timeout: float = 90.0):
    """Poll until the batch ends; returns it and the statuses seen, in order."""
    deadline = time.monotonic() + timeout
    seen = []
    while True:
        batch = client.batches.retrieve(batch_id)
        if not seen or seen[-1] != batch.status:
            seen.append(batch.status)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch, seen
        assert time.monotonic() < deadline, f"{batch_id} still {batch.status}"
        time.sleep(0.2)


@pytest.mark.parametrize("path", sorted(SHARED_BATCHES.glob("*.jsonl")), ids=lambda p: p.stem)
def test_shared_batch_file_runs_end_to_end(stack, path):
    client = stack
    endpoint = "/v1/embeddings" if "embeddings" in path.name else "/v1/chat/completions"
    custom_ids = [orjson.loads(line)["custom_id"] for line in path.read_bytes().splitlines() if line.strip()]
    uploaded = client.files.create(file=path.open("rb"), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h")
    done, statuses = wait_terminal(client, batch.id)

    if "REPLACE-WITH-MODEL-DEPLOYMENT-NAME" in path.read_text():
        assert done.status == "failed" and set(statuses) <= {"validating", "failed"}, statuses
        assert [(e.code, e.line, e.param) for e in done.errors.data] == [("model_not_found", 1, "body.model")]
        assert "'REPLACE-WITH-MODEL-DEPLOYMENT-NAME'" in done.errors.data[0].message
        assert done.output_file_id is None and done.error_file_id is None
        return
    assert done.status == "completed", (statuses, done.errors)
    assert set(statuses) <= {"validating", "in_progress", "finalizing", "completed"}
    assert done.created_at <= done.in_progress_at <= done.finalizing_at <= done.completed_at
    assert done.failed_at is None and done.expired_at is None and done.cancelled_at is None
    counts = done.request_counts
    assert counts.total == len(custom_ids) == counts.completed + counts.failed

    output = [orjson.loads(x) for x in client.files.content(done.output_file_id).read().splitlines()] \
        if done.output_file_id else []
    errors = [orjson.loads(x) for x in client.files.content(done.error_file_id).read().splitlines()] \
        if done.error_file_id else []
    assert len(output) == counts.completed and len(errors) == counts.failed
    assert sorted(row["custom_id"] for row in output + errors) == sorted(custom_ids)

    body_type = CreateEmbeddingResponse if endpoint == "/v1/embeddings" else ChatCompletion
    for row in output:
        assert row["error"] is None and row["id"].startswith("batch_req_")
        assert row["response"]["status_code"] == 200
        body_type.model_validate(row["response"]["body"])
    usage = [row["response"]["body"]["usage"] for row in output]
    assert done.usage.input_tokens == sum(u["prompt_tokens"] for u in usage)
    assert done.usage.output_tokens == sum(u.get("completion_tokens", 0) for u in usage)
    assert done.usage.total_tokens == done.usage.input_tokens + done.usage.output_tokens

    assert errors == [] and done.error_file_id is None
