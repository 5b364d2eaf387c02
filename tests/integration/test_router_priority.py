"""A caller's own ``priority`` never reaches an engine (issue 26 item 14): vLLM's
``--scheduling-policy priority`` runs lower values first, so a body ``"priority": -1000`` would jump
every queue. The router drops it with and without ``--engine-priority``; with it (every launch mode
of ``backfill up``, ``--engine-url`` engines included) the engine gets the trusted objective's
priority instead, whatever the body said. A recording proxy between the router and a simulated
engine shows what the engine received."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import httpx
import orjson
import pytest
from aiohttp import web

from tests.integration.engine_twin.conftest import free_port
from tests.router_stack import RouterStack


@contextlib.contextmanager
def recording_proxy(port: int, upstream: str) -> Iterator[list[dict]]:
    """An HTTP proxy on 127.0.0.1:``port`` forwarding every request to ``upstream`` (answers read
    whole: no streaming); yields the list of the JSON bodies of the POSTs it forwarded."""
    bodies: list[dict] = []
    loop = asyncio.new_event_loop()
    session: aiohttp.ClientSession | None = None

    async def forward(request: web.Request) -> web.Response:
        data = await request.read()
        if request.method == "POST":
            bodies.append(orjson.loads(data))
        assert session is not None
        try:
            async with session.request(request.method, upstream + request.path_qs, data=data,
                                       headers={"Content-Type": request.headers.get("Content-Type", "")}) as answer:
                return web.Response(body=await answer.read(), status=answer.status,
                                    content_type=answer.content_type)
        except aiohttp.ClientError:  # the engine stopped first at the end
            return web.Response(status=502)

    async def start() -> web.AppRunner:
        nonlocal session
        session = aiohttp.ClientSession()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", forward)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner

    runner = loop.run_until_complete(start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield bodies
    finally:
        async def stop() -> None:
            await runner.cleanup()
            assert session is not None
            await session.close()

        asyncio.run_coroutine_threadsafe(stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@pytest.mark.parametrize("engine_priority", [False, True], ids=["no-engine-priority", "engine-priority"])
def test_a_clients_priority_never_reaches_the_engine(tmp_path: Path, engine_priority: bool) -> None:
    stack = RouterStack(tmp_path, engines=1, router_options={"engine_priority": engine_priority})
    proxy_port = free_port()
    with recording_proxy(proxy_port, stack.engine_urls[0]) as bodies:
        stack.engine_urls = [f"http://127.0.0.1:{proxy_port}"]  # the router sends through the proxy
        with stack:
            messages = [{"role": "user", "content": "hello"}]
            for extra in ({"priority": -1000}, {}):
                answer = httpx.post(f"{stack.url}/v1/chat/completions", timeout=30,
                                    json={"model": stack.model, "max_tokens": 2, "messages": messages, **extra})
                assert answer.status_code == 200, answer.text
    sent = [body for body in bodies if "messages" in body]
    assert len(sent) == 2
    if engine_priority:  # the router's own value, the same as for a body without one
        assert sent[0]["priority"] == sent[1]["priority"] != -1000
    else:
        assert "priority" not in sent[0] and "priority" not in sent[1]


def test_up_with_engine_url_sends_the_router_s_priority_to_that_engine(tmp_path: Path) -> None:
    """``backfill up --engine-url`` (an engine on vLLM's default ``fcfs`` policy, behind the
    recording proxy): a direct call's own ``-1000`` is replaced by the interactive band's engine
    priority, and a batch line reaches the engine with the batch band's, which runs later (vLLM:
    lower first). Before, ``up --engine-url`` started the router without ``--engine-priority``."""
    import json
    import time

    from router.parsing import engine_priority
    from tests.conftest import backfill_up
    from tests.integration.engine_twin.conftest import RunningSim

    sim = RunningSim(served_model_name=["sim-model"], scheduling_policy="fcfs").start()
    proxy_port = free_port()
    try:
        with recording_proxy(proxy_port, sim.url) as bodies, \
                backfill_up(tmp_path / "data", "--engine-url", f"http://127.0.0.1:{proxy_port}") as up:
            router = json.loads((tmp_path / "data" / "stack.json").read_text())["router_url"]
            messages = [{"role": "user", "content": "hello"}]
            answer = httpx.post(f"{router}/v1/chat/completions", timeout=30,
                                json={"model": "sim-model", "max_tokens": 2, "messages": messages, "priority": -1000})
            assert answer.status_code == 200, answer.text
            client = up.client()
            line = orjson.dumps({"custom_id": "b1", "method": "POST", "url": "/v1/chat/completions",
                                 "body": {"model": "sim-model", "max_tokens": 2, "messages": messages}})
            uploaded = client.files.create(file=("one.jsonl", line + b"\n"), purpose="batch")
            batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                          completion_window="24h")
            deadline = time.monotonic() + 120
            while (status := client.batches.retrieve(batch.id).status) not in ("completed", "failed"):
                assert time.monotonic() < deadline, status
                time.sleep(0.2)
    finally:
        sim.stop()
    sent = [body for body in bodies if "messages" in body]
    assert sent[0]["priority"] == engine_priority(100)  # interactive, the default band of a direct call
    assert status == "completed" and [body["priority"] for body in sent[1:]] == [engine_priority(-10)]  # batch
