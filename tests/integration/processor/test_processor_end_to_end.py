"""The processor against real targets over real Redis Streams: a simulated vLLM engine
(``backfill engine-sim`` at ``--time-scale 0``) and small in-test stub apps.

F1-style crash (kill -9 with requests in flight, restart: one result per id), F5 duplicates, poison
answers, 429 + Retry-After retried then served, llm-d headers, strict lane priority and EDF order,
fair turns between tenants.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import threading
import time
from collections.abc import Iterator

import orjson
import pytest
import redis
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from async_processor.processor import run_processor
from async_processor.settings import build_settings
from backfill.up import free_port
from common.contracts.queue import RESULT_FIELD, RequestMessage, decode_result, encode_request, request_stream
from common.executable import backfill_executable
from engine_twin.launch import sim_engine_argv, wait_ready
from tests.conftest import serve

LANES = ["interactive", "async", "batch"]


@pytest.fixture(scope="module")
def engine() -> Iterator[str]:
    """Base URL of one simulated engine serving model ``m`` (time scale 0: answers at once)."""
    port = free_port()
    proc = subprocess.Popen(sim_engine_argv(port, ["m"], time_scale=0), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_ready(f"http://127.0.0.1:{port}", timeout=60, process=proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


class Ns:
    """Unique stream names for one test, plus helpers over a sync redis client."""

    def __init__(self, redis_url: str):
        self.redis_url = redis_url
        self.prefix = f"it{secrets.token_hex(4)}"
        self.client = redis.Redis.from_url(redis_url)

    @property
    def results(self) -> str:
        return f"{self.prefix}:results"

    def settings(self, router_url: str, **overrides):
        base = dict(backend="redis", redis_url=self.redis_url, router_url=router_url, lanes=LANES,
                    stream_prefix=f"{self.prefix}:requests", result_stream=self.results,
                    consumer_group=f"{self.prefix}-g", lease_s=1.0, backoff_base_s=0.05, poll_interval_s=0.01,
                    grace_s=2.0)
        return build_settings(**{**base, **overrides})

    def put(self, lane: str, message: RequestMessage | bytes) -> None:
        body = message if isinstance(message, bytes) else encode_request(message)
        self.client.xadd(request_stream(lane, "default", f"{self.prefix}:requests"), {"message": body})

    def read_results(self) -> list:
        return [decode_result(f[RESULT_FIELD.encode()]) for _, f in self.client.xrange(self.results)]

    def wait_results(self, n: int, timeout_s: float = 30.0) -> list:
        until = time.monotonic() + timeout_s
        while self.client.xlen(self.results) < n:
            assert time.monotonic() < until, f"{self.client.xlen(self.results)} of {n} results"
            time.sleep(0.02)
        return self.read_results()


@pytest.fixture
def ns(stores) -> Ns:
    return Ns(stores.redis_url)


def message(id: str | None = None, deadline_in: float = 300, lane: str = "batch", **meta) -> RequestMessage:
    return RequestMessage(id=id or f"r-{secrets.token_hex(6)}", created=int(time.time()),
                          deadline=int(time.time() + deadline_in),
                          payload={"model": "m", "messages": [{"role": "user", "content": "hello there"}],
                                   "max_tokens": 4},
                          metadata={"tenant": "acme", "objective": lane, **meta})


class InProcess:
    """``run_processor`` in a thread with its own loop, until :meth:`stop`."""

    def __init__(self, settings):
        self.settings = settings
        self.loop = asyncio.new_event_loop()
        self.stop_event: asyncio.Event | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.ready = threading.Event()
        self.processor = None

    def _run(self):
        async def main():
            self.stop_event = asyncio.Event()
            self.ready.set()
            self.processor = await run_processor(self.settings, self.stop_event)
        self.loop.run_until_complete(main())

    def __enter__(self):
        self.thread.start()
        self.ready.wait(10)
        return self

    def __exit__(self, *exc):
        self.loop.call_soon_threadsafe(self.stop_event.set)
        self.thread.join(30)
        assert not self.thread.is_alive()


def test_requests_through_redis_come_back_with_the_engine_body(ns, engine):
    sent = [message() for _ in range(20)] + [message(lane="interactive") for _ in range(5)]
    for m in sent:
        ns.put(m.metadata["objective"], m)
    with InProcess(ns.settings(engine)):
        results = ns.wait_results(len(sent))
    assert sorted(r.id for r in results) == sorted(m.id for m in sent)
    for r in results:
        assert r.status_code == 200 and r.error_code == "" and r.metadata["tenant"] == "acme"
        assert '"choices"' in r.payload and '"model":"m"' in r.payload.replace(" ", "")


def test_duplicate_deliveries_give_one_result_each(ns, engine):
    sent = [message() for _ in range(30)]
    for m in sent * 2:  # F5: every message delivered twice
        ns.put("batch", m)
    stream = request_stream("batch", "default", f"{ns.prefix}:requests")
    with InProcess(ns.settings(engine)):
        ns.wait_results(len(sent))
        until = time.monotonic() + 30
        while ns.client.xlen(stream) and time.monotonic() < until:  # duplicates acked (and deleted) too
            time.sleep(0.05)
    results = ns.read_results()
    assert sorted(r.id for r in results) == sorted(m.id for m in sent)
    assert ns.client.xlen(stream) == 0


def _stub(behaviour) -> tuple[FastAPI, list]:
    seen: list = []
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def completions(request: Request):
        body = await request.json()
        seen.append((body.get("id_hint"), dict(request.headers)))
        return await behaviour(body, request, seen)
    return app, seen


def test_429_with_retry_after_is_retried_then_served_with_llm_d_headers(ns):
    attempts: dict[str, int] = {}

    async def behaviour(body, request, seen):
        n = attempts[body["id_hint"]] = attempts.get(body["id_hint"], 0) + 1
        if n <= 2:
            return JSONResponse({"error": "busy"}, status_code=429,
                                headers={"retry-after": "1", "x-llm-d-request-dropped-reason": "rejected-saturated"})
        return JSONResponse({"ok": True, "attempt": n})
    app, seen = _stub(behaviour)
    port = free_port()
    m = RequestMessage(id="r429", deadline=int(time.time() + 60), payload={"model": "m", "id_hint": "r429"},
                       metadata={"tenant": "acme", "objective": "batch", "session_id": "s-1",
                                 "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
                       headers={"x-custom": "kept", "x-llm-d-inference-fairness-id": "spoofed"})
    ns.put("batch", m)
    with serve(app, port), InProcess(ns.settings(f"http://127.0.0.1:{port}")):
        results = ns.wait_results(1)
    assert [(r.id, r.status_code, r.error_code) for r in results] == [("r429", 200, "")]
    assert '"attempt":3' in results[0].payload.replace(" ", "")
    assert len(seen) == 3
    for _, headers in seen:
        assert headers["x-llm-d-inference-objective"] == "batch"
        assert headers["x-llm-d-inference-fairness-id"] == "acme"
        assert headers["x-session-id"] == "s-1" and headers["traceparent"].startswith("00-0af7")
        assert headers["x-custom"] == "kept"
    budgets = [int(h["x-llm-d-slo-ttft-ms"]) for _, h in seen]
    assert budgets == sorted(budgets, reverse=True) and budgets[0] > budgets[-1] and budgets[0] <= 60_000


def test_final_errors_and_poison_answers_end_with_one_result(ns):
    async def behaviour(body, request, seen):
        if body["id_hint"] == "bad":
            return JSONResponse({"error": {"message": "bad model"}}, status_code=400)
        return JSONResponse({"error": "boom"}, status_code=500)  # always fails: a poison request
    app, seen = _stub(behaviour)
    port = free_port()
    ns.put("batch", RequestMessage(id="bad", deadline=int(time.time() + 60), payload={"id_hint": "bad"}))
    ns.put("batch", RequestMessage(id="poison", deadline=int(time.time() + 3600), payload={"id_hint": "poison"}))
    with serve(app, port), InProcess(ns.settings(f"http://127.0.0.1:{port}", max_error_attempts=3)):
        results = {r.id: r for r in ns.wait_results(2)}
    assert results["bad"].status_code == 400 and "bad model" in results["bad"].payload
    assert results["poison"].status_code == 500 and results["poison"].error_code == ""
    assert sum(1 for hint, _ in seen if hint == "bad") == 1
    assert sum(1 for hint, _ in seen if hint == "poison") == 3  # ended after 3 attempts, not at the deadline


def test_strict_lane_priority_and_earliest_deadline_first(ns):
    async def behaviour(body, request, seen):
        return JSONResponse({"ok": True})
    app, seen = _stub(behaviour)
    port = free_port()
    now = int(time.time())
    plan = [("batch", 500), ("batch", 300), ("async", 400), ("interactive", 600), ("batch", 300),
            ("interactive", 200), ("async", 100), ("batch", 100), ("interactive", 200)]
    for i, (lane, deadline_in) in enumerate(plan):
        ns.put(lane, RequestMessage(id=f"m{i}", deadline=now + deadline_in, payload={"id_hint": f"m{i}"},
                                    metadata={"objective": lane}))
    with serve(app, port), InProcess(ns.settings(f"http://127.0.0.1:{port}", concurrency=1)):
        ns.wait_results(len(plan))
    order = [hint for hint, _ in seen]
    expected = [f"m{i}" for i, _ in sorted(enumerate(plan), key=lambda p: (
        -{"interactive": 100, "async": 10, "batch": -10}[p[1][0]], p[1][1], p[0]))]
    assert order == expected


def test_a_small_tenant_interleaves_with_an_older_backlog_of_another(ns):
    """Issue 12: tenant B's batch, queued after tenant A's, is served in turns with A's (fair
    shares over tenants) although every line of A has an earlier deadline."""
    async def behaviour(body, request, seen):
        return JSONResponse({"ok": True})
    app, seen = _stub(behaviour)
    port = free_port()
    now = int(time.time())
    tag = secrets.token_hex(3)  # ids are claimed across the Redis server: none shared with other tests
    for i in range(30):
        ns.put("batch", RequestMessage(id=f"fair-{tag}-a{i}", deadline=now + 3600 + i, payload={"id_hint": f"a{i}"},
                                       metadata={"tenant": "A", "batch_id": "batch_a"}))
    for i in range(5):
        ns.put("batch", RequestMessage(id=f"fair-{tag}-b{i}", deadline=now + 86_400, payload={"id_hint": f"b{i}"},
                                       metadata={"tenant": "B", "batch_id": "batch_b"}))
    with serve(app, port), InProcess(ns.settings(f"http://127.0.0.1:{port}", concurrency=1)):
        ns.wait_results(35)
    order = [hint for hint, _ in seen]
    b_at = [i for i, hint in enumerate(order) if hint.startswith("b")]
    assert len(b_at) == 5 and b_at[-1] < 12, order  # earliest deadline first alone: positions 30-34
    assert [h for h in order if h.startswith("a")] == [f"a{i}" for i in range(30)]  # EDF inside A


def test_kill_9_with_requests_in_flight_then_restart_gives_one_result_per_id(ns):
    async def behaviour(body, request, seen):
        await asyncio.sleep(0.05)
        return JSONResponse({"ok": True})
    app, seen = _stub(behaviour)
    port = free_port()
    sent = [message() for _ in range(200)]
    for m in sent:
        ns.put("batch", m)
    settings = ns.settings(f"http://127.0.0.1:{port}")
    argv = [*backfill_executable(), "processor", "--backend", "redis", "--redis-url", ns.redis_url,
            "--router-url", settings.router_url, "--lease", "1", "--concurrency", "16", "--backoff-base", "0.05",
            "--log-level", "WARNING"]
    env = {**os.environ, "BACKFILL_PROCESSOR_STREAM_PREFIX": settings.stream_prefix,
           "BACKFILL_PROCESSOR_RESULT_STREAM": settings.result_stream,
           "BACKFILL_PROCESSOR_CONSUMER_GROUP": settings.consumer_group}
    with serve(app, port):
        first = subprocess.Popen(argv, env=env)
        try:
            until = time.monotonic() + 60
            while ns.client.xlen(ns.results) < 40:
                assert time.monotonic() < until and first.poll() is None
                time.sleep(0.01)
            first.send_signal(signal.SIGKILL)
            first.wait(10)
            done_before = ns.client.xlen(ns.results)
            assert done_before < len(sent)  # work was left in flight or queued
            second = subprocess.Popen(argv, env=env)
            try:
                results = ns.wait_results(len(sent), timeout_s=60)
                time.sleep(1.5)  # past one more lease: nothing else may appear
                results = ns.read_results()
            finally:
                second.send_signal(signal.SIGTERM)
                assert second.wait(30) == 0
        finally:
            if first.poll() is None:
                first.kill()
    ids = [r.id for r in results]
    assert sorted(ids) == sorted(m.id for m in sent)  # every id exactly once
    assert all(r.status_code == 200 for r in results)



def test_held_work_of_a_batch_cancelled_later_is_dropped_not_run(ns):
    """A cancel marker set after the messages were admitted still stops them: held work of that
    batch is answered CANCELLED without reaching the target."""
    from common.contracts.queue import cancel_marker_key

    release = threading.Event()

    async def behaviour(body, request, seen):
        while body["id_hint"] == "blocker" and not release.is_set():
            await asyncio.sleep(0.01)  # hold the only slot until the batch below is cancelled
        return JSONResponse({"ok": True})
    app, seen = _stub(behaviour)
    port = free_port()
    ns.put("batch", RequestMessage(id="blocker", deadline=int(time.time() + 120), payload={"id_hint": "blocker"}))
    for i in range(3):
        ns.put("batch", RequestMessage(id=f"b{i}", deadline=int(time.time() + 600), payload={"id_hint": f"b{i}"},
                                       metadata={"batch_id": "batch_x"}))
    with serve(app, port), InProcess(ns.settings(f"http://127.0.0.1:{port}", concurrency=1, cancel_poll_s=0.1)):
        until = time.monotonic() + 30
        while not seen:
            assert time.monotonic() < until, "the blocker never reached the target"
            time.sleep(0.02)
        ns.client.set(cancel_marker_key("batch_x"), b"1")
        cancelled = ns.wait_results(3)
        release.set()
        results = {r.id: r for r in ns.wait_results(4)}
    assert {i for i, r in results.items() if r.error_code == "CANCELLED"} == {"b0", "b1", "b2"}
    assert results["blocker"].status_code == 200
    assert [hint for hint, _ in seen] == ["blocker"]
    assert len(cancelled) == 3


def test_llm_d_async_sorted_set_producer_gets_its_result_on_its_list_with_userid_as_tenant(ns):
    """llm-d-async's SubmitRequest (MULTI; DEL request-cancel; SET request-active EX; ZADD
    request-sortedset; EXEC), then its GetResult (BRPOP on the result list)."""
    async def behaviour(body, request, seen):
        return JSONResponse({"ok": True})
    app, seen = _stub(behaviour)
    port = free_port()
    sorted_set, result_list, token = f"{ns.prefix}:request-sortedset", f"{ns.prefix}:result-list", "ab" * 16
    deadline = int(time.time()) + 60
    member = orjson.dumps({"internal": {"request_token": token, "request_queue_name": sorted_set,
                                        "result_queue_name": result_list}, "request_kind": "redis",
                           "data": {"id": "llmd-1", "created": int(time.time()), "deadline": deadline,
                                    "payload": {"model": "m", "id_hint": "llmd-1"}, "metadata": {"userid": "u-7"},
                                    "request_queue_name": sorted_set, "result_queue_name": result_list}})
    with ns.client.pipeline(transaction=True) as pipe:
        pipe.delete("request-cancel:llmd-1")
        pipe.set("request-active:llmd-1", token, ex=60)
        pipe.zadd(sorted_set, {member: deadline})
        pipe.execute()
    with serve(app, port), InProcess(ns.settings(f"http://127.0.0.1:{port}", llmd_sorted_sets=[sorted_set])):
        reply = ns.client.brpop([result_list], timeout=30)
    assert reply is not None
    result = orjson.loads(reply[1])
    assert (result["id"], result["status_code"], result["error_code"]) == ("llmd-1", 200, "")
    assert [h["x-llm-d-inference-fairness-id"] for _, h in seen] == ["u-7"]
    assert [h["x-llm-d-inference-objective"] for _, h in seen] == ["async"]
    assert ns.client.zcard(sorted_set) == 0 and not ns.client.exists("request-active:llmd-1")


def _llmd_submit(client, sorted_set: str, result_list: str, id: str, deadline_in: int = 600) -> str:
    """llm-d-async's SubmitRequest, command for command; returns the request token."""
    token, deadline = secrets.token_hex(16), int(time.time()) + deadline_in
    member = orjson.dumps({"internal": {"request_token": token, "request_queue_name": sorted_set,
                                        "result_queue_name": result_list}, "request_kind": "redis",
                           "data": {"id": id, "created": int(time.time()), "deadline": deadline,
                                    "payload": {"model": "m", "id_hint": id}}})
    with client.pipeline(transaction=True) as pipe:
        pipe.delete(f"request-cancel:{id}")
        pipe.set(f"request-active:{id}", token, ex=deadline_in)
        pipe.zadd(sorted_set, {member: deadline})
        pipe.execute()
    return token


