"""``backfill demo`` on a public batch file: its engines serve the models the file names, so every
line is answered (before, every line failed with 404: the file's model was not served)."""

from __future__ import annotations

import os
import subprocess
import sys

import orjson

from backfill.up import free_port
from tests.conftest import SHARED_BATCHES


def test_demo_runs_a_public_file_naming_its_own_model(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "BACKFILL_DATA_DIR")}
    public = SHARED_BATCHES / "litellm-batch-small.jsonl"  # model gpt-3.5-turbo, 3 lines
    done = subprocess.run([sys.executable, "-m", "backfill", "demo", str(public), "--port", str(free_port()),
                           "--data-dir", str(tmp_path / "data"), "--output-dir", str(tmp_path / "results")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "serving gpt-3.5-turbo" in done.stdout
    outputs = list((tmp_path / "results").glob("*_output.jsonl"))
    assert len(outputs) == 1 and not list((tmp_path / "results").glob("*_errors.jsonl")), done.stdout
    lines = [orjson.loads(line) for line in outputs[0].read_bytes().splitlines()]
    assert sorted(line["custom_id"] for line in lines) == ["request-1", "request-2", "request-3"]
    assert all(line["response"]["status_code"] == 200 for line in lines)
