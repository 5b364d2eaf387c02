"""``backfill router`` in front of slot-bound simulated engines (one stack per test, split from
``test_router_proxy.py`` so the files run on separate test workers): the saturation gate is per
engine and batch work with no room anywhere gets an immediate 429; once an engine's slot count is
learned, batch work leaves it a reserved slot for interactive work; with no reserve, an interactive
request makes room by evicting the newest batch request."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import openai

from tests.integration.test_router_proxy import _aborted, _hog, chat
from tests.router_stack import RouterStack
from tests.waiting import wait_for

#: ~48 s per request at the simulator's ~12 ms a token: work that outlasts anything the test
#: waits for however busy the machine (the twin keeps wall time, the test's own steps slow down);
#: its client goes away once the test has looked.
ENDLESS_TOKENS = 4000


def _wait_waiting(s: RouterStack, url: str, at_least: int) -> dict:
    def waiting() -> dict | None:
        state = s.state()
        return state if next(e for e in state["endpoints"] if e["name"] == url)["num_requests_waiting"] >= at_least \
            else None

    state = wait_for(waiting, f"{url} showing {at_least} waiting")
    assert state is not None
    return state


def test_the_gate_is_per_engine_and_batch_with_no_room_gets_an_immediate_429(tmp_path: Path) -> None:
    # two engines running one sequence at a time, slowly; direct requests fill their waiting queues
    slow = {"time_scale": 1.0, "max_num_seqs": 1}
    with RouterStack(tmp_path, engines=2, engine_options=[slow, slow]) as s:
        full, idle = s.engine_urls
        _hog(full, 11, ENDLESS_TOKENS)  # none ends while the test looks: the queues stay as filled
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
        _hog(idle, 6, ENDLESS_TOKENS)
        state = _wait_waiting(s, idle, 5)
        assert state["gate_saturation"] >= 1.0 and not any(e["gate_open"] for e in state["endpoints"])
        refused = httpx.post(f"{s.url}/v1/completions", json=body, headers=batch, timeout=30)
        assert refused.status_code == 429
        assert refused.headers["x-llm-d-request-dropped-reason"] == "rejected-saturated"
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "rejected-saturated"
        bands = {b["objective"]: b for b in s.state()["bands"]}
        assert bands["batch"]["queued_requests"] == 0 and bands["batch"]["refused_total"]["rejected_saturated"] == 1


def _endpoint(s: RouterStack, url: str) -> dict:
    return next(e for e in s.state()["endpoints"] if e["name"] == url)


def _until(predicate, what: str, timeout: float = 30.0) -> None:
    wait_for(predicate, what, timeout)


def _learn_the_slot_count(s: RouterStack, url: str) -> None:
    """6 direct requests fill the engine's 4 slots with 2 waiting: the router learns the slot count."""
    _hog(url, 6)
    _until(lambda: _endpoint(s, url)["num_requests_waiting"] >= 2, "the engine showing 2 waiting")
    full = _endpoint(s, url)
    assert full["saturation"] >= 1.0 and not full["gate_open"] and full["headroom"] == 0.0
    _until(lambda: _endpoint(s, url)["num_requests_running"] == 0, "the direct requests ending", 60)


async def _stop(requests: list[asyncio.Task]) -> None:
    """Cancel the requests still running (their client goes away: the router aborts them upstream)."""
    for task in requests:
        task.cancel()
    await asyncio.gather(*requests, return_exceptions=True)


