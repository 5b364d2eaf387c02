"""``backfill beat``, ``backfill worker`` and ``backfill gateway`` as subprocesses on the test stores:
everything they write (stdout and stderr) is JSON lines, Celery's banners included, no line carries
uvicorn's ``color_message``, and beat's per-task "Sending due task" line is not at INFO
(docs/observability.md "Logs")."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

RUN_SECONDS = 6.0


def run_for(args: list[str], env: dict[str, str], seconds: float = RUN_SECONDS) -> list[str]:
    """Run ``python -m backfill *args`` for ``seconds``, stop it with SIGTERM and return every
    line it wrote to stdout and stderr."""
    proc = subprocess.Popen([sys.executable, "-m", "backfill", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    time.sleep(seconds)
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return [line for line in out.splitlines() if line.strip()]


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


def test_beat_writes_only_json_and_no_due_task_line_at_info(celery_env, tmp_path):
    records = parsed(run_for(["beat", "--data-dir", str(tmp_path), "--log-level", "INFO"], celery_env))
    assert any(r.get("action") == "beat_started" for r in records), records  # the banner, as JSON
    assert not [r for r in records if "Sending due task" in r.get("message", "")]
    assert all("color_message" not in r for r in records)


def test_beat_keeps_the_due_task_line_at_debug(celery_env, tmp_path):
    records = parsed(run_for(["beat", "--data-dir", str(tmp_path), "--log-level", "DEBUG"], celery_env))
    due = [r for r in records if r.get("message", "").startswith("Scheduler: Sending due task")]
    assert due and {r["level"] for r in due} == {"DEBUG"}


def test_worker_writes_only_json_banner_included(celery_env):
    records = parsed(run_for(["worker", "--pool", "solo", "--log-level", "INFO"], celery_env))
    banner = [r for r in records if r.get("action") == "worker_started"]
    assert banner and "\x1b[" not in banner[0]["banner"] and "transport" in banner[0]["banner"]
    assert any(r.get("logger", "").startswith("celery") for r in records)  # Celery's own lines, as JSON
    assert all("color_message" not in r for r in records)
    assert any(r.get("action") == "worker_stopped" for r in records)  # not Celery's "Warm shutdown" text


def test_gateway_writes_json_without_color_message(celery_env):
    from backfill.up import free_port

    port = free_port()
    records = parsed(run_for(["gateway", "--port", str(port), "--log-level", "info"], celery_env, seconds=5.0))
    running = [r for r in records if r.get("message", "").startswith("Uvicorn running on")]
    assert running and all("color_message" not in r for r in records)
