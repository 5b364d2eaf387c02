"""RELIABILITY.md F9, F10, F11 against ``backfill router`` and simulated engines (subprocesses).

* F9 — an engine killed mid-stream: the client's stream ends with an error event, new requests go
  to the survivor, the dead engine's in-flight counters and prefix entries are dropped.
* F10 — every engine gone, then back: a fast 503 with ``Retry-After``, and recovery without a
  router restart.
* F11 — one tenant floods the batch band while another sends interactive traffic: interactive
  first, fair shares within the band, bounded queues, explicit 429 with the reason header.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import orjson

from router.trust import TOKEN_HEADER
from tests.router_stack import ROUTER_STACK_TOKEN, RouterStack

#: 1,200 bytes = 300 estimate tokens: four 64-token blocks in the router's approximate index.
PREFIX = "You are a careful assistant. Follow the house rules exactly. " * 20


def _body(content: str, max_tokens: int, stream: bool = False, system: str = PREFIX) -> dict:
    return {"model": "sim-model", "max_tokens": max_tokens, "stream": stream,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": content}]}


def test_f9_engine_killed_mid_stream(tmp_path: Path) -> None:
    # real time: 200 tokens at 12 ms each take ~2.4 s, long enough to kill the engine mid-stream
    with RouterStack(tmp_path, engines=2, engine_options=[{"time_scale": 1.0}, {"time_scale": 1.0}]) as s:
        events: list[bytes] = []
        with httpx.Client(timeout=30) as client, \
                client.stream("POST", f"{s.url}/v1/chat/completions", json=_body("long answer", 200, True)) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    events.append(line.encode())
                    if len(events) == 3:
                        break
            serving = [e for e in s.state()["endpoints"] if e["in_flight_requests"] == 1]
            assert len(serving) == 1
            victim = s.engine_urls.index(serving[0]["name"])
            assert serving[0]["cache_blocks"]["gpu"] > 0  # the approximate index learned the prefix there
            s.kill_engine(victim)
            rest = [line for line in lines if line.startswith("data: ")]
        last = orjson.loads(rest[-1].removeprefix("data: "))
        assert last["error"]["code"] == "upstream_failed" and last["error"]["type"] == "server_error"
        assert "data: [DONE]" not in rest

        state = s.wait_candidates(1)
        dead = next(e for e in state["endpoints"] if e["name"] == s.engine_urls[victim])
        assert not dead["healthy"] and dead["in_flight_requests"] == 0
        assert dead["cache_blocks"] == {"gpu": 0, "cpu": 0, "disk": 0}
        survivor = 1 - victim
        before = s.served_counts()[survivor]
        for i in range(3):  # the same prefix now goes to the survivor
            r = httpx.post(f"{s.url}/v1/chat/completions", json=_body(f"again {i}", 2), timeout=30)
            assert r.status_code == 200, r.text
        assert s.served_counts()[survivor] - before == 3


def test_f10_all_engines_gone_then_back(tmp_path: Path) -> None:
    with RouterStack(tmp_path, engines=2) as s:
        assert httpx.post(f"{s.url}/v1/chat/completions", json=_body("hi", 2), timeout=10).status_code == 200
        s.kill_engine(0)
        s.kill_engine(1)
        # before the health checks notice: both connections are refused, nothing ran → 503, retry later
        r = httpx.post(f"{s.url}/v1/chat/completions", json=_body("right away", 2), timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        s.wait_candidates(0)
        r = httpx.post(f"{s.url}/v1/chat/completions", json=_body("anyone?", 2), timeout=10)
        assert r.status_code == 503
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "no_healthy_endpoints"
        assert httpx.get(f"{s.url}/health", timeout=10).status_code == 503

        s.start_engine(0)
        s.start_engine(1)
        s.wait_candidates(2)
        r = httpx.post(f"{s.url}/v1/chat/completions", json=_body("back", 2), timeout=10)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
        assert httpx.get(f"{s.url}/health", timeout=10).status_code == 200


def test_f9_engine_hung_mid_stream(tmp_path: Path) -> None:
    """An engine that stops answering (SIGSTOP) is marked down by its failed health checks, and the
    streams it was serving end with an error event then, not at the client's own timeout."""
    with RouterStack(tmp_path, engines=2, engine_options=[{"time_scale": 1.0}, {"time_scale": 1.0}]) as s:
        with httpx.Client(timeout=60) as client, \
                client.stream("POST", f"{s.url}/v1/chat/completions", json=_body("long answer", 400, True)) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            serving = next(e["name"] for e in s.state()["endpoints"] if e["in_flight_requests"] == 1)
            victim = s.engine_urls.index(serving)
            proc = s.engines[victim]
            os.killpg(proc.pid, signal.SIGSTOP)
            try:
                started = time.monotonic()
                rest = [line for line in lines if line.startswith("data: ")]
                waited = time.monotonic() - started
            finally:
                os.killpg(proc.pid, signal.SIGCONT)
        last = orjson.loads(rest[-1].removeprefix("data: "))
        assert last["error"]["code"] == "upstream_failed" and "went down" in last["error"]["message"]
        assert waited < 30  # the health checks' doing (about 2 s), far below the 60 s client timeout
        state = s.wait_candidates(2)  # resumed: healthy again, and nothing left counted in flight
        assert all(e["in_flight_requests"] == 0 for e in state["endpoints"])


EVICTION_FLOW = """
eviction: true
eviction_interval_s: 0
bands:
- {objective: interactive, priority: 100, ttl_s: 30}
- {objective: batch, priority: -10, ttl_s: 600, sheddable: true}
"""


