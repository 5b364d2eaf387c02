"""Observability: the series documented in docs/observability.md exist on every service's
``/metrics`` with their labels and move under a small load; JSON log lines parse and carry
``action`` / ``batch_id`` / ``custom_id`` / ``tenant``; the trace id a client sends with
``POST /v1/batches`` reaches the router's ``traceparent`` header.
"""

from __future__ import annotations

import asyncio
import io
import logging
import re
import secrets
import time
from pathlib import Path

import httpx
import orjson
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from async_processor.metrics import ProcessorMetrics
from async_processor.processor import run_processor
from async_processor.settings import build_settings
from async_processor.testing import mock_target
from backfill.up import free_port
from common.contracts.queue import REQUEST_FIELD, request_stream
from common.logging import configure_logging
from common.tracing import trace_id_of
from tests.conftest import SHARED_BATCHES, backfill_up
from workers import lifecycle

DOC = Path(__file__).resolve().parents[2] / "docs" / "observability.md"
ROW = re.compile(r"^\| `(backfill_[a-z_]+)` \| (counter|gauge|histogram) \| ([^|]*) \|")
PER_TENANT = "backfill_worker_tenant_tokens"
"""The one family with a tenant label (bounded: workers.metrics.TENANT_LABEL_LIMIT)."""
SECTIONS = {"### Gateway": "gateway", "### Worker": "worker", "### Processor": "processor"}
BATCH_FILE = SHARED_BATCHES / "vllm-openai-example-batch.jsonl"
CUSTOM_IDS = {"request-1", "request-2"}


def documented_series() -> dict[str, dict[str, tuple[str, frozenset[str]]]]:
    """``{service: {series: (type, label names)}}`` from the tables of docs/observability.md."""
    out: dict[str, dict[str, tuple[str, frozenset[str]]]] = {}
    service = None
    for line in DOC.read_text().splitlines():
        if line.startswith("#"):
            service = SECTIONS.get(line.strip())
            continue
        match = ROW.match(line)
        if match and service:
            labels = frozenset(re.findall(r"`([a-z_]+)`", match.group(3)))
            out.setdefault(service, {})[match.group(1)] = (match.group(2), labels)
    return out


def family_name(series: str, kind: str) -> str:
    """The name prometheus-client's parser gives the family of a documented series."""
    return series.removesuffix("_total") if kind == "counter" else series


def parse(text: str) -> dict[str, tuple[str, list]]:
    """``{family: (type, samples)}`` of a Prometheus text exposition."""
    return {f.name: (f.type, f.samples) for f in text_string_to_metric_families(text)}


def value(families: dict, name: str, suffix: str = "_total", **labels: str) -> float:
    """Sum of the samples ``name + suffix`` whose labels include ``labels``."""
    _, samples = families[name]
    return sum(s.value for s in samples
               if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items()))


def check_documented(service: str, families: dict) -> None:
    """Every documented series of ``service`` is exported, with its type and exactly its labels,
    and has samples; no family but the bounded per-tenant one carries a tenant label."""
    for series, (kind, labels) in documented_series()[service].items():
        name = family_name(series, kind)
        assert name in families, f"{service}: {series} missing"
        found_kind, samples = families[name]
        assert found_kind == kind, (series, found_kind)
        assert samples, f"{service}: {series} has no samples"
        for sample in samples:
            assert set(sample.labels) - {"le"} == labels, (series, sample)
    for name, (_, samples) in families.items():
        for sample in samples:
            if name != PER_TENANT:
                assert not {"tenant", "tenant_id"} & set(sample.labels), (name, sample)
            assert not sample.name.endswith("_created"), sample


def test_documentation_lists_every_service():
    documented = documented_series()
    assert set(documented) == {"gateway", "worker", "processor"}
    assert all(len(series) >= 5 for series in documented.values())


@pytest.fixture
def json_logs():
    """Every record at INFO (DEBUG for workers and the processor) as JSON lines in a buffer; the
    root logger is restored afterwards."""
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    buffer = io.StringIO()
    configure_logging("INFO", json=True, stream=buffer)
    for name in ("workers", "async_processor"):
        logging.getLogger(name).setLevel(logging.DEBUG)
    yield buffer
    for name in ("workers", "async_processor"):
        logging.getLogger(name).setLevel(logging.NOTSET)
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])


