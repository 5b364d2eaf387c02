"""``backfill router`` in front of slot-bound simulated engines (one stack per test, split from
``test_router_proxy.py`` so the files run on separate test workers): the saturation gate is per
engine and batch work with no room anywhere gets an immediate 429; once an engine's slot count is
learned, batch work leaves it a reserved slot for interactive work; with no reserve, an interactive
request makes room by evicting the newest batch request."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import openai

from tests.integration.test_router_proxy import _aborted, _hog, chat
from tests.router_stack import RouterStack


def _wait_waiting(s: RouterStack, url: str, at_least: int) -> dict:
    deadline = time.monotonic() + 15
    while True:
        state = s.state()
        if next(e for e in state["endpoints"] if e["name"] == url)["num_requests_waiting"] >= at_least:
            return state
        assert time.monotonic() < deadline, f"{url} never showed {at_least} waiting"
        time.sleep(0.05)


def test_the_gate_is_per_engine_and_batch_with_no_room_gets_an_immediate_429(tmp_path: Path) -> None:
    # two engines running one sequence at a time, slowly; direct requests fill their waiting queues
    slow = {"time_scale": 1.0, "max_num_seqs": 1}
    with RouterStack(tmp_path, engines=2, engine_options=[slow, slow]) as s:
        full, idle = s.engine_urls
        _hog(full, 11)
        state = _wait_waiting(s, full, 10)  # saturation 10 / 5 = 2.0 there, 0 on the idle engine
        by_name = {e["name"]: e for e in state["endpoints"]}
        assert state["pool_saturation"] >= 0.9  # the mean reads (about) saturated ...
        assert state["gate_saturation"] < 0.5  # ... but the gate is per engine: open
        assert (by_name[full]["gate_open"], by_name[idle]["gate_open"]) == (False, True)
        batch = s.trusted({"x-llm-d-inference-objective": "batch"})
        body = {"model": "sim-model", "prompt": "batch line", "max_tokens": 4}
        before = s.served_counts()
        answer = httpx.post(f"{s.url}/v1/completions", json=body, headers=batch, timeout=30)
        assert answer.status_code == 200
        assert [a - b for a, b in zip(s.served_counts(), before)] == [0, 1]  # on the engine with room
        _hog(idle, 6)
        state = _wait_waiting(s, idle, 5)
        assert state["gate_saturation"] >= 1.0 and not any(e["gate_open"] for e in state["endpoints"])
        refused = httpx.post(f"{s.url}/v1/completions", json=body, headers=batch, timeout=30)
        assert refused.status_code == 429
        assert refused.headers["x-llm-d-request-dropped-reason"] == "rejected-saturated"
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "rejected-saturated"
        bands = {b["objective"]: b for b in s.state()["bands"]}
        assert bands["batch"]["queued_requests"] == 0 and bands["batch"]["shed_total"]["rejected-saturated"] == 1


def _endpoint(s: RouterStack, url: str) -> dict:
    return next(e for e in s.state()["endpoints"] if e["name"] == url)


def _until(predicate, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_with_the_slot_count_learned_batch_leaves_a_slot_to_interactive_work(tmp_path: Path) -> None:
    # one engine with 4 sequence slots: reserve max(1, ⌈10 % × 4⌉) = 1, so batch may hold 3
    with RouterStack(tmp_path, engines=1, engine_options=[{"time_scale": 1.0, "max_num_seqs": 4}]) as s:
        url = s.engine_urls[0]
        body = {"model": "sim-model", "prompt": "batch line", "max_tokens": 400}  # ~5 s at 12 ms a token
        batch = s.trusted({"x-llm-d-inference-objective": "batch"})
        # 6 direct requests fill the 4 slots with 2 waiting: the router learns the slot count, and
        # with it known a waiting request closes the engine to sheddable work (llm-d's 2 / 5 would not)
        _hog(url, 6)
        _until(lambda: _endpoint(s, url)["num_requests_waiting"] >= 2, "the engine never showed 2 waiting")
        full = _endpoint(s, url)
        assert full["saturation"] >= 1.0 and not full["gate_open"] and full["headroom"] == 0.0
        _until(lambda: _endpoint(s, url)["num_requests_running"] == 0, "the direct requests never ended", 30)
        results: list[int] = []

        def send() -> None:
            results.append(httpx.post(f"{s.url}/v1/completions", json=body, headers=batch, timeout=60).status_code)

        senders = [threading.Thread(target=send) for _ in range(3)]
        for t in senders:
            t.start()
        _until(lambda: _endpoint(s, url)["in_flight_requests"] == 3, "the 3 batch requests never started")
        state = _endpoint(s, url)
        assert state["num_requests_waiting"] == 0 and not state["gate_open"] and state["headroom"] == 0.0
        refused = httpx.post(f"{s.url}/v1/completions", json=body, headers=batch, timeout=30)
        assert refused.status_code == 429  # the fourth slot is the reserve
        assert refused.headers["x-llm-d-request-dropped-reason"] == "rejected-saturated"
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=30)
        chat(client, "interactive", "now")  # takes the reserved slot: no wait for a batch request
        assert not results  # answered before any of the ~5-s batch requests ended
        for t in senders:
            t.join()
        assert results == [200, 200, 200]
        _until(lambda: _endpoint(s, url)["gate_open"], "the gate never reopened")


def test_an_interactive_request_makes_room_by_evicting_the_newest_batch_request(tmp_path: Path, monkeypatch) -> None:
    # no slot reserve: batch may hold all 4 slots of the engine; an interactive request then evicts one
    monkeypatch.setenv("BACKFILL_ROUTER_MIN_SLOT_RESERVE", "0")
    monkeypatch.setenv("BACKFILL_ROUTER_SLOT_RESERVE_FRACTION", "0")
    with RouterStack(tmp_path, engines=1, engine_options=[{"time_scale": 1.0, "max_num_seqs": 4}]) as s:
        url = s.engine_urls[0]
        _hog(url, 6)  # fills the 4 slots with 2 waiting: the router learns the slot count
        _until(lambda: _endpoint(s, url)["num_requests_waiting"] >= 2, "the engine never showed 2 waiting")
        _until(lambda: _endpoint(s, url)["num_requests_running"] == 0, "the direct requests never ended", 30)
        body = {"model": "sim-model", "prompt": "batch line", "max_tokens": 400}  # ~5 s at 12 ms a token
        batch = s.trusted({"x-llm-d-inference-objective": "batch"})
        results: list[httpx.Response] = []

        def send() -> None:
            results.append(httpx.post(f"{s.url}/v1/completions", json=body, headers=batch, timeout=60))

        senders = []
        for _ in range(4):
            senders.append(threading.Thread(target=send))
            senders[-1].start()
            n = len(senders)
            _until(lambda n=n: _endpoint(s, url)["num_requests_running"] == n, f"batch request {n} never ran")
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=30)
        chat(client, "interactive", "now")  # evicts one batch request: no wait for a ~5-s one to end
        assert [r.status_code for r in results] == [429]  # only the evicted one has ended
        evicted = results[0]
        assert evicted.headers["x-llm-d-request-dropped-reason"] == "evicted"
        assert evicted.headers["retry-after"] == "1" and evicted.json()["error"]["code"] == "evicted"
        for t in senders:
            t.join()
        assert sorted(r.status_code for r in results) == [200, 200, 200, 429]
        metrics = httpx.get(f"{s.url}/metrics").text
        assert f'backfill_router_make_room_evictions_total{{endpoint="{url}"}} 1.0' in metrics
        assert 'backfill_router_shed_total{band="batch",reason="evicted"} 1.0' in metrics
        assert _aborted(url) >= 1  # the engine aborted the evicted request