def test_an_llm_d_async_request_cancelled_while_held_is_answered_cancelled_not_run(ns):
    # ids of this test alone: llm-d-async ids are global keys, and a finished id of another test
    # (tests/contract/test_llmd_async_producer.py uses the same names) is acked as a duplicate
    gone, kept = f"{ns.prefix}-llmd-gone", f"{ns.prefix}-llmd-kept"
    release = threading.Event()

    async def behaviour(body, request, seen):
        while body["id_hint"] == "llmd-blocker" and not release.is_set():
            await asyncio.sleep(0.01)  # hold the only slot until the request below is cancelled
        return JSONResponse({"ok": True})
    app, seen = _stub(behaviour)
    port = free_port()
    sorted_set, result_list = f"{ns.prefix}:request-sortedset", f"{ns.prefix}:result-list"
    ns.put("batch", RequestMessage(id=f"{ns.prefix}-llmd-blocker", deadline=int(time.time() + 120), payload={"id_hint": "llmd-blocker"}))
    for id in (gone, kept):
        _llmd_submit(ns.client, sorted_set, result_list, id)
    settings = ns.settings(f"http://127.0.0.1:{port}", concurrency=1, cancel_poll_s=0.1,
                           llmd_sorted_sets=[sorted_set], llmd_lane="batch")
    with serve(app, port), InProcess(settings):
        until = time.monotonic() + 30
        while not seen or ns.client.zcard(sorted_set):  # the blocker runs, both requests are held
            assert time.monotonic() < until, "the blocker never reached the target"
            time.sleep(0.02)
        # llm-d-async's CancelRequests(["llmd-gone"]): copy the active token into the cancel key
        ns.client.set(f"request-cancel:{gone}", ns.client.get(f"request-active:{gone}"), ex=7 * 24 * 3600)
        first = orjson.loads(ns.client.brpop([result_list], timeout=30)[1])
        release.set()
        second = orjson.loads(ns.client.brpop([result_list], timeout=30)[1])
    assert (first["id"], first["error_code"]) == (gone, "CANCELLED")
    assert (second["id"], second["status_code"]) == (kept, 200)
    assert [hint for hint, _ in seen] == ["llmd-blocker", kept]
    assert not ns.client.exists(f"request-active:{gone}", f"request-cancel:{gone}", f"request-active:{kept}")