def test_with_the_slot_count_learned_batch_leaves_a_slot_to_interactive_work(tmp_path: Path) -> None:
    # one engine with 4 sequence slots: reserve max(1, ⌈10 % × 4⌉) = 1, so batch may hold 3
    with RouterStack(tmp_path, engines=1, engine_options=[{"time_scale": 1.0, "max_num_seqs": 4}]) as s:
        url = s.engine_urls[0]
        # with the slot count known a waiting request closes the engine to sheddable work (llm-d's 2 / 5 would not)
        _learn_the_slot_count(s, url)
        body = {"model": "sim-model", "prompt": "batch line", "max_tokens": ENDLESS_TOKENS}
        batch = s.trusted({"x-llm-d-inference-objective": "batch"})
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=30)

        async def scenario() -> None:
            async with httpx.AsyncClient(timeout=120) as http:
                senders = [asyncio.create_task(http.post(f"{s.url}/v1/completions", json=body, headers=batch))
                           for _ in range(3)]
                def closed_by_the_three() -> bool:  # a scrape from the learning phase may still show waiting
                    state = _endpoint(s, url)
                    return (state["in_flight_requests"] == 3 and state["num_requests_waiting"] == 0
                            and not state["gate_open"] and state["headroom"] == 0.0)

                await asyncio.to_thread(_until, closed_by_the_three,
                                        "the 3 batch requests running, nothing waiting, the gate closed")
                refused = await http.post(f"{s.url}/v1/completions", json=body, headers=batch)
                assert refused.status_code == 429  # the fourth slot is the reserve
                assert refused.headers["x-llm-d-request-dropped-reason"] == "rejected-saturated"
                # takes the reserved slot: answered while all 3 batch requests still run
                await asyncio.to_thread(chat, client, "interactive", "now")
                assert not any(t.done() for t in senders)
                await _stop(senders)

        asyncio.run(scenario())
        _until(lambda: _endpoint(s, url)["gate_open"], "the gate reopening")


def test_an_interactive_request_makes_room_by_evicting_the_newest_batch_request(tmp_path: Path, monkeypatch) -> None:
    # no slot reserve: batch may hold all 4 slots of the engine; an interactive request then evicts one
    monkeypatch.setenv("BACKFILL_ROUTER_MIN_SLOT_RESERVE", "0")
    monkeypatch.setenv("BACKFILL_ROUTER_SLOT_RESERVE_FRACTION", "0")
    with RouterStack(tmp_path, engines=1, engine_options=[{"time_scale": 1.0, "max_num_seqs": 4}]) as s:
        url = s.engine_urls[0]
        _learn_the_slot_count(s, url)
        body = {"model": "sim-model", "prompt": "batch line", "max_tokens": ENDLESS_TOKENS}
        batch = s.trusted({"x-llm-d-inference-objective": "batch"})
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=30)
        aborted_before = _aborted(url)

        async def scenario() -> tuple[list[httpx.Response], int]:
            async with httpx.AsyncClient(timeout=120) as http:
                senders: list[asyncio.Task] = []
                for n in range(1, 5):  # one at a time, so "newest" is the fourth
                    senders.append(asyncio.create_task(
                        http.post(f"{s.url}/v1/completions", json=body, headers=batch)))
                    await asyncio.to_thread(_until, lambda n=n: _endpoint(s, url)["num_requests_running"] == n,
                                            f"batch request {n} running")
                # evicts one batch request: no wait for a ~48-s one to end (the client's timeout is 30 s)
                await asyncio.to_thread(chat, client, "interactive", "now")
                await asyncio.wait(senders, timeout=30, return_when=asyncio.FIRST_COMPLETED)
                ended = [t.result() for t in senders if t.done()]
                assert senders[3].done()  # the newest one
                await asyncio.to_thread(_until, lambda: _endpoint(s, url)["in_flight_requests"] == 3,
                                        "the router's in-flight count back to the 3 batch requests left")
                still_running = sum(not t.done() for t in senders)
                await _stop(senders)
                return ended, still_running

        ended, still_running = asyncio.run(scenario())
        assert [r.status_code for r in ended] == [429] and still_running == 3  # only the evicted one has ended
        evicted = ended[0]
        assert evicted.headers["x-llm-d-request-dropped-reason"] == "evicted"
        assert evicted.headers["retry-after"] == "1" and evicted.json()["error"]["code"] == "evicted"
        metrics = httpx.get(f"{s.url}/metrics").text
        assert f'backfill_router_make_room_evictions_total{{endpoint="{url}"}} 1.0' in metrics
        assert 'backfill_router_shed_total{band="batch",reason="evicted"} 1.0' in metrics
        assert _aborted(url) >= aborted_before + 1  # the engine aborted the evicted request
