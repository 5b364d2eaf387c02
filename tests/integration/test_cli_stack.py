"""The client commands against one ``backfill up`` stack, found as a user finds it: from
``DATA_DIR/stack.json``, with no URL or key given.

``stack.json`` and the embedded Redis's stable socket, ``enqueue`` (found queue, refused lane),
``submit`` (``--no-wait`` JSON, ``--wait`` exit status), ``batches`` / ``files``, ``keys list``
and the Celery broker URL in the form kombu (Flower) accepts.
"""

from __future__ import annotations

import json
import os
import time

import orjson
import pytest
from click.testing import CliRunner

from backfill.cli import main
from tests.conftest import SHARED_BATCHES, backfill_up

CLIENT_ENV = ("DATABASE_URL", "REDIS_URL", "BACKFILL_PROCESSOR_REDIS_URL", "BACKFILL_API_KEY", "BACKFILL_BASE_URL",
              "OPENAI_API_KEY", "OPENAI_BASE_URL", "BACKFILL_DATA_DIR")
CHAT_FILE = SHARED_BATCHES / "litellm-batch-small.jsonl"  # model gpt-3.5-turbo, 3 lines


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("cli") / "data"
    with backfill_up(data_dir, "--engines", "1", "--served-model-name", "gpt-3.5-turbo") as up:
        yield up, data_dir
    assert not (data_dir / "stack.json").exists(), "stack.json must be removed when the stack stops"


@pytest.fixture
def cli(stack, monkeypatch):
    """Run ``backfill ARGS --data-dir DIR`` in-process with no URL, key or store in the environment."""
    for name in CLIENT_ENV:
        monkeypatch.delenv(name, raising=False)
    _, data_dir = stack

    def run(*args: str, data_dir=data_dir):
        return CliRunner().invoke(main, [*args, "--data-dir", str(data_dir)], catch_exceptions=False)

    return run


def test_stack_file_records_the_endpoints_and_a_stable_redis_socket(stack):
    up, data_dir = stack
    info = json.loads((data_dir / "stack.json").read_text())
    assert (data_dir / "stack.json").stat().st_mode & 0o077 == 0  # it holds the API key
    assert info["status"] == "running" and info["pid"] == up.proc.pid
    assert info["gateway_url"] == up.base_url and info["api_key"] == up.api_key
    socket_path = (data_dir / "redis" / "redis.sock").resolve()
    assert info["redis_url"] == f"unix://{socket_path}"
    assert info["celery_broker_url"] == f"redis+socket://{socket_path}"
    assert "broker=" not in up.ready_line and len(up.ready_line) < 400  # the full map is here, not there
    assert set(info["health"]) >= {"gateway", "router", "processor", "worker"}
    assert info["router_url"] and info["database_url"] and info["metrics"]["gateway"].endswith("/metrics")


def test_the_broker_url_is_one_kombu_connects_to(stack):
    """Flower and ``celery inspect`` take the broker URL printed by ``backfill up``."""
    from kombu import Connection

    _, data_dir = stack
    url = json.loads((data_dir / "stack.json").read_text())["celery_broker_url"]
    with Connection(url, connect_timeout=5) as connection:
        connection.ensure_connection(max_retries=1)
        assert connection.connected


def test_enqueue_finds_the_stack_and_gets_a_result(cli):
    result = cli("enqueue", "--lane", "interactive", "--wait", "--timeout", "60", "--payload",
                 orjson.dumps({"model": "gpt-3.5-turbo", "messages": [{"role": "user", "content": "hi"}],
                               "max_tokens": 2}).decode())
    assert result.exit_code == 0, result.output
    answer = orjson.loads(result.output.strip().splitlines()[-1])
    assert answer["status_code"] == 200, answer
    assert answer["payload"]["choices"][0]["message"]["role"] == "assistant"  # the answer as JSON, not a string


def test_enqueue_wait_exits_non_zero_on_an_error_result(cli):
    result = cli("enqueue", "--lane", "interactive", "--wait", "--timeout", "60", "--payload",
                 orjson.dumps({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}).decode())
    assert result.exit_code == 3, result.output  # the result came: an error, not a timeout (1)
    answer = orjson.loads(result.output.strip().splitlines()[-1])
    assert answer["status_code"] == 404, answer
    refused = cli("enqueue", "--deadline-in", "-5", "--payload", "{}")
    assert refused.exit_code == 2 and "--deadline-in" in refused.output