def test_the_batch_requests_in_flight_are_reported_for_the_job_page(ns):
    """Concurrency 3 and five requests of batch A plus one of B, held at the router until released:
    the processor's report in Redis (``running_key``) counts what it has in flight by batch (3 of
    them, A first: earliest deadline) and drops to nothing once they are answered, and its field is
    gone after it stops (async_processor/running.py)."""
    from common.contracts.queue import running_counts, running_key

    release = threading.Event()

    async def behaviour(body, request, seen):
        await asyncio.to_thread(release.wait, 30)
        return JSONResponse({"ok": True})

    app, seen = _stub(behaviour)
    port = free_port()
    pool = f"{ns.prefix}-pool"  # a pool of its own: its report key is this test's alone
    key = running_key(pool)
    stream = request_stream("batch", pool, f"{ns.prefix}:requests")
    # ids of this test alone: a finished id of another test in Redis would be acked as a duplicate
    for m in [message(id=f"{ns.prefix}-a{i}", deadline_in=100, batch_id="batch_a") for i in range(5)] + \
            [message(id=f"{ns.prefix}-b0", deadline_in=200, batch_id="batch_b")]:
        ns.client.xadd(stream, {"message": encode_request(m)})

    def running() -> dict[str, int]:
        return running_counts(ns.client.hgetall(key), time.time())

    def wait_for(condition, what: str) -> None:
        until = time.monotonic() + 30
        while not condition():
            assert time.monotonic() < until, f"{what}: {running()}"
            time.sleep(0.02)

    settings = ns.settings(f"http://127.0.0.1:{port}", concurrency=3, lease_s=30.0, running_report_s=0.05,
                           pool=pool, lanes=["batch"])
    with serve(app, port), InProcess(settings):
        wait_for(lambda: len(seen) == 3 and running() == {"batch_a": 3}, "three of A in flight")
        release.set()
        ns.wait_results(6)
        wait_for(lambda: running() == {}, "nothing in flight")
    assert ns.client.hlen(key) == 0  # withdrawn at stop
