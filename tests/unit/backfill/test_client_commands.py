"""Client commands without a stack: clear one-line errors naming what is missing or unreachable,
the stack file's life cycle, ``demo``'s served models and ``engine-sim --help``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from backfill.cli import main
from backfill.up import free_port

CLIENT_ENV = ("DATABASE_URL", "REDIS_URL", "BACKFILL_PROCESSOR_REDIS_URL", "BACKFILL_API_KEY", "BACKFILL_BASE_URL",
              "OPENAI_API_KEY", "OPENAI_BASE_URL", "BACKFILL_DATA_DIR", "BACKFILL_PROCESSOR_BACKEND")
SHARED_BATCHES = Path(__file__).resolve().parents[4] / "shared" / "data" / "batches"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in CLIENT_ENV:
        monkeypatch.delenv(name, raising=False)


def _invoke(*args: str):
    return CliRunner().invoke(main, list(args))


@pytest.mark.parametrize("args", [
    ("batches", "list"), ("batches", "show", "batch_x"), ("batches", "cancel", "batch_x"),
    ("batches", "download", "batch_x"), ("files", "list"), ("files", "show", "file-x"),
    ("files", "download", "file-x"), ("files", "delete", "file-x"),
])
def test_a_connection_error_names_the_url(args, tmp_path):
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    result = _invoke(*args, "--base-url", url, "--api-key", "sk-x", "--data-dir", str(tmp_path))
    assert result.exit_code == 1, result.output
    assert f"cannot reach the gateway at {url}" in result.output
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)


def test_submit_connection_error_names_the_url(tmp_path):
    url = f"http://127.0.0.1:{free_port()}/v1"
    result = _invoke("submit", str(SHARED_BATCHES / "litellm-batch-small.jsonl"), "--base-url", url,
                     "--api-key", "sk-x")
    assert result.exit_code == 1
    assert f"cannot reach the gateway at {url}" in result.output and "Traceback" not in result.output


def test_client_commands_without_a_stack_name_the_stack_file(tmp_path):
    result = _invoke("batches", "list", "--data-dir", str(tmp_path))
    assert result.exit_code == 1
    assert str(tmp_path / "stack.json") in result.output and "--base-url" in result.output


def test_enqueue_names_an_unreachable_redis(tmp_path):
    url = f"unix://{tmp_path}/no-such.sock"
    result = _invoke("enqueue", "--redis-url", url, "--payload", "{}")
    assert result.exit_code == 1
    assert f"cannot reach Redis at {url}" in result.output and "Traceback" not in result.output


def test_stack_file_is_private_removed_by_its_writer_and_stale_once_its_writer_died(tmp_path):
    from backfill.stack_file import NoStack, load_stack, remove_stack, write_stack

    path = write_stack(tmp_path, {"gateway_url": "http://127.0.0.1:1/v1"})
    assert path.stat().st_mode & 0o777 == 0o600
    assert load_stack(tmp_path)["pid"] == os.getpid()
    info = json.loads(path.read_text())
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    path.write_text(json.dumps({**info, "pid": pid}))  # written by a stack that is gone now
    with pytest.raises(NoStack, match="stale"):
        load_stack(tmp_path)
    remove_stack(tmp_path)  # not ours: left alone
    assert path.exists()
    path.write_text(json.dumps({**info, "pid_started": 1.0}))  # our pid, but another process's start time
    with pytest.raises(NoStack, match="stale"):
        load_stack(tmp_path)
    write_stack(tmp_path, info)
    remove_stack(tmp_path)
    assert not path.exists()
    with pytest.raises(NoStack, match="not found"):
        load_stack(tmp_path)


def test_demo_serves_the_files_models_or_the_names_given(monkeypatch, tmp_path):
    import backfill.submit as submit

    seen = []

    class Done:
        status = "completed"

    monkeypatch.setattr(submit, "_demo", lambda file, data_dir, output_dir, port, names: seen.append(names) or Done())
    public = SHARED_BATCHES / "aibrix-sample-job-input.jsonl"
    assert _invoke("demo", str(public)).exit_code == 0
    assert _invoke("demo", str(public), "--served-model-name", "a,b", "--served-model-name", "c").exit_code == 0
    assert seen == [["gpt-3.5-turbo-0125"], ["a", "b", "c"]]


def test_engine_sim_help_explains_every_option_in_clicks_style():
    from engine_twin.cli import sim_parser

    result = _invoke("engine-sim", "--help")
    assert result.exit_code == 0
    assert result.output.startswith("Usage: backfill engine-sim [OPTIONS]")
    assert "\nOptions:\n" in result.output
    for action in sim_parser()._actions:
        assert action.help, f"{action.option_strings} has no help"
        assert action.option_strings[-1] in result.output
    assert "[default: 16]" in result.output  # defaults come from EngineSimSettings


def test_engine_sim_usage_errors_are_clicks():
    result = _invoke("engine-sim", "--bogus")
    assert result.exit_code == 2
    assert "Error: no such option: --bogus" in result.output and "Traceback" not in result.output


def test_a_cancelled_batchs_counts_say_the_cancel_may_have_stopped_them():
    from openai.types import Batch

    from backfill.batches import _counts

    fields = {"id": "batch_1", "object": "batch", "endpoint": "/v1/chat/completions", "input_file_id": "file-1",
              "completion_window": "24h", "created_at": 0, "request_counts": {"total": 200, "completed": 105, "failed": 95}}
    assert _counts(Batch(**fields, status="cancelled")) == "105/200 ok, 95 failed or cancelled"
    assert _counts(Batch(**fields, status="completed")) == "105/200 ok, 95 failed"