def test_eviction_frees_room_for_a_blocked_higher_band(tmp_path: Path) -> None:
    flow = tmp_path / "flow.yaml"
    flow.write_text(EVICTION_FLOW)
    # one slow engine running one sequence at a time: five batch requests saturate it
    with RouterStack(tmp_path, engines=1, engine_options=[{"time_scale": 1.0, "max_num_seqs": 1}],
                     router_options={"flow_control": str(flow)}) as s:
        done: list[tuple[str, int, str | None]] = []

        async def send(client: httpx.AsyncClient, objective: str, tag: str) -> None:
            r = await client.post(f"{s.url}/v1/chat/completions", json=_body(tag, 100, system=tag),
                                  headers=s.trusted({"x-llm-d-inference-objective": objective}))
            done.append((objective, r.status_code, r.headers.get("x-llm-d-request-dropped-reason")))

        async def scenario() -> None:
            async with httpx.AsyncClient(timeout=60) as client:
                batch = [asyncio.create_task(send(client, "batch", f"b{i}")) for i in range(8)]
                deadline = time.monotonic() + 10
                while True:
                    bands = (await asyncio.to_thread(s.state))["bands"]
                    if next(b for b in bands if b["objective"] == "batch")["queued_requests"] > 0:
                        break  # saturated: batch work now waits in the router
                    assert time.monotonic() < deadline, bands
                    await asyncio.sleep(0.05)
                await send(client, "interactive", "urgent")
                for task in batch:
                    task.cancel()
                await asyncio.gather(*batch, return_exceptions=True)

        asyncio.run(scenario())
    assert ("interactive", 200, None) in done
    evicted = [d for d in done if d[2] == "evicted"]
    assert evicted and all(d[0] == "batch" and d[1] == 429 for d in evicted)


F11_FLOW = """
bands:
- {objective: interactive, priority: 100, ttl_s: 30, bypass_saturation: true, max_in_flight: 16}
- {objective: async, priority: 10, ttl_s: 600, sheddable: true}
- {objective: batch, priority: -10, ttl_s: 600, sheddable: true, max_queued_requests: 40, tenant_max_queued: 30}
"""


async def _send(client: httpx.AsyncClient, url: str, tenant: str, objective: str, tag: str,
                done: list[tuple[str, str, int, str | None]], max_tokens: int = 16) -> None:
    # no shared prefix: the requests spread over both engines
    r = await client.post(f"{url}/v1/chat/completions", json=_body(tag, max_tokens, system=f"{tag} "),
                          headers={"x-llm-d-inference-fairness-id": tenant, "x-llm-d-inference-objective": objective,
                                   TOKEN_HEADER: ROUTER_STACK_TOKEN})
    done.append((tenant, objective, r.status_code, r.headers.get("x-llm-d-request-dropped-reason")))
    if r.status_code == 429:
        assert r.headers["retry-after"].isdigit() and r.json()["error"]["message"]


def test_f11_flood_in_the_batch_band(tmp_path: Path) -> None:
    flow = tmp_path / "flow.yaml"
    flow.write_text(F11_FLOW)
    # two slow engines, two sequences each: ~0.25 s per request, so the pool saturates at once; the
    # flood's ~0.8 s each (64 tokens), so its backlog outlasts the test's own steps on a busy machine
    slow = {"time_scale": 1.0, "max_num_seqs": 2}
    with RouterStack(tmp_path, engines=2, engine_options=[slow, slow],
                     router_options={"flow_control": str(flow)}) as s:
        done: list[tuple[str, str, int, str | None]] = []

        async def scenario() -> None:
            limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
            async with httpx.AsyncClient(timeout=120, limits=limits) as client:
                flood = [asyncio.create_task(_send(client, s.url, "tenant-a", "batch", f"a{i}", done, 64))
                         for i in range(80)]
                deadline = time.monotonic() + 20
                while True:  # the admin JSON read off the loop, so the flood keeps going
                    bands = (await asyncio.to_thread(s.state))["bands"]
                    if any(b["objective"] == "batch" and b["queued_requests"] >= 20 for b in bands):
                        break
                    assert time.monotonic() < deadline, bands
                    await asyncio.sleep(0.05)
                fair = [asyncio.create_task(_send(client, s.url, "tenant-b", "batch", f"b{i}", done))
                        for i in range(8)]
                await asyncio.sleep(0.2)
                interactive = [asyncio.create_task(_send(client, s.url, "tenant-c", "interactive", f"c{i}", done))
                               for i in range(5)]
                await asyncio.gather(*flood, *fair, *interactive)

        asyncio.run(scenario())
        state = s.state()

    rejected = [d for d in done if d[2] == 429 and d[3] == "rejected-quota"]
    # bounded queues: the flooder is refused past its share of the band's queue, the other tenant is not
    assert rejected and {d[0] for d in rejected} == {"tenant-a"}
    # make room: tenant-c's interactive requests may evict running batch work (re-run by a processor)
    evicted = [d for d in done if d[2] == 429 and d[3] == "evicted"]
    assert {d[1] for d in evicted} <= {"batch"} and len(evicted) <= 5
    order = [d for d in done if d[2] == 200]
    assert len(order) == len(done) - len(rejected) - len(evicted)
    # interactive first: every interactive request finished while batch work was still queued
    last_c = max(i for i, d in enumerate(order) if d[0] == "tenant-c")
    assert sum(1 for d in order[last_c + 1:] if d[1] == "batch") >= 10
    # fair shares: tenant-b's requests, sent after tenant-a's backlog, did not wait for all of it
    last_b = max(i for i, d in enumerate(order) if d[0] == "tenant-b")
    assert sum(1 for d in order[last_b + 1:] if d[0] == "tenant-a") >= 10
    batch = next(b for b in state["bands"] if b["objective"] == "batch")
    assert batch["refused_total"].get("rejected_quota", 0) == len(rejected)
