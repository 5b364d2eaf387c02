"""``backfill up`` as a user runs it: embedded stores on a fresh data directory, one ready line,
the API usable with the printed key, and a clean stop of every child and store on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import psutil

from common.stack_file import load_stack
from tests.conftest import SHARED_BATCHES, free_port


def test_up_runs_the_stack_and_stops_cleanly(tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "backfill", "up", "--data-dir", str(tmp_path / "data"),
         "--port", str(port), "--api-key", "sk-up-test", "--engines", "2",
         "--served-model-name", "gpt-3.5-turbo,intfloat/e5-mistral-7b-instruct"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("backfill ready"), (line, proc.stderr.read() if proc.poll() is not None else "")
        assert f"gateway=http://127.0.0.1:{port}/v1" in line and "api_key=sk-up-test" in line
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 5
        engines = line.split("engines=")[1].split()[0].split(",")
        assert len(engines) == 2
        for engine in engines:
            served = httpx.get(f"{engine}/v1/models", timeout=10).json()
            assert {m["id"] for m in served["data"]} == {"gpt-3.5-turbo", "intfloat/e5-mistral-7b-instruct"}

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-up-test", max_retries=0)
        uploaded = client.files.create(file=(SHARED_BATCHES / "vllm-readme-embeddings.jsonl").open("rb"),
                                       purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings",
                                      completion_window="24h")
        deadline = time.monotonic() + 30
        while client.batches.retrieve(batch.id).status == "validating" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert client.batches.retrieve(batch.id).status == "in_progress"
        # the router keeps Responses state in the stack's Redis: previous_response_id chains turns
        router = load_stack(tmp_path / "data")["router_url"]  # the ready line is short: the map is in stack.json
        direct = openai.OpenAI(base_url=f"{router}/v1", api_key="unused", max_retries=0)
        first = direct.responses.create(model="gpt-3.5-turbo", input="My name is Ada.", max_output_tokens=16)
        second = direct.responses.create(model="gpt-3.5-turbo", input="What is my name?", max_output_tokens=16,
                                         previous_response_id=first.id)
        assert second.previous_response_id == first.id and direct.responses.retrieve(first.id).id == first.id
        seen = [item.content[0].text for item in direct.responses.input_items.list(second.id, order="asc").data
                if item.type == "message" and item.role == "user"]
        assert seen == ["My name is Ada.", "What is my name?"]
        with __import__("pytest").raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong", max_retries=0).files.list()

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        _check_start_up_lines(proc.stderr.read(), line)
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert alive == []
        assert not (tmp_path / "data" / "postgres" / "postmaster.pid").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _check_start_up_lines(stderr: str, ready: str) -> None:
    """Each service got one short line as it became ready, in start order; the ready line is short
    (the full map is in stack.json) and a summary names the dashboard and the key."""
    said = [line.removeprefix("backfill: ") for line in stderr.splitlines() if line.startswith("backfill: ")]
    order = ["redis ready", "postgres ready", "engine ready", "engine ready", "router ready", "beat started",
             "gateway ready", "processor ready", "worker ready"]
    assert [next(p for p in order if s.startswith(p)) for s in said if any(s.startswith(p) for p in order)] == order
    assert all(len(s) < 80 for s in said), said
    assert len(ready) < 250 and " metrics=" not in ready and ready.split()[3] == "admin=-"
    assert "dashboard closed (start with --admin-key" in stderr and "API key sk-up-test" in stderr
    assert "stack.json" in stderr
