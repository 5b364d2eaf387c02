"""The processor's strict lanes end to end over the in-memory backend and a mock router: an
interactive request is read and dispatched while batch fills its buffer share and every slot it
may use; the router's fast 429 ``rejected-saturated`` is held for its Retry-After, counts no
attempt, and shuts the saturation gate until a reading asked for after it."""

from __future__ import annotations

import asyncio
import time

import httpx
import orjson
import pytest

from async_processor.backends.memory import MemoryBackend
from async_processor.settings import build_settings
from async_processor.testing import eventually, mock_target, running
from common.contracts.queue import DEFAULT_RESULT_STREAM, RequestMessage

REFUSAL = {"retry-after": "0.3", "x-llm-d-request-dropped-reason": "rejected-saturated"}


def request(rid: str, tenant: str = "A") -> RequestMessage:
    now = time.time()
    return RequestMessage(id=rid, created=int(now), deadline=int(now + 120), payload={"id": rid},
                          metadata={"tenant": tenant})


def results(backend: MemoryBackend) -> dict:
    return {r.id: r for r in backend.results.get(DEFAULT_RESULT_STREAM, [])}


def test_interactive_is_read_and_dispatched_while_batch_holds_its_buffer_and_every_slot_it_may_use():
    release = asyncio.Event()
    running_batch: list[str] = []
    most_batch = [0]

    async def router(r: httpx.Request) -> httpx.Response:
        rid = orjson.loads(r.content)["id"]
        if rid.startswith("b"):
            running_batch.append(rid)
            most_batch[0] = max(most_batch[0], len(running_batch))
            await release.wait()
            running_batch.remove(rid)
        return httpx.Response(200, json={"id": rid})

    settings = build_settings(backend="memory", lanes=["interactive", "batch"], concurrency=4,
                              reserved_slots={"interactive": 1}, buffer_size=2, receive_batch=2,
                              poll_interval_s=0.005)

    async def scenario() -> None:
        backend = MemoryBackend()
        for i in range(12):
            await backend.publish_request("batch", request(f"b{i}"))
        async with running(settings, backend, mock_target(router)) as processor:
            async def batch_full() -> bool:
                return len(running_batch) == 3 and processor.buffer.depth("batch") == 2

            await eventually(batch_full)
            unread = [e for e in backend.lanes["batch"].values() if not e.deliveries]
            assert len(unread) == 7  # the batch share of the buffer is full: the rest waits in the queue
            await backend.publish_request("interactive", request("i0", tenant="B"))

            async def interactive_answered() -> bool:
                return "i0" in results(backend)

            await eventually(interactive_answered)
            assert len(running_batch) == 3 and not release.is_set()  # batch never let go of a slot
            release.set()

            async def all_answered() -> bool:
                return len(results(backend)) == 13

            await eventually(all_answered)
        assert most_batch[0] == 3  # 4 slots, 1 reserved for interactive
        assert all(r.status_code == 200 for r in results(backend).values())

    asyncio.run(scenario())


def _refusing_router(refusals: int, events: list[tuple[str, float, str]], then: list[int],
                     headers: dict[str, str] = REFUSAL):
    """POSTs: ``refusals`` fast refusals (``headers``), then the statuses in ``then`` (200 after). GETs of the
    router state: some engine has room. ``events``: (kind, monotonic start, detail)."""
    answered = [0]

    async def router(r: httpx.Request) -> httpx.Response:
        started = time.monotonic()
        if r.method == "GET":
            events.append(("state", started, ""))
            return httpx.Response(200, json={"gate_saturation": 0.5})
        answered[0] += 1
        n = answered[0]
        if n <= refusals:
            events.append(("refused", started, ""))
            return httpx.Response(429, json={"error": "saturated"}, headers=headers)
        status = then[n - refusals - 1] if n - refusals - 1 < len(then) else 200
        events.append((str(status), started, ""))
        return httpx.Response(status, json={"n": n})
    return router


@pytest.mark.parametrize("reason", ["rejected-saturated", "evicted"])
def test_a_fast_refusal_is_held_for_its_retry_after_and_counts_no_attempt(reason: str):
    # "evicted": the router aborted the running request to make room for interactive work; a
    # batch request is re-run after the hold, never failed for it
    events: list[tuple[str, float, str]] = []
    refusal = {**REFUSAL, "x-llm-d-request-dropped-reason": reason}
    # two error attempts allowed: were the three refusals attempts, the 500 would be the last one
    settings = build_settings(backend="memory", lanes=["batch"], max_error_attempts=2, backoff_base_s=0.01,
                              poll_interval_s=0.005)

    async def scenario():
        backend = MemoryBackend()
        await backend.publish_request("batch", request("r1"))
        async with running(settings, backend, mock_target(_refusing_router(3, events, [500], refusal))) as processor:
            async def answered() -> bool:
                return "r1" in results(backend)

            await eventually(answered)
            return processor, results(backend)["r1"]

    processor, result = asyncio.run(scenario())
    assert (result.status_code, result.error_code) == (200, "")
    assert [kind for kind, _, _ in events] == ["refused", "refused", "refused", "500", "200"]
    starts = [t for _, t, _ in events]
    assert all(b - a >= 0.3 for a, b in zip(starts[:3], starts[1:4]))  # each held its Retry-After
    assert processor.counts["held_saturated"] == 3 and processor.counts["retried"] == 1
    exposition = processor.metrics.exposition().decode()
    assert 'backfill_processor_retries_total{lane="batch",reason="rejected_saturated"} 3.0' in exposition
    assert processor.gate.gates[0].in_flight == 0  # every slot given back


def test_a_fast_refusal_shuts_the_saturation_gate_until_the_next_reading():
    events: list[tuple[str, float, str]] = []
    settings = build_settings(backend="memory", lanes=["batch"], saturation_gate=True, saturation_poll_s=0.2, concurrency=1,
                              poll_interval_s=0.005)

    async def scenario():
        backend = MemoryBackend()
        for i in range(3):
            await backend.publish_request("batch", request(f"r{i}"))
        async with running(settings, backend, mock_target(_refusing_router(4, events, []))):
            async def answered() -> bool:
                return len(results(backend)) == 3

            await eventually(answered)

    asyncio.run(scenario())
    posts = [(i, t) for i, (kind, t, _) in enumerate(events) if kind != "state"]
    refused = [(i, t) for i, (kind, t, _) in enumerate(events) if kind == "refused"]
    assert len(refused) == 4
    for i, t in refused:
        later = [(j, s) for j, s in posts if j > i]
        if not later:
            continue
        j, _ = later[0]
        # the next POST after a refusal comes only after a reading of the router asked for after it
        assert any(kind == "state" and i < k < j and s >= t for k, (kind, s, _) in enumerate(events)), events
