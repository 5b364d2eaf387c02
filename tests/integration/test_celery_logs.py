"""``backfill beat``, ``backfill worker`` and ``backfill gateway`` as subprocesses on the test stores:
everything they write (stdout and stderr) is JSON lines, Celery's banners included, no line carries
uvicorn's ``color_message``, and beat's per-task "Sending due task" line is not at INFO
(docs/observability.md "Logs")."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

WAIT_SECONDS = 60.0
"""Longest wait for a process to log what a test looks for (a bound against hanging, not a speed
check: the process is stopped as soon as it has)."""


def run_until(args: list[str], env: dict[str, str], done: Callable[[list[dict]], bool]) -> list[str]:
    """Run ``python -m backfill *args`` until ``done(records)`` holds for the JSON records it has
    written so far (or :data:`WAIT_SECONDS` pass), stop it with SIGTERM and return every line it
    wrote to stdout and stderr."""
    proc = subprocess.Popen([sys.executable, "-m", "backfill", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + WAIT_SECONDS
    while time.monotonic() < deadline and proc.poll() is None and not done(_records(list(lines))):
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    reader.join(10)
    return [line.rstrip("\n") for line in lines if line.strip()]


def _records(lines: list[str]) -> list[dict]:
    """The JSON objects among ``lines`` (what a process wrote so far; the rest is judged later)."""
    records = []
    for line in lines:
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict):
                records.append(record)
    return records


def parsed(lines: list[str]) -> list[dict]:
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            pytest.fail(f"not a JSON line: {line!r}\n(all output: {lines})")
        assert isinstance(record, dict), line
        records.append(record)
    return records


@pytest.fixture
def celery_env(stores, database_url, tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "REDIS_URL": stores.redis_url, "DATABASE_URL": database_url,
            "BACKFILL_LOG_FORMAT": "json", "BACKFILL_DATA_DIR": str(tmp_path),
            "BACKFILL_WORKER_TASK_QUEUE": f"backfill-logs-{os.getpid()}"}


def _due_task_line(records: list[dict]) -> bool:
    return any(r.get("message", "").startswith("Scheduler: Sending due task") for r in records)


def test_beat_writes_only_json_and_no_due_task_line_at_info(celery_env, tmp_path):
    queue = redis.Redis.from_url(celery_env["REDIS_URL"])

    def sent_a_task(records: list[dict]) -> bool:  # a due task reached the task queue: its line was due
        return any(r.get("action") == "beat_started" for r in records) and \
            queue.llen(celery_env["BACKFILL_WORKER_TASK_QUEUE"]) > 0

    records = parsed(run_until(["beat", "--data-dir", str(tmp_path), "--log-level", "INFO"], celery_env, sent_a_task))
    assert sent_a_task(records), records
    assert any(r.get("action") == "beat_started" for r in records), records  # the banner, as JSON
    assert not [r for r in records if "Sending due task" in r.get("message", "")]
    assert all("color_message" not in r for r in records)


def test_beat_keeps_the_due_task_line_at_debug(celery_env, tmp_path):
    records = parsed(run_until(["beat", "--data-dir", str(tmp_path), "--log-level", "DEBUG"], celery_env,
                               _due_task_line))
    due = [r for r in records if r.get("message", "").startswith("Scheduler: Sending due task")]
    assert due and {r["level"] for r in due} == {"DEBUG"}


def test_worker_writes_only_json_banner_included(celery_env):
    def started(records: list[dict]) -> bool:
        return any(r.get("action") == "worker_started" for r in records) and \
            any(r.get("message", "").endswith(" ready.") for r in records)

    records = parsed(run_until(["worker", "--pool", "solo", "--log-level", "INFO"], celery_env, started))
    banner = [r for r in records if r.get("action") == "worker_started"]
    assert banner and "\x1b[" not in banner[0]["banner"] and "transport" in banner[0]["banner"]
    assert any(r.get("logger", "").startswith("celery") for r in records)  # Celery's own lines, as JSON
    assert all("color_message" not in r for r in records)
    assert any(r.get("action") == "worker_stopped" for r in records)  # not Celery's "Warm shutdown" text


def test_gateway_writes_json_without_color_message(celery_env):
    from backfill.up import free_port

    def running(records: list[dict]) -> bool:
        return any(r.get("message", "").startswith("Uvicorn running on") for r in records)

    port = free_port()
    records = parsed(run_until(["gateway", "--port", str(port), "--log-level", "info"], celery_env, running))
    running_lines = [r for r in records if r.get("message", "").startswith("Uvicorn running on")]
    assert running_lines and all("color_message" not in r for r in records)