def test_enqueue_refuses_a_lane_no_processor_reads(cli):
    result = cli("enqueue", "--pool", "nobody-reads-this", "--payload", "{}")
    assert result.exit_code == 1
    assert "no processor reads backfill:requests:nobody-reads-this:batch" in result.output
    assert "Traceback" not in result.output


def test_enqueue_without_a_stack_names_the_missing_stack_file(cli, tmp_path):
    result = cli("enqueue", "--payload", "{}", data_dir=tmp_path)
    assert result.exit_code == 1
    assert str(tmp_path / "stack.json") in result.output and "--redis-url" in result.output


def test_submit_no_wait_prints_the_batch_as_json(cli):
    result = cli("submit", str(CHAT_FILE), "--no-wait")
    assert result.exit_code == 0, result.output
    batch = json.loads(result.stdout)  # standard output is the JSON alone: no progress bar
    assert batch["object"] == "batch" and batch["id"].startswith("batch_")
    assert batch["status"] in ("validating", "in_progress")


def test_submit_wait_downloads_and_batches_commands_see_it(cli, tmp_path):
    result = cli("submit", str(CHAT_FILE), "--wait", "--output-dir", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    batch_id = next(word for word in result.stdout.split() if word.startswith("batch_")).rstrip(":")
    assert (tmp_path / "out" / f"{batch_id}_output.jsonl").read_text().count("\n") == 3

    listed = cli("batches", "list", "--json")
    assert listed.exit_code == 0, listed.output
    assert batch_id in {b["id"] for b in json.loads(listed.stdout)}
    table = cli("batches", "list").stdout.splitlines()
    assert table[0].split() == ["ID", "STATUS", "ENDPOINT", "REQUESTS", "CREATED"]
    assert any(line.startswith(batch_id) and "completed" in line and "3/3 ok" in line for line in table)

    shown = json.loads(cli("batches", "show", batch_id, "--json").stdout)
    assert shown["status"] == "completed" and shown["request_counts"]["completed"] == 3
    assert "status:" in cli("batches", "show", batch_id).stdout

    again = cli("batches", "download", batch_id, "--output-dir", str(tmp_path / "again"))
    assert again.exit_code == 0, again.output
    assert (tmp_path / "again" / f"{batch_id}_output.jsonl").read_bytes() == (
        tmp_path / "out" / f"{batch_id}_output.jsonl").read_bytes()

    output_id = shown["output_file_id"]
    files = json.loads(cli("files", "list", "--json").stdout)
    assert {output_id, shown["input_file_id"]} <= {f["id"] for f in files}
    assert json.loads(cli("files", "show", output_id, "--json").stdout)["purpose"] == "batch_output"
    target = tmp_path / "output.jsonl"
    assert cli("files", "download", output_id, "-o", str(target)).exit_code == 0
    assert target.read_bytes() == (tmp_path / "out" / f"{batch_id}_output.jsonl").read_bytes()
    deleted = cli("files", "delete", shown["input_file_id"], "--json")
    assert deleted.exit_code == 0 and json.loads(deleted.stdout)["deleted"] is True
    missing = cli("files", "show", shown["input_file_id"])
    assert missing.exit_code == 1 and "404" in missing.output and "Traceback" not in missing.output


def test_submit_wait_exits_non_zero_when_the_batch_fails(cli, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("this is not JSON\n")
    result = cli("submit", str(bad), "--wait", "--endpoint", "/v1/chat/completions", "--output-dir", str(tmp_path))
    assert "failed" in result.stdout, result.output
    assert result.exit_code == 1


def test_cancel_a_batch(cli, tmp_path):
    slow = tmp_path / "slow.jsonl"  # 3000 output tokens at the simulator's 12 ms each: 36 s a line
    slow.write_text("".join(orjson.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                          "body": {"model": "gpt-3.5-turbo", "max_tokens": 3000,
                                                   "messages": [{"role": "user", "content": "go"}]}}).decode() + "\n"
                            for i in range(2)))
    created = json.loads(cli("submit", str(slow), "--no-wait").stdout)
    result = cli("batches", "cancel", created["id"], "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["status"] in ("cancelling", "cancelled")
    deadline = time.monotonic() + 60
    while (status := json.loads(cli("batches", "show", created["id"], "--json").stdout)["status"]) != "cancelled":
        assert time.monotonic() < deadline, status
        time.sleep(0.5)
    again = cli("batches", "cancel", created["id"])  # an ended batch, cancelled included: OpenAI's 409
    assert again.exit_code == 1 and "Cannot cancel a batch with status 'cancelled'." in again.output, again.output


def test_keys_list_uses_the_stacks_database_and_prints_a_table(cli):
    created = cli("keys", "create", "--tenant", "acme")
    assert created.exit_code == 0, created.output
    listed = cli("keys", "list", "--tenant", "acme")
    assert listed.exit_code == 0, listed.output
    header, row = listed.stdout.splitlines()[:2]
    assert header.split() == ["ID", "TENANT", "KEY", "STATE", "CREATED", "REVOKED"]
    assert row.split()[0].startswith("key_") and row.split()[1] == "acme" and row.split()[3] == "active"
    assert row.rstrip().endswith("-") and row.split()[6] == "UTC"  # CREATED as YYYY-MM-DD HH:MM:SS UTC
    as_json = cli("keys", "list", "--tenant", "acme", "--json")
    assert as_json.exit_code == 0, as_json.output
    [key] = json.loads(as_json.stdout)[-1:]
    assert key["id"] == row.split()[0] and key["tenant_name"] == "acme" and key["state"] == "active"
    assert key["revoked_at"] is None
    assert isinstance(key["created_at"], int) and len(key["key_prefix"]) == 12


def test_a_killed_stacks_file_is_reported_stale(tmp_path, monkeypatch):
    from backfill.stack_file import write_stack

    for name in CLIENT_ENV:
        monkeypatch.delenv(name, raising=False)
    write_stack(tmp_path, {"gateway_url": "http://127.0.0.1:9/v1", "api_key": "sk-x"})
    info = json.loads((tmp_path / "stack.json").read_text())
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    info["pid"] = pid  # a process that no longer exists
    (tmp_path / "stack.json").write_text(json.dumps(info))
    result = CliRunner().invoke(main, ["batches", "list", "--data-dir", str(tmp_path)])
    assert result.exit_code == 1 and "stale" in result.output and "Traceback" not in result.output


def test_llm_d_async_producers_work_unchanged_on_llm_d_async_s_default_names(stack):
    """``backfill up`` reads llm-d-async's default sorted set, retry set and channel: its
    SubmitRequest (MULTI; DEL request-cancel; SET request-active EX; ZADD request-sortedset; EXEC) is
    answered on its result list (BRPOP), so is a due retry its consumer parked (ZADD retry-sortedset
    <due> <envelope>), and a PUBLISH on request-queue on the result-queue channel."""
    import secrets

    import redis

    _, data_dir = stack
    client = redis.Redis.from_url(json.loads((data_dir / "stack.json").read_text())["redis_url"])
    listener = client.pubsub(ignore_subscribe_messages=True)
    listener.subscribe("result-queue")
    payload = {"model": "gpt-3.5-turbo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    id, token, deadline = f"llmd-{secrets.token_hex(4)}", secrets.token_hex(16), int(time.time()) + 120
    results = f"llm-d-async:results:{id}"
    envelope = {"internal": {"request_token": token, "request_queue_name": "request-sortedset",
                             "result_queue_name": results}, "request_kind": "redis",
                "data": {"id": id, "created": int(time.time()), "deadline": deadline, "payload": payload}}
    with client.pipeline(transaction=True) as pipe:
        pipe.delete(f"request-cancel:{id}")
        pipe.set(f"request-active:{id}", token, ex=120)
        pipe.zadd("request-sortedset", {orjson.dumps(envelope): deadline})
        pipe.execute()
    reply = client.brpop([results], timeout=60)
    assert reply is not None, "no result on the producer's list"
    answer = orjson.loads(reply[1])
    assert (answer["id"], answer["status_code"]) == (id, 200), answer

    retried = {**envelope, "internal": {**envelope["internal"], "retry_count": 1},
               "data": {**envelope["data"], "id": id + "-retry"}}
    client.zadd("retry-sortedset", {orjson.dumps(retried): int(time.time()) - 1})
    reply = client.brpop([results], timeout=60)
    assert reply is not None, "no result for the parked retry"
    assert orjson.loads(reply[1])["id"] == id + "-retry" and client.zcard("retry-sortedset") == 0

    until = time.monotonic() + 30
    while client.pubsub_numsub("request-queue")[0][1] < 1:
        assert time.monotonic() < until, "no processor subscribes to request-queue"
        time.sleep(0.05)
    published = {**envelope, "request_kind": "plain", "data": {**envelope["data"], "id": id + "-ps"}}
    client.publish("request-queue", orjson.dumps(published))
    message = None
    while message is None and time.monotonic() < until + 30:
        message = listener.get_message(timeout=1.0)
    assert message is not None, "no result on result-queue"
    assert orjson.loads(message["data"])["id"] == id + "-ps"
    listener.close()
    client.close()
