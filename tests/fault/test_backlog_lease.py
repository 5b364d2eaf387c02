"""RELIABILITY.md F16 through ``backfill up``: a backlog that waits for spare capacity many request
leases long (lease 3 s, sweep every second, two requests in flight on slow engines, a small
processor buffer so most messages wait undelivered in the stream) is neither re-run nor failed:
the batch completes with every request succeeded and the engines ran each request exactly once."""

from __future__ import annotations

import re
import time

import httpx
import orjson

from tests.acceptance.test_end_to_end import wait_terminal
from tests.conftest import backfill_up

REQUESTS = 24
LEASE_SECONDS = 3


def _engine_runs(engine_urls: list[str]) -> int:
    """Requests the simulated engines finished, any reason (``vllm:request_success_total``)."""
    total = 0.0
    for url in engine_urls:
        text = httpx.get(f"{url}/metrics", timeout=5).text
        total += sum(float(value) for value in re.findall(r"^vllm:request_success_total\{[^}]*\} (\S+)$", text,
                                                          re.MULTILINE))
    return int(total)


def test_a_backlog_waiting_many_leases_is_run_once_and_completes(tmp_path):
    ids = [f"wait-{i:03d}" for i in range(REQUESTS)]
    (tmp_path / "in.jsonl").write_bytes(b"".join(orjson.dumps({
        "custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "sim-model", "max_tokens": 20, "messages": [{"role": "user", "content": custom_id}]},
    }) + b"\n" for custom_id in ids))
    env = {"BACKFILL_WORKER_LEASE_SECONDS": str(LEASE_SECONDS), "BACKFILL_WORKER_SWEEP_INTERVAL_SECONDS": "1",
           "BACKFILL_PROCESSOR_CONCURRENCY": "2", "BACKFILL_PROCESSOR_BUFFER_SIZE": "2",
           "BACKFILL_PROCESSOR_RECEIVE_BATCH": "2", "BACKFILL_ENGINE_SIM_STEP_OVERHEAD_MS": "50"}
    with backfill_up(tmp_path / "data", "--engines", "2", env=env) as up:
        engines = re.search(r"engines=(\S+)", up.ready_line).group(1).split(",")
        client = up.client()
        uploaded = client.files.create(file=(tmp_path / "in.jsonl").open("rb"), purpose="batch")
        started = time.monotonic()
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        done, _ = wait_terminal(client, batch.id, timeout=120)
        waited = time.monotonic() - started
        output = [orjson.loads(line) for line in client.files.content(done.output_file_id).read().splitlines()] \
            if done.output_file_id else []
        runs = _engine_runs(engines)

    assert waited > 3 * LEASE_SECONDS  # the last requests waited several leases for capacity
    assert done.status == "completed"
    assert (done.request_counts.completed, done.request_counts.failed, done.request_counts.total) == \
        (REQUESTS, 0, REQUESTS)
    assert done.error_file_id is None
    assert sorted(row["custom_id"] for row in output) == ids
    assert runs == REQUESTS  # each custom_id reached an engine once: nothing was published twice
