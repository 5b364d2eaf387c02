"""A caller's own ``priority`` never reaches an engine (issue 26 item 14): vLLM's
``--scheduling-policy priority`` runs lower values first, so a body ``"priority": -1000`` would jump
every queue. The router drops it in both launch modes of ``backfill up``: without
``--engine-priority`` (``up --engine-url``: engines get no priority) and with it (simulated engines:
the trusted objective's priority, whatever the body said). A recording proxy between the router and
a simulated engine shows what the engine received."""

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


@pytest.mark.parametrize("engine_priority", [False, True], ids=["up-engine-url", "up-simulated"])
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
