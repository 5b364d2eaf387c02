"""RELIABILITY.md F1 and friends through ``backfill up``: SIGKILL the processor and the Celery
worker while a batch of 1,500 requests runs; ``backfill up`` restarts them, the new processor takes
over the dead one's pending entries after its lease, and the batch completes with every custom_id
exactly once across the output and error files."""

from __future__ import annotations

import time

import orjson

from tests.acceptance.test_end_to_end import wait_terminal
from tests.conftest import backfill_up

REQUESTS = 1500


def _batch_file(path) -> list[str]:
    ids = [f"req-{i:05d}" for i in range(REQUESTS)]
    path.write_bytes(b"".join(orjson.dumps({
        "custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "sim-model", "max_tokens": 4,
                 "messages": [{"role": "system", "content": f"shared prefix {i % 7}"},
                              {"role": "user", "content": custom_id}]}}) + b"\n" for i, custom_id in enumerate(ids)))
    return ids


def test_killed_processor_and_worker_lose_and_double_nothing(tmp_path):
    ids = _batch_file(tmp_path / "in.jsonl")
    env = {"BACKFILL_PROCESSOR_LEASE_S": "3", "BACKFILL_WORKER_FEED_WINDOW": "600"}
    with backfill_up(tmp_path / "data", "--engines", "1", env=env) as up:
        client = up.client()
        uploaded = client.files.create(file=(tmp_path / "in.jsonl").open("rb"), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        deadline = time.monotonic() + 60
        while client.batches.retrieve(batch.id).request_counts.completed < 100:
            assert time.monotonic() < deadline, "the batch did not start"
            time.sleep(0.05)
        processor = up.child("processor")
        processor.kill()  # SIGKILL with requests in flight
        worker = up.child("worker")
        worker.kill()
        done, _ = wait_terminal(client, batch.id, timeout=180)
        assert up.child("processor").pid != processor.pid  # restarted by backfill up
        assert up.child("worker").pid != worker.pid
        output = _lines(client, done.output_file_id)
        errors = _lines(client, done.error_file_id)

    assert done.status == "completed"
    assert done.request_counts.total == REQUESTS
    assert sorted(row["custom_id"] for row in output + errors) == ids  # every custom_id exactly once
    assert errors == [] and done.request_counts.completed == REQUESTS


def _lines(client, file_id: str | None) -> list[dict]:
    return [orjson.loads(line) for line in client.files.content(file_id).read().splitlines()] if file_id else []