def test_one_batch_from_the_api_to_the_router_header(gateway, json_logs):
    """The client's trace id goes API -> batch -> queue message metadata -> router header; the same
    run moves the gateway's, the worker's and the processor's series and writes the JSON log lines."""
    trace_id, parent_span = secrets.token_hex(16), secrets.token_hex(8)
    client = gateway.client()
    uploaded = client.files.create(file=BATCH_FILE.open("rb"), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h",
                                  extra_headers={"traceparent": f"00-{trace_id}-{parent_span}-01"})
    gateway.wait_status(batch.id, ("in_progress",))

    ctx = gateway.celery.backfill
    assert lifecycle.feed(ctx) == 2
    stream = request_stream("batch", gateway.settings.task_queue)
    queued = [orjson.loads(fields[REQUEST_FIELD.encode()]) for _, fields in redis.Redis.from_url(
        gateway.settings.redis_url).xrange(stream)]
    assert {m["metadata"]["custom_id"] for m in queued} == CUSTOM_IDS
    batch_tenant = queued[0]["metadata"]["tenant"]  # the tenant's id, as in every log line's "tenant"
    stored = {m["metadata"]["traceparent"] for m in queued}
    assert len(stored) == 1 and trace_id_of(stored.pop()) == trace_id
    assert all(m["metadata"]["traceparent"].split("-")[2] != parent_span for m in queued)  # the gateway's span

    seen: list[httpx.Request] = []

    def router(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"id": "chatcmpl-1", "object": "chat.completion", "choices": [],
                                         "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})

    settings = build_settings(backend="redis", redis_url=gateway.settings.redis_url, pool=gateway.settings.task_queue,
                              lanes=["batch"], router_url="http://router.test", concurrency=4)
    processor_metrics = ProcessorMetrics()

    async def pump() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(run_processor(settings, stop, http=mock_target(router), metrics=processor_metrics))
        deadline = time.monotonic() + 20
        while value(parse(processor_metrics.exposition().decode()), "backfill_processor_results",
                    lane="batch", error_code="none") < 2:
            assert time.monotonic() < deadline and not task.done(), "the processor did not answer both requests"
            await asyncio.sleep(0.05)
        stop.set()
        await task

    asyncio.run(pump())
    assert len(seen) == 2
    assert {trace_id_of(r.headers["traceparent"]) for r in seen} == {trace_id}

    deadline = time.monotonic() + 20
    while lifecycle.collect(ctx) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lifecycle.finalize(ctx, batch.id) == "completed"

    # processor series
    processor = parse(processor_metrics.exposition().decode())
    check_documented("processor", processor)
    assert value(processor, "backfill_processor_dispatched", lane="batch") == 2
    assert value(processor, "backfill_processor_queue_wait_seconds", "_count", lane="batch") == 2
    assert value(processor, "backfill_processor_router_request_duration_seconds", "_count",
                 lane="batch", status="2xx") == 2
    assert value(processor, "backfill_processor_gate_decisions", gate="concurrency", decision="admit") == 2
    assert value(processor, "backfill_processor_held_requests", "", lane="batch") == 0

    # worker series (threads pool here: the context's own registry)
    from prometheus_client import generate_latest

    worker = parse(generate_latest(ctx.metrics.registry).decode())
    check_documented("worker", worker)
    assert value(worker, "backfill_worker_requests_fed") == 2
    assert value(worker, "backfill_worker_requests_collected", state="succeeded") == 2
    tokens = {s.labels["tenant"] for s in worker[PER_TENANT][1]}
    assert tokens == {batch_tenant} and value(worker, PER_TENANT, kind="prompt", tenant=batch_tenant) == 2 * 3
    assert value(worker, "backfill_worker_batches_validated", status="in_progress") == 1
    assert value(worker, "backfill_worker_batches_finalized", status="completed") == 1
    assert value(worker, "backfill_worker_requests_finalized", file="output") == 2
    assert value(worker, "backfill_worker_tasks", task="backfill.validate_batch", outcome="success") >= 1
    assert value(worker, "backfill_worker_task_duration_seconds", "_count", task="backfill.validate_batch") >= 1

    # gateway series
    scraped = httpx.get(gateway.base_url + "/metrics", timeout=10)
    assert scraped.status_code == 200 and scraped.headers["content-type"].startswith("text/plain")
    gateway_families = parse(scraped.text)
    check_documented("gateway", gateway_families)
    assert value(gateway_families, "backfill_gateway_http_requests", method="POST", handler="/v1/batches",
                 status="2xx") == 1
    assert value(gateway_families, "backfill_gateway_http_requests", method="GET",
                 handler="/v1/batches/{batch_id}", status="2xx") >= 1
    assert value(gateway_families, "backfill_gateway_file_uploaded_bytes", purpose="batch") == BATCH_FILE.stat().st_size
    assert value(gateway_families, "backfill_gateway_batches", "", status="completed") == 1

    # JSON logs: every line parses; the lifecycle of this batch is there with its ids
    records = [orjson.loads(line) for line in json_logs.getvalue().splitlines()]
    assert records and all({"time", "level", "logger", "message"} <= set(r) for r in records)
    mine = [r for r in records if r.get("batch_id") == batch.id]
    actions = {r["action"] for r in mine}
    assert {"batch_created", "batch_in_progress", "feed", "dispatch", "result", "collect",
            "batch_completed"} <= actions, actions
    assert all(r.get("tenant") for r in mine if r["action"] != "cancel")
    for action in ("dispatch", "result", "collect"):
        assert {r["custom_id"] for r in mine if r["action"] == action} == CUSTOM_IDS, action
    created = next(r for r in mine if r["action"] == "batch_created")
    assert created["trace_id"] == trace_id  # logged inside the traced request


def test_gateway_metrics_need_the_admin_key_when_one_is_set(gateway_settings):
    from fastapi.testclient import TestClient

    from batch_gateway.app import create_app

    admin_key = "adm-" + secrets.token_hex(8)
    app = create_app(gateway_settings.model_copy(update={"admin_key": admin_key}))
    with TestClient(app) as http:
        refused = http.get("/metrics")
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "invalid_request_error"
        assert http.get("/metrics", headers={"authorization": "Bearer wrong"}).status_code == 401
        allowed = http.get("/metrics", headers={"authorization": f"Bearer {admin_key}"})
        assert allowed.status_code == 200 and "backfill_gateway_batches" in allowed.text


def test_every_service_of_backfill_up_serves_its_documented_series(tmp_path):
    """``backfill up`` (prefork worker: multiprocess mode) with metrics ports set; one batch of two
    embeddings (quick on the simulated engine) through the router; then each ``/metrics`` has every
    documented series, moved."""
    worker_port, processor_port = free_port(), free_port()
    env = {"BACKFILL_WORKER_METRICS_PORT": str(worker_port), "BACKFILL_PROCESSOR_METRICS_PORT": str(processor_port)}
    with backfill_up(tmp_path / "data", "--engines", "1", "--served-model-name",
                     "intfloat/e5-mistral-7b-instruct", env=env) as up:
        client = up.client()
        uploaded = client.files.create(file=(SHARED_BATCHES / "vllm-readme-embeddings.jsonl").open("rb"),
                                       purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
        deadline = time.monotonic() + 60
        while (status := client.batches.retrieve(batch.id).status) != "completed":
            assert status not in ("failed", "expired", "cancelled") and time.monotonic() < deadline, status
            time.sleep(0.2)

        gateway = parse(httpx.get(up.base_url.removesuffix("/v1") + "/metrics", timeout=10).text)
        check_documented("gateway", gateway)
        assert value(gateway, "backfill_gateway_http_requests", method="POST", handler="/v1/files", status="2xx") == 1
        assert value(gateway, "backfill_gateway_batches", "", status="completed") == 1

        worker_url, processor_url = f"http://127.0.0.1:{worker_port}", f"http://127.0.0.1:{processor_port}"
        assert httpx.get(worker_url + "/health", timeout=10).json() == {"status": "ok"}
        assert httpx.get(processor_url + "/health", timeout=10).json() == {"status": "ok"}
        worker = parse(httpx.get(worker_url + "/metrics", timeout=10).text)
        check_documented("worker", worker)
        assert value(worker, "backfill_worker_tasks", task="backfill.validate_batch", outcome="success") >= 1
        assert value(worker, "backfill_worker_tasks", task="backfill.feed", outcome="success") >= 1
        assert value(worker, "backfill_worker_requests_fed") == 2
        assert value(worker, "backfill_worker_requests_collected", state="succeeded") == 2
        assert value(worker, "backfill_worker_batches_finalized", status="completed") == 1

        processor = parse(httpx.get(processor_url + "/metrics", timeout=10).text)
        check_documented("processor", processor)
        assert value(processor, "backfill_processor_dispatched", lane="batch") == 2
        assert value(processor, "backfill_processor_results", lane="batch", error_code="none") == 2


def test_processor_counts_retries_sheds_and_gate_decisions_once_per_request():
    """Concurrency 1 and three requests: the two held back are each denied once by the concurrency
    gate however often the dispatcher asks; a 429 is a retry; the router's fast refusal
    (``rejected-saturated``) is held, not an attempt; a past deadline is shed. Each request is
    dispatched once; its later POSTs are re-sends."""
    from async_processor.backends.memory import MemoryBackend
    from async_processor.testing import eventually, running
    from common.contracts.queue import RequestMessage

    answers: dict[str, list[int | str]] = {"r1": [429, 200], "r2": ["refused", 200], "r3": [200]}

    async def router(request: httpx.Request) -> httpx.Response:
        answer = answers[orjson.loads(request.content)["id"]].pop(0)
        await asyncio.sleep(0.2)  # the dispatcher wakes every 10 ms meanwhile and asks the gates again
        if answer == "refused":
            return httpx.Response(429, json={}, headers={"retry-after": "0",
                                                          "x-llm-d-request-dropped-reason": "rejected-saturated"})
        return httpx.Response(answer, json={}, headers={"retry-after": "0"} if answer == 429 else {})

    settings = build_settings(backend="memory", lanes=["batch"], concurrency=1, backoff_base_s=0.01,
                              saturation_poll_s=0.01)

    async def scenario() -> dict:
        backend = MemoryBackend()
        await backend.start()
        now = time.time()
        for rid in answers:
            await backend.publish_request("batch", RequestMessage(id=rid, created=int(now), deadline=int(now + 60),
                                                                  payload={"id": rid}, metadata={"tenant": "t1"}))
        await backend.publish_request("batch", RequestMessage(id="late", created=int(now), deadline=int(now - 1),
                                                              payload={}))
        async with running(settings, backend, mock_target(router)) as processor:
            async def all_answered() -> bool:
                return value(parse(processor.metrics.exposition().decode()), "backfill_processor_results",
                             lane="batch") >= 4

            await eventually(all_answered)
            return parse(processor.metrics.exposition().decode())

    families = asyncio.run(scenario())
    check_documented("processor", families)
    assert value(families, "backfill_processor_retries", lane="batch", reason="429") == 1
    assert value(families, "backfill_processor_retries", lane="batch", reason="rejected_saturated") == 1
    assert value(families, "backfill_processor_dispatched", lane="batch") == 3  # r1, r2, r3 once each
    assert value(families, "backfill_processor_resent", lane="batch") == 2  # r1 after its 429, r2 after its refusal
    assert value(families, "backfill_processor_queue_wait_seconds", "_count", lane="batch") == 3  # r1's retry not
    assert value(families, "backfill_processor_shed", lane="batch", reason="deadline_exceeded") == 1
    assert value(families, "backfill_processor_results", lane="batch", error_code="DEADLINE_EXCEEDED") == 1
    assert value(families, "backfill_processor_results", lane="batch", error_code="none") == 3
    assert value(families, "backfill_processor_gate_decisions", gate="concurrency", decision="admit") == 5
    denied = value(families, "backfill_processor_gate_decisions", gate="concurrency", decision="deny")
    assert 2 <= denied <= 4  # r2 and r3 (and r1, r2 again after their 429s if another went first): once per wait
    assert value(families, "backfill_processor_router_request_duration_seconds", "_count",
                 lane="batch", status="4xx") == 2


def test_log_format_follows_the_environment_and_the_terminal(monkeypatch):
    from common.logging import wants_json

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert wants_json(io.StringIO(), {}) is True
    assert wants_json(Tty(), {}) is False
    assert wants_json(Tty(), {"BACKFILL_LOG_FORMAT": "json"}) is True
    assert wants_json(io.StringIO(), {"BACKFILL_LOG_FORMAT": "text"}) is False
    with pytest.raises(ValueError, match="BACKFILL_LOG_FORMAT"):
        wants_json(io.StringIO(), {"BACKFILL_LOG_FORMAT": "xml"})

    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        buffer = io.StringIO()
        monkeypatch.setenv("BACKFILL_LOG_FORMAT", "text")
        configure_logging("INFO", stream=buffer)
        logging.getLogger("workers.lifecycle").info("batch fed", extra={"action": "feed", "batch_id": "batch_1"})
        assert buffer.getvalue().split()[2:] == ["INFO", "workers.lifecycle", "batch", "fed"]
        buffer = io.StringIO()
        configure_logging("WARNING", json=True, stream=buffer)
        logging.getLogger("workers.lifecycle").info("dropped below the level")
        logging.getLogger("workers.lifecycle").warning("kept", extra={"action": "feed", "custom_id": "c\u00e9"})
        [line] = buffer.getvalue().splitlines()
        record = orjson.loads(line)
        assert (record["level"], record["action"], record["custom_id"]) == ("WARNING", "feed", "c\u00e9")
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])


def test_trace_helpers():
    from common.tracing import make_tracer_provider

    assert trace_id_of("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01") == "0af7651916cd43dd8448eb211c80319c"
    assert trace_id_of("not a traceparent") is None and trace_id_of(None) is None
    with pytest.raises(ValueError, match="BACKFILL_TRACE_EXPORTER"):
        make_tracer_provider("backfill-test", exporter="zipkin")
